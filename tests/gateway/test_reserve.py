"""A router's ``Reserve`` stream (:class:`kvcoord.gateway.reserve.ReserveStream`) against a real ``kvcoord
serve``: a reservation shows in the coordinator's view at once, its first byte ends its prefill, its
completion the request (also when it replaces a first byte not sent yet), and after the coordinator
restarts the reopened stream carries the next reservations (the failed call's writer takes none of
them). Every wait is a poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from kvcoord.gateway.reserve import ReserveStream
from kvcoord.router.client import AsyncCoordinatorClient
from tests.procs import stop
from tests.procs import until_async as _until
from tests.route_fleet import MODEL, RouteFleet, route_fleet

pytestmark = pytest.mark.slow

NODE = "node-a"
HASHES = list(range(1, 33))


@contextlib.asynccontextmanager
async def _stream(fleet: RouteFleet) -> AsyncIterator[ReserveStream]:
    client = AsyncCoordinatorClient(fleet.coordinator)
    stream = ReserveStream(client, logging.getLogger("test_reserve"), ttl=60.0, retry_seconds=0.1)
    task = asyncio.create_task(stream.run())
    try:
        await _until(_is_up(stream, True), "the stream is up")
        yield stream
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await client.close()


def _is_up(stream: ReserveStream, up: bool) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return stream.up is up
    return check


async def _view(s: aiohttp.ClientSession, fleet: RouteFleet) -> tuple[float, float]:
    """(requests reserved, their prefill tokens) in the coordinator's metrics."""
    got = await fleet.coordinator_metrics(s, "kvcoord_reservations{", "kvcoord_reserved_prefill_tokens")
    return (got.get('kvcoord_reservations{kind="requests"}', -1.0),
            got.get("kvcoord_reserved_prefill_tokens", -1.0))


def _shows(s: aiohttp.ClientSession, fleet: RouteFleet,
           want: tuple[float, float]) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await _view(s, fleet) == want
    return check


async def test_reservations_and_releases_reach_the_coordinator_also_after_it_restarts(tmp_path: Path) -> None:
    with route_fleet(tmp_path, (NODE,), agentless=(NODE,), metrics=True) as fleet:
        async with aiohttp.ClientSession() as s, _stream(fleet) as stream:
            stream.reserve("r1", MODEL, (NODE, 0), 0, HASHES, 500)
            await _until(_shows(s, fleet, (1.0, 500.0)), "r1 reserved with its prefill")
            stream.release("r1", first_byte=True)
            await _until(_shows(s, fleet, (1.0, 0.0)), "r1's first byte ends its prefill")
            stream.release("r1", first_byte=False)
            await _until(_shows(s, fleet, (0.0, 0.0)), "r1's completion ends it")

            stream.reserve("r2", MODEL, (NODE, 0), 8, HASHES, 300)
            await _until(_shows(s, fleet, (1.0, 300.0)), "r2 reserved")
            stream.release("r2", first_byte=True)
            stream.release("r2", first_byte=False)  # replaces the first byte, still pending
            await _until(_shows(s, fleet, (0.0, 0.0)), "r2's completion ends it")

            stop(fleet.procs["serve"])
            await _until(_is_up(stream, False), "the stream is down")
            fleet.start_serve()
            await _until(_is_up(stream, True), "the stream is up again", timeout=120)
            for i in range(3):  # each wakes the failed call's writer too, if it still waited
                stream.reserve(f"r{3 + i}", MODEL, (NODE, 0), 0, HASHES, 100)
                await _until(_shows(s, fleet, (i + 1.0, 100.0 * (i + 1))), f"r{3 + i} after the restart")
            assert stream.dropped == 0
