"""Redis-only behaviour of ``kvcoord.index.redis``: key layout, no-scan removal, memory, outages, replicas.

The semantics are covered by the shared backend suite (tests/index/test_index_backends.py), which runs on
the ``redis`` and ``redis-cluster`` params; these tests look at what only Redis has.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import pytest
import redis

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index import open_index
from kvcoord.index.base import IndexReset
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.redis.client import IndexUnavailable
from kvcoord.index.redis.index import RedisIndex
from kvcoord.validate import InvalidEvent, ops_of, snapshot_columns
from tests.redis_servers import RedisCluster, RedisServer, TlsRedis

M = "m"
T = TypeVar("T")


def stored(*hashes: int, medium: str | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=16, medium=medium
    )


def H(*xs: int) -> list[BlockHash64]:
    return [BlockHash64(x) for x in xs]


def keys_of(server: RedisServer) -> list[bytes]:
    with redis.Redis(port=server.port) as r:
        return sorted(r.keys("*"))


@pytest.fixture
async def rindex(redis_server: RedisServer) -> AsyncIterator[RedisIndex]:
    redis_server.flushall()
    idx = RedisIndex.from_uri(redis_server.url, key_prefix="kvt")
    try:
        yield idx
    finally:
        await idx.close()


@pytest.fixture
async def cindex(redis_cluster: RedisCluster) -> AsyncIterator[RedisIndex]:
    redis_cluster.flushall()
    idx = RedisIndex.from_uri(redis_cluster.url, key_prefix="kvt")
    try:
        yield idx
    finally:
        await idx.close()


# ------------------------------------------------------------------------------------------- URIs


async def test_open_index_picks_the_backend(redis_server: RedisServer, redis_cluster: RedisCluster) -> None:
    a = open_index(redis_server.url)
    b = open_index(redis_cluster.url + "?buckets=6")
    try:
        assert isinstance(a, RedisIndex) and (a.backend, a.buckets) == ("redis", 1)
        assert isinstance(b, RedisIndex) and (b.backend, b.buckets) == ("redis-cluster", 6)
        assert await a.remote.ping() and await b.remote.ping()
    finally:
        await a.close()
        await b.close()


async def test_one_spec_opens_the_index_the_directory_and_the_engine_store(redis_server: RedisServer) -> None:
    """The URI is parsed once: its ``prefix`` option (over the configured key prefix) places the index
    and the directory and engine store it carries."""
    from kvcoord.coordinator.engine_store import open_engine_store
    from kvcoord.coordinator.engines import Engine, Listener
    from kvcoord.coordinator.shared import SharedNode, open_directory
    from kvcoord.index.uri import parse_index_uri

    redis_server.flushall()
    spec = parse_index_uri(redis_server.url + "?prefix=one", key_prefix="configured")
    assert (spec.backend, spec.key_prefix) == ("redis", "one")
    assert parse_index_uri("memory", key_prefix="p").backend == "memory"
    idx = open_index(spec)
    directory, store = open_directory(idx), open_engine_store(idx)
    assert directory is not None
    try:
        await idx.apply(M, "n1", 0, ops_of([stored(1)]))
        await directory.publish([SharedNode("n1", M, (0,), "active", 1, time.time() + 5, "r1", time.time())])
        assert await store.swap(7, None, Engine(7, M, "default", 16, (Listener(0, "tcp://127.0.0.1:1"),)))
        assert {k.split(b":")[0] for k in keys_of(redis_server)} == {b"{one}", b"{one"}
    finally:
        await idx.close()
        await directory.close()
        await store.close()
    assert open_directory(open_index("memory")) is None
    with pytest.raises(ValueError, match="unknown option 'bucket'"):
        parse_index_uri(redis_server.url + "?bucket=4")


@pytest.mark.parametrize(
    "uri",
    ["redis+cluster://", "redis+cluster://hostonly", "redis+cluster://h:1,h:x", "redis+cluster://h:1?nope=1"],
)
def test_bad_cluster_uris(uri: str) -> None:
    with pytest.raises(ValueError):
        RedisIndex.from_uri(uri)


async def test_clients_with_other_bucket_counts_cannot_share_a_keyspace(redis_server: RedisServer) -> None:
    redis_server.flushall()
    a = RedisIndex.from_uri(redis_server.url + "?buckets=4", key_prefix="kvt")
    b = RedisIndex.from_uri(redis_server.url + "?buckets=2", key_prefix="kvt")
    try:
        await a.apply(M, "n1", 0, ops_of([stored(1)]))
        before = keys_of(redis_server)
        with pytest.raises(ValueError, match="buckets"):
            await b.apply(M, "n1", 0, ops_of([stored(2)]))
        assert keys_of(redis_server) == before
        assert [m.matched_blocks for m in await a.match(M, H(1, 2))] == [1]
    finally:
        await a.close()
        await b.close()


async def test_a_keyspace_of_another_layout_is_refused(redis_server: RedisServer) -> None:
    redis_server.flushall()
    with redis.Redis(port=redis_server.port) as r:
        r.set("{kvt}:conf", "1")  # what the first format (unsorted holder records) wrote
    idx = RedisIndex.from_uri(redis_server.url, key_prefix="kvt")
    try:
        before = keys_of(redis_server)
        with pytest.raises(ValueError, match="layout"):
            await idx.apply(M, "n1", 0, ops_of([stored(1)]))
        assert keys_of(redis_server) == before
    finally:
        await idx.close()


# ------------------------------------------------------------------------------------- key layout


async def test_every_key_is_namespaced_and_tagged(rindex: RedisIndex, redis_server: RedisServer) -> None:
    await rindex.apply(M, "n1", 0, ops_of([stored(1, 2)]))
    await rindex.apply("other", "n2", 3, ops_of([stored(1)]))
    ks = keys_of(redis_server)
    assert ks and all(k.startswith(b"{kvt:0}:") or k == b"{kvt}:conf" for k in ks)
    assert {b"{kvt:0}:inv:m", b"{kvt:0}:inv:other", b"{kvt:0}:node:n1", b"{kvt:0}:node:n2"} <= set(ks)


async def test_cluster_keeps_a_node_on_one_slot_and_spreads_nodes(
    cindex: RedisIndex, redis_cluster: RedisCluster
) -> None:
    nodes = [f"node-{i}" for i in range(24)]
    for n in nodes:
        await cindex.apply(M, n, 0, ops_of([stored(1, 2, 3)]))
    with redis.RedisCluster(host="127.0.0.1", port=redis_cluster.servers[0].port) as rc:
        for n in nodes[:4]:
            tag = cindex.tag_of(n)
            pattern = tag.replace("{", "\\{").replace("}", "\\}") + "*"
            slots = {rc.keyslot(k) for k in rc.scan_iter(match=pattern)}
            assert len(slots) == 1
    shards_with_data = [s for s in redis_cluster.servers if int(s.cli("DBSIZE").strip()) > 0]
    assert len(shards_with_data) == len(redis_cluster.servers)
    got = await cindex.match(M, H(1, 2, 3))
    assert sorted(m.node_id for m in got) == sorted(nodes)
    assert {m.matched_blocks for m in got} == {3}


# ------------------------------------------------------------------------------- removal, reclaim


def commandstats(server: RedisServer) -> set[str]:
    return {
        line.split(":", 1)[0].removeprefix("cmdstat_")
        for line in server.cli("INFO", "commandstats").splitlines()
        if line.startswith("cmdstat_")
    }


async def test_remove_and_clear_never_scan_keyspace(rindex: RedisIndex, redis_server: RedisServer) -> None:
    await rindex.apply(M, "keep", 0, ops_of([stored(*range(500))]))
    baseline = keys_of(redis_server)
    await rindex.apply(M, "gone", 0, ops_of([stored(*range(5000)), stored(*range(100), medium="CPU")]))
    await rindex.apply(M, "gone", 1, ops_of([stored(*range(3000))]))
    await rindex.apply(M, "cleared", 0, ops_of([stored(*range(2500))]))
    redis_server.cli("CONFIG", "RESETSTAT")
    await rindex.remove_node("gone")
    await rindex.clear(M, "cleared", 0)
    assert [m.node_id for m in await rindex.match(M, H(*range(10)))] == ["keep"]
    await rindex.reclaim()  # the background task may be doing some of it at the same time
    deadline = time.monotonic() + 10
    while rindex.metrics.reclaimed_entries < 5000 + 3000 + 2500:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    assert rindex.metrics.reclaimed_entries == 5000 + 3000 + 2500
    cmds = commandstats(redis_server)
    assert not cmds & {"scan", "keys", "flushdb", "flushall"}
    # reclaim walked only the retired locations' own hashes (HSCAN), in chunks, and left nothing behind
    assert "hscan" in cmds
    assert sorted(k for k in keys_of(redis_server) if b":node:" not in k) == sorted(
        k for k in baseline if b":node:" not in k
    )
    st = await rindex.stats()
    assert (st.entries, st.blocks, st.nodes) == (500, 500, 1)


async def test_background_reclaim_runs_unasked(rindex: RedisIndex, redis_server: RedisServer) -> None:
    await rindex.apply(M, "a", 0, ops_of([stored(*range(3000))]))
    await rindex.remove_node("a")

    def finished() -> bool:
        # the final state: every entry counted (reclaim counts real deletions only, so never past 3000),
        # no forward/inverted hash left, and the retired-location queue drained
        return rindex.metrics.reclaimed_entries >= 3000 and not any(
            b":fwd:" in k or b":inv:" in k or k.endswith(b":dead") for k in keys_of(redis_server)
        )

    deadline = time.monotonic() + 20
    while not finished():
        assert time.monotonic() < deadline, f"background reclaim did not finish: {rindex.metrics}"
        await asyncio.sleep(0.02)
    assert rindex.metrics.reclaimed_entries == 3000
    assert (await rindex.stats()).entries == 0


async def test_replace_larger_than_one_script_call_is_atomic_for_readers(rindex: RedisIndex) -> None:
    await rindex.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
    entries = [(BlockHash64(h), Tier.GPU) for h in range(10, 45_010)]
    await rindex.replace_node(M, "n1", 0, *snapshot_columns(entries))
    assert await rindex.match(M, H(1)) == []
    [m] = await rindex.match(M, H(*range(10, 200)))
    assert m.matched_blocks == 190
    st = await rindex.stats()
    assert (st.entries, st.blocks) == (45_000, 45_000)


# ---------------------------------------------------------------------------------------- memory


async def test_memory_per_entry_on_real_redis(rindex: RedisIndex, redis_server: RedisServer) -> None:
    """INFO used_memory before/after loading (the benchmark reports the figure; this keeps it sane)."""
    await rindex.apply(M, "warm", 0, ops_of([stored(1)]))
    before = redis_server.used_memory()
    n_nodes, per_node = 8, 5000
    rng = random.Random(7)
    shared = [rng.getrandbits(64) for _ in range(per_node // 2)]
    for i in range(n_nodes):
        own = [rng.getrandbits(64) for _ in range(per_node - len(shared))]
        await rindex.apply(M, f"n{i}", 0, ops_of([stored(*shared), stored(*own)]))
    per_entry = (redis_server.used_memory() - before) / (n_nodes * per_node)
    assert 20 < per_entry < 250, per_entry


# ------------------------------------------------------------------------------- equivalence


async def test_many_nodes_match_like_the_memory_backend(cindex: RedisIndex) -> None:
    """Long shared prefixes over many nodes and tiers: the cluster walk equals the memory walk."""
    mem = MemoryIndex()
    rng = random.Random(11)
    chain = [rng.getrandbits(64) for _ in range(120)]
    for i in range(40):
        depth = rng.randrange(1, len(chain))
        held = [h for h in chain[:depth] if rng.random() > 0.03]
        tiers = {"GPU": held[: depth // 2], "CPU": held[depth // 3 :], None: held[::7]}
        for medium, hs in tiers.items():
            for idx in (cindex, mem):
                await idx.apply(M, f"node-{i % 29}", i % 3, ops_of([stored(*hs, medium=medium)]))
    for q in (chain, chain[:10], chain[5:], [chain[0], 12345]):
        assert await cindex.match(M, H(*q)) == await mem.match(M, H(*q))
        cands = [(f"node-{i}", r) for i in range(0, 29, 3) for r in range(3)]
        assert await cindex.match(M, H(*q), cands) == await mem.match(M, H(*q), cands)
    # Many lookups at once: each reads every bucket in a transaction of its own (a connection of its
    # shard), and all of them answer, none refused for want of connections.
    queries = [chain[: rng.randrange(1, len(chain))] for _ in range(300)]
    got = await asyncio.gather(*(cindex.match(M, H(*q)) for q in queries))
    assert got == [await mem.match(M, H(*q)) for q in queries]
    await mem.close()


@pytest.mark.parametrize(("over", "buckets"), [("tcp", 1), ("tcp", 3), ("tls", 1), ("tls", 3)])
async def test_fast_path_walk_matches_the_memory_backend(
    request: pytest.FixtureRequest, redis_server: RedisServer, over: str, buckets: int
) -> None:
    """Standalone Redis over plain TCP or TLS walks client-side (raw HMGET): same answers as the memory
    walk, with and without candidates, over one bucket and several (one MULTI per bucket, one write)."""
    target: RedisServer | TlsRedis = redis_server if over == "tcp" else request.getfixturevalue("redis_tls")
    target.flushall()
    sep = "&" if "?" in target.url else "?"
    idx = RedisIndex.from_uri(f"{target.url}{sep}buckets={buckets}", key_prefix="kvt")
    mem = MemoryIndex()
    try:
        assert idx._fast is not None
        rng = random.Random(13)
        chain = [rng.getrandbits(64) for _ in range(300)]
        for i in range(50):
            depth = rng.randrange(1, len(chain))
            held = [h for h in chain[:depth] if rng.random() > 0.02]
            tiers = {"GPU": held[: depth // 2], "CPU": held[depth // 3 :], None: held[::5]}
            for medium, hs in tiers.items():
                for index in (idx, mem):
                    await index.apply(M, f"node-{i % 23}", i % 2, ops_of([stored(*hs, medium=medium)]))
        for index in (idx, mem):
            await index.remove_node("node-4")
            await index.clear(M, "node-5", 0)
        for q in (chain, chain[:7], chain[3:], [chain[0], 99], [99, chain[0]], [*chain, 1, 2, 3]):
            assert await idx.match(M, H(*q)) == await mem.match(M, H(*q))
            cands = [*((f"node-{i}", r) for i in range(0, 23, 2) for r in range(2)), ("nobody", 0)]
            assert await idx.match(M, H(*q), cands) == await mem.match(M, H(*q), cands)
        assert await idx.match(M, H(*chain), [("nobody", 0)]) == []
        assert await idx.match("other-model", H(*chain)) == []
    finally:
        await idx.close()
        await mem.close()


async def test_cached_location_names_follow_other_replicas_and_restarts(own_server: RedisServer) -> None:
    """The fast path caches ``T:name`` by its version token: another replica's removals, clears and
    re-adds show at once, and a Redis restarted empty (ids start over) never reuses a stale cache."""
    a = RedisIndex.from_uri(own_server.url, key_prefix="kvt")
    b = RedisIndex.from_uri(own_server.url, key_prefix="kvt")
    try:
        await a.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
        await a.apply(M, "n2", 0, ops_of([stored(1, 2)]))
        assert [m.node_id for m in await a.match(M, H(1, 2, 3))] == ["n1", "n2"]
        await b.remove_node("n1")
        assert [m.node_id for m in await a.match(M, H(1, 2, 3))] == ["n2"]
        await b.apply(M, "n1", 0, ops_of([stored(1)]))
        await b.clear(M, "n2", 0)
        assert [(m.node_id, m.matched_blocks) for m in await a.match(M, H(1, 2, 3))] == [("n1", 1)]
        own_server.restart()

        resets = []

        async def retrying(ix: RedisIndex, fn: Callable[[], Awaitable[T]]) -> T:
            deadline = time.monotonic() + 10
            while True:
                try:
                    return await fn()
                except IndexUnavailable:  # the first call on a lost connection fails; the next reconnects
                    assert time.monotonic() < deadline
                    await asyncio.sleep(0.05)
                except IndexReset:  # the data is gone: accept the new lifetime, as the coordinator does
                    resets.append(ix)
                    assert ix.remote is not None
                    await ix.remote.generation()

        await retrying(b, lambda: b.apply(M, "fresh", 0, ops_of([stored(7, 8)])))  # location id 1 again
        got = await retrying(a, lambda: a.match(M, H(7, 8)))
        assert resets == [b, a]  # each client noticed the loss itself, in its own call
        assert [(m.node_id, m.matched_blocks) for m in got] == [("fresh", 2)]
        assert await a.match(M, H(1, 2, 3)) == []
    finally:
        await a.close()
        await b.close()


async def test_two_replicas_on_one_redis_answer_alike(redis_server: RedisServer) -> None:
    redis_server.flushall()
    a = RedisIndex.from_uri(redis_server.url, key_prefix="kvt")
    b = RedisIndex.from_uri(redis_server.url, key_prefix="kvt")
    try:
        await a.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
        await b.apply(M, "n2", 0, ops_of([stored(1, 2)]))
        await a.remove_node("n2")
        await b.apply(M, "n2", 0, ops_of([stored(1)]))
        for q in (H(1, 2, 3), H(1)):
            assert await a.match(M, q) == await b.match(M, q)
        assert [(m.node_id, m.matched_blocks) for m in await b.match(M, H(1, 2, 3))] == [("n1", 3), ("n2", 1)]
    finally:
        await a.close()
        await b.close()


async def test_concurrent_batches_coalesce_and_apply_like_the_memory_backend(rindex: RedisIndex) -> None:
    """Batches of many nodes in flight at once share script calls; each node's order is kept, and a bad
    target among them fails alone (refused before queueing) without touching the others."""
    mem = MemoryIndex()
    rng = random.Random(5)
    chain = [rng.getrandbits(64) for _ in range(64)]
    calls: list[tuple[str, list[KVEvent]]] = []
    for i in range(60):
        node = f"node-{i % 12}"
        evs: list[KVEvent] = [stored(*chain[: rng.randrange(1, 64)], medium=rng.choice(["GPU", "CPU"]))]
        if i % 5 == 0:
            evs.append(BlockRemoved(block_hashes=tuple(chain[rng.randrange(64) :]), medium="CPU"))
        if i % 17 == 0:
            evs.append(AllBlocksCleared())
        calls.append((node, evs))
    # The first write checks the keyspace's layout (one round trip the others wait for): done before, so
    # that all 61 calls below reach the writer's queue in one pass of the loop, whatever the timing.
    for idx in (rindex, mem):
        await idx.apply(M, "node-0", 0, ops_of([AllBlocksCleared()]))
    trips = rindex.metrics.round_trips
    results = await asyncio.gather(
        *(rindex.apply(M, n, 0, ops_of(evs)) for n, evs in calls[:30]),
        rindex.apply(M, "node-bad", -1, ops_of([stored(1, 2)])),
        *(rindex.apply(M, n, 0, ops_of(evs)) for n, evs in calls[30:]),
        return_exceptions=True,
    )
    assert isinstance(results[30], InvalidEvent)
    assert not any(isinstance(r, BaseException) for i, r in enumerate(results) if i != 30)
    assert rindex.metrics.round_trips - trips < len(calls) // 2  # coalesced
    for n, evs in calls:
        await mem.apply(M, n, 0, ops_of(evs))
    for q in (chain, chain[:5], chain[10:]):
        assert await rindex.match(M, H(*q)) == await mem.match(M, H(*q))
    st_r, st_m = await rindex.stats(), await mem.stats()
    assert (st_r.entries, st_r.blocks, st_r.nodes) == (st_m.entries, st_m.blocks, st_m.nodes)
    assert await rindex.export_node(M, "node-bad", 0) == []
    await mem.close()


# ------------------------------------------------------------------------------ reservation feed


async def test_reservation_feed_history_pages_back_within_its_window(rindex: RedisIndex,
                                                                     redis_server: RedisServer) -> None:
    """A catch-up reads more than one page (1,000 entries a read), oldest first, and leaves out an entry
    older than its window (written at Redis' 1 ms)."""
    feed = rindex.reservation_feed
    assert feed is not None
    key = "{kvt}:reservations"
    with redis.Redis(port=redis_server.port) as r:
        r.xadd(key, {"c": b"ancient"}, id="1-1")
        pipe = r.pipeline(transaction=False)
        for i in range(2500):
            pipe.xadd(key, {"c": str(i).encode()})
        pipe.execute()
    _, added, back = await feed.history(b"last", 3600)
    assert [raw for _, raw in back] == [str(i).encode() for i in range(2500)] + [b"last"]
    times = [when for when, _ in back]
    assert times == sorted(times) and times[-1] == added and added - times[0] < 3600


# ------------------------------------------------------------------------------------- outages


async def test_ping_apply_and_reconnect_across_a_redis_restart(own_server: RedisServer) -> None:
    idx = RedisIndex.from_uri(own_server.url + "?timeout=1")
    try:
        await idx.apply(M, "n1", 0, ops_of([stored(1, 2)]))
        epoch = await idx.remote.data_epoch()
        assert await idx.remote.data_epoch() == epoch
        own_server.kill()
        assert await idx.remote.ping() is False
        assert not idx.metrics.up
        errors = idx.metrics.errors
        with pytest.raises(IndexUnavailable):
            await idx.apply(M, "n1", 0, ops_of([stored(3)]))
        with pytest.raises(IndexUnavailable):
            await idx.match(M, H(1, 2))
        assert idx.metrics.errors > errors and idx.metrics.connection_errors >= 2
        own_server.start()  # same port, empty: persistence is off
        deadline = time.monotonic() + 10
        while not await idx.remote.ping():
            assert time.monotonic() < deadline
        assert idx.metrics.up and idx.metrics.reconnects >= 1
        assert await idx.remote.data_epoch() != epoch  # the coordinator's cue to ask agents for snapshots
        assert await idx.match(M, H(1, 2)) == []
        await idx.apply(M, "n1", 0, ops_of([stored(1, 2)]))
        assert [m.matched_blocks for m in await idx.match(M, H(1, 2))] == [2]
        assert idx.metrics.round_trips > 0 and sum(idx.metrics.latency_counts) == idx.metrics.round_trips
    finally:
        await idx.close()


async def test_ping_is_false_when_nothing_listens() -> None:
    from tests.procs import free_port

    idx = RedisIndex.from_uri(f"redis://127.0.0.1:{free_port()}/0?timeout=0.5")
    try:
        assert await idx.remote.ping() is False
    finally:
        await idx.close()


# Coordinator-level fault test (issue 6, "Faults"), to be written once `kvcoord serve --index redis://…`,
# the sim-engine and the agent run end to end:
#   1. start own_server; `kvcoord serve --index <url>`; a `kvcoord sim-engine` publishing a steady
#      workload; a `kvcoord agent` relaying it to the coordinator.
#   2. poll gRPC health until SERVING and the index is non-empty;
#   3. own_server.kill(): poll health until NOT_SERVING (the agent's batches stay unacked);
#   4. own_server.start() (empty): poll until SERVING again; the coordinator sees data_epoch() change
#      and asks every agent for a snapshot;
#   5. stop the engine's workload, wait until the agent's acked seq reaches the engine's last seq, then
#      compare `export_node` for the node with the engine pool's own block set (the sim-engine's
#      mirror): equal, tier by tier. Repeat step 3-5 with a restart that keeps data (SIGSTOP/SIGCONT
#      the server) to prove "back intact -> resume without snapshot".
