"""Routers' reservations shared by two ``kvcoord serve`` replicas on one real ``redis-server``
(:mod:`kvcoord.coordinator.reservation_sync`): a router's Reserve stream on each replica (played here, as
``kvcoord route`` writes it), lookups on the other. A reservation made through one replica shows in the
other's lookup answers, its release clears it there, and a replica killed with SIGKILL has its routers'
reservations dropped on the survivor long before their ttl. A replica started later, or cut off from Redis
for a while, catches up on the reservations in force, and one stopped with SIGTERM has the other drop its
routers' at once. A replica cut off from Redis alone (a TCP proxy between it and Redis) has its routers'
reservations dropped by the other, and written again when it reconnects. Every wait is a poll."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from kvcoord.agent.reporter import Reporter
from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.reservation_sync import HEARTBEAT_SECONDS
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError
from kvcoord.validate import pack_u64
from tests.http_util import by_label, metrics
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.procs import until_async as _until
from tests.redis_servers import RedisServer, redis_server

MODEL = "resrep-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="7")
TTL = 120.0
"""Every reservation's ttl here: far longer than any wait, so what clears one is its release or drop."""
ORIGIN_SILENT_SECONDS = CoordinatorConfig().replica_silent_seconds


class Replica:
    """One ``kvcoord serve`` on the test's Redis, started (not yet listening) in ``stack``."""

    def __init__(self, stack: contextlib.ExitStack, redis: RedisServer, log: Path, *flags: str,
                 redis_url: str | None = None) -> None:
        """``redis_url``: where this replica reaches ``redis`` (default: its own URL)."""
        self.port, self.mport, self.redis = free_port(), free_port(), redis
        self.redis_url = redis.url if redis_url is None else redis_url
        self.addr = f"127.0.0.1:{self.port}"
        self.proc = stack.enter_context(running(kvcoord_cmd(
            "serve", "--listen", self.addr, "--metrics-listen", f"127.0.0.1:{self.mport}",
            "--index", f"{self.redis_url}?timeout=2", "--lease-seconds", "5",
            "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=7", *flags,
        ), log=log))


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[Replica, Replica]]:
    """Replicas A and B on one Redis (the index's default key prefix)."""
    with redis_server() as redis, contextlib.ExitStack() as stack:
        out = [Replica(stack, redis, tmp_path / f"serve-{name}.log") for name in ("a", "b")]
        for r in out:
            wait_for_port(r.port)
        yield out[0], out[1]


class Stream:
    """A router's Reserve stream to one replica, fed batch by batch."""

    def __init__(self, client: AsyncCoordinatorClient, router: str) -> None:
        self.router = router
        self._q: asyncio.Queue[pb.ReserveBatch | None] = asyncio.Queue()
        self.call = client.reserve_stream(self._batches())

    async def _batches(self) -> AsyncIterator[pb.ReserveBatch]:
        while (msg := await self._q.get()) is not None:
            yield msg

    def reserve(self, request_id: str, node: str, hashes: list[int], prefill: int, ttl: float = TTL) -> None:
        msg = pb.ReserveBatch(router_id=self.router)
        r = msg.ops.add(request_id=request_id).reserve
        r.model, r.node_id, r.first_block = MODEL, node, 0
        r.block_hashes, r.prefill_tokens, r.ttl_seconds = pack_u64(hashes), prefill, ttl
        self._q.put_nowait(msg)

    def release(self, request_id: str) -> None:
        msg = pb.ReserveBatch(router_id=self.router)
        msg.ops.add(request_id=request_id).release.first_byte = False
        self._q.put_nowait(msg)

    def close(self) -> None:
        self._q.put_nowait(None)
        self.call.cancel()


def _prompt(seed: int) -> list[int]:
    return [seed * 1000 + i for i in range(8 * BS)]


