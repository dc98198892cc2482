"""One lookup worker of ``kvcoord serve --lookup-workers N`` (:mod:`kvcoord.coordinator.workers`): run by
the main process as ``python -m kvcoord.coordinator.lookup_worker``, fed over its stdin, serving the HTTP
lookup API on the shared port (``SO_REUSEPORT``) from its own copy of the index and node records.

Lookups (``/query``, ``/query_by_hash``) and ``/health`` are answered here, by the same handler and fast
path as the main process's; the other routes are forwarded to the main process. Every answer names the
worker in ``x-kvcoord-worker``. Its metrics go to the main process over its stdout
(:mod:`kvcoord.coordinator.worker_metrics`). It exits when its pipe closes, on SIGTERM or SIGINT, and on
a gap in the frames' numbers (the main process restarts it from a snapshot).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Awaitable
from typing import Any

from kvcoord.coordinator.auth import Authenticator
from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.fastpath import FastAnswers
from kvcoord.coordinator.httpapi import HttpApi
from kvcoord.coordinator.httpd import HttpLimits, HttpServer, Request, Response, Route, json_error
from kvcoord.coordinator.lookup import UNAVAILABLE
from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.registry import CHANGES, NodeRecord
from kvcoord.coordinator.tls import server_ssl_context
from kvcoord.coordinator.worker_metrics import REPORT_EVERY, SAMPLES_EVERY, Report, encode_report
from kvcoord.coordinator.workers import MAX_LAG
from kvcoord.eventloop import use_uvloop
from kvcoord.index.memory import MemoryIndex
from kvcoord.media import configure_media

log = logging.getLogger("kvcoord.coordinator")

__all__ = ["WorkerApi", "main"]

NOT_CURRENT = "lookup worker not current"
_FORWARDED = ("/register", "/unregister", "/workers", "/dump")
_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "expect"}
"""Request headers not forwarded (the client library sets its own)."""
_SET_HERE = {*_HOP, "date", "server", "content-type", "x-kvcoord-replica", "x-kvcoord-worker"}
"""Answer headers the worker's server writes itself."""
_REPORTS_BACKLOG = 1 << 20
"""Bytes of reports queued unread past which a worker skips its next ones."""


class WorkerApi(HttpApi):
    """The HTTP API over a worker's copy: the registered engines' partitions come from the feed."""

    def __init__(self, state: CoordinatorState, auth: Authenticator, main_url: str) -> None:
        super().__init__(state, None, auth)
        self.partitions: dict[str, int] = {}
        self.main_url = main_url
        self._session: Any = None

    def known(self, model: str) -> bool:
        return model in self.partitions or super().known(model)

    def block_size(self, model: str) -> int:
        profile = self.state.config.profile(model)
        if profile is None and model in self.partitions:
            return self.partitions[model]
        return super().block_size(model)

    def query(self, req: Request) -> Response | Awaitable[Response]:
        down = self.lookups.index_down()
        return super().query(req) if down is None else self._not_current(down)

    def query_by_hash(self, req: Request) -> Response | Awaitable[Response]:
        down = self.lookups.index_down()
        return super().query_by_hash(req) if down is None else self._not_current(down)

    def _not_current(self, down: str) -> Response:
        """503 while this worker's copy is not current (counted: the main process sums the workers')."""
        self.state.metrics.lookup_errors[UNAVAILABLE] += 1
        return json_error(503, down)

    def routes(self) -> dict[str, Route]:
        routes = super().routes()
        for path in _FORWARDED:
            route = routes[path]
            routes[path] = Route(dict.fromkeys(route.methods, self.forward), route.body_limit)
        return routes

    async def forward(self, req: Request) -> Response:
        """A route that is not a lookup, answered by the main process."""
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        headers = {k: v for k, v in req.headers.items() if k not in _HOP}
        url = self.main_url + req.path + (f"?{req.query}" if req.query else "")
        try:
            async with self._session.request(req.method, url, data=req.body, headers=headers) as resp:
                body = await resp.read()
                kept = [(k, v) for k, v in resp.headers.items() if k.lower() not in _SET_HERE]
                return Response(resp.status, body, resp.headers.get("content-type"), kept)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            return json_error(503, f"the coordinator's main process does not answer: {exc}")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


