"""How the Redis backend reaches Redis. The index and the lookup mirror both go through
:class:`RedisConnection` (timed round trips, scripts by EVALSHA), so neither needs the other's internals;
to a standalone Redis, or to the primary a Sentinel names, over TCP, TLS or a unix socket, it uses a
pipelined connection of its own (see the package docstring).

Following the primary: a connection is only used while its node is the primary. Every (re)connect of the
fast path resolves the address again (DNS, or the sentinels' ``SENTINEL MASTERS``) and checks ``ROLE``;
a ``READONLY`` reply (the node was demoted: a failover, or a DNS name that moved) drops the fast path's
connection and redis-py's pooled ones, so the next round trip reconnects to whatever is primary then,
and is reported as :class:`IndexUnavailable` (the coordinator retries the write later). With Sentinel, the
sentinels' ``+switch-master`` message drops the connections too, without waiting for either.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import hiredis
import redis.asyncio as aredis
import redis.exceptions as rexc
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import Connection as _PlainConnection
from redis.asyncio.connection import SSLConnection, UnixDomainSocketConnection
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool, SentinelManagedConnection

from kvcoord.index.base import WriteNotReplicated

_T = TypeVar("_T")
log = logging.getLogger("kvcoord.index.redis")
LATENCY_BUCKETS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
"""Upper bounds (seconds) of the round-trip latency histogram in :class:`RedisMetrics`."""


class IndexUnavailable(ConnectionError):
    """Redis could not be reached (or timed out). Nothing is known to be applied; retry later."""


@dataclass(slots=True)
class RedisMetrics:
    """Plain counters the coordinator exports (it owns Prometheus; this module does not import it)."""

    round_trips: int = 0
    """Completed Redis round trips (a pipeline over several shards counts once)."""
    round_trip_seconds: float = 0.0
    latency_counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    """Round trips per ``LATENCY_BUCKETS`` bound (non-cumulative; the last slot is +Inf)."""
    errors: int = 0
    """Failed round trips (connection errors, timeouts, server errors)."""
    connection_errors: int = 0
    failovers: int = 0
    """Failovers of the primary the sentinels announced (``+switch-master``) while this client ran."""
    readonly_errors: int = 0
    """Round trips refused because the node was no longer the primary (a ``READONLY`` reply, or ``ROLE``
    not ``master`` on connect): each dropped the connections so that the next one finds the primary."""
    reconnects: int = 0
    """Times a round trip succeeded after Redis had been unreachable."""
    walked_lookups: int = 0
    """Lookups read from Redis on the pipelined fast path (hiredis connections of our own: to the primary,
    or one per Cluster primary; TCP, TLS or a unix socket) and walked here; the mirror's are
    ``mirror.lookups``. Every lookup not answered by the mirror is one of these, or failed."""
    reclaimed_entries: int = 0
    """(block, location) pairs of retired locations dropped by reclaim (any tiers count once)."""
    reclaimed_nodes: int = 0
    """Dead owners' nodes this client removed after their lease (``reclaim_node``)."""
    up: bool = True
    mirror: Any = None
    """The lookup mirror (``ready``, ``loads``, ``entries_applied``, ``lookups``), or None."""
    waits: int = 0
    """Writes followed by ``WAIT`` (``?wait_replicas=N``)."""
    wait_short: int = 0
    """Of those, the WAITs that returned fewer replicas than asked (the write then is not acknowledged)."""
    wait_seconds: float = 0.0
    """Seconds spent in writes followed by WAIT (the script and the WAIT: one round trip)."""
    latency_buckets: tuple[float, ...] = LATENCY_BUCKETS

    def answered(self) -> None:
        """A round trip or ping succeeded: up again, counting a reconnect if it had been down."""
        if not self.up:
            self.up = True
            self.reconnects += 1

    def observe(self, seconds: float) -> None:
        self.round_trips += 1
        self.round_trip_seconds += seconds
        for i, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.latency_counts[i] += 1
                return
        self.latency_counts[-1] += 1


def _command(*args: object) -> bytes:
    """A RESP command, packed by hiredis (its stub types the argument as a 1-tuple)."""
    packed: bytes = hiredis.pack_command(args)  # type: ignore[arg-type]
    return packed


_MULTI = _command("MULTI")
_EXEC = _command("EXEC")
_FIELD = b"$8\r\n" + bytes(8) + b"\r\n"