async def _reserved(c: AsyncCoordinatorClient, tokens: list[int], asker: str) -> tuple[int, int, int]:
    """``(blocks, requests, prefill tokens)`` reserved on node-r, as a lookup by router ``asker`` sees."""
    answer = await c.lookup(MODEL, tokens=tokens, include_unmatched=True, router_id=asker)
    for n in answer.nodes:
        if n.node_id == "node-r":
            return n.reserved_blocks, n.reserved.in_flight, n.reserved.prefill_tokens
    return -1, -1, -1  # node-r not (yet) in this replica's answers


async def _sync_counts(mport: int, family: str = "kvcoord_reservation_sync_total",
                       label: str = "op") -> dict[str, float]:
    """A labelled metric family of the replica's ``/metrics``: ``{label value: value}``."""
    page = await asyncio.to_thread(metrics, f"http://127.0.0.1:{mport}/metrics")
    return by_label(page, family, label)


async def _bad_entries(b: Replica) -> None:
    """Entries no replica wrote: undecodable, without an origin, and a reservation without its node. B
    counts each (rejected) and its view stays as it was."""
    bad = pb.ReservationChanges(replica_id="intruder")
    bad.changes.add(router_id="r").op.reserve.model = MODEL
    client = aioredis.from_url(b.redis_url)
    try:
        for entry in (b"\xff\xffnot a message", pb.ReservationChanges().SerializeToString(),
                      bad.SerializeToString()):
            await client.xadd("{kvcoord}:reservations", {"c": entry})
    finally:
        await client.aclose()

    async def counted() -> bool:
        return (await _sync_counts(b.mport)).get("rejected", 0) == 3

    await _until(counted, "B counting the three bad entries", timeout=30)


async def _node_on(addr: str) -> Reporter:
    """node-r, an engine with nothing cached, streaming to the replica at ``addr``, connected."""
    rep = Reporter([addr], node_id="node-r", model=MODEL, epoch=1, hash_profile=PROFILE,
                   snapshot=lambda rank: [])
    await rep.start()
    try:
        await rep.wait_connected(10)
    except BaseException:
        await rep.close()
        raise
    return rep


@pytest.mark.slow
async def test_reservations_cross_replicas_and_a_killed_replicas_go(
        replicas: tuple[Replica, Replica]) -> None:
    a, b = replicas
    # The engine's stream is on B (so it stays when A is killed); B publishes it to A via the directory.
    rep = await _node_on(b.addr)
    streams: list[Stream] = []
    try:
        async with AsyncCoordinatorClient(a.addr) as ca, AsyncCoordinatorClient(b.addr) as cb:
            p1, p2, p3 = _prompt(1), _prompt(2), _prompt(3)

            async def both_list_node() -> bool:
                return all([await _reserved(c, p1, "x") != (-1, -1, -1) for c in (ca, cb)])

            await _until(both_list_node, "node-r in both replicas' answers", timeout=30)
            on_a, on_b = Stream(ca, "router-a"), Stream(cb, "router-b")
            streams += [on_a, on_b]

            # Through A, seen on B (and on A by another router); then through B, seen on A.
            on_a.reserve("q1", "node-r", block_hashes64(PROFILE, p1), 32)

            async def seen_b() -> bool:
                return await _reserved(cb, p1, "router-b") == (8, 1, 32)

            await _until(seen_b, "A's reservation in B's lookups", timeout=30)
            assert await _reserved(ca, p1, "router-b") == (8, 1, 32)
            on_b.reserve("q2", "node-r", block_hashes64(PROFILE, p2), 16)

            async def seen_a() -> bool:
                return await _reserved(ca, p2, "router-x") == (8, 2, 48)  # q1 and q2 both run on node-r

            await _until(seen_a, "B's reservation in A's lookups", timeout=30)
            await _bad_entries(b)

            # The release on A ends the request on B (its blocks stay routed a little: BLOCK_HOLD).
            on_a.release("q1")

            async def released_b() -> bool:
                return await _reserved(cb, p1, "router-x") == (8, 1, 16)  # q2 alone runs now

            await _until(released_b, "A's release applied on B", timeout=30)

            # A reserves again, then is killed: B drops what A's routers held, long before the ttl.
            on_a.reserve("q3", "node-r", block_hashes64(PROFILE, p3), 64)

            async def seen_q3() -> bool:
                return await _reserved(cb, p3, "router-x") == (8, 2, 80)

            await _until(seen_q3, "A's second reservation on B", timeout=30)
            killed = time.monotonic()
            os.killpg(a.proc.pid, signal.SIGKILL)
            a.proc.wait(timeout=30)

            async def dropped() -> bool:
                return await _reserved(cb, p3, "router-x") == (0, 1, 16)  # only B's own q2 is left

            await _until(dropped, "the killed replica's reservations dropped on B",
                         timeout=ORIGIN_SILENT_SECONDS + 20)
            took = time.monotonic() - killed
            # A's last entry (a change or its heartbeat) was at most HEARTBEAT_SECONDS before the kill.
            assert took >= (ORIGIN_SILENT_SECONDS - HEARTBEAT_SECONDS) * 0.9 and took < TTL
            counts = await _sync_counts(b.mport)
            assert counts["published"] >= 1 and counts["applied"] >= 3, counts
            assert counts["origin_dropped"] >= 1 and counts["rejected"] == 3, counts
    finally:
        for s in streams:
            s.close()
        await rep.close()


