"""Real ``redis-server`` processes for tests and benchmarks: one standalone server (also one that speaks
TLS), a 3-shard Cluster, or a primary with a replica watched by 3 sentinels (``redis-sentinel``).

The Cluster and Sentinel starters take ``tls=True``: then every server and sentinel listens with TLS
only (``--port 0``, client certificates required, replication, the cluster bus and the sentinels' links
over TLS too), with a test PKI (:func:`~tests.procs.make_certs`) in a temporary directory of its own.

Every server runs on a free port in its own temporary directory with persistence off
(``--save "" --appendonly no``); ``stop()`` kills the processes and removes the directories.
The Redis already running on 6379 is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import redis

from kvcoord.index.base import Index
from tests.procs import free_port, make_certs, spawn, stop, wait_for_port

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
REDIS_SENTINEL = shutil.which("redis-sentinel")
SENTINEL_MASTER = "kvtest"


Certs = dict[str, Path]
"""A test PKI (:func:`~tests.procs.make_certs`): ``ca_crt``, ``server_crt``, ``client_crt``, keys."""


def _tls_cli(certs: Certs | None) -> list[str]:
    """``redis-cli``'s TLS options with the test client certificate (none without ``certs``)."""
    if certs is None:
        return []
    return ["--tls", "--cacert", str(certs["ca_crt"]), "--cert", str(certs["client_crt"]),
            "--key", str(certs["client_key"])]


def _tls_server(certs: Certs) -> list[tuple[str, str]]:
    """A server's (or sentinel's) TLS settings: client certificates required, and its own outgoing links
    (replication, the cluster bus, a sentinel's to the servers and the other sentinels) over TLS with the
    client certificate (the server one is for serving only)."""
    return [
        ("tls-cert-file", str(certs["server_crt"])), ("tls-key-file", str(certs["server_key"])),
        ("tls-client-cert-file", str(certs["client_crt"])), ("tls-client-key-file", str(certs["client_key"])),
        ("tls-ca-cert-file", str(certs["ca_crt"])), ("tls-auth-clients", "yes"), ("tls-replication", "yes"),
    ]  # fmt: skip


def tls_query(certs: Certs) -> str:
    """The index URI options that make redis-py (and the fast path) present the test client certificate."""
    return (f"ssl_ca_certs={certs['ca_crt']}&ssl_certfile={certs['client_crt']}"
            f"&ssl_keyfile={certs['client_key']}")


def new_certs() -> Certs:
    """A test PKI in a fresh temporary directory (:func:`remove_certs` removes it)."""
    return make_certs(Path(tempfile.mkdtemp(prefix="kvcoord-redis-tls-")))


def remove_certs(certs: Certs | None) -> None:
    if certs is not None:
        shutil.rmtree(certs["ca_crt"].parent, ignore_errors=True)


def _cli(port: int, *args: str, timeout: float = 10.0, certs: Certs | None = None) -> str:
    out = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *_tls_cli(certs), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return out.stdout


@dataclass
class RedisServer:
    """One ``redis-server`` process; ``restart()`` brings it back on the same port (empty, no persistence).
    With ``certs``, ``port`` is a TLS port and the only one (``--port 0``)."""

    port: int
    dir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    certs: Certs | None = None

    @property
    def url(self) -> str:
        if self.certs is not None:
            return f"rediss://127.0.0.1:{self.port}/0?{tls_query(self.certs)}"
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        listen = ["--port", str(self.port)]
        if self.certs is not None:
            listen = ["--port", "0", "--tls-port", str(self.port),
                      *(a for k, v in _tls_server(self.certs) for a in (f"--{k}", v))]
            if "--cluster-enabled" in self.extra:
                listen += ["--tls-cluster", "yes"]
        cmd = [
            REDIS_SERVER,
            *listen,
            "--bind", "127.0.0.1",
            "--save", "",
            "--appendonly", "no",
            "--dir", str(self.dir),
            "--logfile", str(self.dir / "redis.log"),
            "--maxmemory-policy", "noeviction",
            *self.extra,
        ]  # fmt: skip
        self.proc = spawn(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(subprocess.SubprocessError):
                if _cli(self.port, "PING", timeout=2, certs=self.certs).strip() == "PONG":
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"redis-server on {self.port} does not answer PING")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL the server (a crash: nothing is saved) and reap it."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        stop(proc)

    def restart(self) -> None:
        self.kill()
        self.start()

    def cli(self, *args: str) -> str:
        return _cli(self.port, *args, certs=self.certs)

    def flushall(self) -> None:
        c = self.certs
        tls: dict[str, Any] = {} if c is None else {
            "ssl": True, "ssl_ca_certs": str(c["ca_crt"]), "ssl_certfile": str(c["client_crt"]),
            "ssl_keyfile": str(c["client_key"])}
        with redis.Redis(host="127.0.0.1", port=self.port, **tls) as r:
            r.flushall()

    def used_memory(self) -> int:
        """``INFO memory`` used_memory in bytes."""
        for line in self.cli("INFO", "memory").splitlines():
            if line.startswith("used_memory:"):
                return int(line.split(":", 1)[1])
        raise RuntimeError("INFO memory has no used_memory")