def _hmget_command(key: bytes, blob: bytes) -> bytes:
    """``HMGET key h1 h2 ...`` in RESP for the packed 8-byte hashes ``blob``: eight strided copies
    instead of one Python object per hash (a 512-block query packs in a few microseconds)."""
    n = len(blob) >> 3
    buf = bytearray(_FIELD * n)
    for j in range(8):
        buf[4 + j :: 14] = blob[j::8]
    return b"*%d\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n" % (n + 2, len(key), key) + buf


class _Pipelined(asyncio.Protocol):
    """One RESP connection with any number of requests in flight, answered in order (Redis's guarantee).

    Why not redis-py for the hot path: its asyncio client takes a pooled connection, builds the command
    and parses the reply through several layers per call (~100 us here, more than the walk of a
    lookup). This sends pre-packed commands (``hiredis.pack_command``) and feeds replies to
    ``hiredis.Reader``; concurrent callers share the socket, so their requests pipeline, and requests
    sent on one connection run in the order sent (the write queue relies on that). A request with no
    reply for ``timeout`` seconds aborts the connection; every waiter then gets ``ConnectionError``.
    """

    def __init__(self, timeout: float) -> None:
        self._reader = hiredis.Reader(replyError=rexc.ResponseError, protocolError=rexc.InvalidResponse)
        self._waiting: deque[asyncio.Future[Any] | None] = deque()
        """One entry per expected reply, in order; ``None`` for a reply nobody waits for."""
        self._transport: asyncio.Transport | None = None
        self._timeout = timeout
        self._last = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's transports are not asyncio's classes

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        self._last = time.monotonic()
        while (reply := self._reader.gets()) is not False:
            fut = self._waiting.popleft()
            if fut is None or fut.done():
                continue
            if isinstance(reply, rexc.ResponseError):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self._timer is not None:
            self._timer.cancel()
        while self._waiting:
            fut = self._waiting.popleft()
            if fut is not None and not fut.done():
                fut.set_exception(rexc.ConnectionError(f"redis connection lost: {exc or 'closed'}"))

    def request(self, packed: bytes, skip: int = 0, keep: int = 1) -> asyncio.Future[Any]:
        """Send ``packed`` (``skip + keep`` commands); the future gets the last reply (MULTI ... EXEC),
        or with ``keep > 1`` the list of the last ``keep`` (a script and its WAIT)."""
        if self.lost or self._transport is None:
            raise rexc.ConnectionError("redis connection lost")
        loop = asyncio.get_running_loop()
        futs: list[asyncio.Future[Any]] = [loop.create_future() for _ in range(keep)]
        if not self._waiting:
            self._last = time.monotonic()
        self._waiting.extend([None] * skip)
        self._waiting.extend(futs)
        self._transport.write(packed)
        if self._timer is None:
            self._timer = loop.call_later(self._timeout, self._check)
        return futs[0] if keep == 1 else asyncio.gather(*futs)

    def _check(self) -> None:
        """Abort when requests wait and nothing arrived for ``timeout`` seconds (Redis hung or gone)."""
        self._timer = None
        if not self._waiting or self.lost:
            return
        idle = time.monotonic() - self._last
        if idle >= self._timeout:
            assert self._transport is not None
            self._transport.abort()
            return
        self._timer = asyncio.get_running_loop().call_later(self._timeout - idle, self._check)

    def close(self, abort: bool = False) -> None:
        """``abort``: drop unsent bytes and fail the waiters now (a node that hangs never drains them)."""
        if self._transport is not None:
            if abort:
                self._transport.abort()
            else:
                self._transport.close()


class NotPrimary(rexc.ConnectionError):
    """The node reached is not the primary (it answered ``ROLE`` as a replica): it is not used."""


Resolver = Callable[[], Awaitable[tuple[str, int]]]
"""Where the primary is now (the sentinels' answer); asked on every connect."""


async def _check_role(conn: _Pipelined, where: str) -> None:
    """:class:`NotPrimary` unless ``ROLE`` says master (a demoted node: a DNS name not yet moved, a stale
    sentinel). A user whose ACL denies ``ROLE`` is not checked: READONLY replies still catch a replica."""
    try:
        role = await conn.request(_command("ROLE"))
    except rexc.ResponseError as e:
        if str(e).startswith("NOPERM"):
            return
        raise
    if role[0] != b"master":
        raise NotPrimary(f"redis at {where} is a {role[0].decode()}, not the primary")


def tls_context(klass: type, kwargs: dict[str, Any]) -> ssl.SSLContext | None:
    """redis-py's own TLS context for a connection of ``klass`` made with ``kwargs`` (None: no TLS)."""
    if not issubclass(klass, SSLConnection):
        return None
    return SSLConnection(**{k: v for k, v in kwargs.items() if k.startswith("ssl_")}).ssl_context.get()


