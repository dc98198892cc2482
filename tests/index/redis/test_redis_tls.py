"""Redis Cluster and Sentinel over TLS only (``--port 0``; client certificates, the cluster bus, replication
and the sentinels' links all TLS): the URIs, the index's pipelined fast path answering like the memory
backend in process, and ``kvcoord serve --index <TLS cluster>`` answering HTTP and gRPC lookups like
``--index memory``. Real ``redis-server``, ``redis-sentinel`` and ``kvcoord serve`` processes only."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import BlockStored, KVEventBatch
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.redis.client import _FastPath
from kvcoord.index.redis.index import RedisIndex
from kvcoord.index.uri import parse_index_uri
from kvcoord.router.client import CoordinatorClient
from kvcoord.validate import ops_of
from tests.http_util import http_json, metrics, sample
from tests.index.redis.test_redis_index import H, M, stored
from tests.procs import free_port, kvcoord_cmd, running, until, until_async, wait_for_port
from tests.redis_servers import RedisCluster, RedisSentinel

# ------------------------------------------------------------------------------------------- URIs


def test_cluster_uris_take_tls_options() -> None:
    spec = parse_index_uri("redis+cluster://a:1,b:2?ssl=1&ssl_ca_certs=/ca.pem&ssl_certfile=/c.crt"
                           "&ssl_keyfile=/c.key&ssl_check_hostname=0&client_name=kv&buckets=8")
    r = spec.redis
    assert r is not None and r.cluster and spec.backend == "redis-cluster" and r.buckets == 8
    assert dict(r.node_options) == {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.crt",
                                    "ssl_keyfile": "/c.key", "ssl_check_hostname": False, "client_name": "kv"}
    plain = parse_index_uri("redis+cluster://a:1").redis
    assert plain is not None and plain.node_options == ()


@pytest.mark.parametrize(("uri", "needle"), [
    ("redis+cluster://h:1?ssl_ca_certs=/ca.pem", "ssl_ca_certs needs ssl=1"),
    ("redis+cluster://h:1?ssl=yes", "ssl must be 0 or 1"),
    ("redis+cluster://h:1?sentinel_ssl=1", "unknown option 'sentinel_ssl'"),
    ("redis+cluster://h:1?ssl=1&health_check_interval=soon", "health_check_interval must be an integer"),
])
def test_bad_cluster_tls_uris(uri: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_index_uri(uri)


# ---------------------------------------------------------------------------------- the index


def _over_tls(path: _FastPath) -> bool:
    """Whether the fast path's connection is open and speaks TLS."""
    conn = path._conn
    return conn is not None and conn._transport is not None and (
        conn._transport.get_extra_info("ssl_object") is not None)


