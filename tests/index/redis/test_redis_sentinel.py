"""Following the Redis primary wherever it moves (issue 29): Sentinel URIs, a failover under a write and
lookup loop, the old primary back empty and demoted, and a standalone server turned into a replica and
back (a DNS name that moved). Real ``redis-server`` and ``redis-sentinel`` processes only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from kvcoord.index import open_index
from kvcoord.index.base import IndexReset
from kvcoord.index.redis.client import IndexUnavailable
from kvcoord.index.redis.index import RedisIndex
from kvcoord.index.uri import parse_index_uri
from kvcoord.router.client import CoordinatorClient
from kvcoord.validate import ops_of
from tests.engine.test_relay_e2e import MODEL
from tests.engine.test_relay_e2e import poll as sync_poll
from tests.index.redis.test_redis_faults import RedisCluster as Trio
from tests.index.redis.test_redis_index import H, M, stored
from tests.redis_servers import RedisSentinel, RedisServer, redis_sentinel, start_server, stop_server

# ------------------------------------------------------------------------------------------- URIs


def test_sentinel_uris_parse_into_sentinels_master_and_options() -> None:
    spec = parse_index_uri(
        "redis+sentinel://app:s%40cret@s1:26379,[::1]:26380/main/2?buckets=4&mirror=1&prefix=p&timeout=0.5"
        "&sentinel_username=sen&sentinel_password=spw&ssl=1&sentinel_ssl=1&ssl_ca_certs=/ca.pem"
        "&ssl_check_hostname=0&client_name=kv"
    )
    r = spec.redis
    assert r is not None and spec.backend == "redis" and spec.key_prefix == "p"
    assert r.sentinel and not r.cluster
    assert r.sentinels == (("s1", 26379), ("::1", 26380)) and (r.service, r.db) == ("main", 2)
    assert (r.username, r.password) == ("app", "s@cret")
    assert (r.buckets, r.mirror, r.timeout) == (4, True, 0.5)
    assert dict(r.node_options) == {"ssl": True, "ssl_ca_certs": "/ca.pem", "ssl_check_hostname": False,
                                    "client_name": "kv"}
    assert dict(r.sentinel_options) == {"username": "sen", "password": "spw", "ssl": True,
                                        "ssl_ca_certs": "/ca.pem", "ssl_check_hostname": False}
    plain = parse_index_uri("redis+sentinel://127.0.0.1:26379/mymaster").redis
    assert plain is not None and (plain.service, plain.db, plain.node_options, plain.sentinel_options) == (
        "mymaster", 0, (), ())
    tls_nodes_only = parse_index_uri("redis+sentinel://h:1/m?ssl=1&ssl_cert_reqs=none").redis
    assert tls_nodes_only is not None and tls_nodes_only.sentinel_options == ()


@pytest.mark.parametrize(("uri", "needle"), [
    ("redis+sentinel://h:1", "no master name"),
    ("redis+sentinel://h:1/", "no master name"),
    ("redis+sentinel://h/m", "bad sentinel 'h'"),
    ("redis+sentinel://h:1,h:x/m", "bad sentinel 'h:x'"),
    ("redis+sentinel://h:1/m/x", "db must be an integer"),
    ("redis+sentinel://h:1/m?sentinel_pass=x", "unknown option 'sentinel_pass'"),
    ("redis+sentinel://h:1/m?ssl=yes", "ssl must be 0 or 1"),
    ("redis+sentinel://h:1/m?ssl_ca_certs=/ca.pem", "needs ssl=1"),
    ("redis+sentinel://h:1/m?health_check_interval=soon", "health_check_interval must be an integer"),
    ("redis+sentinel://h:1/m?buckets=0", "buckets must be an integer"),
    ("redis://h:1/0?sentinel_password=x", "unknown option 'sentinel_password'"),
    ("redis+cluster://h:1?sentinel_password=x", "unknown option 'sentinel_password'"),
])
def test_bad_sentinel_uris(uri: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        parse_index_uri(uri)


# ---------------------------------------------------------------------------------- the index


async def test_sentinel_index_applies_and_matches_on_the_fast_path(redis_sentinel: RedisSentinel) -> None:
    redis_sentinel.flushall()
    for query in ("", "?mirror=1&buckets=2"):
        idx = open_index(redis_sentinel.url + query, key_prefix="kvsent")
        assert isinstance(idx, RedisIndex) and idx.backend == "redis"
        try:
            assert idx._conn.fast is not None, "Sentinel lost the pipelined fast path"
            assert idx.remote is not None and await idx.remote.ping()
            await idx.apply(M, "n1", 0, ops_of([stored(1, 2, 3)]))
            await idx.apply(M, "n2", 0, ops_of([stored(1, 2)]))
            got = [(m.node_id, m.matched_blocks) for m in await idx.match(M, H(1, 2, 3, 4))]
            assert got == [("n1", 3), ("n2", 2)]
            if query:
                assert await idx.mirror_ready()
        finally:
            await idx.close()
        redis_sentinel.flushall()


# ------------------------------------------------------------------------------------- failover


@dataclass
class Loop:
    """Writes a new block and looks it up, over and over; ``ok`` holds when each pair that succeeded
    began (so an entry after a moment means a write sent after it succeeded)."""

    idx: RedisIndex
    ok: list[float] = field(default_factory=list)
    failed: int = 0
    resets: int = 0
    written: list[int] = field(default_factory=list)
    lost: list[float] = field(default_factory=list)
    """When each pair began whose write was acknowledged but not seen by the lookup right after it."""

    async def run(self, stop: asyncio.Event) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            began = time.monotonic()
            try:
                await self.idx.apply(M, "n1", 0, ops_of([stored(i)]))
                got = await self.idx.match(M, H(i))
            except IndexUnavailable:
                self.failed += 1
                await asyncio.sleep(0.02)
                continue
            except IndexReset:
                # What the primary acknowledged last had not reached the replica when it died (Redis
                # replicates asynchronously; a loaded machine widens the window): kvcoord notices, as
                # the coordinator does, re-reads the generation and goes on.
                self.resets += 1
                assert self.idx.remote is not None
                with contextlib.suppress(IndexUnavailable):
                    await self.idx.remote.generation()
                await asyncio.sleep(0.02)
                continue
            if [(m.node_id, m.matched_blocks) for m in got] != [("n1", 1)]:
                self.lost.append(began)
                continue
            self.written.append(i)
            self.ok.append(began)
            await asyncio.sleep(0.005)

    def first_ok_after(self, t: float) -> float | None:
        return next((x for x in self.ok if x > t), None)

    def lost_only_within(self, start: float, end: float) -> None:
        """Every acknowledged write that a lookup missed began inside the switch ``[start, end]``: one the
        old primary acknowledged as it was being replaced can be lost (Redis replicates asynchronously;
        ``?wait_replicas`` is the durable mode), never one before it or on the new primary."""
        outside = [round(t - start, 3) for t in self.lost if not start <= t <= end]
        assert not outside, f"writes lost outside the switch (s after its start): {outside}"


@contextlib.asynccontextmanager
async def looping(idx: RedisIndex) -> AsyncIterator[Loop]:
    loop, stop = Loop(idx), asyncio.Event()
    task = asyncio.create_task(loop.run(stop))
    try:
        yield loop
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)


async def poll(cond: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not (cond() if callable(cond) else cond):
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f}s waiting for {what}"
        await asyncio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("query", ["?timeout=1", "?timeout=1&mirror=1"], ids=["fast-path", "mirror"])
async def test_sentinel_failover_is_followed_and_the_old_primary_returns_demoted(query: str) -> None:
    """SIGKILL the primary under load: once Sentinel promotes the replica, kvcoord writes and looks up on
    it by itself. The old primary restarted empty is demoted by Sentinel, and writes still succeed."""
    with redis_sentinel() as rs:
        idx = RedisIndex.from_uri(rs.url + query, key_prefix="kvfail")
        try:
            if "mirror=1" in query:
                assert await idx.mirror_ready()
            async with looping(idx) as loop:
                await poll(lambda: len(loop.ok) > 20, "the loop to run")
                old = rs.primary()
                t_kill = time.monotonic()
                old.kill()
                await poll(lambda: rs.primary_port() not in (None, old.port), "the replica's promotion")
                t_promoted = time.monotonic()
                await poll(lambda: loop.first_ok_after(t_promoted) is not None, "writes on the new primary")
                back = loop.first_ok_after(t_kill)
                assert back is not None
                loop.lost_only_within(t_kill, back)
                outage, after_promotion = back - t_kill, back - t_promoted
                print(f"\nfailover: outage {outage:.2f}s, {after_promotion:.2f}s after the promotion")
                assert outage < 30 and after_promotion < 10
                assert loop.failed > 0
                await poll(lambda: idx.metrics.failovers >= 1, "the sentinels' +switch-master to be seen")
                # The old primary comes back empty, a primary again until Sentinel demotes it; on a loaded
                # machine the sentinels may instead judge the new primary down and fail back over to the old
                # node (seen in CI): then that failover is followed like the first.
                old.start()
                await poll(lambda: rs.role(old) == "slave" or rs.primary_port() == old.port,
                           "Sentinel to demote the old primary, or to fail back over to it", 180)
                t_settled = time.monotonic()
                await poll(lambda: loop.first_ok_after(t_settled) is not None, "writes after the demotion")
                if rs.primary_port() == old.port:
                    await poll(lambda: idx.metrics.failovers >= 2, "the second +switch-master to be seen")
                else:
                    loop.lost_only_within(t_kill, back)  # the empty old primary's moment lost nothing
            if "mirror=1" in query:
                assert await idx.mirror_ready(), "the mirror did not reload from the new primary"
                assert idx._mirror is not None and idx._mirror.loads >= 2
            # Every block written after the promotion is on the new primary, none on a demoted node only.
            t = loop.written[-1]
            assert [(m.node_id, m.matched_blocks) for m in await idx.match(M, H(t))] == [("n1", 1)]
            assert idx.metrics.reconnects >= 1
        finally:
            await idx.close()


@pytest.mark.slow
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_a_hung_primary_is_left_when_the_sentinels_announce_the_failover(tls: bool) -> None:
    """SIGSTOP the primary (it hangs rather than dies) with a 30 s socket timeout: the sentinels'
    ``+switch-master`` message makes kvcoord drop its connections and reconnect to the new primary, so
    round trips resume after the promotion instead of waiting out the timeout. With ``tls`` every link
    is TLS only: the sentinels' messages, their answer naming the new primary, and the fast path to it."""
    with redis_sentinel(tls=tls) as rs:
        idx = RedisIndex.from_uri(rs.url + ("&" if tls else "?") + "timeout=30", key_prefix="kvhung")
        try:
            async with looping(idx) as loop:
                await poll(lambda: len(loop.ok) > 20, "the loop to run")
                old = rs.primary()
                assert old.proc is not None
                t_stop = time.monotonic()
                os.killpg(old.proc.pid, signal.SIGSTOP)
                await poll(lambda: rs.primary_port() not in (None, old.port), "the replica's promotion")
                await poll(lambda: loop.first_ok_after(t_stop) is not None, "writes on the new primary", 25)
                back = loop.first_ok_after(t_stop)
                assert back is not None
                loop.lost_only_within(t_stop, back)
                print(f"\nhung primary: writes back {back - t_stop:.2f}s after SIGSTOP (socket timeout 30 s)")
            assert idx.metrics.failovers >= 1
        finally:
            await idx.close()


