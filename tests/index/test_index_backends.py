"""The backend suite: every ``Index`` backend must pass it unchanged, through the protocol only."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import asdict
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.hashing import BlockHash64, to_block_hash64
from kvcoord.index.base import ApplyResult, Index, NodeMatch, fence_token, ping
from kvcoord.index.memory import HAVE_C_CORE
from kvcoord.validate import InvalidEvent, SnapshotEntry, ops_of, snapshot_columns
from tests.conftest import INDEX_FACTORIES

M = "m"
BIG = (1 << 64) - 1
HI = 1 << 63


def H(*xs: int) -> list[BlockHash64]:
    return [BlockHash64(x) for x in xs]


@pytest.fixture(params=list(INDEX_FACTORIES))
def index_backend(request: pytest.FixtureRequest) -> str:
    """Every backend, conftest's ``SUITE_ONLY`` ones too (a Redis Cluster over TLS only)."""
    return str(request.param)


def stored(
    *hashes: int | bytes,
    medium: str | None = None,
    kind: str | None = None,
    group: int | None = None,
) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=None,
        token_ids=(),
        block_size=16,
        medium=medium,
        kv_cache_spec_kind=kind,
        group_idx=group,
    )


def removed(*hashes: int | bytes, medium: str | None = None, group: int | None = None) -> BlockRemoved:
    return BlockRemoved(block_hashes=tuple(hashes), medium=medium, group_idx=group)


def as_tuples(ms: Sequence[NodeMatch]) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return [(m.node_id, m.dp_rank, m.matched_blocks, tuple(m.tiers)) for m in ms]


async def observable(
    index: Index, keys: Iterable[tuple[str, str, int]], queries: Iterable[tuple[str, Sequence[int]]]
) -> tuple[object, ...]:
    """Everything a reader can see (bytes excluded: an estimate that may move on its own)."""
    st_ = await index.stats()
    counts = (st_.entries, st_.blocks, st_.nodes, st_.entries_by_model_tier, st_.blocks_by_model)
    exports = [await index.export_node(m, n, d) for m, n, d in keys]
    matches = [as_tuples(await index.match(m, H(*q))) for m, q in queries]
    return counts, exports, matches


# ---------------------------------------------------------------------------------------- basics


async def test_backend_name_and_capabilities(index: Index, index_backend: str) -> None:
    """The core protocol on every backend; each optional capability present exactly where it means
    something: fencing and remote on Redis, the native view on the memory index's C core."""
    assert await ping(index) is True
    assert isinstance(index.backend, str) and index.backend
    names = ("fencing", "native", "remote", "node_directory", "engine_store", "reservation_feed")
    have = {name for name in names if getattr(index, name) is not None}
    if index_backend.startswith("redis"):
        assert have == {"fencing", "remote", "node_directory", "engine_store", "reservation_feed"}
    else:
        assert have == ({"native"} if index_backend == "memory" and HAVE_C_CORE else set())
    await index.apply(M, "n1", 0, ops_of([stored(1, 2)]))
    assert fence_token(index, "n1") == 0  # never claimed: unfenced
    quick, exact = await index.stats(exact=False), await index.stats()
    assert (quick.entries, quick.nodes, exact.entries, exact.blocks) == (2, 1, 2, 2)
    if index.fencing is not None:
        await index.fencing.claim("n1")
        await index.apply(M, "n1", 0, ops_of([stored(3)]))  # the claim's token is issued by this write
        assert index.fencing.fence_token("n1") > 0
    if index.native is not None:
        view = index.native.native_view(M)
        assert view is not None and ("n1", 0) in view[1]
        assert index.native.native_view("other-model") is None
    if index.node_directory is not None:
        record = '{"owner":"r1","heard":1.0,"fence":0}'
        await index.node_directory.publish([("n1", "r1", 1.0, 0, record)])
        assert await index.node_directory.fetch("n1") == record.encode()
        assert await index.node_directory.fetch_all() == {"n1": record.encode()}
        await index.node_directory.delete(["n1"])
        assert await index.node_directory.fetch("n1") is None
    if index.engine_store is not None:
        assert await index.engine_store.swap(7, "", "seven") and not await index.engine_store.swap(7, "", "x")
        assert await index.engine_store.all() == {7: b"seven"}
        assert await index.engine_store.claim(7, "r1", "{}", 5.0) and not await index.engine_store.claim(
            7, "r2", "{}", 5.0)
        assert await index.engine_store.owners() == {7: ("r1", "{}")}
    if index.reservation_feed is not None:
        feed = index.reservation_feed
        start, added, back = await feed.history(b"one", 60)
        assert back == [(added, b"one")]
        after, wrote, got = await feed.exchange(b"two", start)
        assert got == [(wrote, b"two")] and after != start and wrote is not None and wrote >= added
        assert await feed.exchange(None, after) == (after, None, [])
        last = await feed.append(b"three")
        after, wrote, got = await feed.exchange(None, after)
        assert (after, wrote, [raw for _, raw in got]) == (last, None, [b"three"])
        _, added, back = await feed.history(b"four", 60)
        assert [raw for _, raw in back] == [b"one", b"two", b"three", b"four"]
        times = [when for when, _ in back]
        assert times == sorted(times) and times[-1] == added  # Redis' clock, in seconds
        assert await feed.claim("m:1f", b"a/r\0q1", 30.0) is None  # claimed
        held = await feed.claim("m:1f", b"b/r\0q2", 30.0)  # held by the first, for the rest of its time
        assert held is not None and held[0] == b"a/r\0q1" and 0 < held[1] <= 30.0
        assert await feed.claim("m:1e", b"b/r\0q2", 30.0) is None  # another prefix
    if index.remote is not None:
        gen = await index.remote.generation()
        assert gen and await index.remote.generation() == gen
        assert await index.remote.ping() and index.remote.metrics.errors == 0