class _FastPath:
    """Lazily (re)connected :class:`_Pipelined` connection to the primary: a standalone Redis over TCP (its
    host name is resolved again on every connect), TLS or a unix socket, or the primary ``resolve`` names
    (Sentinel, over TCP or TLS)."""

    __slots__ = (
        "_conn",
        "_connect_timeout",
        "_db",
        "_host",
        "_lock",
        "_password",
        "_path",
        "_port",
        "_resolve",
        "_ssl",
        "_timeout",
        "_username",
    )

    def __init__(self, kwargs: dict[str, Any], resolve: Resolver | None = None,
                 tls: ssl.SSLContext | None = None) -> None:
        self._resolve = resolve
        self._ssl = tls
        self._path: str | None = kwargs.get("path") or None
        """A unix socket's path (None: TCP)."""
        self._host: str = kwargs.get("host", "localhost")
        self._port: int = int(kwargs.get("port", 6379))
        self._db: int = int(kwargs.get("db", 0) or 0)
        self._username: str | None = kwargs.get("username")
        self._password: str | None = kwargs.get("password")
        self._timeout: float = float(kwargs.get("socket_timeout") or 5.0)
        self._connect_timeout: float = float(kwargs.get("socket_connect_timeout") or self._timeout)
        self._conn: _Pipelined | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def for_client(cls, client: aredis.Redis | RedisCluster) -> _FastPath | None:
        """For a standalone Redis or Sentinel's primary, over TCP, TLS or a unix socket (a Cluster keeps
        redis-py, which follows its slots). TLS takes redis-py's own context from the same options."""
        if isinstance(client, RedisCluster):
            return None
        pool = client.connection_pool
        klass, kwargs = pool.connection_class, dict(pool.connection_kwargs)
        resolve: Resolver | None = None
        if isinstance(pool, SentinelConnectionPool) and issubclass(klass, SentinelManagedConnection):
            manager, name = pool.sentinel_manager, pool.service_name

            async def resolve() -> tuple[str, int]:
                host, port = await manager.discover_master(name)
                return str(host), int(port)

        elif klass not in (_PlainConnection, SSLConnection, UnixDomainSocketConnection):
            return None
        return cls(kwargs, resolve, tls_context(klass, kwargs))

    async def _open(self) -> tuple[_Pipelined, str]:
        """A new connection, and where it goes (for messages)."""
        loop = asyncio.get_running_loop()
        if self._path is not None:
            _, conn = await asyncio.wait_for(
                loop.create_unix_connection(lambda: _Pipelined(self._timeout), self._path),
                self._connect_timeout,
            )
            return conn, self._path
        host, port = await self._resolve() if self._resolve is not None else (self._host, self._port)
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Pipelined(self._timeout), host, port, ssl=self._ssl),
            self._connect_timeout,
        )
        return conn, f"{host}:{port}"

    async def _connect(self) -> _Pipelined:
        async with self._lock:
            if self._conn is not None and not self._conn.lost:
                return self._conn
            conn, where = await self._open()
            try:
                if self._password is not None:
                    auth = (self._username, self._password) if self._username else (self._password,)
                    await conn.request(_command("AUTH", *auth))
                if self._db:
                    await conn.request(_command("SELECT", self._db))
                await _check_role(conn, where)
            except BaseException:
                conn.close()
                raise
            self._conn = conn
            return conn

    async def call(self, packed: bytes, skip: int = 0, keep: int = 1) -> Any:
        conn = self._conn
        if conn is None or conn.lost:
            conn = await self._connect()
        return await conn.request(packed, skip, keep)

    def close(self, abort: bool = False) -> None:
        if self._conn is not None:
            self._conn.close(abort)
            self._conn = None


class _Script:
    """A Lua script run by EVALSHA, falling back to EVAL (which caches it) after a Redis restart."""

    __slots__ = ("sha", "src")

    def __init__(self, src: str) -> None:
        self.src = src
        self.sha = hashlib.sha1(src.encode()).hexdigest()


def is_not_primary(e: BaseException) -> bool:
    """``READONLY`` (redis-py's ``ReadOnlyError``, the fast path's raw reply, or redis-py's Sentinel
    connection turning either into a ``ConnectionError``), a blocked read unblocked by a demotion, or
    :class:`NotPrimary`."""
    for x in (e, e.__context__):
        if isinstance(x, rexc.ReadOnlyError | NotPrimary):
            return True
        if isinstance(x, rexc.ResponseError) and str(x).startswith(("READONLY", "UNBLOCKED")):
            return True
    return False