@pytest.mark.slow
async def test_sentinel_manual_failover_demotes_the_node_kvcoord_is_connected_to() -> None:
    """``SENTINEL FAILOVER``: the primary kvcoord's connections point at becomes a replica while they stay
    open; its READONLY replies make kvcoord drop them and ask the sentinels again."""
    with redis_sentinel() as rs:
        idx = RedisIndex.from_uri(rs.url + "?timeout=1", key_prefix="kvfail")
        try:
            async with looping(idx) as loop:
                await poll(lambda: len(loop.ok) > 20, "the loop to run")
                old = rs.primary()
                t0 = time.monotonic()
                rs.sentinels[0].cli("SENTINEL", "FAILOVER", "kvtest")
                await poll(lambda: rs.role(old) == "slave" and rs.primary_port() != old.port, "the failover")
                t_demoted = time.monotonic()
                await poll(lambda: loop.first_ok_after(t_demoted) is not None, "writes after the failover")
                back = loop.first_ok_after(t_demoted)
                assert back is not None
                loop.lost_only_within(t0, back)
                gaps = [b - a for a, b in zip(loop.ok, loop.ok[1:], strict=False) if b > t0]
                print(f"\nmanual failover: longest gap between successful writes {max(gaps):.2f}s, "
                      f"{idx.metrics.readonly_errors} READONLY")
                assert max(gaps) < 30
        finally:
            await idx.close()