async def test_empty_index_matches_nothing(index: Index) -> None:
    assert await index.match(M, H(1, 2, 3)) == []
    assert await index.match(M, []) == []
    st_ = await index.stats()
    assert (st_.entries, st_.blocks, st_.nodes) == (0, 0, 0)


async def test_store_then_match_longest_leading_run(index: Index) -> None:
    res = await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3, 4, 5)]))
    assert res.stored == 5
    assert as_tuples(await index.match(M, H(1, 2, 3, 9, 4))) == [("n1", 0, 3, (3, 0, 0))]
    assert await index.match(M, H(9, 1, 2)) == []
    assert await index.match(M, []) == []
    assert await index.match("other-model", H(1, 2)) == []


async def test_match_is_gap_free(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2, 4, 5)]))
    assert as_tuples(await index.match(M, H(1, 2, 3, 4, 5))) == [("n1", 0, 2, (2, 0, 0))]


async def test_match_order_longest_first_then_node_then_rank(index: Index) -> None:
    await index.apply(M, "b", 1, ops_of([stored(1, 2)]))
    await index.apply(M, "b", 0, ops_of([stored(1, 2)]))
    await index.apply(M, "a", 3, ops_of([stored(1, 2)]))
    await index.apply(M, "c", 0, ops_of([stored(1, 2, 3)]))
    await index.apply(M, "d", 0, ops_of([stored(1)]))
    got = [(m.node_id, m.dp_rank, m.matched_blocks) for m in await index.match(M, H(1, 2, 3))]
    assert got == [("c", 0, 3), ("a", 3, 2), ("b", 0, 2), ("b", 1, 2), ("d", 0, 1)]


async def test_per_tier_counts_each_block_once_in_fastest_tier(index: Index) -> None:
    await index.apply(
        M,
        "n1",
        0,
        ops_of([
            stored(1, 2),  # GPU
            stored(2, 3, medium="CPU"),
            stored(3, 4, 5, medium="STORAGE"),
            stored(6, medium="cpu_pinned"),  # SGLang alias, case-insensitive
            stored(7, medium="DISK"),
        ]),
    )
    [m] = await index.match(M, H(1, 2, 3, 4, 5, 6, 7, 8))
    assert m.matched_blocks == 7
    # 1,2 GPU; 3 CPU (also on storage); 4,5 STORAGE; 6 CPU; 7 STORAGE
    assert tuple(m.tiers) == (2, 2, 3)
    assert sum(m.tiers) == m.matched_blocks


async def test_match_across_tiers_without_gap(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1), stored(2, medium="CPU"), stored(4, medium="GPU")]))
    [m] = await index.match(M, H(1, 2, 3, 4))
    assert (m.matched_blocks, tuple(m.tiers)) == (2, (1, 1, 0))