def _is_connection_error(e: BaseException) -> bool:
    return isinstance(
        e, rexc.ConnectionError | rexc.TimeoutError | rexc.ClusterDownError | OSError | asyncio.TimeoutError
    ) or (isinstance(e, rexc.RedisClusterException) and "connect" in str(e).lower())


class _FailoverWatch:
    """Listens to the sentinels' ``+switch-master`` channel (one sentinel at a time, the next when it
    fails) and calls ``moved`` when the primary of ``name`` changed: connections to an old primary that
    hangs rather than dies are dropped at once, not after a socket timeout or a ``READONLY``."""

    __slots__ = ("_manager", "_moved", "_name", "_task")

    def __init__(self, manager: Sentinel, name: str, moved: Callable[[bytes], Awaitable[None]]) -> None:
        self._manager, self._name, self._moved = manager, name.encode(), moved
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="redis-sentinel-watch")

    async def _run(self) -> None:
        while True:
            for sentinel in list(self._manager.sentinels):
                try:
                    async with sentinel.pubsub() as ps:
                        await ps.subscribe("+switch-master")
                        while True:  # get_message's own timeout: the client's socket timeout is short
                            msg = await ps.get_message(ignore_subscribe_messages=True, timeout=1.0)
                            # "<name> <old ip> <old port> <new ip> <new port>"
                            if msg is not None and bytes(msg["data"]).split(b" ", 1)[0] == self._name:
                                await self._moved(bytes(msg["data"]))
                except Exception:
                    await asyncio.sleep(0.5)  # that sentinel is away: the next one

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait({task}, timeout=1.0)