HOLD = 50.0
"""``--reservation-hold-seconds`` of the hold test: longer than any wait there, so only the pick (or its
release) coming by the feed ends the other replica's wait."""


@pytest.mark.slow
async def test_a_lookup_on_one_replica_waits_for_the_pick_of_a_new_prefix_held_through_the_other(
        tmp_path: Path) -> None:
    """Router X looks a new prompt up on A (its lookup holds the prompt's new prefix, claimed in Redis);
    router Y's lookup of the same prompt on B then waits until X's reservation of its pick, made on A,
    reaches B by the feed, and answers with it: two routers on two replicas do not send one new prefix to
    two nodes at once."""
    with redis_server() as redis, contextlib.ExitStack() as stack:
        a, b = (Replica(stack, redis, tmp_path / f"serve-{n}.log", "--reservation-hold-seconds", str(HOLD))
                for n in ("a", "b"))
        for port in (a.port, a.mport, b.port, b.mport):
            await asyncio.to_thread(wait_for_port, port)
        rep = await _node_on(b.addr)
        streams: list[Stream] = []
        try:
            async with AsyncCoordinatorClient(a.addr) as ca, AsyncCoordinatorClient(b.addr) as cb:
                prompt = _prompt(5)

                probes = iter(range(100, 10_000))

                async def heard(c: AsyncCoordinatorClient, r: Replica) -> bool:
                    """A lookup that holds (a new probe prompt each time) claims across replicas once
                    ``r`` heard of the other replica; node-r is in its answers."""
                    probe = _prompt(next(probes))
                    if await _reserved(c, probe, "router-p") == (-1, -1, -1):
                        return False
                    await c.lookup(MODEL, tokens=probe, router_id="router-p", reserve_id=f"p{probe[0]}")
                    return (await _sync_counts(r.mport)).get("claims", 0) >= 1

                for c, r in ((ca, a), (cb, b)):
                    await _until(lambda c=c, r=r: heard(c, r), "each replica hearing of the other",
                                 timeout=30)
                await ca.lookup(MODEL, tokens=prompt, include_unmatched=True, router_id="router-x",
                                reserve_id="q1")
                waiting = asyncio.create_task(cb.lookup(
                    MODEL, tokens=prompt, include_unmatched=True, router_id="router-y", reserve_id="q2",
                    timeout=HOLD))

                async def contested() -> bool:
                    return (await _sync_counts(b.mport)).get("contested", 0) >= 1

                await _until(contested, "B's lookup finding router-x holding the prefix", timeout=30)
                assert not waiting.done()  # nothing has reserved the prefix: it waits (HOLD is far off)
                on_a = Stream(ca, "router-x")
                streams.append(on_a)
                on_a.reserve("q1", "node-r", block_hashes64(PROFILE, prompt), 32)
                answer = await asyncio.wait_for(waiting, HOLD / 2)
                row = next(n for n in answer.nodes if n.node_id == "node-r")
                got = (row.reserved_blocks, row.reserved.in_flight, row.reserved.prefill_tokens)
                assert got == (8, 1, 32)
                assert (await _sync_counts(a.mport)).get("contested", 0) == 0
        finally:
            for st in streams:
                st.close()
            await rep.close()