async def test_store_is_idempotent(index: Index) -> None:
    first = await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
    again = await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3), stored(3, 2)]))
    assert first.stored == 3 and again.stored == 0
    st_ = await index.stats()
    assert (st_.entries, st_.blocks) == (3, 3)
    assert await index.export_node(M, "n1", 0) == [(1, Tier.GPU), (2, Tier.GPU), (3, Tier.GPU)]


async def test_same_block_on_two_tiers_is_two_entries(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1), stored(1, medium="CPU")]))
    st_ = await index.stats()
    assert (st_.entries, st_.blocks) == (2, 1)
    assert st_.entries_by_model_tier == {(M, Tier.GPU): 1, (M, Tier.CPU): 1}
    # removing one tier keeps the other
    res = await index.apply(M, "n1", 0, ops_of([removed(1, medium="GPU")]))
    assert res.removed == 1
    [m] = await index.match(M, H(1))
    assert tuple(m.tiers) == (0, 1, 0)


async def test_remove_and_remove_unknown_is_counted_noop(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
    res = await index.apply(M, "n1", 0, ops_of([removed(2, 99), removed(3, medium="CPU")]))
    assert (res.removed, res.removed_unknown) == (1, 2)
    assert as_tuples(await index.match(M, H(1, 2, 3))) == [("n1", 0, 1, (1, 0, 0))]
    # removals for a node / rank / model never seen are no-ops too
    res = await index.apply(M, "ghost", 0, ops_of([removed(1)]))
    assert (res.removed, res.removed_unknown) == (0, 1)
    res = await index.apply("nope", "n1", 0, ops_of([removed(1)]))
    assert (res.removed, res.removed_unknown) == (0, 1)
    res = await index.apply(M, "n1", 0, ops_of([removed(1), removed(1)]))
    assert (res.removed, res.removed_unknown) == (1, 1)
    st_ = await index.stats()
    assert (st_.entries, st_.blocks, st_.nodes) == (1, 1, 1)


async def test_removal_keeps_other_holders(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2)]))
    await index.apply(M, "n2", 0, ops_of([stored(1, 2)]))
    await index.apply(M, "n1", 0, ops_of([removed(2)]))
    assert as_tuples(await index.match(M, H(1, 2))) == [("n2", 0, 2, (2, 0, 0)), ("n1", 0, 1, (1, 0, 0))]
    assert (await index.stats()).blocks == 2


async def test_all_blocks_cleared_drops_only_that_node_rank(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2), stored(3, medium="CPU")]))
    await index.apply(M, "n1", 1, ops_of([stored(1, 2)]))
    await index.apply("m2", "n1", 0, ops_of([stored(1, 2)]))
    res = await index.apply(M, "n1", 0, ops_of([AllBlocksCleared()]))
    assert res.cleared == 3
    assert as_tuples(await index.match(M, H(1, 2))) == [("n1", 1, 2, (2, 0, 0))]
    assert as_tuples(await index.match("m2", H(1, 2))) == [("n1", 0, 2, (2, 0, 0))]
    assert await index.export_node(M, "n1", 0) == []
    # events after a clear in the same batch apply to the now-empty node
    res = await index.apply(M, "n1", 1, ops_of([stored(7), AllBlocksCleared(), stored(5)]))
    assert res.cleared == 3
    assert await index.export_node(M, "n1", 1) == [(5, Tier.GPU)]
    assert (await index.apply(M, "ghost", 0, ops_of([AllBlocksCleared()]))).cleared == 0


async def test_clear_method(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2)]))
    await index.apply(M, "n2", 0, ops_of([stored(1, 2)]))
    await index.clear(M, "n1", 0)
    await index.clear(M, "ghost", 0)
    assert as_tuples(await index.match(M, H(1, 2))) == [("n2", 0, 2, (2, 0, 0))]
    await index.apply(M, "n1", 0, ops_of([stored(1)]))
    assert await index.export_node(M, "n1", 0) == [(1, Tier.GPU)]


