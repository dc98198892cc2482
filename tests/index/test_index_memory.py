"""Memory-backend specifics: bytes per entry, lazy reclamation of removed nodes, the sync API."""

from __future__ import annotations

import asyncio
import gc
import random
import time
import tracemalloc
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import Index
from kvcoord.index.memory import HAVE_C_CORE, MemoryIndex
from kvcoord.index.table import Core
from kvcoord.native import native
from kvcoord.validate import InvalidEvent, ops_of, snapshot_columns

M = "m"
CORES = ["c", "python"] if HAVE_C_CORE else ["python"]


@pytest.fixture(params=CORES)
def core(request: pytest.FixtureRequest) -> Core:
    """Every memory-specific test runs on both cores (the C one when built)."""
    return cast(Core, request.param)


def stored(*hashes: int, medium: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=16, medium=medium
    )


def raw_keys(idx: MemoryIndex, model: str = M) -> int:
    """Keys physically present, dead or alive (what reclamation frees)."""
    mi = idx._models.get(model)
    return 0 if mi is None else mi.nkeys()


def test_is_an_index() -> None:
    assert isinstance(MemoryIndex(), Index)


def test_bytes_per_entry_measured_with_tracemalloc(core: Core) -> None:
    """Single-holder GPU entries (the common case) stay well under 100 bytes at 200k entries."""
    rng = random.Random(1)
    idx = MemoryIndex(core=core)
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for batch in range(400):
            # hashes are created inside the traced region so the key ints the index keeps are counted
            hashes = tuple(rng.getrandbits(64) | (1 << 63) for _ in range(500))
            idx.apply_sync(M, f"node-{batch % 8}", 0, ops_of([stored(*hashes)]))
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


def test_shared_blocks_cost_less_per_entry(core: Core) -> None:
    idx = MemoryIndex(core=core)
    hashes = tuple(range(1000, 21_000))
    for n in range(16):
        idx.apply_sync(M, f"n{n}", 0, ops_of([stored(*hashes)]))
    st = idx.stats_sync()
    assert (st.entries, st.blocks) == (16 * 20_000, 20_000)
    assert st.bytes / st.entries < 20


def test_remove_node_is_lazy_and_reclaim_frees_keys(core: Core) -> None:
    idx = MemoryIndex(core=core)
    idx.apply_sync(M, "gone", 0, ops_of([stored(*range(100, 200))]))
    idx.apply_sync(M, "stays", 0, ops_of([stored(*range(150, 160))]))
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
    idx.apply_sync(M, "new", 0, ops_of([stored(1)]))
    assert idx._models[M].slot_of[("new", 0)] == idx._models[M].slot_of.get(("gone", 0), 0)
    assert idx.export_node_sync(M, "new", 0) == [(1, Tier.GPU)]
    assert idx.match_sync(M, [BlockHash64(100)]) == []


def test_slots_are_not_reused_before_the_sweep_finishes(core: Core) -> None:
    idx = MemoryIndex(core=core)
    idx.apply_sync(M, "a", 0, ops_of([stored(*range(10))]))
    old_slot = idx._models[M].slot_of[("a", 0)]
    idx.remove_node_sync("a")
    idx.apply_sync(M, "a", 0, ops_of([stored(50)]))  # the store runs before this call's piggy-backed sweep
    assert idx._models[M].slot_of[("a", 0)] != old_slot
    assert idx.export_node_sync(M, "a", 0) == [(50, Tier.GPU)]


def test_apply_sync_sweeps_in_small_steps(core: Core) -> None:
    idx = MemoryIndex(core=core)
    idx.apply_sync(M, "gone", 0, ops_of([stored(*range(1, 20_001))]))
    idx.remove_node_sync("gone")
    steps = 0
    while idx.reclaim_pending:
        idx.apply_sync(M, "live", 0, ops_of([stored(7_000_000 + steps)]))
        steps += 1
        assert steps < 200
    assert steps > 1  # done piecemeal, not in one stall
    assert raw_keys(idx) == steps