SILENT = 600.0
"""``replica_silent_seconds`` of the catch-up test: longer than every ttl and wait there, so only a stopped
replica's last entry can drop its routers' reservations on the other in time."""


async def _published(r: Replica, changes: int, running_requests: int) -> bool:
    """Whether ``r`` has written ``changes`` changes to the stream and holds ``running_requests`` now."""
    if (await _sync_counts(r.mport)).get("published") != changes:
        return False
    return (await _sync_counts(r.mport, "kvcoord_reservations", "kind")).get("requests") == running_requests


async def _ghost_says_gone(b: Replica, cb: AsyncCoordinatorClient) -> None:
    """Entries of a replica "ghost" written straight to the stream: a reservation, then its ``gone``
    entry alone (no stream's end), which drops it on B at once."""
    hello = pb.ReservationChanges(replica_id="ghost")
    op = hello.changes.add(router_id="router-g").op
    op.request_id = "q9"
    r = op.reserve
    r.model, r.node_id, r.block_hashes = MODEL, "node-r", pack_u64(block_hashes64(PROFILE, _prompt(9)))
    r.prefill_tokens, r.ttl_seconds = 8, TTL
    client = aioredis.from_url(b.redis_url)
    try:
        await client.xadd("{kvcoord}:reservations", {"c": hello.SerializeToString()})

        async def seen() -> bool:
            return (await _reserved(cb, _prompt(9), "router-x"))[0] == 8

        await _until(seen, "the ghost's reservation on B", timeout=30)
        gone = pb.ReservationChanges(replica_id="ghost", gone=True)
        await client.xadd("{kvcoord}:reservations", {"c": gone.SerializeToString()})
    finally:
        await client.aclose()

    async def dropped() -> bool:
        return (await _reserved(cb, _prompt(9), "router-x"))[0] == 0

    await _until(dropped, "the ghost's reservation dropped on B by its gone entry", timeout=30)
    assert (await _sync_counts(b.mport))["origin_gone"] == 1