async def test_bytes_and_int_hashes_share_one_keyspace(index: Index) -> None:
    digest = bytes(range(24)) + (HI + 5).to_bytes(8, "big")  # 32-byte digest, low 8 bytes >= 2**63
    key = to_block_hash64(digest)
    assert key == HI + 5
    await index.apply(M, "bytes-node", 0, ops_of([stored(digest)]))
    await index.apply(M, "int-node", 0, ops_of([stored(int(key))]))
    got = sorted((m.node_id, m.matched_blocks) for m in await index.match(M, [key]))
    assert got == [("bytes-node", 1), ("int-node", 1)]
    res = await index.apply(M, "int-node", 0, ops_of([removed(digest)]))
    assert res.removed == 1
    assert await index.export_node(M, "bytes-node", 0) == [(key, Tier.GPU)]
    st_ = await index.stats()
    assert (st_.entries, st_.blocks) == (1, 1)


async def test_unsigned_hashes_at_the_top_of_uint64(index: Index) -> None:
    hs = [0, 1, HI - 1, HI, HI + 1, BIG]
    await index.apply(M, "n1", 0, ops_of([stored(*hs)]))
    [m] = await index.match(M, H(*hs))
    assert m.matched_blocks == 6
    exported = await index.export_node(M, "n1", 0)
    assert exported == [(h, Tier.GPU) for h in sorted(hs)]
    assert all(type(h) is int for h, _ in exported)
    assert await index.match(M, H(BIG - 1)) == []


# ------------------------------------------------------------------------------------- bad input

BAD_BATCHES: list[tuple[str, list[Any]]] = [
    ("negative hash", [stored(10), stored(-1)]),
    ("hash wider than 64 bits", [stored(10), stored(1 << 64)]),
    ("float hash", [stored(10), stored(1.5)]),  # type: ignore[arg-type]
    ("str hash", [stored(10), stored("abc")]),  # type: ignore[arg-type]
    ("bool hash", [stored(10), stored(True)]),
    ("None hash", [stored(10), stored(None)]),  # type: ignore[arg-type]
    ("empty digest", [stored(10), stored(b"")]),
    ("medium not a string", [stored(10), stored(11, medium=3)]),  # type: ignore[arg-type]
    ("bad removal after good store", [stored(10), removed(1, 2, -3)]),
    ("bad removal medium", [stored(10), removed(1, medium=b"GPU")]),  # type: ignore[arg-type]
    ("not an event", [stored(10), {"type": "BlockStored"}]),
    ("negative group", [stored(10), stored(11, group=-1)]),
    ("clear then bad", [AllBlocksCleared(), stored(11, medium=["GPU"])]),  # type: ignore[arg-type]
    ("unknown medium, then bad", [stored(11, medium="FLOPPY"), stored(12, group=-1)]),
]


async def test_an_unknown_medium_is_skipped_and_the_rest_applies(index: Index) -> None:
    """Its stores are not indexed and its removals remove nothing: the batch's other events apply."""
    await index.apply(M, "n1", 0, ops_of([stored(1, medium="CPU"), stored(2, medium="SHARED_STORAGE")]))
    await index.apply(M, "n1", 0, ops_of([stored(3, medium="TAPE"), removed(1, medium="TAPE"), stored(4)]))
    assert await index.export_node(M, "n1", 0) == [(1, Tier.CPU), (2, Tier.STORAGE), (4, Tier.GPU)]


@pytest.mark.parametrize("bad", BAD_BATCHES, ids=[name for name, _ in BAD_BATCHES])
async def test_bad_batch_raises_and_applies_nothing(index: Index, bad: tuple[str, list[Any]]) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3), stored(4, medium="CPU")]))
    await index.apply(M, "n2", 0, ops_of([stored(1, 2)]))
    keys = [(M, "n1", 0), (M, "n2", 0)]
    queries = [(M, [1, 2, 3, 4]), (M, [10, 11])]
    before = await observable(index, keys, queries)
    with pytest.raises(InvalidEvent):
        await index.apply(M, "n1", 0, ops_of(bad[1]))
    assert await observable(index, keys, queries) == before


@pytest.mark.parametrize(
    ("node_id", "dp_rank"),
    [("", 0), ("n1", -1), ("n1", True), (None, 0), ("n1", "0")],
)
async def test_bad_target_raises_and_applies_nothing(index: Index, node_id: Any, dp_rank: Any) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1)]))
    before = await observable(index, [(M, "n1", 0)], [(M, [1, 2])])
    with pytest.raises(InvalidEvent):
        await index.apply(M, node_id, dp_rank, ops_of([stored(2)]))
    assert await observable(index, [(M, "n1", 0)], [(M, [1, 2])]) == before


