"""The lookup workers' copy of the memory index (kvcoord.coordinator.workers): a :class:`FeedIndex`'s logged
calls, replayed on another memory index, and its whole-index image (``export_all_sync``/``load_all_sync``),
loaded into one that held something else, both answer every query as the original does, through random
churn: stores on every tier, removals of skipped groups, clears, removals, snapshots."""

from __future__ import annotations

import pickle
import random

import pytest

from kvcoord.coordinator.workers import FeedIndex
from kvcoord.events import BlockRemoved, BlockStored, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.memory import MemoryIndex
from kvcoord.validate import ops_of, snapshot_columns

M = "m"
NODES = ["a", "b", "c"]
POOL = list(range(1, 40))


def _answers(idx: MemoryIndex, queries: list[list[int]]) -> list[object]:
    return [[(m.node_id, m.dp_rank, m.matched_blocks, m.tiers) for m in idx.match_sync(M, q)]
            for q in queries]


@pytest.mark.parametrize("seed", range(3))
def test_replayed_log_and_loaded_image_answer_as_the_index(seed: int) -> None:
    rng = random.Random(seed)
    main, replica, loaded = FeedIndex(), MemoryIndex(), MemoryIndex()
    loaded.apply_sync(M, "z", 0, ops_of([BlockStored(block_hashes=(1, 2, 3), parent_block_hash=None,
                                                     token_ids=(), block_size=16)]))  # to be dropped
    queries = [rng.sample(POOL, 5) for _ in range(20)] + [POOL[:10]]
    for _ in range(300):
        node, dp, op = rng.choice(NODES), rng.randrange(2), rng.random()
        if op < 0.5:
            kind = rng.choice([None, "sliding_window"])
            hashes = tuple(rng.sample(POOL, rng.randrange(1, 6)))
            ev = BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(), block_size=16,
                             medium=rng.choice([None, "CPU", "STORAGE"]),
                             group_idx=1 if kind else 0, kv_cache_spec_kind=kind)
            main.apply_sync(M, node, dp, ops_of([ev]))
        elif op < 0.7:
            main.apply_sync(M, node, dp, ops_of([BlockRemoved(block_hashes=tuple(rng.sample(POOL, 3)),
                                                              group_idx=rng.choice([None, 0, 1]))]))
        elif op < 0.8:
            main.clear_sync(M, node, dp)
        elif op < 0.87:
            main.remove_node_sync(node)
        else:
            entries = [(BlockHash64(rng.choice(POOL)), rng.choice(list(Tier)))
                       for _ in range(rng.randrange(5))]
            main.replace_node_sync(M, node, dp, *snapshot_columns(entries))
        for method, *args in pickle.loads(pickle.dumps(main.log)):  # as a frame carries them
            getattr(replica, method)(*args)
        main.log.clear()
        if rng.random() < 0.1:
            loaded.load_all_sync(pickle.loads(pickle.dumps(main.export_all_sync())))
            assert _answers(loaded, queries) == _answers(main, queries)
        assert _answers(replica, queries) == _answers(main, queries)
    loaded.load_all_sync(main.export_all_sync())
    for node in NODES:  # the skipped groups came along: a removal of group 1 is skipped in both
        for dp in range(2):
            ops = ops_of([BlockRemoved(block_hashes=tuple(POOL), group_idx=1)])
            assert main.apply_sync(M, node, dp, ops) == loaded.apply_sync(M, node, dp, ops)
    assert _answers(loaded, queries) == _answers(main, queries)