async def _fill_alike(indexes: list[Any], seed: int) -> list[list[int]]:
    """Apply one random fleet (shared prefixes, three tiers, a removal and a clear) to every index;
    return queries over it."""
    rng = random.Random(seed)
    chain = [rng.getrandbits(64) for _ in range(120)]
    for i in range(30):
        depth = rng.randrange(1, len(chain))
        held = [h for h in chain[:depth] if rng.random() > 0.03]
        tiers = {"GPU": held[: depth // 2], "CPU": held[depth // 3 :], None: held[::7]}
        for medium, hs in tiers.items():
            for idx in indexes:
                await idx.apply(M, f"node-{i % 17}", i % 2, ops_of([stored(*hs, medium=medium)]))
    for idx in indexes:
        await idx.remove_node("node-3")
        await idx.clear(M, "node-4", 0)
    prefixes = [chain[: rng.randrange(2, 120)] for _ in range(20)]
    return [chain, chain[:9], chain[4:], [chain[0], 12345], *prefixes]


async def _assert_alike(idx: RedisIndex, mem: MemoryIndex, queries: list[list[int]]) -> int:
    """Every query, with and without candidates, answers as the memory backend; returns the lookups made."""
    cands = [*((f"node-{i}", r) for i in range(0, 17, 2) for r in range(2)), ("nobody", 0)]
    for q in queries:
        assert await idx.match(M, H(*q)) == await mem.match(M, H(*q))
        assert await idx.match(M, H(*q), cands) == await mem.match(M, H(*q), cands)
    return 2 * len(queries)


@pytest.mark.parametrize("query", ["", "&mirror=1"])
async def test_tls_cluster_answers_on_the_fast_path_like_the_memory_backend(
    redis_cluster_tls: RedisCluster, query: str
) -> None:
    """Lookups on a TLS-only Cluster read each bucket on its shard's own pipelined connection, over TLS
    (one per primary); with ``mirror=1`` the copy answers, loaded and fed over TLS. Same answers."""
    redis_cluster_tls.flushall()
    idx = RedisIndex.from_uri(redis_cluster_tls.url + query, key_prefix="kvtls")
    mem = MemoryIndex()
    try:
        assert idx.backend == "redis-cluster" and idx._shards is not None
        queries = await _fill_alike([idx, mem], seed=21)
        if query:
            assert await idx.mirror_ready()
            mirror = idx.metrics.mirror

            async def answered_by_mirror() -> bool:
                before = mirror.lookups
                await idx.match(M, H(*queries[0]))
                return bool(mirror.lookups > before)

            await until_async(answered_by_mirror, "the mirror answering")
            before, walked = mirror.lookups, idx.metrics.walked_lookups
            made = await _assert_alike(idx, mem, queries)
            # (a lookup while the copy's markers are not confirmed recently reads Redis instead)
            assert mirror.lookups - before + idx.metrics.walked_lookups - walked == made
        else:
            made = await _assert_alike(idx, mem, queries)
            assert idx.metrics.walked_lookups == made and idx.metrics.errors == 0
            paths = list(idx._shards._paths.values())
            assert len(paths) == len(redis_cluster_tls.servers) and all(map(_over_tls, paths))
    finally:
        await idx.close()
        await mem.close()


async def test_tls_sentinel_answers_on_the_fast_path_like_the_memory_backend(
    redis_sentinel_tls: RedisSentinel,
) -> None:
    """Sentinel with TLS to the sentinels and the data nodes: the fast path asks the sentinels (over TLS)
    for the primary and reads it over TLS. Same answers as the memory backend."""
    redis_sentinel_tls.flushall()
    idx = RedisIndex.from_uri(f"{redis_sentinel_tls.url}&buckets=3", key_prefix="kvtls")
    mem = MemoryIndex()
    try:
        assert idx._fast is not None
        made = await _assert_alike(idx, mem, await _fill_alike([idx, mem], seed=22))
        assert idx.metrics.walked_lookups == made and idx.metrics.errors == 0
        assert _over_tls(idx._fast)
    finally:
        await idx.close()
        await mem.close()


# ---------------------------------------------------------------------------- kvcoord serve

MODEL = "tls-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="42")


@dataclass
class Serve:
    name: str
    grpc: int
    http: int
    metrics: int

    def query(self, tokens: list[int]) -> list[tuple[Any, ...]]:
        status, body = http_json("POST", f"http://127.0.0.1:{self.http}/query",
                                 {"token_ids": tokens, "model_name": MODEL})
        assert status == 200, (self.name, body)
        return [(n["node_id"], n["dp_rank"], n["matched_blocks"], n["tiers"]) for n in body["nodes"]]

    def lookup(self, tokens: list[int]) -> list[tuple[Any, ...]]:
        with CoordinatorClient(f"127.0.0.1:{self.grpc}") as client:
            res = client.lookup(MODEL, tokens=tokens)
        return [(n.node_id, n.dp_rank, n.matched_blocks, n.tiers) for n in res.nodes]

    def metric(self, name: str) -> float:
        """The sum of ``name``'s samples; AssertionError if there is none."""
        page = metrics(f"http://127.0.0.1:{self.metrics}/metrics", timeout=10)
        assert any(n == name for n, _ in page), f"{self.name} exports no {name}"
        return sample(page, name)


@contextlib.contextmanager
def serves(tmp: Path, indexes: dict[str, str]) -> Iterator[list[Serve]]:
    """One ``kvcoord serve`` per named index URI, each with gRPC, HTTP and metrics on free ports."""
    with contextlib.ExitStack() as stack:
        out = []
        for name, index in indexes.items():
            s = Serve(name, free_port(), free_port(), free_port())
            stack.enter_context(running(kvcoord_cmd(
                "serve", "--listen", f"127.0.0.1:{s.grpc}", "--metrics-listen", f"127.0.0.1:{s.metrics}",
                "--http-listen", f"127.0.0.1:{s.http}", "--index", index,
                "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42",
            ), log=tmp / f"serve-{name}.log"))
            out.append(s)
        for s in out:
            wait_for_port(s.http)
            wait_for_port(s.grpc)
        yield out


def _stored(tokens: list[int], medium: str) -> KVEventBatch:
    hashes = block_hashes64(PROFILE, tokens)
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tuple(tokens[: len(hashes) * BS]),
        block_size=BS, lora_id=None, medium=medium)])


