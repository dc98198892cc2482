"""Issue 15 item 4: replicas that cannot corrupt each other (fencing tokens), and dead replicas' nodes
reclaimed after their lease.

The index-level tests drive two ``RedisIndex`` clients on one real Redis, as two replicas would. The
end-to-end tests run a real ``redis-server``, two real ``kvcoord serve`` replicas and the real Reporter:
replica A is paused (SIGSTOP) while its agent's batch waits in its socket, the agent reconnects to
replica B, which takes the node over; A resumes, tries the late write, and Redis refuses it. A replica
killed outright (SIGKILL) leaves entries that the other replica reclaims once the lease ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.reporter import Reporter
from kvcoord.coordinator.metrics import PyTally
from kvcoord.coordinator.shared import SharedNode, open_directory
from kvcoord.events import BlockStored, Tier
from kvcoord.hashing import BlockHash64, HashProfile, block_hashes64
from kvcoord.index.base import FencedWrite, IndexReset, fence_token
from kvcoord.index.instrumented import OPS, InstrumentedIndex
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.redis.index import RedisIndex
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.validate import ops_of
from tests.http_util import metrics, sample
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import RedisCluster, RedisServer, redis_server

M = "m"
MODEL = "fence-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="7")
TOKENS = list(range(100, 100 + 10 * BS))
OTHER = list(range(900, 900 + 4 * BS))


def stored(*hashes: int) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=BS)


def H(*xs: int) -> list[BlockHash64]:
    return [BlockHash64(x) for x in xs]


async def held(index: RedisIndex, node: str = "n") -> list[int]:
    return [h for h, _ in await index.export_node(M, node, 0)]


# --- index level: two clients of one Redis ------------------------------------------------------

@pytest.fixture(params=["redis_server", "redis_cluster"], ids=["redis", "redis-cluster"])
def server(request: pytest.FixtureRequest) -> RedisServer | RedisCluster:
    srv: RedisServer | RedisCluster = request.getfixturevalue(request.param)
    srv.flushall()
    return srv


@pytest.fixture
async def pair(server: RedisServer | RedisCluster) -> AsyncIterator[tuple[RedisIndex, RedisIndex]]:
    a = RedisIndex.from_uri(server.url, key_prefix="kvf")
    b = RedisIndex.from_uri(server.url, key_prefix="kvf")
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


async def test_a_stale_owner_is_refused_every_write(pair: tuple[RedisIndex, RedisIndex]) -> None:
    a, b = pair
    await a.fencing.claim("n")
    await a.apply(M, "n", 0, ops_of([stored(1, 2, 3)]))
    token_a = a.fencing.fence_token("n")
    await b.fencing.claim("n")
    await b.replace_node(M, "n", 0, H(4, 5))
    assert b.fencing.fence_token("n") > token_a > 0
    counted = InstrumentedIndex(a, lambda: PyTally((1.0,)))  # the coordinator's metrics wrapper
    stale: list[Callable[[], Awaitable[object]]] = [
        lambda: counted.apply(M, "n", 0, ops_of([stored(9)])),
        lambda: counted.replace_node(M, "n", 0, H(7, 8)),
        lambda: counted.clear(M, "n", 0),
        lambda: counted.remove_node("n"),
    ]
    for call in stale:
        with pytest.raises(FencedWrite) as info:
            await call()
        assert info.value.node_id == "n"
    assert counted.fenced_writes == 4
    refused = {"apply": 1, "replace_node": 1, "clear": 1, "remove_node": 1}
    assert counted.errors == {**dict.fromkeys(OPS, 0), **refused}
    assert await held(a) == [4, 5] == await held(b)
    assert [m.node_id for m in await a.match(M, H(4, 5))] == ["n"]
    # A claims the node back (its agent reconnected to it): now B is the stale one.
    await a.fencing.claim("n")
    await a.apply(M, "n", 0, ops_of([stored(6)]))
    with pytest.raises(FencedWrite):
        await b.apply(M, "n", 0, ops_of([stored(10)]))
    assert await held(a) == [4, 5, 6]


async def test_fencing_is_per_node_within_one_coalesced_write(pair: tuple[RedisIndex, RedisIndex]) -> None:
    a, b = pair
    for node in ("n1", "n2"):
        await a.fencing.claim(node)
        await a.apply(M, node, 0, ops_of([stored(1)]))
    await b.fencing.claim("n1")
    await b.apply(M, "n1", 0, ops_of([stored(2)]))
    # Both batches go out in one script call (same bucket): only n1's is refused.
    res = await asyncio.gather(a.apply(M, "n1", 0, ops_of([stored(3)])),
                               a.apply(M, "n2", 0, ops_of([stored(3)])), return_exceptions=True)
    assert isinstance(res[0], FencedWrite) and not isinstance(res[1], BaseException)
    assert await held(a, "n1") == [1, 2] and await held(a, "n2") == [1, 3]


async def test_unclaimed_writes_and_lost_fence_keys(pair: tuple[RedisIndex, RedisIndex],
                                                    server: RedisServer | RedisCluster) -> None:
    a, b = pair
    # A client that never claimed a node writes unfenced (library use): nothing changes for it.
    await a.apply(M, "n", 0, ops_of([stored(1)]))
    await b.apply(M, "n", 0, ops_of([stored(2)]))
    assert await held(a) == [1, 2] and a.fencing.fence_token("n") == 0
    # Redis loses everything (restarted empty): the highest token still wins, whoever writes first.
    await a.fencing.claim("n")
    await a.apply(M, "n", 0, ops_of([stored(3)]))
    await b.fencing.claim("n")
    await b.apply(M, "n", 0, ops_of([stored(4)]))
    server.flushall()
    for ix in (a, b):  # the loss is noticed by the write itself: refused until the generation is re-read
        with pytest.raises(IndexReset):
            await ix.apply(M, "n", 0, ops_of([stored(5)]))
        assert ix.remote is not None
        await ix.remote.generation()
    await a.apply(M, "n", 0, ops_of([stored(5)]))  # adopts A's token: nobody else holds the key
    await b.apply(M, "n", 0, ops_of([stored(6)]))  # B's is higher: B owns the node again
    with pytest.raises(FencedWrite):
        await a.apply(M, "n", 0, ops_of([stored(7)]))
    assert await held(a) == [5, 6]


async def test_reclaim_only_while_nobody_claimed_since(pair: tuple[RedisIndex, RedisIndex]) -> None:
    a, b = pair
    await a.fencing.claim("n")
    await a.apply(M, "n", 0, ops_of([stored(1, 2)]))
    dead_token = a.fencing.fence_token("n")
    await b.fencing.claim("n")  # the node came back, on B
    await b.apply(M, "n", 0, ops_of([stored(3)]))
    assert not await a.fencing.reclaim_node("n", dead_token)  # a stale record: the node stays
    assert await held(b) == [1, 2, 3]
    # B died: its token is still the node's
    assert await a.fencing.reclaim_node("n", b.fencing.fence_token("n"))
    assert await held(b) == [] and a.metrics.reclaimed_nodes == 1
    assert not await a.fencing.reclaim_node("n", b.fencing.fence_token("n"))  # once
    with pytest.raises(FencedWrite):  # B, late, cannot write on top of the reclaim
        await b.apply(M, "n", 0, ops_of([stored(4)]))
    assert not await a.fencing.reclaim_node("n", 0)


async def test_directory_keeps_the_later_claims_record(redis_server: RedisServer) -> None:
    redis_server.flushall()
    index = RedisIndex.from_uri(redis_server.url, key_prefix="kvf")
    d = open_directory(index)
    assert d is not None
    now = time.time()

    def rec(owner: str, heard: float, fence: int) -> SharedNode:
        return SharedNode("n", M, (0,), "active", 1, now + 10, owner, heard, fence=fence)

    try:
        await d.publish([rec("b", now - 5, 20)])
        # A stale owner woke up and heard the node later (buffered messages): its older claim loses.
        await d.publish([rec("a", now, 10)])
        got = await d.fetch("n")
        assert got is not None and (got.owner, got.fence) == ("b", 20)
        await d.publish([rec("c", now - 9, 30)])  # a later claim wins, whenever it heard the node
        got = await d.fetch("n")
        assert got is not None and got.owner == "c"
        await d.publish([rec("d", now - 1, 0)])  # without a token (not written yet): heard decides
        got = await d.fetch("n")
        assert got is not None and got.owner == "d"
    finally:
        await d.close()
        await index.close()


async def test_memory_backend_needs_no_fencing() -> None:
    """One process: the memory index has no fencing capability, and every write goes through."""
    idx = MemoryIndex()
    assert idx.fencing is None and fence_token(idx, "n") == 0
    await idx.apply(M, "n", 0, ops_of([stored(1)]))
    await idx.apply(M, "n", 0, ops_of([stored(2)]))
    assert [h for h, _ in await idx.export_node(M, "n", 0)] == [1, 2]


# --- end to end: real replicas, a paused one and a dead one -------------------------------------

class Replica:
    def __init__(self, proc: subprocess.Popen[bytes], addr: str, metrics_port: int) -> None:
        self.proc, self.addr, self.metrics_port = proc, addr, metrics_port

    def signal(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    async def metric(self, name: str) -> float:
        page = await asyncio.to_thread(metrics, f"http://127.0.0.1:{self.metrics_port}/metrics", 5)
        return sample(page, name)


@contextlib.contextmanager
def replicas(tmp: Path, lease: float) -> Iterator[tuple[RedisServer, Replica, Replica]]:
    with redis_server() as rs, contextlib.ExitStack() as stack:
        out: list[Replica] = []
        for name in ("a", "b"):
            port, mport = free_port(), free_port()
            proc = stack.enter_context(running(kvcoord_cmd(
                "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
                "--index", f"{rs.url}?timeout=2", "--lease-seconds", str(lease),
                "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=7",
            ), log=tmp / f"serve-{name}.log"))
            replica = Replica(proc, f"127.0.0.1:{port}", mport)
            stack.callback(replica.signal, signal.SIGCONT)  # a paused replica must not hang the stop
            wait_for_port(port)
            wait_for_port(mport)
            out.append(replica)
        yield rs, out[0], out[1]


async def until(cond: Callable[[], Awaitable[bool]], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


def view(res: Any) -> list[tuple[str, int]]:
    return [(n.node_id, n.matched_blocks) for n in res.nodes]


def reporter(addr: str, state: dict[int, Tier], *, slow_reconnect: bool = False) -> Reporter:
    opts = ReporterOptions(backoff_initial=60.0, backoff_max=60.0) if slow_reconnect else None
    return Reporter([addr], node_id="node-f", model=MODEL, epoch=5, hash_profile=PROFILE,
                    snapshot=lambda rank: sorted(state.items()), options=opts)


async def test_paused_replica_cannot_write_after_takeover(tmp_path: Path) -> None:
    hashes, other = block_hashes64(PROFILE, TOKENS), block_hashes64(PROFILE, OTHER)
    # A long lease: A's own lease must not run out while it is paused (then it would drop the node
    # before trying the late write, and the test would show nothing).
    with replicas(tmp_path, lease=60.0) as (_rs, a, b):
        state_a: dict[int, Tier] = {}
        rep_a = reporter(a.addr, state_a, slow_reconnect=True)  # the agent's old stream, to A
        rep_b: Reporter | None = None
        try:
            await rep_a.start()
            await rep_a.wait_connected(20)
            rep_a.submit(0, [stored(*hashes[:6])])
            state_a.update({h: Tier.GPU for h in hashes[:6]})
            await rep_a.wait_acked(20)
            async with AsyncCoordinatorClient(a.addr) as ca, AsyncCoordinatorClient(b.addr) as cb:
                assert view(await ca.lookup(MODEL, hashes=hashes)) == [("node-f", 6)]
                a.signal(signal.SIGSTOP)
                # A batch goes out to the paused A: it waits in A's socket, unapplied.
                sent = rep_a.stats().links[0].batches_sent
                rep_a.submit(0, [stored(*hashes[6:10])])

                async def queued() -> bool:
                    return rep_a.stats().links[0].batches_sent > sent

                await until(queued, "the late batch sent to the paused replica")
                # The agent reconnects to B (a second stream of the same node): B takes the node over.
                state_b: dict[int, Tier] = {h: Tier.GPU for h in [*hashes[:3], *other]}
                rep_b = reporter(b.addr, state_b)
                await rep_b.start()
                await rep_b.wait_connected(20)
                await rep_b.wait_acked(20)

                async def b_serves() -> bool:
                    return (view(await cb.lookup(MODEL, hashes=hashes)) == [("node-f", 3)]
                            and view(await cb.lookup(MODEL, hashes=other)) == [("node-f", len(other))])

                await until(b_serves, "replica B serving the node's snapshot")
                a.signal(signal.SIGCONT)

                async def refused() -> bool:
                    return await a.metric("kvcoord_index_fenced_writes_total") >= 1

                await until(refused, "replica A's late write refused and counted")

                async def stream_ended() -> bool:
                    link = rep_a.stats().links[0]
                    return not link.connected and "ABORTED" in link.last_error

                await until(stream_ended, "replica A ending the agent's old stream")
                await rep_a.close()
                # The index is what B applied, whichever replica answers (A's view of the node records
                # catches up within its directory refresh), and A names B as the node's replica.
                replica_b = (await cb.stats()).replica_id

                async def both_serve_b() -> bool:
                    if [n.replica for n in await ca.list_nodes()] != [replica_b]:
                        return False
                    for c in (ca, cb):
                        if (view(await c.lookup(MODEL, hashes=hashes)) != [("node-f", 3)]
                                or view(await c.lookup(MODEL, hashes=other)) != [("node-f", len(other))]
                                or view(await c.lookup(MODEL, hashes=hashes[6:])) != []):  # the late batch
                            return False
                    return True

                await until(both_serve_b, "both replicas answering with B's snapshot")
                assert (await cb.stats()).entries == len(state_b) == (await ca.stats()).entries
                assert await b.metric("kvcoord_index_fenced_writes_total") == 0
                assert [n.replica for n in await cb.list_nodes()] == [""]  # B's own
        finally:
            a.signal(signal.SIGCONT)
            await rep_a.close()
            if rep_b is not None:
                await rep_b.close()


async def test_dead_replicas_nodes_are_reclaimed_after_the_lease(tmp_path: Path) -> None:
    lease = 1.5
    hashes = block_hashes64(PROFILE, TOKENS)
    with replicas(tmp_path, lease=lease) as (rs, a, b):
        state: dict[int, Tier] = {}
        rep = reporter(a.addr, state)
        try:
            await rep.start()
            await rep.wait_connected(20)
            rep.submit(0, [stored(*hashes)])
            state.update({h: Tier.GPU for h in hashes})
            await rep.wait_acked(20)
            async with AsyncCoordinatorClient(b.addr) as cb:
                async def b_sees() -> bool:  # A's record (with its fencing token) reached B
                    return view(await cb.lookup(MODEL, hashes=hashes)) == [("node-f", len(hashes))]

                await until(b_sees, "replica B answering for A's node")
                with redis.Redis(port=rs.port) as r:
                    async def fenced_record() -> bool:  # what a reclaim is guarded by
                        raw = r.hget("{kvcoord}:nodes", "node-f")
                        return raw is not None and SharedNode.decode(raw).fence > 0

                    await until(fenced_record, "A's record of the node carrying its fencing token")
                    killed = time.monotonic()
                    a.signal(signal.SIGKILL)
                    a.proc.wait(timeout=10)
                    await rep.close()  # the node does not come back
                    assert r.exists("{kvcoord:0}:node:node-f")

                    async def reclaimed() -> bool:
                        return (not r.exists("{kvcoord:0}:node:node-f")
                                and (await cb.stats()).entries == 0)

                    await until(reclaimed, "replica B reclaiming the dead replica's node")
                assert time.monotonic() - killed >= lease * 0.9, "reclaimed before the lease ran out"
                assert await b.metric("kvcoord_index_reclaimed_nodes_total") == 1
        finally:
            await rep.close()