def test_retire_during_sweep_is_picked_up(core: Core) -> None:
    idx = MemoryIndex(core=core, sweep_chunk=100)
    idx.apply_sync(M, "a", 0, ops_of([stored(*range(1, 1001))]))
    idx.apply_sync(M, "b", 0, ops_of([stored(*range(500, 1501))]))
    idx.remove_node_sync("a")
    idx._sweep_some(300)  # part-way through the first sweep
    assert idx.reclaim_pending
    idx.clear_sync(M, "b", 0)
    idx.reclaim_sync()
    assert raw_keys(idx) == 0
    assert idx.stats_sync().entries == 0


def test_clear_of_an_empty_slot_frees_it_at_once(core: Core) -> None:
    idx = MemoryIndex(core=core)
    idx.apply_sync(M, "a", 0, ops_of([stored(1)]))
    idx.apply_sync(M, "a", 0, ops_of([BlockRemoved(block_hashes=(1,))]))
    res = idx.apply_sync(M, "a", 0, ops_of([AllBlocksCleared()]))
    assert res.cleared == 0
    assert not idx.reclaim_pending


async def test_background_sweeper_reclaims_without_blocking(core: Core) -> None:
    idx = MemoryIndex(core=core, sweep_chunk=500)
    try:
        await idx.apply(M, "gone", 0, ops_of([stored(*range(1, 10_001))]))
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


async def test_close_cancels_a_running_sweep(core: Core) -> None:
    idx = MemoryIndex(core=core, sweep_chunk=10)
    await idx.apply(M, "gone", 0, ops_of([stored(*range(1, 5001))]))
    await idx.remove_node("gone")
    task = idx._sweeper
    assert task is not None and not task.done()
    await idx.close()
    assert task.done()


def test_tiered_values_collapse_back_to_plain_masks() -> None:
    idx = MemoryIndex(core="python")  # the pure-Python layout's tiered side table
    idx.apply_sync(M, "a", 0, ops_of([stored(1, 2, 3), stored(2, medium="CPU")]))
    idx.apply_sync(M, "b", 0, ops_of([stored(2, medium="STORAGE")]))
    mi = idx._models[M]
    assert set(mi.tiered) == {2}
    idx.apply_sync(M, "a", 0, ops_of([BlockRemoved(block_hashes=(2,), medium="CPU")]))
    idx.apply_sync(M, "b", 0, ops_of([BlockRemoved(block_hashes=(2,), medium="STORAGE")]))
    assert mi.tiered == {}
    assert [m.matched_blocks for m in idx.match_sync(M, [BlockHash64(h) for h in (1, 2, 3)])] == [3]


@pytest.mark.parametrize("nodes", [1, 7, 40, 300])
def test_match_orders_ties_by_name(nodes: int, core: Core) -> None:
    idx = MemoryIndex(core=core)
    rng = random.Random(nodes)
    names = [f"n{rng.randrange(10**6):06d}" for _ in range(nodes)]
    chain = list(range(1, 41))
    for name in names:
        idx.apply_sync(M, name, rng.randrange(2), ops_of([stored(*chain[: rng.randrange(1, 41)])]))
    rows = [tuple(m) for m in idx.match_sync(M, [BlockHash64(h) for h in chain])]
    assert rows == sorted(rows, key=lambda r: (-r[2], r[0], r[1]))