# ---------------------------------------------------------------------------------------- groups


async def test_non_full_attention_groups_are_counted_and_skipped(index: Index) -> None:
    res = await index.apply(
        M,
        "n1",
        0,
        ops_of([
            stored(1, 2, kind="full_attention", group=0),
            stored(1, 2, 3, kind="sliding_window", group=1),
            stored(50, kind="mamba", group=2),
            stored(60, 61, kind="mla_attention", group=3),
        ]),
    )
    assert (res.stored, res.skipped_group) == (4, 4)
    assert as_tuples(await index.match(M, H(1, 2, 3))) == [("n1", 0, 2, (2, 0, 0))]
    assert await index.match(M, H(50)) == []
    assert [m.matched_blocks for m in await index.match(M, H(60, 61))] == [2]
    # the sliding-window group evicting hash 2 must not drop the full-attention entry
    res = await index.apply(M, "n1", 0, ops_of([removed(2, group=1), removed(50, group=2)]))
    assert (res.removed, res.removed_unknown, res.skipped_group) == (0, 0, 2)
    assert as_tuples(await index.match(M, H(1, 2))) == [("n1", 0, 2, (2, 0, 0))]
    # a removal of the full-attention group applies
    res = await index.apply(M, "n1", 0, ops_of([removed(2, group=0)]))
    assert res.removed == 1
    assert as_tuples(await index.match(M, H(1, 2))) == [("n1", 0, 1, (1, 0, 0))]
    st_ = await index.stats()
    assert st_.entries == 3


async def test_group_memory_is_per_node_and_removals_without_group_apply(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, kind="sliding_window", group=1)]))
    await index.apply(M, "n2", 0, ops_of([stored(1, 2)]))
    # group 1 is a sliding-window group on n1, not known on n2: n2 applies the removal
    res = await index.apply(M, "n2", 0, ops_of([removed(2, group=1)]))
    assert res.removed == 1
    res = await index.apply(M, "n2", 0, ops_of([removed(1)]))
    assert res.removed == 1
    assert await index.match(M, H(1)) == []


# ------------------------------------------------------------------------------------ candidates


