"""Memory-backend specifics: bytes per entry, lazy reclamation of removed nodes, the sync API."""

from __future__ import annotations

import asyncio
import gc
import random
import time
import tracemalloc

import pytest

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index import Index
from kvcoord.index.memory import MemoryIndex

M = "m"


def stored(*hashes: int, medium: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=16, medium=medium
    )


def raw_keys(idx: MemoryIndex, model: str = M) -> int:
    """Keys physically present, dead or alive (what reclamation frees)."""
    mi = idx._models.get(model)
    return 0 if mi is None else len(mi.blocks)


def test_is_an_index() -> None:
    assert isinstance(MemoryIndex(), Index)


def test_bytes_per_entry_measured_with_tracemalloc() -> None:
    """Single-holder GPU entries (the common case) stay well under 100 bytes at 200k entries."""
    rng = random.Random(1)
    idx = MemoryIndex()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for batch in range(400):
            # hashes are created inside the traced region so the key ints the index keeps are counted
            hashes = tuple(rng.getrandbits(64) | (1 << 63) for _ in range(500))
            idx.apply_sync(M, f"node-{batch % 8}", 0, [stored(*hashes)])
        del hashes
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    st = idx.stats_sync()
    assert st.entries == 200_000
    per_entry = used / st.entries
    assert per_entry < 100, per_entry
    # the stats() figure is an estimate from a sample; it must be in the right ballpark
    assert 0.75 * used < st.bytes < 1.35 * used, (st.bytes, used)


def test_shared_blocks_cost_less_per_entry() -> None:
    idx = MemoryIndex()
    hashes = tuple(range(1000, 21_000))
    for n in range(16):
        idx.apply_sync(M, f"n{n}", 0, [stored(*hashes)])
    st = idx.stats_sync()
    assert (st.entries, st.blocks) == (16 * 20_000, 20_000)
    assert st.bytes / st.entries < 20


def test_remove_node_is_lazy_and_reclaim_frees_keys() -> None:
    idx = MemoryIndex()
    idx.apply_sync(M, "gone", 0, [stored(*range(100, 200))])
    idx.apply_sync(M, "stays", 0, [stored(*range(150, 160))])
    idx.remove_node_sync("gone")
    # gone from answers at once, but the keys are still physically there
    assert [m.node_id for m in idx.match_sync(M, [BlockHash64(150)])] == ["stays"]
    assert idx.match_sync(M, [BlockHash64(100)]) == []
    assert idx.reclaim_pending
    assert raw_keys(idx) == 100
    idx.reclaim_sync()
    assert not idx.reclaim_pending
    assert raw_keys(idx) == 10
    # the freed slot is reused by the next node without resurrecting anything
    idx.apply_sync(M, "new", 0, [stored(1)])
    assert idx._models[M].slot_of[("new", 0)] == idx._models[M].slot_of.get(("gone", 0), 0)
    assert idx.export_node_sync(M, "new", 0) == [(1, Tier.GPU)]
    assert idx.match_sync(M, [BlockHash64(100)]) == []


def test_slots_are_not_reused_before_the_sweep_finishes() -> None:
    idx = MemoryIndex()
    idx.apply_sync(M, "a", 0, [stored(*range(10))])
    old_slot = idx._models[M].slot_of[("a", 0)]
    idx.remove_node_sync("a")
    idx.apply_sync(M, "a", 0, [stored(50)])  # the store runs before this call's piggy-backed sweep step
    assert idx._models[M].slot_of[("a", 0)] != old_slot
    assert idx.export_node_sync(M, "a", 0) == [(50, Tier.GPU)]


def test_apply_sync_sweeps_in_small_steps() -> None:
    idx = MemoryIndex()
    idx.apply_sync(M, "gone", 0, [stored(*range(1, 20_001))])
    idx.remove_node_sync("gone")
    steps = 0
    while idx.reclaim_pending:
        idx.apply_sync(M, "live", 0, [stored(7_000_000 + steps)])
        steps += 1
        assert steps < 200
    assert steps > 1  # done piecemeal, not in one stall
    assert raw_keys(idx) == steps


def test_retire_during_sweep_is_picked_up() -> None:
    idx = MemoryIndex(sweep_chunk=100)
    idx.apply_sync(M, "a", 0, [stored(*range(1, 1001))])
    idx.apply_sync(M, "b", 0, [stored(*range(500, 1501))])
    idx.remove_node_sync("a")
    idx._sweep_some(300)  # part-way through the first sweep
    assert idx.reclaim_pending
    idx.clear_sync(M, "b", 0)
    idx.reclaim_sync()
    assert raw_keys(idx) == 0
    assert idx.stats_sync().entries == 0


def test_clear_of_an_empty_slot_frees_it_at_once() -> None:
    idx = MemoryIndex()
    idx.apply_sync(M, "a", 0, [stored(1)])
    idx.apply_sync(M, "a", 0, [BlockRemoved(block_hashes=(1,))])
    res = idx.apply_sync(M, "a", 0, [AllBlocksCleared()])
    assert res.cleared == 0
    assert not idx.reclaim_pending