async def test_a_standalone_server_turned_replica_is_refused_until_primary_again() -> None:
    """``redis://`` whose server becomes a replica (what a DNS name that moved looks like): writes get
    READONLY, kvcoord drops its connections, counts it, refuses the replica on reconnect (ROLE), and
    recovers once the server is a primary again, without a restart."""
    a, b = start_server(), start_server()
    idx = RedisIndex.from_uri(a.url + "?timeout=1", key_prefix="kvro")
    try:
        async with looping(idx) as loop:
            await poll(lambda: len(loop.ok) > 20, "the loop to run")
            t_switch = time.monotonic()
            a.cli("REPLICAOF", "127.0.0.1", str(b.port))
            t_demoted = time.monotonic()
            await poll(lambda: idx.metrics.readonly_errors > 0, "a READONLY reply to be counted")
            assert idx.remote is not None
            assert await idx.remote.ping() is False, "a replica answered the health check as healthy"
            failed = loop.failed
            await poll(lambda: loop.failed > failed + 5, "writes refused while the server is a replica")
            ok_while_replica = [t for t in loop.ok if t > t_demoted]
            assert ok_while_replica == [], "a write succeeded against a replica"
            a.cli("REPLICAOF", "NO", "ONE")
            t_primary = time.monotonic()
            await poll(lambda: loop.first_ok_after(t_primary) is not None, "writes once primary again", 30)
            back = loop.first_ok_after(t_primary)
            assert back is not None
            loop.lost_only_within(t_switch, back)
        assert await idx.remote.ping()
        assert idx.metrics.readonly_errors > 0 and idx.metrics.up
    finally:
        await idx.close()
        stop_server(a)
        stop_server(b)