@pytest.mark.slow
async def test_a_starting_replica_catches_up_and_a_stopping_one_tells_the_other(tmp_path: Path) -> None:
    """B starts after A's router reserved, released, let one expire and ended another router's stream: B's
    lookups show exactly the reservations in force. Then A gets SIGTERM: B drops them at once (its ``gone``
    entry), long before their ttl or A's silence could."""
    with redis_server() as redis, contextlib.ExitStack() as stack:
        a = Replica(stack, redis, tmp_path / "serve-a.log", "--replica-silent-seconds", str(SILENT))
        for port in (a.port, a.mport):
            await asyncio.to_thread(wait_for_port, port)
        streams: list[Stream] = []
        rep: Reporter | None = None
        try:
            async with AsyncCoordinatorClient(a.addr) as ca:
                p1, p2, p3, p4 = (_prompt(i) for i in range(1, 5))
                on_a, router_y = Stream(ca, "router-a"), Stream(ca, "router-y")
                streams += [on_a, router_y]
                on_a.reserve("q1", "node-r", block_hashes64(PROFILE, p1), 32)
                on_a.reserve("q2", "node-r", block_hashes64(PROFILE, p2), 16)
                on_a.reserve("q3", "node-r", block_hashes64(PROFILE, p3), 64, ttl=1.0)
                on_a.release("q1")
                router_y.reserve("q4", "node-r", block_hashes64(PROFILE, p4), 8)
                await _until(lambda: _published(a, 5, 3), "A publishing its routers' 5 changes", timeout=30)
                router_y.close()  # its end goes on the stream too; q3's ttl runs out meanwhile
                await _until(lambda: _published(a, 6, 1), "A's view down to q2", timeout=30)

                b = Replica(stack, redis, tmp_path / "serve-b.log", "--replica-silent-seconds",
                            str(SILENT))
                for port in (b.port, b.mport):
                    await asyncio.to_thread(wait_for_port, port)
                rep = await _node_on(b.addr)
                async with AsyncCoordinatorClient(b.addr) as cb:

                    async def caught_up() -> bool:
                        return await _reserved(cb, p2, "router-x") == (8, 1, 16)

                    await _until(caught_up, "A's reservation q2 in the lookups of B, started after it",
                                 timeout=30)
                    assert await _reserved(cb, p3, "router-x") == (0, 1, 16)  # q3 expired before B began
                    assert await _reserved(cb, p4, "router-x") == (0, 1, 16)  # router-y's stream ended
                    assert (await _reserved(cb, p1, "router-x"))[1:] == (1, 16)  # q1 released: no load
                    counts = await _sync_counts(b.mport)
                    assert counts["replayed"] >= 1 and counts["origin_gone"] == 0, counts
                    await _ghost_says_gone(b, cb)

                    # A's stop: its routers' streams end, then its last entry says it is gone.
                    os.killpg(a.proc.pid, signal.SIGTERM)

                    async def dropped() -> bool:
                        return (await _reserved(cb, p2, "router-x") == (0, 0, 0)
                                and (await _sync_counts(b.mport))["origin_gone"] == 2)

                    await _until(dropped, "A's reservations dropped on B, and its last entry read, after its "
                                 "SIGTERM", timeout=TTL / 4)
                    assert (await _sync_counts(b.mport))["origin_dropped"] == 0
                    assert await asyncio.to_thread(a.proc.wait, 30) == 0
        finally:
            for s in streams:
                s.close()
            if rep is not None:
                await rep.close()


def redis_pid(redis: RedisServer) -> int:
    assert redis.proc is not None
    return redis.proc.pid


@pytest.mark.slow
async def test_a_replica_cut_off_from_redis_catches_up_after(replicas: tuple[Replica, Replica]) -> None:
    """Redis paused (SIGSTOP) past ``replica_silent_seconds``: B drops A's reservation (A is silent to it),
    and once Redis answers again B replays the stream: the reservation is back, counted once."""
    a, b = replicas
    rep = await _node_on(b.addr)
    streams: list[Stream] = []
    try:
        async with AsyncCoordinatorClient(a.addr) as ca, AsyncCoordinatorClient(b.addr) as cb:
            p1 = _prompt(1)
            streams.append(on_a := Stream(ca, "router-a"))
            on_a.reserve("q1", "node-r", block_hashes64(PROFILE, p1), 32)

            async def seen() -> bool:
                with contextlib.suppress(CoordinatorError):  # the index is back a little after Redis
                    return await _reserved(cb, p1, "router-x") == (8, 1, 32)
                return False

            await _until(seen, "A's reservation in B's lookups", timeout=30)
            before = await _sync_counts(b.mport)
            os.kill(redis_pid(a.redis), signal.SIGSTOP)
            try:
                async def dropped() -> bool:
                    counts = await _sync_counts(b.mport)
                    return counts["origin_dropped"] > before["origin_dropped"]

                await _until(dropped, "B dropping A's reservation while Redis is paused", timeout=60)
                assert (await _sync_counts(b.mport, "kvcoord_reservations", "kind"))["requests"] == 0
            finally:
                os.kill(redis_pid(a.redis), signal.SIGCONT)
            await _until(seen, "A's reservation back in B's lookups, once", timeout=60)
            assert (await _sync_counts(b.mport))["replayed"] > before["replayed"]
    finally:
        for s in streams:
            s.close()
        await rep.close()