async def test_background_sweeper_reclaims_without_blocking() -> None:
    idx = MemoryIndex(sweep_chunk=500)
    try:
        await idx.apply(M, "gone", 0, [stored(*range(1, 10_001))])
        await idx.remove_node("gone")
        assert idx.reclaim_pending
        deadline = time.monotonic() + 10
        yields = 0
        while idx.reclaim_pending:
            assert time.monotonic() < deadline, "sweeper did not finish"
            await asyncio.sleep(0)
            yields += 1
        assert yields > 1  # it gave the loop back between chunks
        assert raw_keys(idx) == 0
    finally:
        await idx.close()


async def test_close_cancels_a_running_sweep() -> None:
    idx = MemoryIndex(sweep_chunk=10)
    await idx.apply(M, "gone", 0, [stored(*range(1, 5001))])
    await idx.remove_node("gone")
    task = idx._sweeper
    assert task is not None and not task.done()
    await idx.close()
    assert task.done()


def test_tiered_values_collapse_back_to_plain_masks() -> None:
    idx = MemoryIndex()
    idx.apply_sync(M, "a", 0, [stored(1, 2, 3), stored(2, medium="CPU")])
    idx.apply_sync(M, "b", 0, [stored(2, medium="STORAGE")])
    mi = idx._models[M]
    assert set(mi.tiered) == {2}
    idx.apply_sync(M, "a", 0, [BlockRemoved(block_hashes=(2,), medium="CPU")])
    idx.apply_sync(M, "b", 0, [BlockRemoved(block_hashes=(2,), medium="STORAGE")])
    assert mi.tiered == {}
    assert [m.matched_blocks for m in idx.match_sync(M, [BlockHash64(h) for h in (1, 2, 3)])] == [3]


@pytest.mark.parametrize("nodes", [1, 7, 40, 300])
def test_raw_match_equals_match_and_orders_ties_by_name(nodes: int) -> None:
    idx = MemoryIndex()
    rng = random.Random(nodes)
    names = [f"n{rng.randrange(10**6):06d}" for _ in range(nodes)]
    chain = list(range(1, 41))
    for name in names:
        idx.apply_sync(M, name, rng.randrange(2), [stored(*chain[: rng.randrange(1, 41)])])
    raw = idx.match_raw_sync(M, chain)
    objs = idx.match_sync(M, [BlockHash64(h) for h in chain])
    assert [(m.node_id, m.dp_rank, m.matched_blocks, m.tiers) for m in objs] == raw
    assert raw == sorted(raw, key=lambda r: (-r[2], r[0], r[1]))


@pytest.mark.parametrize("seed", range(4))
def test_partial_sweeps_never_change_answers(seed: int) -> None:
    """Random churn with sweeps left half-done between operations, checked against the reference."""
    from tests.test_index_backends import NODES, POOL, Reference

    rng = random.Random(seed)
    idx = MemoryIndex(sweep_chunk=3)
    ref = Reference()
    for _ in range(400):
        node, dp = rng.choice(NODES), rng.randrange(2)
        op = rng.random()
        if op < 0.45:
            hs = rng.sample(POOL, rng.randrange(1, 6))
            medium = rng.choice([None, "CPU", "STORAGE"])
            ev = [stored(*hs, medium=medium)]
            assert idx.apply_sync(M, node, dp, ev) == ref.apply(M, node, dp, ev)
        elif op < 0.65:
            ev2 = [BlockRemoved(block_hashes=tuple(rng.sample(POOL, 3)), medium=rng.choice([None, "CPU"]))]
            assert idx.apply_sync(M, node, dp, ev2) == ref.apply(M, node, dp, ev2)
        elif op < 0.75:
            idx.clear_sync(M, node, dp)
            ref.apply(M, node, dp, [AllBlocksCleared()])
        elif op < 0.85:
            idx.remove_node_sync(node)
            ref.remove_node(node)
        else:
            entries = [(rng.choice(POOL), rng.choice(list(Tier))) for _ in range(rng.randrange(4))]
            idx.replace_node_sync(M, node, dp, [(BlockHash64(h), t) for h, t in entries])
            ref.replace(M, node, dp, [(h, int(t)) for h, t in entries])
        idx._sweep_some(rng.randrange(0, 4))  # leave sweeps part-way
        query = rng.sample(POOL, 4)
        got = [(m.node_id, m.dp_rank, m.matched_blocks, m.tiers) for m in idx.match_sync(M, query)]
        assert got == ref.match(M, query)
        n2, d2 = rng.choice(NODES), rng.randrange(2)
        assert [(int(h), int(t)) for h, t in idx.export_node_sync(M, n2, d2)] == ref.export(M, n2, d2)
    st = idx.stats_sync()
    assert (st.entries, st.blocks, st.nodes, st.entries_by_model_tier, st.blocks_by_model) == ref.counts()