@pytest.mark.parametrize("seed", range(4))
def test_partial_sweeps_never_change_answers(seed: int, core: Core) -> None:
    """Random churn with sweeps left half-done between operations, checked against the reference."""
    from tests.index.test_index_backends import NODES, POOL, Reference

    rng = random.Random(seed)
    idx = MemoryIndex(core=core, sweep_chunk=3)
    ref = Reference()
    for _ in range(400):
        node, dp = rng.choice(NODES), rng.randrange(2)
        op = rng.random()
        if op < 0.45:
            hs = rng.sample(POOL, rng.randrange(1, 6))
            medium = rng.choice([None, "CPU", "STORAGE"])
            ev = [stored(*hs, medium=medium)]
            assert idx.apply_sync(M, node, dp, ops_of(ev)) == ref.apply(M, node, dp, ev)
        elif op < 0.65:
            ev2 = [BlockRemoved(block_hashes=tuple(rng.sample(POOL, 3)), medium=rng.choice([None, "CPU"]))]
            assert idx.apply_sync(M, node, dp, ops_of(ev2)) == ref.apply(M, node, dp, ev2)
        elif op < 0.75:
            idx.clear_sync(M, node, dp)
            ref.apply(M, node, dp, [AllBlocksCleared()])
        elif op < 0.85:
            idx.remove_node_sync(node)
            ref.remove_node(node)
        else:
            entries = [(rng.choice(POOL), rng.choice(list(Tier))) for _ in range(rng.randrange(4))]
            idx.replace_node_sync(M, node, dp, *snapshot_columns([(BlockHash64(h), t) for h, t in entries]))
            ref.replace(M, node, dp, [(h, int(t)) for h, t in entries])
        idx._sweep_some(rng.randrange(0, 4))  # leave sweeps part-way
        query = rng.sample(POOL, 4)
        got = [(m.node_id, m.dp_rank, m.matched_blocks, m.tiers) for m in idx.match_sync(M, query)]
        assert got == ref.match(M, query)
        n2, d2 = rng.choice(NODES), rng.randrange(2)
        assert [(int(h), int(t)) for h, t in idx.export_node_sync(M, n2, d2)] == ref.export(M, n2, d2)
    st = idx.stats_sync()
    assert (st.entries, st.blocks, st.nodes, st.entries_by_model_tier, st.blocks_by_model) == ref.counts()


# ------------------------------------------------------------------ the C core against the Python core

POOL2 = [0, 1, 2, 3, 5, 8, 13, 1 << 40, (1 << 63) + 7, (1 << 64) - 1, *range(100, 140)]
NODES2 = [f"n{i:02d}" for i in range(40)]
BAD_HASHES: list[Any] = [-1, 1 << 64, "x", 1.0, None, True, b""]
medium_st = st.sampled_from([None, "GPU", "CPU", "STORAGE"])
hashes_st = st.lists(st.sampled_from(POOL2), max_size=12)
event_st = st.one_of(
    st.builds(lambda hs, m: BlockStored(tuple(hs), None, (), 16, medium=m), hashes_st, medium_st),
    st.builds(lambda hs, m: BlockRemoved(block_hashes=tuple(hs), medium=m), hashes_st, medium_st),
    st.builds(
        lambda hs, bad, at: BlockStored((*hs[:at], bad, *hs[at:]), None, (), 16),
        hashes_st, st.sampled_from(BAD_HASHES), st.integers(0, 12),
    ),
    st.just(AllBlocksCleared()),
)
target_st = st.tuples(st.sampled_from(["m", "m2"]), st.sampled_from(NODES2), st.integers(0, 1))
op_st = st.one_of(
    st.tuples(st.just("apply"), target_st, st.lists(event_st, min_size=1, max_size=4)),
    st.tuples(st.just("fan"), target_st, st.integers(2, 40), st.integers(1, 45)),
    st.tuples(st.just("clear"), target_st),
    st.tuples(st.just("remove_node"), st.sampled_from(NODES2)),
    st.tuples(
        st.just("replace"),
        target_st,
        st.lists(st.tuples(st.sampled_from([*POOL2, -1]), st.sampled_from([0, 1, 2, 3])), max_size=6),
    ),
    st.tuples(st.just("sweep"), st.integers(0, 30)),
    st.tuples(
        st.just("match"),
        st.sampled_from(["m", "m2"]),
        st.lists(st.sampled_from([*POOL2, 999]), max_size=45),
        st.none() | st.sets(st.tuples(st.sampled_from(NODES2), st.integers(0, 1)), max_size=8),
    ),
)


