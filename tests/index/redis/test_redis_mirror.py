"""The Redis backend's lookup mirror (``?mirror=1``): an in-memory copy kept current by the change feed
that every write script appends to. Real ``redis-server`` processes; a second, plain ``RedisIndex`` on
the same keyspace is the reference (its lookups read Redis itself).

Proves: the copy answers exactly what Redis answers after any mix of stores, removals, clears, node
removals, snapshots and reclaims written by *another* client (a replica); a missed feed entry, a
FLUSHALL and a Redis restart make it reload instead of serving an old copy; while Redis is down it
does not answer from the copy at all.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
from collections.abc import AsyncIterator
from typing import Any, cast

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.index.base import IndexReset, NodeMatch
from kvcoord.index.redis.client import IndexUnavailable
from kvcoord.index.redis.index import RedisIndex
from kvcoord.native import native
from kvcoord.validate import ops_of, snapshot_columns
from tests.redis_servers import RedisCluster, RedisServer

PREFIX = "kvmirror"
MODELS = ("m1", "m2")
NODES = ("n1", "n2", "n3", "n4")
MEDIA = (None, "CPU", "GPU")


def _stored(hashes: list[int], medium: str | None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=4,
                       medium=medium)


async def _feed_seq(r: Any, tag: str) -> int:
    return int(await r.get(f"{tag}:feedseq") or 0)


async def _settled(ix: RedisIndex, r: Any) -> None:
    """Until the mirror has replayed the feed to its current end."""
    mirror = ix._mirror
    assert mirror is not None
    deadline = time.monotonic() + 10
    while True:
        ends = [await _feed_seq(r, t) for t in ix._tags]
        if mirror.ready and all(mirror.seq.get(t, -1) >= end for t, end in zip(ix._tags, ends, strict=True)):
            return
        if time.monotonic() > deadline:
            raise AssertionError("the mirror did not catch up with the feed")
        await asyncio.sleep(0.005)


def _key(ms: list[NodeMatch]) -> list[tuple[str, int, int, tuple[int, ...]]]:
    return sorted((m.node_id, m.dp_rank, m.matched_blocks, tuple(m.tiers)) for m in ms)


@pytest.fixture(params=["redis", "redis-cluster"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[RedisIndex, RedisIndex, Any]]:
    """(writer without a mirror, reader with one, the writer's raw client), on one fresh keyspace of
    a standalone Redis or a 3-shard Cluster (4 buckets there: feeds on several shards)."""
    target: RedisServer | RedisCluster = request.getfixturevalue(
        "redis_server" if request.param == "redis" else "redis_cluster"
    )
    target.flushall()
    opts = "?buckets=4" if request.param == "redis-cluster" else "?"
    writer = RedisIndex.from_uri(target.url + opts, key_prefix=PREFIX)
    reader = RedisIndex.from_uri(target.url + opts + "&mirror=1", key_prefix=PREFIX)
    try:
        assert await reader.mirror_ready()
        yield writer, reader, writer._r
    finally:
        await reader.close()
        await writer.close()


async def _same_answers(writer: RedisIndex, reader: RedisIndex, raw: Any, chains: list[list[int]],
                        rng: random.Random) -> None:
    await _settled(reader, raw)
    mirror = reader._mirror
    assert mirror is not None
    before = mirror.lookups
    for model in MODELS:
        for chain in chains:
            cut = rng.randrange(1, len(chain) + 1)
            query = [*chain[:cut], rng.getrandbits(64)]
            cands = None
            if rng.random() < 0.3:
                cands = [(n, r) for n in rng.sample(NODES, 2) for r in (0, 1)]
            want = await writer.match(model, query, cands)
            await _current(reader)
            got = await reader.match(model, query, cands)
            assert _key(got) == _key(want), (model, cut, cands)
    assert mirror.lookups > before, "the reader's lookups did not come from its copy"


async def _current(ix: RedisIndex) -> None:
    """Until the copy may answer (its buckets' epochs confirmed lately): on a loaded machine a feed
    reader can miss its 0.5 s, and the lookup would then take Redis, which proves nothing of the copy."""
    mirror = ix._mirror
    assert mirror is not None
    deadline = time.monotonic() + 30
    while not mirror.current():
        if time.monotonic() > deadline:
            raise AssertionError("the copy never became current")
        await asyncio.sleep(0.005)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_copy_answers_what_redis_answers_after_another_clients_writes(
    pair: Pair, seed: int
) -> None:
    writer, reader, raw = pair
    rng = random.Random(seed)
    chains = [[rng.getrandbits(64) for _ in range(24)] for _ in range(5)]
    for step in range(50):
        model, node, rank = rng.choice(MODELS), rng.choice(NODES), rng.randrange(2)
        chain = rng.choice(chains)
        a, b = sorted(rng.sample(range(len(chain) + 1), 2))
        roll = rng.random()
        events: list[KVEvent]
        if roll < 0.55:
            events = [_stored(chain[a:b], rng.choice(MEDIA)), _stored(chain[:a], None)]
            await writer.apply(model, node, rank, ops_of(events))
        elif roll < 0.8:
            await writer.apply(model, node, rank, ops_of([BlockRemoved(block_hashes=tuple(chain[a:b]),
                                                                medium=rng.choice(MEDIA))]))
        elif roll < 0.86:
            await writer.apply(model, node, rank, ops_of([AllBlocksCleared(), _stored(chain[:a], None)]))
        elif roll < 0.9:
            await writer.clear(model, node, rank)
        elif roll < 0.94:
            await writer.remove_node(node)
        elif roll < 0.97:
            await writer.replace_node(model, node, rank,
                                      *snapshot_columns([(h, Tier.CPU) for h in chain[a:b]]))
        else:
            await writer.reclaim()
        if step % 10 == 9:
            await _same_answers(writer, reader, raw, chains, rng)
    await writer.reclaim()
    await _same_answers(writer, reader, raw, chains, rng)


Pair = tuple[RedisIndex, RedisIndex, Any]


async def test_own_writes_are_visible_to_the_next_lookup(pair: Pair) -> None:
    _, reader, _ = pair
    mirror = reader._mirror
    assert mirror is not None
    chain = list(range(1, 33))
    for i in range(1, 33):
        await reader.apply("m1", "n1", 0, ops_of([_stored(chain[i - 1 : i], None)]))
        await _current(reader)
        got = await reader.match("m1", chain)
        assert [(m.node_id, m.matched_blocks) for m in got] == [("n1", i)]
    await reader.remove_node("n1")
    assert await reader.match("m1", chain) == []
    assert mirror.lookups >= 33


async def test_a_missed_entry_or_a_flush_reloads_the_copy(pair: Pair) -> None:
    writer, reader, raw = pair
    mirror = reader._mirror
    assert mirror is not None
    tag = reader.tag_of("n2")  # the bucket of the write below
    chain = [random.getrandbits(64) for _ in range(8)]
    await writer.apply("m1", "n1", 0, ops_of([_stored(chain, None)]))
    await _settled(reader, raw)
    loads = mirror.loads
    # An entry the mirror never sees (as when the feed was trimmed past it): the next one jumps.
    await raw.incr(f"{tag}:feedseq")
    await writer.apply("m1", "n2", 0, ops_of([_stored(chain[:4], None)]))
    await _settled(reader, raw)
    assert mirror.loads == loads + 1
    assert _key(await reader.match("m1", chain)) == _key(await writer.match("m1", chain))
    # Redis loses everything: the copy must not keep answering from the old data. It may answer as of
    # at most CURRENT_SECONDS before (the old data, never an empty answer); then the lookup takes the
    # Redis path, which sees the lost epoch in its own round trip.
    before = _key(await reader.match("m1", chain))
    await raw.flushall()
    deadline = time.monotonic() + 10
    while True:
        try:
            got = _key(await reader.match("m1", chain))
        except IndexReset:
            break
        assert got == before, "the mirror answered from a keyspace that lost its data"
        assert time.monotonic() < deadline, "the mirror kept serving data Redis no longer has"
        await asyncio.sleep(0.02)
    with pytest.raises(IndexReset):
        await writer.apply("m1", "n3", 1, ops_of([_stored(chain[:2], None)]))
    assert await raw.keys("*") == []  # refused atomically: nothing written on top of the lost data
    for ix in (writer, reader):  # the coordinator's cue: re-read the generation (and resync the nodes)
        assert ix.remote is not None
        await ix.remote.generation()
    # ...and the copy reloads in the new lifetime (once its other readers returned from their XREAD).
    while not (mirror.loads >= loads + 2 and mirror.current()):
        assert time.monotonic() < deadline, "the mirror did not reload after the flush"
        await asyncio.sleep(0.02)
    assert await reader.match("m1", chain) == []
    await writer.apply("m1", "n3", 1, ops_of([_stored(chain[:2], None)]))
    await _settled(reader, raw)
    assert _key(await reader.match("m1", chain)) == [("n3", 1, 2, (2, 0, 0))]


async def test_down_redis_is_reported_not_answered_from_the_copy(own_server: RedisServer) -> None:
    reader = RedisIndex.from_uri(own_server.url + "?mirror=1&timeout=1", key_prefix=PREFIX)
    try:
        assert await reader.mirror_ready()
        chain = [random.getrandbits(64) for _ in range(6)]
        await reader.apply("m1", "n1", 0, ops_of([_stored(chain, None)]))
        assert len(await reader.match("m1", chain)) == 1
        own_server.kill()
        deadline = time.monotonic() + 5
        while True:
            try:
                await reader.match("m1", chain)
            except IndexUnavailable:
                break
            assert time.monotonic() < deadline, "lookups kept answering from the copy with Redis down"
            await asyncio.sleep(0.02)
        own_server.start()  # empty
        while True:  # the loss is noticed by the lookup itself (after one failed reconnect, maybe)
            try:
                await reader.match("m1", chain)
            except IndexUnavailable:
                assert time.monotonic() < deadline + 10
                await asyncio.sleep(0.02)
                continue
            except IndexReset:
                break
            raise AssertionError("a lookup answered from a Redis that came back empty")
        assert reader.remote is not None
        await reader.remote.generation()
        assert await reader.mirror_ready()
        assert await reader.match("m1", chain) == []
        await reader.apply("m1", "n1", 0, ops_of([_stored(chain[:3], None)]))
        assert [m.matched_blocks for m in await reader.match("m1", chain)] == [3]
    finally:
        await reader.close()


def test_mirror_option_is_checked() -> None:
    with pytest.raises(ValueError, match="mirror must be 0 or 1"):
        RedisIndex.from_uri("redis://127.0.0.1:1/0?mirror=yes")


# --- the C walk is the Python walk ------------------------------------------------------------------
Case = tuple[dict[int, bytes], list[object], dict[int, tuple[str, str, int]], set[int] | None]


def _holders(draw: st.DrawFn, ids: list[int]) -> bytes:
    """A well-formed holder string: records sorted by id, unique, each with a tier mask."""
    chosen = sorted(set(draw(st.lists(st.sampled_from(ids), max_size=len(ids)))))
    return b"".join(struct.pack(">IB", i, draw(st.integers(1, 7))) for i in chosen)


@st.composite
def walk_case(draw: st.DrawFn) -> Case:
    ids = draw(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=8, unique=True))
    keys = draw(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=12, unique=True))
    copy: dict[int, bytes] = {}
    pool = [_holders(draw, ids) for _ in range(3)]  # few distinct strings: runs of equal ones
    for k in keys:
        if draw(st.booleans()) or not copy:
            copy[k] = draw(st.sampled_from(pool))
    query: list[object] = list(draw(st.lists(st.sampled_from(keys), max_size=20)))
    if draw(st.integers(0, 9)) == 0:  # an invalid hash somewhere
        query.insert(draw(st.integers(0, len(query))), draw(st.sampled_from([-1, 2**64, True, 1.0, "x"])))
    live = {i: ("m", f"node{i % 3}", i % 2) for i in ids if draw(st.booleans())}
    allowed = None if draw(st.booleans()) else set(draw(st.lists(st.sampled_from(ids), max_size=4)))
    return copy, query, live, allowed


@pytest.mark.skipif(native is None, reason="native code not built or KVCOORD_NATIVE=0")
@settings(max_examples=400, deadline=None)
@given(walk_case())
def test_c_mirror_walk_is_the_python_walk(case: Case) -> None:
    from kvcoord.index.redis.walk import _Names, _runs_of, _walk_runs

    assert native is not None
    copy, query, live, allowed = case
    valid = all(type(h) is int and 0 <= h < 2**64 for h in query)
    got = native.mirror_walk(copy, query, live, allowed, NodeMatch)
    if not valid:
        assert got is None  # the caller's Python path words the error
        return
    names = _Names(b"v", [x for i, loc in live.items() for x in (str(i).encode(), _loc(loc))])
    want = _walk_runs(_runs_of([copy.get(cast(int, h)) for h in query]), names, allowed)
    assert got is not None
    assert sorted(got) == sorted(want)
    assert all(type(m) is NodeMatch for m in got)


def _loc(loc: tuple[str, str, int]) -> bytes:
    from kvcoord.index.redis.keys import _loc_name

    return _loc_name(loc[0], loc[1], loc[2]).encode()


def test_merged_strings_keep_each_buckets_records_as_one_sorted_segment() -> None:
    """Cluster mirrors merge every bucket's holder string of a block into one (global id = bucket << 24
    | local id); a bucket's update replaces exactly its segment, and an id past 2**24 is refused."""
    from kvcoord.index.redis.walk import _rebase

    def rec(*pairs: tuple[int, int]) -> bytes:
        return b"".join(struct.pack(">IB", i, m) for i, m in pairs)

    assert _rebase(3, rec((1, 1), (2**24 - 1, 2))) == rec((3 << 24 | 1, 1), (3 << 24 | 2**24 - 1, 2))
    assert _rebase(3, rec((1, 1), (2**24, 1))) is None
    reader = RedisIndex.from_uri("redis+cluster://127.0.0.1:1?buckets=4&mirror=1", key_prefix=PREFIX)
    mirror = reader._mirror
    assert mirror is not None
    mirror.merged = {}
    steps: list[tuple[int, bytes | None]] = [(2, rec((5, 1))), (0, rec((1, 1), (9, 2))), (3, rec((1, 4))),
                                             (2, rec((4, 1), (6, 1))), (0, None), (2, None), (3, None)]
    want: dict[int, bytes] = {}
    for bucket, v in steps:
        mirror._merge_one(bucket, "m", 7, v)
        if v is None:
            want.pop(bucket, None)
        else:
            want[bucket] = v
        expect = b"".join(cast(bytes, _rebase(b, want[b])) for b in sorted(want))
        assert mirror.merged["m"].get(7, b"") == expect
    assert 7 not in mirror.merged["m"]
