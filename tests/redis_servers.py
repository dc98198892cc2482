"""Real ``redis-server`` processes for tests and benchmarks: one standalone server, or a 3-shard Cluster.

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

from kvcoord.index import Index
from tests.procs import free_port, spawn, stop, wait_for_port

REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"


def _cli(port: int, *args: str, timeout: float = 10.0) -> str:
    out = subprocess.run(
        [REDIS_CLI, "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return out.stdout


@dataclass
class RedisServer:
    """One ``redis-server`` process; ``restart()`` brings it back on the same port (empty, no persistence)."""

    port: int
    dir: Path
    extra: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        cmd = [
            REDIS_SERVER,
            "--port", str(self.port),
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
                if _cli(self.port, "PING", timeout=2).strip() == "PONG":
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
        return _cli(self.port, *args)

    def flushall(self) -> None:
        with redis.Redis(host="127.0.0.1", port=self.port) as r:
            r.flushall()

    def used_memory(self) -> int:
        """``INFO memory`` used_memory in bytes."""
        for line in self.cli("INFO", "memory").splitlines():
            if line.startswith("used_memory:"):
                return int(line.split(":", 1)[1])
        raise RuntimeError("INFO memory has no used_memory")


@dataclass
class RedisCluster:
    """A Redis Cluster: its primaries, and one replica per primary when started with ``replicas=1``."""

    servers: list[RedisServer] = field(default_factory=list)

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{s.port}" for s in self.servers)

    def flushall(self) -> None:
        for s in self.servers:
            s.flushall()

    def used_memory(self) -> int:
        return sum(s.used_memory() for s in self.servers)


def start_server(*extra: str) -> RedisServer:
    """Start a standalone server on a free port in a fresh temporary directory."""
    d = Path(tempfile.mkdtemp(prefix="kvcoord-redis-"))
    server = RedisServer(port=free_port(), dir=d, extra=extra)
    try:
        server.start()
    except BaseException:
        stop_server(server)
        raise
    return server


def stop_server(server: RedisServer) -> None:
    server.kill()
    shutil.rmtree(server.dir, ignore_errors=True)


def start_cluster(shards: int = 3, timeout: float = 30.0, replicas: int = 0) -> RedisCluster:
    """Start ``shards`` cluster-enabled primaries (and ``replicas`` replicas of each), join them
    (``redis-cli --cluster create``), wait for ok."""
    cluster = RedisCluster()
    total = shards * (1 + replicas)
    try:
        for _ in range(total):
            # An explicit bus port: the default (port + 10000) may be past 65535 for a high free port.
            cluster.servers.append(
                start_server(
                    "--cluster-enabled", "yes",
                    "--cluster-port", str(free_port()),
                    "--cluster-node-timeout", "2000",
                )
            )  # fmt: skip
        subprocess.run(
            [
                REDIS_CLI, "--cluster", "create",
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


@contextlib.contextmanager
def redis_server(*extra: str) -> Iterator[RedisServer]:
    server = start_server(*extra)
    try:
        yield server
    finally:
        stop_server(server)


@contextlib.contextmanager
def redis_cluster(shards: int = 3) -> Iterator[RedisCluster]:
    cluster = start_cluster(shards)
    try:
        yield cluster
    finally:
        stop_cluster(cluster)


# ------------------------------------------------------------------------------- pytest plumbing


def redis_session_fixtures() -> tuple[Any, Any]:
    """The session-scoped ``redis_server`` and ``redis_cluster`` fixtures (conftest binds them by name)."""

    @pytest.fixture(scope="session", name="redis_server")
    def _redis_server() -> Iterator[RedisServer]:
        with redis_server() as server:
            yield server

    @pytest.fixture(scope="session", name="redis_cluster")
    def _redis_cluster() -> Iterator[RedisCluster]:
        with redis_cluster() as cluster:
            yield cluster

    return _redis_server, _redis_cluster


def redis_index_factory(fixture: str, query: str = "") -> Callable[[pytest.FixtureRequest], Awaitable[Index]]:
    """An ``INDEX_FACTORIES`` entry: flush the session server (or cluster) and open a fresh RedisIndex
    (``query``: URI options, e.g. ``?mirror=1``)."""

    async def make(request: pytest.FixtureRequest) -> Index:
        from kvcoord.index.redis import RedisIndex

        target: RedisServer | RedisCluster = request.getfixturevalue(fixture)
        target.flushall()
        index = RedisIndex.from_uri(target.url + query, key_prefix="kvtest")
        if "mirror=1" in query:
            assert await index.mirror_ready(), "the Redis mirror did not load"
        return index

    return make