def _do(idx: MemoryIndex, op: tuple[Any, ...]) -> object:
    """Run one op; returns what a caller can observe (its result or the exception type)."""
    kind = op[0]
    try:
        if kind == "apply":
            (model, node, dp), events = op[1], op[2]
            return idx.apply_sync(model, node, dp, ops_of(events))
        if kind == "fan":
            # many nodes storing a shared chain of different lengths: multi-holder keys, big answers
            (model, _node, dp), nodes, length = op[1], op[2], op[3]
            chain = POOL2[10:] + POOL2[:10]
            return [idx.apply_sync(model, NODES2[i], dp,
                                   ops_of([stored(*chain[: (length * (i + 1)) % 46 or 1])]))
                    for i in range(nodes)]
        if kind == "clear":
            return idx.clear_sync(*op[1])
        if kind == "remove_node":
            idx.remove_node_sync(op[1])
            return None
        if kind == "replace":
            (model, node, dp), entries = op[1], op[2]
            idx.replace_node_sync(model, node, dp, *snapshot_columns(entries))
            return None
        if kind == "sweep":
            idx._sweep_some(op[1])
            return None
        model, query, cands = op[1], op[2], op[3]
        return idx.match_sync(model, query, cands)
    except InvalidEvent as e:
        return ("InvalidEvent", str(e))


def _state(idx: MemoryIndex) -> object:
    st_ = idx.stats_sync()  # finishes sweeps: do it on copies of the op sequence only at the end
    exports = [idx.export_node_sync(m, n, d) for m in ("m", "m2") for n in NODES2 for d in (0, 1)]
    return st_.entries, st_.blocks, st_.nodes, st_.entries_by_model_tier, st_.blocks_by_model, exports


@pytest.mark.skipif(not HAVE_C_CORE, reason="C core not built")
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(op_st, min_size=1, max_size=25))
def test_c_core_equals_python_core(ops: list[tuple[Any, ...]]) -> None:
    """Random op sequences (bad input included) give identical results, errors and state."""
    c, py = MemoryIndex(core="c", sweep_chunk=5), MemoryIndex(core="python", sweep_chunk=5)
    for op in ops:
        assert _do(c, op) == _do(py, op), op
        probe = ("match", "m", POOL2[10:] + POOL2[:10], None)
        assert _do(c, probe) == _do(py, probe)
    assert _state(c) == _state(py)
    assert c.reclaim_pending == py.reclaim_pending


@pytest.mark.skipif(not HAVE_C_CORE, reason="C core not built")
def test_c_table_rejects_bad_input_and_stays_unchanged() -> None:
    assert native is not None
    t = native.Table()
    assert t.store(0, 0, [1, 2, 3]) == 3
    t.set_live(0, True)
    keys: list[tuple[str, int] | None] = [("a", 0)]
    before = (len(t), t.export(0), t.match([1, 2, 3], None, keys, None))
    bad_calls: list[tuple[str, tuple[Any, ...]]] = [
        ("store", (0, 0, [4, 5, -1])),
        ("store", (0, 0, [4, 1 << 64])),
        ("store", (0, 0, [4, "x"])),
        ("store", (0, 0, [4, True])),
        ("store", (0, 0, {4, 5})),
        ("store", (0, 3, [4])),
        ("store", (-1, 0, [4])),
        ("store", (1 << 40, 0, [4])),
        ("store", ("0", 0, [4])),
        ("store", (0, 0)),
        ("remove", (0, 0, [1, -1])),
        ("remove", (0, 0, [1, None])),
        ("set_live", (-1, True)),
        ("set_order", ([0, "x"],)),
        ("sweep_begin", ([0, -2],)),
        ("export", ("x",)),
        ("match", ([1], ["x"], keys, None)),
        ("match", ([1], None, keys, dict)),
        ("match", ([1], None, (("a", 0),), None)),
        ("match", (5, None, keys, None)),
    ]
    for name, args in bad_calls:
        with pytest.raises((TypeError, ValueError, OverflowError)):
            getattr(t, name)(*args)
        assert (len(t), t.export(0), t.match([1, 2, 3], None, keys, None)) == before, name
    # a hash that is not a uint64 int just ends the matched run
    assert t.match([1, 2, cast(int, "x"), 3], None, keys, None) == [("a", 0, 2, (2, 0, 0))]
    assert t.match([1, 1 << 64], None, keys, None) == [("a", 0, 1, (1, 0, 0))]
    assert t.match([-1], None, keys, None) == []
    # a live slot without a key is reported, not a crash
    t.store(3, 0, [1])
    t.set_live(3, True)
    with pytest.raises(RuntimeError):
        t.match([1], None, keys, None)
    seqs: list[object] = [[1, 2], (0, (1 << 64) - 1), [], [True], [-1], [1 << 64], "ab", [1.0]]
    assert [native.validate_u64_seq(x) for x in seqs] == [True, True, True, False, False, False, False, False]