class CutProxy:
    """A TCP proxy from one replica to Redis, in the test's event loop: :meth:`cut` resets every
    connection through it and refuses new ones until :meth:`restore`, so that replica alone loses Redis."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.cut_off = False
        self._transports: set[asyncio.WriteTransport] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> CutProxy:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cut()
        if self._server is not None:
            self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.cut_off:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer.transport, up_writer.transport)
        self._transports.update(pair)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for t in pair:
                self._transports.discard(t)
                t.abort()

    def cut(self) -> None:
        self.cut_off = True
        for t in list(self._transports):
            t.abort()

    def restore(self) -> None:
        self.cut_off = False


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


@pytest.mark.slow
async def test_a_replica_cut_off_alone_writes_its_reservations_again(tmp_path: Path) -> None:
    """A loses Redis alone (its proxy cut) past ``replica_silent_seconds``: B drops A's routers'
    reservations. Meanwhile A's router releases one and reserves another. Once A reaches Redis again it
    writes its routers' live reservations again: B sees the one kept and the new one, each once, and not
    the one released."""
    with redis_server() as redis:
        async with CutProxy(redis.port) as proxy:
            with contextlib.ExitStack() as stack:
                a = Replica(stack, redis, tmp_path / "serve-a.log",
                            redis_url=f"redis://127.0.0.1:{proxy.port}/0")
                b = Replica(stack, redis, tmp_path / "serve-b.log")
                for port in (a.port, a.mport, b.port, b.mport):
                    await asyncio.to_thread(wait_for_port, port)
                await _cut_off_alone(a, b, proxy)


async def _cut_off_alone(a: Replica, b: Replica, proxy: CutProxy) -> None:
    rep = await _node_on(b.addr)
    streams: list[Stream] = []
    try:
        async with AsyncCoordinatorClient(a.addr) as ca, AsyncCoordinatorClient(b.addr) as cb:
            p1, p2, p3 = _prompt(1), _prompt(2), _prompt(3)
            streams.append(on_a := Stream(ca, "router-a"))
            on_a.reserve("q1", "node-r", block_hashes64(PROFILE, p1), 32)
            on_a.reserve("q2", "node-r", block_hashes64(PROFILE, p2), 16)

            async def seen() -> bool:
                return await _reserved(cb, p1, "router-x") == (8, 2, 48)

            await _until(seen, "A's two reservations in B's lookups", timeout=30)
            proxy.cut()

            async def dropped() -> bool:
                return await _reserved(cb, p1, "router-x") == (0, 0, 0)

            await _until(dropped, "B dropping A's reservations while A is cut off from Redis",
                         timeout=ORIGIN_SILENT_SECONDS + 30)
            assert (await _sync_counts(b.mport))["origin_dropped"] >= 2
            on_a.release("q2")  # during the outage: not to be brought back
            on_a.reserve("q3", "node-r", block_hashes64(PROFILE, p3), 8)

            async def applied_on_a() -> bool:
                kinds = await _sync_counts(a.mport, "kvcoord_reservations", "kind")
                return kinds.get("requests") == 2 and (await _sync_counts(a.mport))["errors"] > 0

            await _until(applied_on_a, "A applying its router's release and reservation", timeout=30)
            proxy.restore()

            async def back() -> bool:
                return await _reserved(cb, p1, "router-x") == (8, 2, 40)  # q1 and q3 run: 32 + 8

            await _until(back, "A's live reservations in B's lookups again", timeout=60)
            assert await _reserved(cb, p3, "router-x") == (8, 2, 40)
            assert (await _reserved(cb, p2, "router-x"))[1:] == (2, 40)  # q2 released: no load

            async def q2_blocks_gone() -> bool:  # its blocks' hold (BLOCK_HOLD) ends, as on A
                return await _reserved(cb, p2, "router-x") == (0, 2, 40)

            await _until(q2_blocks_gone, "q2's blocks no longer reserved on B", timeout=30)
            assert (await _sync_counts(b.mport, "kvcoord_reservations", "kind"))["requests"] == 2
            assert (await _sync_counts(a.mport))["republished"] >= 2
    finally:
        for s in streams:
            s.close()
        await rep.close()