@dataclass
class RedisCluster:
    """A Redis Cluster: its primaries, and one replica per primary when started with ``replicas=1``;
    over TLS only with ``certs``."""

    servers: list[RedisServer] = field(default_factory=list)
    certs: Certs | None = None

    @property
    def url(self) -> str:
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)
        return url if self.certs is None else f"{url}?ssl=1&{tls_query(self.certs)}"

    def flushall(self) -> None:
        for s in self.servers:
            s.flushall()

    def used_memory(self) -> int:
        return sum(s.used_memory() for s in self.servers)


def start_server(*extra: str, certs: Certs | None = None) -> RedisServer:
    """Start a standalone server on a free port in a fresh temporary directory (TLS only with ``certs``)."""
    d = Path(tempfile.mkdtemp(prefix="kvcoord-redis-"))
    server = RedisServer(port=free_port(), dir=d, extra=extra, certs=certs)
    try:
        server.start()
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: RedisServer) -> None:
    server.kill()
    shutil.rmtree(server.dir, ignore_errors=True)


@dataclass
class TlsRedis:
    """A standalone server that also listens with TLS, client certificates required (``url`` is the TLS
    one, with the test CA and a client certificate; the plain port stays for the test's own commands)."""

    server: RedisServer
    tls_port: int
    certs: dict[str, Path]

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls_port}/0?{tls_query(self.certs)}"

    @property
    def servers(self) -> list[RedisServer]:
        return [self.server]

    def flushall(self) -> None:
        self.server.flushall()


@contextlib.contextmanager
def redis_tls() -> Iterator[TlsRedis]:
    certs = new_certs()
    port = free_port()
    server = start_server(
        "--tls-port", str(port),
        "--tls-cert-file", str(certs["server_crt"]),
        "--tls-key-file", str(certs["server_key"]),
        "--tls-ca-cert-file", str(certs["ca_crt"]),
        "--tls-auth-clients", "yes",
    )  # fmt: skip
    try:
        wait_for_port(port)
        yield TlsRedis(server, port, certs)
    finally:
        stop_server(server)
        remove_certs(certs)