@pytest.mark.slow
def test_serve_on_a_tls_cluster_answers_http_and_grpc_like_memory(
    tmp_path: Path, redis_cluster_tls: RedisCluster
) -> None:
    """Three engines (vLLM-exact ZMQ publishers) registered over HTTP with three ``kvcoord serve``: on the
    memory index, on the TLS-only Cluster, and on it with ``mirror=1``. Every lookup, HTTP and gRPC,
    answers alike on all three; the Cluster ones came from the fast path's walk and from the mirror."""
    redis_cluster_tls.flushall()
    prefix = list(range(100, 100 + 12 * BS))
    branches = [list(range(1000 * (i + 1), 1000 * (i + 1) + 3 * BS)) for i in range(3)]
    chains = [prefix[: (4 + 4 * i) * BS] + branch for i, branch in enumerate(branches)]
    queries = [prefix, prefix[: 6 * BS], chains[2], chains[0][: 5 * BS + 2], [7, 7, 7, 7, 7]]
    ports = [(free_port(), free_port()) for _ in chains]
    pubs = [ZmqEventPublisher(0, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", bind=True) for p, r in ports]
    url = redis_cluster_tls.url
    try:
        for i, (pub, tokens) in enumerate(zip(pubs, chains, strict=True)):
            pub.publish(_stored(tokens, "GPU"))
            pub.publish(_stored(tokens[: 3 * BS], "CPU") if i else _stored(tokens[:BS], "CPU"))
        indexes = {"memory": "memory", "cluster": f"{url}&prefix=kvw", "mirror": f"{url}&prefix=kvm&mirror=1"}
        with serves(tmp_path, indexes) as (mem, walk, mirror):
            for s in (mem, walk, mirror):
                for i, (p, r) in enumerate(ports):
                    status, body = http_json("POST", f"http://127.0.0.1:{s.http}/register", {
                        "instance_id": 10 + i, "endpoint": f"tcp://127.0.0.1:{p}",
                        "replay_endpoint": f"tcp://127.0.0.1:{r}", "model_name": MODEL, "block_size": BS})
                    assert status == 201, (s.name, body)
            full = until(lambda: a if len(a := mem.query(prefix)) == 3 else None, "every engine on memory")
            assert sorted(m[2] for m in full) == [4, 8, 12]
            for s in (walk, mirror):
                until(lambda s=s: s.query(prefix) == full, f"every engine on {s.name}",
                      diagnose=lambda s=s: s.query(prefix))
            # The copy loads (over TLS) once lookups start: it answers one.
            mirrored = "kvcoord_index_mirror_lookups_total"
            until(lambda: mirror.query(prefix) == full and mirror.metric(mirrored), "the mirror answering",
                  timeout=60)
            walked = walk.metric("kvcoord_index_walked_lookups_total")
            from_mirror = mirror.metric(mirrored)
            mirror_walked = mirror.metric("kvcoord_index_walked_lookups_total")
            for q in queries:
                expected = mem.query(q)
                assert walk.query(q) == expected and mirror.query(q) == expected, q
                got = mem.lookup(q)
                assert [(n, r, b) for n, r, b, _ in got] == [(n, r, b) for n, r, b, _ in expected]
                assert walk.lookup(q) == got and mirror.lookup(q) == got, q
            # Each Cluster lookup came from Redis on the pipelined TLS connections, or from the mirror
            # (which reads Redis the same way while its markers are not confirmed recently), and succeeded
            # (the counters count answers only).
            assert walk.metric("kvcoord_index_walked_lookups_total") - walked == 2 * len(queries)
            by_mirror = mirror.metric(mirrored) - from_mirror
            by_walk = mirror.metric("kvcoord_index_walked_lookups_total") - mirror_walked
            assert by_mirror + by_walk == 2 * len(queries)
    finally:
        for pub in pubs:
            pub.shutdown()
