"""The relay's mirror against the index: random event streams of one node go through the mirror (as the
relay applies them) and through the memory index (by the coordinator's path: the wire, then the ops the
coordinator makes of it); what the mirror would snapshot must be what the index holds for the node.

The snapshot replaces the index's copy of the node whenever the coordinator asks for one, so any
difference between the two is a block that appears or vanishes at a resync."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvcoord.engine.mirror import BlockMirror
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, Tier
from kvcoord.index.base import ApplyResult
from kvcoord.index.memory import HAVE_C_CORE, MemoryIndex
from kvcoord.wire import events_to_proto, ops_from_proto
from tests.procs import stop, until

CORES = ["python", "c"] if HAVE_C_CORE else ["python"]
MODEL, NODE = "m", "n1"

Batch = tuple[int, Sequence[KVEvent] | None]
"""``(dp_rank, events)``; None: the relay clears the rank itself (a gap or a restart), forwarding an
``AllBlocksCleared``."""


def stored(*hashes: int, medium: str | None = None, group: int | None = None, kind: str | None = None,
           parent: int | None = None) -> BlockStored:
    return BlockStored(hashes, parent, (), 16, None, medium, group_idx=group, kv_cache_spec_kind=kind)


def removed(*hashes: int, medium: str | None = None, group: int | None = None) -> BlockRemoved:
    return BlockRemoved(hashes, medium, group_idx=group)


_hashes = st.lists(st.integers(1, 6), min_size=1, max_size=3).map(tuple)
_medium = st.sampled_from([None, "GPU", "CPU", "cpu", "DISK"])
_group = st.sampled_from([None, 0, 1])
_kind = st.sampled_from([None, "full_attention", "mla_attention", "sliding_window", "mamba"])
_events = st.one_of(
    st.builds(lambda h, m, g, k, p: stored(*h, medium=m, group=g, kind=k, parent=p),
              _hashes, _medium, _group, _kind, st.sampled_from([None, 9])),
    st.builds(lambda h, m, g: removed(*h, medium=m, group=g), _hashes, _medium, _group),
    st.just(AllBlocksCleared()),
)
_batches = st.lists(
    st.tuples(st.integers(0, 1), st.one_of(st.lists(_events, min_size=1, max_size=4), st.none())),
    min_size=1, max_size=12)

PROBE: list[Batch] = [(0, [stored(1, group=1, kind="sliding_window")]), (0, [stored(1, group=1)]),
                      (0, [removed(1, group=1)])]
"""The issue's probe: a group first seen on a sliding-window store, then on a full-attention store of the
same hash, then a removal of that group. The index skips the removal (the group was seen as not
indexable); the mirror's copy of the rules un-skipped the group at the second store and dropped the
block."""


def run_both(batches: Sequence[Batch], mirror_core: str,
             index_core: str) -> tuple[BlockMirror, MemoryIndex, ApplyResult]:
    """``batches`` through a mirror (as the relay applies them) and an index (as the coordinator does);
    the index's counts, summed."""
    mirror = BlockMirror(core=mirror_core)  # type: ignore[arg-type]
    index = MemoryIndex(core=index_core)  # type: ignore[arg-type]
    counts = ApplyResult()
    for dp, events in batches:
        if events is None:
            mirror.clear(dp)
            events = [AllBlocksCleared()]
        else:
            _kept, ops, _spans = mirror.prepare(events)
            mirror.commit(dp, ops)
        counts.add(index.apply_sync(MODEL, NODE, dp, ops_from_proto(events_to_proto(events), merge=True)))
    return mirror, index, counts


def assert_same(mirror: BlockMirror, index: MemoryIndex, counts: ApplyResult) -> None:
    for dp in (0, 1):
        held = index.export_node_sync(MODEL, NODE, dp)
        assert sorted(mirror.rank_entries(dp)) == held, f"DP rank {dp}"
        assert mirror.num_blocks(dp) == len(held)
    assert mirror.counts == counts


@pytest.mark.parametrize("mirror_core", CORES)
@pytest.mark.parametrize("index_core", CORES)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(batches=_batches)
@example(batches=PROBE)
@example(batches=[(0, [stored(1, 2, group=0, kind="mamba"), stored(2, group=0)]), (0, None),
                  (0, [stored(2, 3, group=0), removed(2, 3, group=0)])])
@example(batches=[(1, [stored(4, medium="CPU"), stored(4)]), (1, [removed(4, medium="DISK")]),
                  (1, [removed(4, medium="cpu")])])
def test_the_mirror_holds_what_the_index_holds(batches: list[Batch], mirror_core: str,
                                              index_core: str) -> None:
    assert_same(*run_both(batches, mirror_core, index_core))


def test_the_probe_keeps_the_block_in_both() -> None:
    """The probe's three operations, named: the index keeps the block (the removal is of a group it
    learnt not to index), and so does the mirror."""
    mirror, index, _ = run_both(PROBE, CORES[-1], CORES[-1])
    assert index.export_node_sync(MODEL, NODE, 0) == [(1, Tier.GPU)]
    assert sorted(mirror.rank_entries(0)) == [(1, Tier.GPU)]


def test_a_big_rank_snapshots_whole_after_clears() -> None:
    """Column snapshots of a rank stay exact while cleared slots wait for their sweep."""
    for core in CORES:
        mirror = BlockMirror(core=core)  # type: ignore[arg-type]
        mirror.apply(0, [stored(*range(1, 5001)), stored(*range(1, 101), medium="CPU")])
        mirror.apply(0, [AllBlocksCleared(), stored(*range(3000, 4001), medium="DISK")])
        mirror.apply(0, [stored(*range(10, 20))])
        want = sorted([(h, Tier.STORAGE) for h in range(3000, 4001)] + [(h, Tier.GPU) for h in range(10, 20)])
        assert sorted(mirror.rank_entries(0)) == want, core
        mirror.clear(0)
        assert list(mirror.rank_entries(0)) == [] and mirror.num_blocks() == 0


def test_a_coordinator_restart_keeps_what_the_index_kept(tmp_path: Path) -> None:
    """Over real processes (this process's engine publisher -> ``kvcoord agent`` -> ``kvcoord serve``): the
    probe, then a marker batch. The index keeps the probe's block; after the coordinator restarts empty,
    the agent's snapshot (its mirror) must bring that block back, not drop it."""
    from tests.coordinator.test_history_lost import BS, Stack, block, stored, tokens

    def probe(spec: str | None, *, remove: bool = False) -> KVEventBatch:
        ev: KVEvent = (BlockRemoved((block(0),), "GPU", group_idx=1) if remove else BlockStored(
            (block(0),), None, tuple(tokens(0)), BS, None, "GPU", group_idx=1, kv_cache_spec_kind=spec))
        return KVEventBatch(ts=time.time(), events=(ev,))

    with contextlib.ExitStack() as es:
        s = Stack(tmp_path, es, early=0)
        s.start_agent("n1")
        until(lambda: s.node("n1") is not None, "the agent's node")
        for batch in (probe("sliding_window"), probe("full_attention"), probe(None, remove=True), stored(1)):
            s.engine.publish(batch)
        until(lambda: 1 in s.held("n1", range(2)), "the marker batch indexed (and every batch before it)")
        assert s.held("n1", range(2)) == [0, 1]
        stop(s.serve)
        s.serve = s.start_serve()
        until(lambda: 1 in s.held("n1", range(2)), "the node's snapshot after the restart")
        assert s.held("n1", range(2)) == [0, 1]