class RedisConnection:
    """One client's way to Redis: redis-py's ``client`` (Cluster-aware), the pipelined ``fast`` path when
    there is one (all but a Cluster, where the index's lookups have ``shards``), and the ``metrics`` every
    round trip updates. A script runs on one bucket, named by its hash ``tag`` (whose ``:loc`` key routes
    it on a Cluster); ARGV[1] is the tag."""

    __slots__ = ("client", "cluster", "fast", "metrics", "wait", "watch")

    def __init__(self, client: aredis.Redis | RedisCluster, metrics: RedisMetrics,
                 wait: tuple[int, float] | None = None) -> None:
        self.client = client
        self.cluster = isinstance(client, RedisCluster)
        self.fast = _FastPath.for_client(client)
        self.metrics = metrics
        self.wait = wait
        """``(replicas, timeout seconds)``: every :meth:`write` is followed by ``WAIT`` (None: off)."""
        pool = None if isinstance(client, RedisCluster) else client.connection_pool
        self.watch = None
        if isinstance(pool, SentinelConnectionPool):
            self.watch = _FailoverWatch(pool.sentinel_manager, pool.service_name, self._failed_over)

    async def round_trip(self, fn: Callable[[], Awaitable[_T]]) -> _T:
        """One timed round trip; connection failures become :class:`IndexUnavailable`."""
        if self.watch is not None:
            self.watch.start()  # (here: the first round trip has a running loop)
        t0 = time.perf_counter()
        try:
            res = await fn()
        except Exception as e:
            self.metrics.errors += 1
            if is_not_primary(e):
                await self.primary_moved()
                self.metrics.connection_errors += 1
                self.metrics.up = False
                raise IndexUnavailable(f"redis node is not the primary: {e}") from e
            if _is_connection_error(e):
                self.metrics.connection_errors += 1
                self.metrics.up = False
                raise IndexUnavailable(f"redis unavailable: {e}") from e
            raise
        self.metrics.observe(time.perf_counter() - t0)
        self.metrics.answered()
        return res

    async def eval(self, script: _Script, tag: str, *args: object) -> Any:
        """Run ``script`` on the bucket ``tag`` (its ``:loc`` key routes it on a Cluster)."""
        key = tag + ":loc"
        fast = self.fast
        if fast is not None:

            async def go_fast() -> Any:
                try:
                    return await fast.call(_command("EVALSHA", script.sha, 1, key, tag, *args))
                except rexc.ResponseError as e:
                    if not str(e).startswith("NOSCRIPT"):
                        raise
                    return await fast.call(_command("EVAL", script.src, 1, key, tag, *args))

            return await self.round_trip(go_fast)

        async def go() -> Any:
            try:
                return await self.client.evalsha(script.sha, 1, key, tag, *args)  # type: ignore[arg-type]
            except rexc.NoScriptError:
                return await self.client.eval(script.src, 1, key, tag, *args)  # type: ignore[arg-type]

        return await self.round_trip(go)

    async def write(self, script: _Script, tag: str, *args: object) -> Any:
        """A write script: :meth:`eval`, and with ``wait`` set, ``WAIT replicas timeout`` on the same
        connection, sent with it (WAIT counts the writes of its own connection; Redis replicates in
        order, so it also covers every write acknowledged before). Raises :class:`WriteNotReplicated`
        (after the script ran) when fewer replicas confirmed: the caller must not count it as done."""
        if self.wait is None:
            return await self.eval(script, tag, *args)
        want, timeout = self.wait
        wait = ("WAIT", want, max(1, round(timeout * 1000)))
        key = tag + ":loc"
        fast = self.fast

        async def go_fast() -> list[Any]:
            try:
                return cast(list[Any], await fast.call(  # type: ignore[union-attr]
                    _command("EVALSHA", script.sha, 1, key, tag, *args) + _command(*wait), keep=2))
            except rexc.ResponseError as e:
                if not str(e).startswith("NOSCRIPT"):
                    raise
                return cast(list[Any], await fast.call(  # type: ignore[union-attr]
                    _command("EVAL", script.src, 1, key, tag, *args) + _command(*wait), keep=2))

        async def go() -> list[Any]:
            for cmd in ("EVALSHA", "EVAL"):
                pipe = self.client.pipeline(transaction=False)
                route: dict[str, Any] = {}
                if self.cluster:  # WAIT has no key: send it to the shard the script went to
                    await self.client.initialize()
                    route["target_nodes"] = cast(RedisCluster, self.client).get_node_from_key(key)
                pipe.execute_command(cmd, script.sha if cmd == "EVALSHA" else script.src, 1, key, tag, *args)  # type: ignore[arg-type]
                pipe.execute_command(*wait, **route)
                res: list[Any] = await pipe.execute(raise_on_error=False)
                if not isinstance(res[0], rexc.NoScriptError):
                    break
            for r in res:
                if isinstance(r, Exception):
                    raise r
            return res

        t0 = time.perf_counter()
        reply, acked = await self.round_trip(go_fast if fast is not None else go)
        self.metrics.waits += 1
        self.metrics.wait_seconds += time.perf_counter() - t0
        if int(acked) < want:
            self.metrics.wait_short += 1
            raise WriteNotReplicated(f"redis WAIT: {int(acked)} of {want} replicas confirmed the write "
                                     f"within {timeout:g}s")
        return reply

    async def eval_many(self, script: _Script, calls: list[tuple[str, list[object]]]) -> list[Any]:
        """Run ``script`` on several buckets in one pipeline (per shard, in parallel, on a Cluster)."""
        if len(calls) == 1:
            tag, args = calls[0]
            return [await self.eval(script, tag, *args)]

        async def go() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for tag, args in calls:
                # execute_command: redis-py's cluster pipeline refuses the evalsha() method by name, but
                # routes EVALSHA by its key like any single-slot command.
                pipe.execute_command("EVALSHA", script.sha, 1, tag + ":loc", tag, *args)  # type: ignore[arg-type]
            res: list[Any] = await pipe.execute(raise_on_error=False)
            for i, r in enumerate(res):
                if isinstance(r, rexc.NoScriptError):
                    tag, args = calls[i]
                    res[i] = await self.client.eval(script.src, 1, tag + ":loc", tag, *args)  # type: ignore[arg-type]
                elif isinstance(r, Exception):
                    raise r
            return res

        return await self.round_trip(go)

    async def primary_moved(self) -> None:
        """The node answered as a replica: count it and drop every connection (the fast path's, redis-py's
        pooled ones, in use or not), so that the next round trip resolves the primary again."""
        self.metrics.readonly_errors += 1
        await self._drop()

    async def _failed_over(self, message: bytes) -> None:
        self.metrics.failovers += 1
        log.warning("redis: the sentinels report a failover (%s); reconnecting to the new primary",
                    message.decode(errors="replace"))
        await self._drop()

    async def _drop(self) -> None:
        if self.fast is not None:
            self.fast.close(abort=True)
        if not isinstance(self.client, RedisCluster):  # (a Cluster follows its primaries by MOVED)
            with contextlib.suppress(Exception):
                await self.client.connection_pool.disconnect()

    async def close(self) -> None:
        """Close the fast path's socket, redis-py's pool and the sentinels' clients (errors closing are of
        no interest)."""
        if self.watch is not None:
            await self.watch.stop()
        if self.fast is not None:
            self.fast.close()
        with contextlib.suppress(Exception):
            await self.client.aclose()
        pool = None if isinstance(self.client, RedisCluster) else self.client.connection_pool
        if isinstance(pool, SentinelConnectionPool):
            with contextlib.suppress(Exception):
                await pool.sentinel_manager.aclose()
