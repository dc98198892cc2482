"""Shared fixtures. ``index`` runs every backend test once per entry of ``INDEX_FACTORIES``."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from types import FrameType

import pytest

from kvcoord.index.base import Index
from kvcoord.index.memory import MemoryIndex
from tests.redis_servers import (
    RedisServer,
    redis_index_factory,
    redis_session_fixtures,
    start_server,
    stop_server,
)

(redis_server, redis_cluster, redis_sentinel, redis_tls, redis_cluster_tls,
 redis_sentinel_tls) = redis_session_fixtures()

# Coordinators the tests start serve no HTTP API unless a test asks (--http-listen, or http_listen in its
# config): the default port is fixed, and tests run next to each other and to whatever else the host runs.
os.environ.setdefault("KVCOORD_HTTP_LISTEN", "")


def _interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def pytest_configure(config: pytest.Config) -> None:
    """SIGTERM (``timeout``, CI cancelling) tears down like Ctrl-C, so fixtures stop what they started."""
    signal.signal(signal.SIGTERM, _interrupt)

IndexFactory = Callable[[pytest.FixtureRequest], Awaitable[Index]]
"""Makes a fresh, empty index. Gets the pytest request so it can pull in e.g. a redis-server fixture
(``request.getfixturevalue("redis_server")``). The caller closes the index."""


async def _memory(request: pytest.FixtureRequest) -> Index:
    return MemoryIndex()  # core="auto": the C core when built


async def _memory_python(request: pytest.FixtureRequest) -> Index:
    return MemoryIndex(core="python")


INDEX_FACTORIES: dict[str, IndexFactory] = {
    "memory": _memory,
    "memory-python": _memory_python,
    # Other backends register here, one line each, e.g. "redis": _redis.
    "redis": redis_index_factory("redis_server"),
    "redis-cluster": redis_index_factory("redis_cluster"),
    "redis-mirror": redis_index_factory("redis_server", "?mirror=1"),
    "redis-cluster-mirror": redis_index_factory("redis_cluster", "?mirror=1"),
    "redis-sentinel": redis_index_factory("redis_sentinel"),
    "redis-tls": redis_index_factory("redis_tls"),
    "redis-cluster-tls": redis_index_factory("redis_cluster_tls"),
}


SUITE_ONLY = ("redis-cluster-tls",)
"""Backends only the backend suite (``tests/index/test_index_backends.py``) runs, not every test that runs
per backend: TLS changes how the backend connects, not what the coordinator above it does."""


@pytest.fixture(params=[b for b in INDEX_FACTORIES if b not in SUITE_ONLY])
def index_backend(request: pytest.FixtureRequest) -> str:
    """The backend name under test (for tests that build indexes themselves, e.g. state machines)."""
    return str(request.param)


@pytest.fixture
async def index(index_backend: str, request: pytest.FixtureRequest) -> AsyncIterator[Index]:
    """A fresh backend per test, closed afterwards."""
    idx = await INDEX_FACTORIES[index_backend](request)
    try:
        yield idx
    finally:
        await idx.close()


@pytest.fixture
def own_server() -> Iterator[RedisServer]:
    """A redis-server of this test alone (for tests that kill and restart it)."""
    server = start_server()
    try:
        yield server
    finally:
        stop_server(server)