# ------------------------------------------------------------------------------- kvcoord serve


@pytest.mark.slow
def test_serve_follows_a_sentinel_failover_and_the_old_primary_demoted(tmp_path: Path) -> None:
    """``kvcoord serve --index redis+sentinel://…`` with an engine and its agent streaming: the primary is
    SIGKILLed under load; after the promotion the coordinator is SERVING again and acks the stream by itself,
    and stays so once the old primary, restarted empty, is demoted. (Whether writes the old primary acked
    but had not replicated are noticed is issue 29's lost-data part, not checked here.)"""
    with redis_sentinel() as rs, contextlib.ExitStack() as stack:
        c = Trio(tmp_path, stack, rs)  # type: ignore[arg-type]  # (it only reads ``url``)
        c.start_serve()
        sync_poll(lambda: c.health() == "SERVING", "SERVING at start")
        c.start_steady_engine(seed=29)
        c.start_agent()
        sync_poll(lambda: c.batches_sent() > 20 and c.link()["acked_seq"] > 0, "the agent to stream")
        old = rs.primary()
        t_kill = time.monotonic()
        old.kill()
        sync_poll(lambda: rs.primary_port() not in (None, old.port), "the replica's promotion", 60)
        acked = c.link()["acked_seq"]
        sync_poll(lambda: c.health() == "SERVING" and c.link()["acked_seq"] > acked, "acks after it", 60)
        print(f"\nserve: SERVING and acking {time.monotonic() - t_kill:.2f}s after the kill")
        old.start()
        sync_poll(lambda: rs.role(old) == "slave", "Sentinel to demote the old primary", 90)
        sync_poll(c.quiescent, "the engine's stream to be acked at quiet", 60)
        assert c.health() == "SERVING"
        pool = sorted(h for h, _ in c.pool())
        with CoordinatorClient(f"127.0.0.1:{c.grpc}") as client:
            found = sum(bool(client.lookup(MODEL, hashes=[h]).nodes) for h in pool[:50])
        assert found > 0, "lookups after the failover found none of the engine's blocks"
        m = c.scrape()
        assert m['kvcoord_index_up{backend="redis"}'] == 1
        assert m['kvcoord_index_reconnects_total{backend="redis"}'] >= 1
        assert m['kvcoord_index_failovers_total{backend="redis"}'] >= 1
        assert 'kvcoord_index_not_primary_total{backend="redis"}' in m


async def test_a_user_denied_role_still_connects(own_server: RedisServer) -> None:
    """An ACL user without ``ROLE``: the primary check is skipped (READONLY still guards writes)."""
    own_server.cli("ACL", "SETUSER", "kv", "on", ">pw", "~*", "&*", "+@all", "-role")
    idx = RedisIndex.from_uri(f"redis://kv:pw@127.0.0.1:{own_server.port}/0?timeout=1", key_prefix="kvacl")
    try:
        assert idx.remote is not None and await idx.remote.ping()
        await idx.apply(M, "n1", 0, ops_of([stored(1, 2)]))
        assert [m.matched_blocks for m in await idx.match(M, H(1, 2))] == [2]
        assert idx._conn.fast is not None and idx.metrics.readonly_errors == 0
    finally:
        await idx.close()