@pytest.mark.skipif(not HAVE_C_CORE, reason="C core not built")
def test_c_table_grows_past_a_million_buckets_and_keeps_every_key() -> None:
    """Past 1M buckets the table grows 4x at a time; every rebuild (growth or tombstone-only) keeps
    each live key, drops each removed one, and memory per key stays bounded."""
    assert native is not None
    t = native.Table()
    t.set_live(0, True)
    t.set_live(1, True)
    rng = random.Random(3)
    keys = [rng.getrandbits(64) for _ in range(1_000_000)]
    for i in range(0, len(keys), 10_000):  # batches, as events arrive: growth happens between them
        assert t.store(0, 0, keys[i : i + 10_000]) == 10_000
    assert t.store(1, 1, keys[:1000]) == 1000  # some shared keys hold two locations
    assert len(t) == len(keys) and t.nbytes() < 100 * len(keys)
    gone = keys[::2]
    assert t.remove(0, 0, gone) == len(gone)
    for _ in range(3):  # churn leaves tombstones; a rebuild sized for the live keys must follow
        fresh = [rng.getrandbits(64) for _ in range(300_000)]
        assert t.store(0, 0, fresh) == len(fresh)
        assert t.remove(0, 0, fresh) == len(fresh)
    assert len(t) == len(keys) - len(gone) + 500  # the shared halves of removed keys stay on slot 1
    assert sorted(h for h, _ in t.export(0)) == sorted(keys[1::2])
    assert sorted(h for h, _ in t.export(1)) == sorted(keys[:1000])
    assert t.nbytes() < 100 * len(keys)


@pytest.mark.skipif(not HAVE_C_CORE, reason="C core not built")
def test_c_u64_view_checks_like_validate_and_packs_long_events() -> None:
    """``u64_view`` is the validation pass that also converts: same verdicts, and a long event packed."""
    assert native is not None
    u64_view, validate_u64_seq = native.u64_view, native.validate_u64_seq
    long_ok = [*range(2, 100), (1 << 64) - 1]
    seqs: list[object] = [[1, 2], (0, (1 << 64) - 1), [], [True], [-1], "ab", long_ok, [*long_ok, -1]]
    seqs += [(*long_ok, True), [*long_ok, 1 << 64], [*long_ok, 1.0], memoryview(b"x" * 8)]
    assert [u64_view(x) is not None for x in seqs] == [validate_u64_seq(x) for x in seqs]
    short = [1, 2]
    assert u64_view(short) is short  # short events are not worth packing
    view = u64_view(long_ok)
    assert isinstance(view, memoryview) and view.format == "Q"
    assert list(view) == long_ok and len(view) == len(long_ok)
    # the core reads a packed view exactly as the list it came from
    a, b = native.Table(), native.Table()
    assert a.store(0, 1, long_ok) == b.store(0, 1, view) == len(long_ok)
    assert a.export(0) == b.export(0)
    assert a.remove(0, 1, long_ok[:50]) == b.remove(0, 1, cast("list[int]", u64_view(long_ok[:50]))) == 50
    assert a.export(0) == b.export(0)