def start_cluster(shards: int = 3, timeout: float = 30.0, replicas: int = 0,
                  tls: bool = False) -> RedisCluster:
    """Start ``shards`` cluster-enabled primaries (and ``replicas`` replicas of each), join them
    (``redis-cli --cluster create``), wait for ok. ``tls``: TLS only (clients, the bus, replication)."""
    cluster = RedisCluster()
    total = shards * (1 + replicas)
    try:
        if tls:
            cluster.certs = new_certs()
        for _ in range(total):
            # An explicit bus port: the default (port + 10000) may be past 65535 for a high free port.
            cluster.servers.append(
                start_server(
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(free_port()),
                    "--cluster-node-timeout", "2000",
                    certs=cluster.certs,
                )
            )  # fmt: skip
        subprocess.run(
            [
                REDIS_CLI, *_tls_cli(cluster.certs), "--cluster", "create",
                *(f"127.0.0.1:{s.port}" for s in cluster.servers),
                "--cluster-replicas", str(replicas), "--cluster-yes",
            ],
            capture_output=True,
            timeout=timeout,
            check=True,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while not all(
            "cluster_state:ok" in s.cli("CLUSTER", "INFO")
            and len(nodes := s.cli("CLUSTER", "NODES").strip().splitlines()) == total
            and sum("slave" in n.split()[2] for n in nodes) == shards * replicas
            for s in cluster.servers
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.1)
        # A replica that never finished its first sync refuses to fail over: wait for every link.
        while sum("master_link_status:up" in s.cli("INFO", "replication") for s in cluster.servers) < (
            shards * replicas
        ):
            if time.monotonic() > deadline:
                raise TimeoutError("redis cluster replicas did not sync")
            time.sleep(0.1)
    except BaseException:
        stop_cluster(cluster)
        raise
    return cluster


def stop_cluster(cluster: RedisCluster) -> None:
    for s in cluster.servers:
        stop_server(s)
    remove_certs(cluster.certs)


@contextlib.contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    server = start_server(*extra)
    try:
        yield server
    finally:
        stop_server(server)


@contextlib.contextmanager
def redis_cluster(shards: int = 3, tls: bool = False) -> Iterator[RedisCluster]:
    cluster = start_cluster(shards, tls=tls)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


@dataclass
class SentinelProc:
    """One ``redis-sentinel`` process (its config file is its own: Sentinel rewrites it); TLS only with
    ``certs`` (it then announces its TLS port to the other sentinels)."""

    port: int
    dir: Path
    proc: subprocess.Popen[bytes] | None = None
    certs: Certs | None = None

    def start(self, primary_port: int) -> None:
        conf = self.dir / "sentinel.conf"
        listen = f"port {self.port}\n"
        if self.certs is not None:
            listen = f"port 0\ntls-port {self.port}\n" + "".join(
                f"{k} {v}\n" for k, v in _tls_server(self.certs))
        conf.write_text(
            f"{listen}bind 127.0.0.1\ndir {self.dir}\nlogfile {self.dir / 'sentinel.log'}\n"
            f"sentinel monitor {SENTINEL_MASTER} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {SENTINEL_MASTER} 800\n"
            f"sentinel failover-timeout {SENTINEL_MASTER} 4000\n"
            f"sentinel parallel-syncs {SENTINEL_MASTER} 1\n"
        )
        assert REDIS_SENTINEL is not None
        self.proc = spawn([REDIS_SENTINEL, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for_port(self.port)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            stop(proc)

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        return _cli(self.port, *args, timeout=timeout, certs=self.certs)

    def master(self) -> dict[str, str]:
        """``SENTINEL MASTER`` as a dict (``ip``, ``port``, ``flags``, ``num-slaves``, ...)."""
        lines = self.cli("SENTINEL", "MASTER", SENTINEL_MASTER, timeout=5).splitlines()
        return dict(zip(lines[0::2], lines[1::2], strict=False))


@dataclass
class RedisSentinel:
    """A primary and a replica (``servers``, the primary first at start) and 3 sentinels with a quorum
    of 2 that fail over in about 2 s (``down-after-milliseconds`` 800); every link over TLS with ``certs``."""

    servers: list[RedisServer] = field(default_factory=list)
    sentinels: list[SentinelProc] = field(default_factory=list)
    certs: Certs | None = None

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        url = f"redis+sentinel://{hosts}/{SENTINEL_MASTER}"
        return url if self.certs is None else f"{url}?ssl=1&sentinel_ssl=1&{tls_query(self.certs)}"

    def primary_port(self) -> int | None:
        """The primary the sentinels name (the first one that answers), or None."""
        for s in self.sentinels:
            with contextlib.suppress(subprocess.SubprocessError, IndexError, ValueError):
                return int(s.master()["port"])
        return None

    def primary(self) -> RedisServer:
        port = self.primary_port()
        return next(s for s in self.servers if s.port == port)

    def role(self, server: RedisServer) -> str:
        """``master`` or ``slave`` as the server itself says (``down`` when it does not answer)."""
        try:
            return server.cli("ROLE").split("\n", 1)[0]
        except subprocess.SubprocessError:
            return "down"

    def flushall(self) -> None:
        self.primary().flushall()

    def settled(self) -> bool:
        """Every sentinel knows the others and the same primary with one healthy replica, and the
        primary says so too: a failover can start, and nothing is in flight."""
        ports = set()
        for s in self.sentinels:
            try:
                m = s.master()
            except subprocess.SubprocessError:
                return False
            if (m.get("flags"), m.get("num-other-sentinels"), m.get("num-slaves")) != ("master", "2", "1"):
                return False
            ports.add(m.get("port"))
        primary = next((x for x in self.servers if str(x.port) in ports), None)
        if len(ports) != 1 or primary is None or self.role(primary) != "master":
            return False
        info = primary.cli("INFO", "replication")
        return "connected_slaves:1" in info and "state=online" in info


def start_sentinel(timeout: float = 60.0, tls: bool = False) -> RedisSentinel:
    """A primary, its replica and 3 sentinels, waited for until :meth:`RedisSentinel.settled`
    (``tls``: every server and sentinel over TLS only)."""
    if REDIS_SENTINEL is None:
        raise FileNotFoundError("redis-sentinel is not installed")
    rs = RedisSentinel(certs=new_certs() if tls else None)
    try:
        primary = start_server(certs=rs.certs)
        rs.servers.append(primary)
        rs.servers.append(start_server("--replicaof", "127.0.0.1", str(primary.port), certs=rs.certs))
        for _ in range(3):
            sp = SentinelProc(port=free_port(), dir=Path(tempfile.mkdtemp(prefix="kvcoord-sentinel-")),
                              certs=rs.certs)
            rs.sentinels.append(sp)
            sp.start(primary.port)
        deadline = time.monotonic() + timeout
        while not rs.settled():
            if time.monotonic() > deadline:
                raise TimeoutError("redis sentinels did not settle")
            time.sleep(0.1)
    except BaseException:
        stop_sentinel(rs)
        raise
    return rs


def stop_sentinel(rs: RedisSentinel) -> None:
    for sp in rs.sentinels:
        sp.kill()
        shutil.rmtree(sp.dir, ignore_errors=True)
    for s in rs.servers:
        stop_server(s)
    remove_certs(rs.certs)


@contextlib.contextmanager
def redis_sentinel(tls: bool = False) -> Iterator[RedisSentinel]:
    """:func:`start_sentinel`, stopped after; skips when ``redis-sentinel`` is missing, unless
    ``KVCOORD_REQUIRE_SENTINEL`` is set (CI): then the test fails."""
    if REDIS_SENTINEL is None and not os.environ.get("KVCOORD_REQUIRE_SENTINEL"):
        pytest.skip("redis-sentinel is not installed")
    rs = start_sentinel(tls=tls)
    try:
        yield rs
    finally:
        stop_sentinel(rs)


# ------------------------------------------------------------------------------- pytest plumbing


def redis_session_fixtures() -> tuple[Any, ...]:
    """The session-scoped ``redis_server``, ``redis_cluster``, ``redis_sentinel``, ``redis_tls``,
    ``redis_cluster_tls`` and ``redis_sentinel_tls`` fixtures (conftest binds them by name)."""

    @pytest.fixture(scope="session", name="redis_server")
    def _redis_server() -> Iterator[RedisServer]:
        with redis_server() as server:
            yield server

    @pytest.fixture(scope="session", name="redis_cluster")
    def _redis_cluster() -> Iterator[RedisCluster]:
        with redis_cluster() as cluster:
            yield cluster

    @pytest.fixture(scope="session", name="redis_sentinel")
    def _redis_sentinel() -> Iterator[RedisSentinel]:
        with redis_sentinel() as rs:
            yield rs

    @pytest.fixture(scope="session", name="redis_tls")
    def _redis_tls() -> Iterator[TlsRedis]:
        with redis_tls() as tls:
            yield tls

    @pytest.fixture(scope="session", name="redis_cluster_tls")
    def _redis_cluster_tls() -> Iterator[RedisCluster]:
        with redis_cluster(tls=True) as cluster:
            yield cluster

    @pytest.fixture(scope="session", name="redis_sentinel_tls")
    def _redis_sentinel_tls() -> Iterator[RedisSentinel]:
        with redis_sentinel(tls=True) as rs:
            yield rs

    return _redis_server, _redis_cluster, _redis_sentinel, _redis_tls, _redis_cluster_tls, _redis_sentinel_tls


def redis_index_factory(fixture: str, query: str = "") -> Callable[[pytest.FixtureRequest], Awaitable[Index]]:
    """An ``INDEX_FACTORIES`` entry: flush the session server (or cluster) and open a fresh RedisIndex
    (``query``: URI options, e.g. ``?mirror=1``)."""

    async def make(request: pytest.FixtureRequest) -> Index:
        from kvcoord.index.redis.index import RedisIndex

        target: RedisServer | RedisCluster | RedisSentinel | TlsRedis = request.getfixturevalue(fixture)
        target.flushall()
        url = target.url  # (a TLS one has options already)
        index = RedisIndex.from_uri(url + (query.replace("?", "&") if "?" in url else query),
                                    key_prefix="kvtest")
        if "mirror=1" in query:
            assert await index.mirror_ready(), "the Redis mirror did not load"
        return index

    return make