class Worker:
    """A worker's copy of the coordinator's state, and what brings it up to date."""

    def __init__(self, config: CoordinatorConfig, number: int, main_port: int) -> None:
        self.number = number
        self.index = MemoryIndex()
        metrics = Metrics()
        self.state = CoordinatorState(config, metrics.instrument(self.index), metrics)
        self.api = WorkerApi(self.state, Authenticator(config.auth), f"http://127.0.0.1:{main_port}")
        self.seq = -1
        self.heard_at = 0.0
        self.frames = 0
        """Frames applied (the ``Report``'s)."""
        self.sent = 0.0
        """The main process's clock when it sent the newest frame applied."""
        self.state.health.up = False
        self.state.health.down_reason = f"{NOT_CURRENT}: no snapshot yet"

    def apply(self, message: tuple[Any, ...]) -> bool:
        """One frame; False on a gap (the worker must start over)."""
        kind = message[0]
        if kind == "snapshot":
            _, seq, sent, image, records, extra = message
            self.index.load_all_sync(image)
            self._records(True, records)
            self._extra(extra)
        elif kind == "delta":
            _, seq, sent, calls, full, records, heard, extra = message
            if seq != self.seq + 1:
                log.error("lookup worker %d: frame %d after %d; starting over", self.number, seq, self.seq)
                return False
            for method, *args in calls:
                try:
                    getattr(self.index, method)(*args)
                except Exception:  # the main process failed at the same op (it logged why)
                    log.debug("lookup worker %d: %s failed as in the main process", self.number, method)
            self._records(full, records)
            if heard:
                for node_id, at in heard.items():
                    rec = self.state.registry.get(node_id)
                    if rec is not None:
                        rec.last_heard = at
            self._extra(extra)
        else:
            return True
        self.seq, self.sent = seq, sent
        self.frames += 1
        self.heard_at = time.monotonic()
        self.state.health.up = True
        return True

    def _records(self, full: bool, records: dict[str, NodeRecord | None]) -> None:
        reg = self.state.registry
        if full:
            for old in reg:
                if old.node_id not in records:
                    reg.remove(old.node_id)
        for node_id, rec in records.items():
            if rec is None:
                reg.remove(node_id)
            else:
                reg.put(rec)

    def _extra(self, extra: tuple[Any, ...] | None) -> None:
        if extra is None:
            return
        reach, publishers, partitions = extra
        self.state.pools.load(reach, publishers)
        if partitions != self.api.partitions:
            self.api.partitions = partitions
            CHANGES.bump()

    def check_current(self) -> None:
        """503 (health down) while no frame came for :data:`MAX_LAG` seconds."""
        if self.seq >= 0 and time.monotonic() - self.heard_at > MAX_LAG:
            self.state.health.up = False
            self.state.health.down_reason = f"{NOT_CURRENT}: no feed for over {MAX_LAG:g} s"


async def _read(reader: asyncio.StreamReader) -> tuple[Any, ...] | None:
    try:
        head = await reader.readexactly(8)
        body = await reader.readexactly(int.from_bytes(head, "big"))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    message = pickle.loads(body)
    assert isinstance(message, tuple)
    return message


async def _feed(worker: Worker, reader: asyncio.StreamReader) -> None:
    while (message := await _read(reader)) is not None:
        if not worker.apply(message):
            return


async def _watch(worker: Worker) -> None:
    while True:
        await asyncio.sleep(0.05)
        worker.check_current()


def _send_report(worker: Worker, reports: asyncio.WriteTransport, samples: bool) -> None:
    """What this worker counted, to the main process (its totals, and with ``samples`` its lookups');
    skipped while the main process does not read them (each holds the totals: none is missed)."""
    if not reports.is_closing() and reports.get_write_buffer_size() < _REPORTS_BACKLOG:
        counted = worker.state.metrics.sums.own_samples() if samples else None
        reports.write(encode_report(Report(worker.sent, worker.frames, counted)))


async def _report(worker: Worker, reports: asyncio.WriteTransport) -> None:
    n = 0
    while not reports.is_closing():  # closed: the main process is gone
        _send_report(worker, reports, n % SAMPLES_EVERY == 0)
        n += 1
        await asyncio.sleep(REPORT_EVERY)


async def _report_pipe() -> asyncio.WriteTransport:
    """The pipe the main process reads reports from: this process's stdout, which is the stderr from here
    on (a stray print cannot garble a report)."""
    loop = asyncio.get_running_loop()
    pipe = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    transport, _ = await loop.connect_write_pipe(asyncio.Protocol, pipe)
    return transport


async def run() -> int:
    loop = asyncio.get_running_loop()
    reports = await _report_pipe()
    reader = asyncio.StreamReader(limit=1 << 30)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    hello = await _read(reader)
    if hello is None or hello[0] != "hello":
        return 2
    _, config, number, host, port, main_port = hello
    configure_media(config.media)
    worker = Worker(config, number, main_port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    lim = config.limits
    limits = HttpLimits(lim.http_header_timeout_s, lim.http_max_header_bytes, lim.http_max_connections,
                        lim.http_idle_timeout_s)
    headers = [("x-kvcoord-replica", worker.state.replicas.replica_id), ("x-kvcoord-worker", str(number))]
    http = HttpServer(worker.api.routes(), worker.api.authorize, headers, limits=limits,
                      on_refused=worker.state.metrics.http_refused)
    if FastAnswers.available(worker.api):
        worker.api.fast = FastAnswers(worker.api)
    ssl_context = server_ssl_context(config.tls) if config.tls.enabled else None
    while worker.seq < 0:  # current before it listens: the kernel sends it no connection before
        message = await _read(reader)
        if message is None or not worker.apply(message):
            return 3
    await http.start(host, port, ssl_context, reuse_port=True)
    tasks = [loop.create_task(_feed(worker, reader)), loop.create_task(_watch(worker)),
             loop.create_task(stop.wait()), loop.create_task(_report(worker, reports))]
    done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    code = 0 if tasks[2] in done else 3  # the feed ended: the main process is gone, or a gap
    for task in tasks:
        task.cancel()
    await http.stop(grace=0.2)
    await worker.api.close()
    _send_report(worker, reports, True)  # what it answered since the last one
    reports.close()
    return code


def main() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    use_uvloop()  # as its main process (KVCOORD_UVLOOP is inherited)
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(asyncio.run(run()))


if __name__ == "__main__":
    main()
