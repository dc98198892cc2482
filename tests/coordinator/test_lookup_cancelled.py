"""A lookup its client abandons (a router's deadline) is normal work for ``kvcoord serve``: counted in
``kvcoord_lookups_cancelled_total``, never logged as an ERROR with a traceback."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError
from tests.http_util import metrics
from tests.procs import free_port, kvcoord_cmd, running, until, wait_for_port

TOKENS = 2_000_000
"""Hashing this many tokens takes tens of milliseconds: far longer than the client waits."""


def _cancelled(mport: int) -> float:
    page = metrics(f"http://127.0.0.1:{mport}/metrics")
    assert ("kvcoord_lookups_cancelled_total", ()) in page, "no kvcoord_lookups_cancelled_total"
    return page[("kvcoord_lookups_cancelled_total", ())]


def test_abandoned_lookups_are_counted_not_logged_as_errors(tmp_path: Path) -> None:
    gport, mport = free_port(), free_port()
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", f"127.0.0.1:{mport}",
                        "--http-listen", "", "--max-query-blocks", str(TOKENS),
                        "--model", "m,algo=sha256_cbor,block_size=16,seed=0")
    log = tmp_path / "serve.log"
    tokens = list(range(TOKENS))

    async def abandon() -> str:
        async with AsyncCoordinatorClient(f"127.0.0.1:{gport}", timeout=0.04) as client:
            await client.ping(timeout=10)  # connected: the deadline runs out on the server, not in connect
            try:
                await client.lookup("m", tokens=tokens, include_unmatched=True)
            except CoordinatorError as exc:
                return str(exc.code.name)
            return "answered"

    with running(serve, log=log):
        wait_for_port(gport, timeout=30)
        wait_for_port(mport, timeout=30)
        assert _cancelled(mport) == 0
        outcomes: list[str] = []

        def abandoned_and_counted() -> bool:
            # A request whose deadline passed before the server read it never reaches the handler (gRPC
            # drops it): try until one was abandoned while the coordinator worked on it.
            outcomes.append(asyncio.run(abandon()))
            return _cancelled(mport) >= 1

        until(abandoned_and_counted, "a lookup abandoned while the coordinator hashed it, counted",
              timeout=60, diagnose=lambda: outcomes)
        assert set(outcomes) <= {"DEADLINE_EXCEEDED", "answered"}, outcomes  # a fast machine may answer
        assert _cancelled(mport) <= len(outcomes)
        assert asyncio.run(_lookup_small(gport)) == 4  # a client that waits is answered
    text = log.read_text()
    assert "ERROR" not in text and "Traceback" not in text, text


async def _lookup_small(gport: int) -> int:
    async with AsyncCoordinatorClient(f"127.0.0.1:{gport}", timeout=10) as client:
        return (await client.lookup("m", tokens=list(range(64)))).num_blocks