async def test_candidates_restrict_the_match(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
    await index.apply(M, "n1", 1, ops_of([stored(1, 2)]))
    await index.apply(M, "n2", 0, ops_of([stored(1)]))
    got = await index.match(M, H(1, 2, 3), candidates=[("n2", 0), ("n1", 1), ("ghost", 0)])
    assert as_tuples(got) == [("n1", 1, 2, (2, 0, 0)), ("n2", 0, 1, (1, 0, 0))]
    assert await index.match(M, H(1, 2, 3), candidates=set()) == []
    assert await index.match(M, H(1, 2, 3), candidates={("ghost", 0)}) == []
    got = await index.match(M, H(1, 2, 3), candidates=frozenset({("n1", 0)}))
    assert as_tuples(got) == [("n1", 0, 3, (3, 0, 0))]


# ---------------------------------------------------------------------------------- remove_node


async def test_remove_node_vanishes_everywhere_and_readd_starts_empty(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
    await index.apply(M, "n1", 1, ops_of([stored(1, 2), stored(5, medium="CPU")]))
    await index.apply("m2", "n1", 0, ops_of([stored(1)]))
    await index.apply(M, "n2", 0, ops_of([stored(1, 2)]))
    await index.remove_node("n1")
    assert as_tuples(await index.match(M, H(1, 2, 3))) == [("n2", 0, 2, (2, 0, 0))]
    assert await index.match("m2", H(1)) == []
    assert await index.match(M, H(1, 2, 3), candidates=[("n1", 0)]) == []
    assert await index.export_node(M, "n1", 0) == []
    st_ = await index.stats()
    assert (st_.entries, st_.blocks, st_.nodes) == (2, 2, 1)
    assert st_.blocks_by_model == {M: 2}
    # re-adding the id must not resurrect anything
    res = await index.apply(M, "n1", 0, ops_of([stored(9)]))
    assert res.stored == 1
    assert await index.export_node(M, "n1", 0) == [(9, Tier.GPU)]
    assert await index.export_node(M, "n1", 1) == []
    assert await index.match(M, H(1), candidates=[("n1", 0), ("n1", 1)]) == []
    res = await index.apply(M, "n1", 1, ops_of([removed(1)]))
    assert (res.removed, res.removed_unknown) == (0, 1)
    await index.remove_node("ghost")  # unknown node: no-op
    st_ = await index.stats()
    assert (st_.entries, st_.nodes) == (3, 2)


async def test_remove_then_readd_many_times(index: Index) -> None:
    for round_ in range(5):
        await index.apply(M, "n1", 0, ops_of([stored(100 + round_, 1, 2)]))
        await index.apply(M, "n2", 0, ops_of([stored(100 + round_)]))
        await index.remove_node("n1")
        assert [m.node_id for m in await index.match(M, H(100 + round_))] == ["n2"]
    st_ = await index.stats()
    assert (st_.entries, st_.nodes) == (5, 1)


# ------------------------------------------------------------------------------------- snapshots


async def test_export_and_replace_node(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(3, 1, 2), stored(2, BIG, medium="CPU")]))
    await index.apply(M, "n2", 0, ops_of([stored(1, 2)]))
    snap = await index.export_node(M, "n1", 0)
    assert snap == [(1, Tier.GPU), (2, Tier.GPU), (2, Tier.CPU), (3, Tier.GPU), (BIG, Tier.CPU)]
    new: list[SnapshotEntry] = [(BlockHash64(1), Tier.CPU), (BlockHash64(7), Tier.GPU)]
    await index.replace_node(M, "n1", 0, *snapshot_columns(new))
    assert await index.export_node(M, "n1", 0) == [(1, Tier.CPU), (7, Tier.GPU)]
    assert await index.export_node(M, "n2", 0) == [(1, Tier.GPU), (2, Tier.GPU)]
    assert as_tuples(await index.match(M, H(1, 2))) == [("n2", 0, 2, (2, 0, 0)), ("n1", 0, 1, (0, 1, 0))]
    st_ = await index.stats()
    assert (st_.entries, st_.blocks) == (4, 3)
    # replace into a node/model never seen, then round-trip
    await index.replace_node("m2", "n9", 2, *snapshot_columns(snap))
    assert await index.export_node("m2", "n9", 2) == snap
    # replace with nothing empties it
    await index.replace_node(M, "n1", 0, *snapshot_columns([]))
    assert await index.export_node(M, "n1", 0) == []
    assert [m.node_id for m in await index.match(M, H(1))] == ["n2"]


@pytest.mark.parametrize(
    "entries",
    [
        [(1, Tier.GPU), (-1, Tier.GPU)],
        [(1, Tier.GPU), (1 << 64, Tier.GPU)],
        [(1, Tier.GPU), (2, 7)],
        [(1, Tier.GPU), ("x", Tier.GPU)],
        [(1, Tier.GPU), (2,)],
    ],
)
async def test_replace_node_bad_entries_change_nothing(index: Index, entries: list[Any]) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2)]))
    before = await observable(index, [(M, "n1", 0)], [(M, [1, 2])])
    with pytest.raises(InvalidEvent):
        await index.replace_node(M, "n1", 0, *snapshot_columns(entries))
    assert await observable(index, [(M, "n1", 0)], [(M, [1, 2])]) == before


# ----------------------------------------------------------------------------------------- stats


async def test_stats_breakdown(index: Index) -> None:
    await index.apply(M, "n1", 0, ops_of([stored(1, 2, 3), stored(3, medium="CPU")]))
    await index.apply(M, "n2", 1, ops_of([stored(1, 2)]))
    await index.apply("m2", "n3", 0, ops_of([stored(1, medium="STORAGE")]))
    st_ = await index.stats()
    assert (st_.entries, st_.blocks, st_.nodes) == (7, 4, 3)
    assert st_.entries_by_model_tier == {(M, Tier.GPU): 5, (M, Tier.CPU): 1, ("m2", Tier.STORAGE): 1}
    assert st_.blocks_by_model == {M: 3, "m2": 1}
    assert st_.bytes > 0
    assert isinstance(asdict(st_), dict)


# --------------------------------------------------------------------- state machine vs reference

