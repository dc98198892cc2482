"""Lost data noticed in the call itself (issue 29): after a FLUSHALL (or a Redis restarted empty), the next
lookup raises ``IndexReset`` instead of answering from the emptied keyspace, and the next write is refused
whole, before anything is written, until the client re-reads the generation. On every lookup path: the
pipelined fast path (plain TCP with one bucket and several, a unix socket, TLS), a Redis Cluster's
per-shard transactions, and the
lookup mirror (which may answer from its copy only while that is provably current).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvcoord.events import BlockStored
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import IndexReset, NodeMatch
from kvcoord.index.redis.index import RedisIndex
from kvcoord.validate import ops_of, snapshot_columns
from tests.redis_servers import RedisCluster, RedisServer, TlsRedis, start_server, stop_server

M = "m"


def stored(hashes: list[int]) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=16)


def view(ms: list[NodeMatch]) -> list[tuple[str, int]]:
    return [(m.node_id, m.matched_blocks) for m in ms]


class Target:
    """One Redis (or Cluster) and how a test opens a client on it and reads its keys."""

    def __init__(self, uri: str, servers: list[RedisServer], unix: str = "") -> None:
        self.uri = uri
        self.servers = servers
        self.unix = unix

    def flushall(self) -> None:
        for s in self.servers:
            s.flushall()

    def all_keys(self) -> list[bytes]:
        out: list[bytes] = []
        for s in self.servers:
            with redis.Redis(port=s.port) as r:
                out.extend(r.keys("*"))
        return sorted(out)

    def open(self, query: str = "") -> RedisIndex:
        sep = "&" if "?" in self.uri else "?"
        return RedisIndex.from_uri(self.uri + (sep + query if query else ""), key_prefix="kvepoch")


@pytest.fixture(scope="module")
def unix_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[RedisServer, str]]:
    sock = str(tmp_path_factory.mktemp("sock") / "redis.sock")
    server = start_server("--unixsocket", sock, "--unixsocketperm", "700")
    try:
        yield server, sock
    finally:
        stop_server(server)


KINDS = ["fast", "fast-4-buckets", "unix-fast", "tls-fast", "cluster", "mirror", "mirror-cluster"]


@pytest.fixture(params=KINDS)
def target(request: pytest.FixtureRequest) -> tuple[Target, str]:
    kind: str = request.param
    t: Target
    if kind.endswith("cluster"):
        c: RedisCluster = request.getfixturevalue("redis_cluster")
        t = Target(c.url, c.servers)
    elif kind == "unix-fast":
        server, sock = request.getfixturevalue("unix_server")
        t = Target(f"unix://{sock}", [server])  # unix:///path, as redis-py's docs write it
    elif kind == "tls-fast":
        tls: TlsRedis = request.getfixturevalue("redis_tls")
        t = Target(tls.url, tls.servers)
    else:
        s: RedisServer = request.getfixturevalue("redis_server")
        t = Target(s.url, [s])
    t.flushall()
    query = {"fast-4-buckets": "buckets=4", "mirror": "mirror=1", "mirror-cluster": "mirror=1"}.get(kind, "")
    return t, query


@pytest.fixture
async def pair(target: tuple[Target, str]) -> AsyncIterator[tuple[Target, RedisIndex, RedisIndex]]:
    t, query = target
    a, b = t.open(query), t.open(query)
    try:
        yield t, a, b
    finally:
        await a.close()
        await b.close()


async def until_reset(ix: RedisIndex, chain: list[BlockHash64], before: list[tuple[str, int]]) -> None:
    """Until a lookup raises IndexReset. Before that, only the mirror may answer, and only as before the
    loss (its copy as of at most ``CURRENT_SECONDS`` ago): never an answer from the emptied keyspace."""
    deadline = time.monotonic() + 10
    while True:
        try:
            got = view(await ix.match(M, chain))
        except IndexReset as exc:
            assert exc.buckets and all(b.startswith("{kvepoch") for b in exc.buckets)
            return
        assert ix._mirror is not None, f"the {ix.backend} lookup answered {got} from a flushed keyspace"
        assert got == before, "the mirror answered from a keyspace that lost its data"
        assert time.monotonic() < deadline, "the mirror kept answering from a frozen copy"
        await asyncio.sleep(0.01)


async def test_flush_is_noticed_by_the_next_lookup_and_write(
    pair: tuple[Target, RedisIndex, RedisIndex],
) -> None:
    t, a, b = pair
    chain = [BlockHash64(random.getrandbits(64)) for _ in range(6)]
    nodes = [f"n{i}" for i in range(8)]  # spread over the buckets
    for n in nodes:
        await a.apply(M, n, 0, ops_of([stored(chain[:3])]))
    for ix in (a, b):
        if ix._mirror is not None:
            assert await ix.mirror_ready()
    before = view(await a.match(M, chain))
    assert before == [(n, 3) for n in nodes]
    assert view(await b.match(M, chain)) == before
    gen = await a.remote.generation() if a.remote is not None else ""
    t.flushall()
    await until_reset(a, chain, before)
    # Every write is refused whole: nothing lands in the emptied keyspace.
    writes: list[Any] = [
        lambda: a.apply(M, "n0", 0, ops_of([stored(chain)])),
        lambda: a.replace_node(M, "n1", 0, *snapshot_columns([(chain[0], 0)])),
        lambda: a.clear(M, "n2", 0),
        lambda: a.remove_node("n3"),
    ]
    for write in writes:
        with pytest.raises(IndexReset):
            await write()
    # (a mirror reloading across the flush may have turned its feed on again: harmless, not a write)
    assert [k for k in t.all_keys() if not k.endswith(b":feedon")] == [], "a refused write left keys behind"
    # The coordinator's cue: the generation is read again (it would ask every agent for a snapshot).
    assert a.remote is not None and b.remote is not None
    new = await a.remote.generation()
    assert new != gen
    assert await a.match(M, chain) == []
    await a.apply(M, "n0", 0, ops_of([stored(chain[:2])]))
    assert view(await a.match(M, chain)) == [("n0", 2)]
    # The other client noticed nothing yet: it is refused too, then adopts the marker the first one set.
    with contextlib.suppress(IndexReset):  # (its mirror may answer once more from its old copy)
        await until_reset(b, chain, before)
    with pytest.raises(IndexReset):
        await b.apply(M, "n5", 0, ops_of([stored(chain[:1])]))
    assert await b.remote.generation() == new
    await b.apply(M, "n5", 0, ops_of([stored(chain[:1])]))
    if b._mirror is not None:
        assert await b.mirror_ready()
    deadline = time.monotonic() + 10
    while (got := view(await b.match(M, chain))) != [("n0", 2), ("n5", 1)]:  # its copy reloads meanwhile
        assert time.monotonic() < deadline, got
        await asyncio.sleep(0.01)


async def test_a_redis_restarted_empty_is_noticed_like_a_flush(tmp_path: Path) -> None:
    server = start_server()
    ix = RedisIndex.from_uri(server.url + "?timeout=1", key_prefix="kvepoch")
    try:
        chain = [BlockHash64(random.getrandbits(64)) for _ in range(4)]
        await ix.apply(M, "n", 0, ops_of([stored(chain)]))
        server.restart()  # same port, no persistence: empty
        deadline = time.monotonic() + 10
        seen: list[str] = []
        while True:
            try:
                await ix.apply(M, "n", 0, ops_of([stored(chain[:1])]))
            except IndexReset:
                break
            except ConnectionError as exc:  # the first call on the lost connection fails
                seen.append(type(exc).__name__)
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
                continue
            raise AssertionError("a write landed in a Redis that came back empty")
        assert Target(server.url, [server]).all_keys() == []
        assert ix.remote is not None
        await ix.remote.generation()
        assert await ix.match(M, chain) == []
    finally:
        await ix.close()
        stop_server(server)