T = TypeVar("T")
POOL = [3, 5, 8, 13, HI, HI + 7, BIG, BIG - 2, 1 << 40, 77]
MODELS = ["m", "m2"]
NODES = ["a", "b", "c"]
TIERS = [None, "GPU", "CPU", "STORAGE"]
hash_lists = st.lists(st.sampled_from(POOL), min_size=0, max_size=6)


class Reference:
    """The naive model: ``(model, node, dp, tier) -> set of hashes`` plus the learned skip groups."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, str, int, int], set[int]] = {}
        self.skip: dict[tuple[str, str, int], set[int]] = {}

    def apply(self, model: str, node: str, dp: int, events: Sequence[KVEvent]) -> ApplyResult:
        res = ApplyResult()
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                for t in range(3):
                    res.cleared += len(self.held.pop((model, node, dp, t), set()))
                continue
            tier = int(Tier[ev.medium]) if ev.medium else 0
            s = self.held.setdefault((model, node, dp, tier), set())
            if isinstance(ev, BlockStored):
                if not ev.is_prefix_indexable():
                    res.skipped_group += len(ev.block_hashes)
                    if ev.group_idx is not None:
                        self.skip.setdefault((model, node, dp), set()).add(ev.group_idx)
                    continue
                for h in ev.block_hashes:
                    assert isinstance(h, int)
                    res.stored += h not in s
                    s.add(h)
            else:
                if ev.group_idx is not None and ev.group_idx in self.skip.get((model, node, dp), ()):
                    res.skipped_group += len(ev.block_hashes)
                    continue
                for h in ev.block_hashes:
                    assert isinstance(h, int)
                    if h in s:
                        s.remove(h)
                        res.removed += 1
                    else:
                        res.removed_unknown += 1
        return res

    def nodes_of(self, model: str) -> set[tuple[str, int]]:
        return {(n, d) for (m, n, d, _t), s in self.held.items() if m == model and s}

    def match(self, model: str, query: Sequence[int]) -> list[tuple[str, int, int, tuple[int, ...]]]:
        out = []
        for node, dp in self.nodes_of(model):
            tiers = [0, 0, 0]
            n = 0
            for h in query:
                where = [t for t in range(3) if h in self.held.get((model, node, dp, t), set())]
                if not where:
                    break
                tiers[min(where)] += 1
                n += 1
            if n:
                out.append((node, dp, n, tuple(tiers)))
        out.sort(key=lambda x: (-x[2], x[0], x[1]))
        return out

    def export(self, model: str, node: str, dp: int) -> list[tuple[int, int]]:
        return sorted((h, t) for t in range(3) for h in self.held.get((model, node, dp, t), set()))

    def remove_node(self, node: str) -> None:
        for k in [k for k in self.held if k[1] == node]:
            del self.held[k]
        for k2 in [k for k in self.skip if k[1] == node]:
            del self.skip[k2]

    def replace(self, model: str, node: str, dp: int, entries: Sequence[tuple[int, int]]) -> None:
        for t in range(3):
            self.held.pop((model, node, dp, t), None)
        for h, t in entries:
            self.held.setdefault((model, node, dp, t), set()).add(h)

    def counts(self) -> tuple[int, int, int, dict[tuple[str, Tier], int], dict[str, int]]:
        entries = sum(len(s) for s in self.held.values())
        blocks: dict[str, set[int]] = {}
        by_tier: dict[tuple[str, Tier], int] = {}
        nodes = set()
        for (m, n, _d, t), s in self.held.items():
            if s:
                blocks.setdefault(m, set()).update(s)
                by_tier[(m, Tier(t))] = by_tier.get((m, Tier(t)), 0) + len(s)
                nodes.add(n)
        by_model = {m: len(s) for m, s in blocks.items()}
        return entries, sum(by_model.values()), len(nodes), by_tier, by_model


event_strategy = st.one_of(
    st.builds(
        lambda hs, medium, skip: stored(*hs, medium=medium, kind="sliding_window" if skip else None,
                                        group=1 if skip else None),
        hash_lists, st.sampled_from(TIERS), st.integers(0, 5).map(lambda x: x == 0),
    ),
    st.builds(
        lambda hs, medium, group: removed(*hs, medium=medium, group=group),
        hash_lists, st.sampled_from(TIERS), st.sampled_from([None, None, 0, 1]),
    ),
    st.just(AllBlocksCleared()),
)


def _make_machine(backend: str, request: pytest.FixtureRequest, loop: asyncio.AbstractEventLoop) -> type:
    def run(aw: Awaitable[T]) -> T:
        return loop.run_until_complete(aw)

    class IndexMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.ref = Reference()
            self.index: Index = run(INDEX_FACTORIES[backend](request))

        def teardown(self) -> None:
            run(self.index.close())

        @initialize()
        def start(self) -> None:
            assert run(self.index.stats()).entries == 0

        @rule(
            model=st.sampled_from(MODELS),
            node=st.sampled_from(NODES),
            dp=st.integers(0, 1),
            events=st.lists(event_strategy, min_size=1, max_size=4),
        )
        def apply(self, model: str, node: str, dp: int, events: list[KVEvent]) -> None:
            got = run(self.index.apply(model, node, dp, ops_of(events)))
            assert got == self.ref.apply(model, node, dp, events)

        @rule(model=st.sampled_from(MODELS), node=st.sampled_from(NODES), dp=st.integers(0, 1))
        def clear(self, model: str, node: str, dp: int) -> None:
            run(self.index.clear(model, node, dp))
            self.ref.apply(model, node, dp, [AllBlocksCleared()])

        @rule(node=st.sampled_from(NODES))
        def remove_node(self, node: str) -> None:
            run(self.index.remove_node(node))
            self.ref.remove_node(node)

        @rule(
            model=st.sampled_from(MODELS),
            node=st.sampled_from(NODES),
            dp=st.integers(0, 1),
            entries=st.lists(st.tuples(st.sampled_from(POOL), st.sampled_from(list(Tier))), max_size=6),
        )
        def replace(self, model: str, node: str, dp: int, entries: list[tuple[int, Tier]]) -> None:
            columns = snapshot_columns([(BlockHash64(h), t) for h, t in entries])
            run(self.index.replace_node(model, node, dp, *columns))
            self.ref.replace(model, node, dp, [(h, int(t)) for h, t in entries])

        @rule(
            model=st.sampled_from(MODELS),
            node=st.sampled_from(NODES),
            dp=st.integers(0, 1),
            bad=st.sampled_from([-1, 1 << 64, "x"]),
        )
        def bad_apply(self, model: str, node: str, dp: int, bad: Any) -> None:
            with pytest.raises(InvalidEvent):
                run(self.index.apply(model, node, dp, ops_of([stored(3, 5), stored(bad)])))

        @rule(model=st.sampled_from(MODELS), node=st.sampled_from(NODES), dp=st.integers(0, 1))
        def export_matches(self, model: str, node: str, dp: int) -> None:
            got = run(self.index.export_node(model, node, dp))
            assert [(int(h), int(t)) for h, t in got] == self.ref.export(model, node, dp)

        @rule(
            model=st.sampled_from(MODELS),
            query=st.lists(st.sampled_from(POOL), min_size=1, max_size=6),
            cands=st.none() | st.sets(st.tuples(st.sampled_from(NODES), st.integers(0, 1))),
        )
        def match(self, model: str, query: list[int], cands: set[tuple[str, int]] | None) -> None:
            got = as_tuples(run(self.index.match(model, H(*query), cands)))
            want = self.ref.match(model, query)
            if cands is not None:
                want = [w for w in want if (w[0], w[1]) in cands]
            assert got == want

        @invariant()
        def counts_agree(self) -> None:
            s = run(self.index.stats())
            assert (s.entries, s.blocks, s.nodes, s.entries_by_model_tier, s.blocks_by_model) == \
                self.ref.counts()

    return IndexMachine


@pytest.mark.slow
def test_state_machine_against_reference(index_backend: str, request: pytest.FixtureRequest) -> None:
    loop = asyncio.new_event_loop()
    try:
        machine = _make_machine(index_backend, request, loop)
        run_state_machine_as_test(
            machine,
            settings=settings(
                # remote backends pay a round trip per step: fewer examples keep them under ~20 s
                max_examples=100 if index_backend.startswith("memory") else 40,
                stateful_step_count=30,
                deadline=None,
                suppress_health_check=list(HealthCheck),
            ),
        )
    finally:
        loop.close()
