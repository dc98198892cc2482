"""Lookup workers (``kvcoord serve --lookup-workers N``): the HTTP lookup API on N more processes, one port.

The main process keeps everything that writes: ingest streams, registered engines, leases, trust states
and the authoritative memory index (a :class:`FeedIndex`). Each worker
(:mod:`kvcoord.coordinator.lookup_worker`) holds its own :class:`~kvcoord.index.memory.MemoryIndex` and
node registry, fed over its stdin pipe with what the main process changed, in order and numbered:

- the index calls as they were applied (apply, clear, remove_node, replace_node: the worker runs the same
  methods on the same ops, so the index's semantics exist once);
- the node records lookups read (the registry's change log, :data:`~kvcoord.coordinator.registry.CHANGES`,
  names the nodes changed since the last frame), every node's last heartbeat at each tick, the shared
  pools' reach and the registered engines' partitions (at ticks, and with a change not of one node's
  record, as a registration is).

A worker starts from a snapshot (the whole index, every record), applies frames whose number follows its
own, exits on a gap (and is restarted, from a snapshot), and answers 503 (never a stale answer) when
no frame came for :data:`MAX_LAG` seconds; the main process sends one every :data:`TICK` seconds. A
worker whose pipe backs up past :data:`BACKLOG_BYTES` gets no more frames until it drained, then a
snapshot. Workers bind the HTTP port with ``SO_REUSEPORT`` (the kernel spreads connections over them);
the main process holds the port bound but does not listen on it: it serves the API on a private loopback
listener, where workers forward the routes that are not lookups (``/register``, ``/workers``, ...).
A worker exits when its pipe closes (the main process died) and on SIGTERM; a worker that exits is
restarted (at most once a second) and logged. Each worker reports its lookup metrics over its stdout
pipe; the main process's ``/metrics`` adds them to its own (:mod:`kvcoord.coordinator.worker_metrics`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import socket
import struct
import sys
import time
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvcoord.coordinator.registry import CHANGES
from kvcoord.coordinator.worker_metrics import WorkerReports
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import ApplyResult
from kvcoord.index.memory import MemoryIndex
from kvcoord.validate import Op

if TYPE_CHECKING:
    from kvcoord.coordinator.config import CoordinatorConfig
    from kvcoord.coordinator.core import CoordinatorState
    from kvcoord.coordinator.engines import Engines

log = logging.getLogger("kvcoord.coordinator")

__all__ = ["BACKLOG_BYTES", "MAX_LAG", "TICK", "FeedIndex", "LookupWorkers", "frame", "reserve_port"]

TICK = 0.1
"""Seconds between the main process's frames when nothing changed (heartbeats ride on them)."""
MAX_LAG = 0.5
"""A worker that heard no frame for this long answers 503 until it does (the Redis mirror's rule)."""
BACKLOG_BYTES = 64 * 1024 * 1024
"""Bytes queued to one worker past which it gets no more frames until drained, then a snapshot."""
RESTART_EVERY = 1.0
"""Seconds between restarts of one worker at most."""

_LEN = struct.Struct("!Q")


def frame(message: object) -> bytes:
    """One message on a worker's pipe: its pickled length, then it (trusted: the main process's own)."""
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


def _portable(ops: Sequence[Op]) -> list[Op]:
    """Ops that can be pickled: a packed ``memoryview`` of hashes becomes an ``array('Q')``."""
    return [op._replace(hashes=cast("list[BlockHash64]", array("Q", op.hashes)))
            if isinstance(op.hashes, memoryview) else op for op in ops]


class FeedIndex(MemoryIndex):
    """The memory index whose changes are also logged, in order, for the lookup workers."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.log: list[tuple[Any, ...]] = []
        """Calls applied since the last frame: ``(method, *args)``, run as they are by the workers."""
        self.on_change: Any = None
        """Called after each logged call (the pool schedules a frame)."""

    def _logged(self, call: tuple[Any, ...]) -> None:
        self.log.append(call)
        if self.on_change is not None:
            self.on_change()

    def apply_sync(self, model: str, node_id: str, dp_rank: int, ops: Sequence[Op]) -> ApplyResult:
        try:
            return super().apply_sync(model, node_id, dp_rank, ops)
        finally:  # even after an error part-way: the worker's replay stops at the same op
            self._logged(("apply_sync", model, node_id, dp_rank, _portable(ops)))

    def clear_sync(self, model: str, node_id: str, dp_rank: int) -> int:
        try:
            return super().clear_sync(model, node_id, dp_rank)
        finally:
            self._logged(("clear_sync", model, node_id, dp_rank))

    def remove_node_sync(self, node_id: str) -> None:
        try:
            super().remove_node_sync(node_id)
        finally:
            self._logged(("remove_node_sync", node_id))

    def replace_node_sync(self, model: str, node_id: str, dp_rank: int, hashes: Sequence[BlockHash64],
                          tiers: bytes = b"") -> None:
        try:
            super().replace_node_sync(model, node_id, dp_rank, hashes, tiers)
        finally:
            kept = array("Q", hashes) if isinstance(hashes, memoryview) else list(hashes)
            self._logged(("replace_node_sync", model, node_id, dp_rank, kept, bytes(tiers)))


def reserve_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` with ``SO_REUSEPORT``, not listening: it holds the port (and picks
    one for port 0) while the workers listen on it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host or "0.0.0.0", port))
    except OSError:
        sock.close()
        raise
    return sock


@dataclass(slots=True)
class _Worker:
    number: int
    proc: asyncio.subprocess.Process | None = None
    synced: bool = False
    """It was sent a snapshot and every frame since."""
    started: float = 0.0
    reading: asyncio.Task[None] | None = None
    """Its metrics reports (:class:`WorkerReports`)."""


def _exited(w: _Worker) -> bool:
    """``w``'s process exited, or its reports pipe closed (the same: uvloop sometimes sets no returncode
    for a killed child)."""
    assert w.proc is not None
    return w.proc.returncode is not None or (w.reading is not None and w.reading.done())


async def _exit(w: _Worker) -> None:
    """Until :func:`_exited` holds for ``w``."""
    assert w.proc is not None
    waiting = asyncio.ensure_future(w.proc.wait())
    try:
        await asyncio.wait({waiting} | ({w.reading} if w.reading is not None else set()),
                           return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()


async def _all_exit(workers: list[_Worker], timeout: float) -> list[_Worker]:
    """Wait up to ``timeout`` for every one of ``workers`` to exit; those that did not."""
    waits = [asyncio.ensure_future(_exit(w)) for w in workers]
    _, pending = await asyncio.wait(waits, timeout=timeout)
    for task in pending:
        task.cancel()
    return [w for w in workers if not _exited(w)]


class LookupWorkers:
    """The main process's side: spawns the workers, feeds them, restarts them, stops them."""

    def __init__(self, state: CoordinatorState, index: FeedIndex, engines: Engines | None, count: int,
                 host: str, port: int, main_port: int) -> None:
        self.state = state
        self.index = index
        self.engines = engines
        self.workers = [_Worker(n + 1) for n in range(count)]
        self.reports = WorkerReports(count, state.metrics.sums)
        state.metrics.registry.register(self.reports)
        self.host, self.port, self.main_port = host, port, main_port
        self.seq = 0
        self._seen = CHANGES.count
        self._extras: tuple[Any, ...] = ()
        self._flush_due = False
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        index.on_change = self._schedule

    async def start(self) -> None:
        for w in self.workers:
            await self._spawn(w)
        self._task = asyncio.get_running_loop().create_task(self._tick_loop(), name="kvcoord-lookup-workers")

    def pids(self) -> list[int]:
        return [w.proc.pid for w in self.workers if w.proc is not None]

    # --- frames ------------------------------------------------------------------------------
    def _schedule(self) -> None:
        if not self._flush_due:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:  # no loop (a write outside serve's): the next tick sends it
                return
            self._flush_due = True
            loop.call_soon(self.flush)

    def _records(self, full: bool) -> tuple[bool, dict[str, Any]]:
        """The node records changed since the last frame (None: gone), or all of them (``full``)."""
        reg = self.state.registry
        changed = CHANGES.since(self._seen)
        self._seen = CHANGES.count
        if full or changed is None or None in changed:
            return True, {rec.node_id: rec for rec in reg}
        return False, {node_id: reg.get(node_id) for node_id in changed if node_id is not None}

    def _extra(self) -> tuple[Any, ...] | None:
        """The pools' reach and publishers and the registered engines' partitions, when changed."""
        pools = self.state.pools
        parts = self.engines.partitions() if self.engines is not None else {}
        now = (dict(pools.reach), dict(pools.publishers), parts)
        if now == self._extras:
            return None
        self._extras = now
        return now

    def flush(self, *, tick: bool = False) -> None:
        """Send what changed since the last frame to every synced worker (at a tick, also heartbeats)."""
        self._flush_due = False
        calls, self.index.log = self.index.log, []
        full, records = self._records(False)
        heard = {rec.node_id: rec.last_heard for rec in self.state.registry} if tick else None
        self.seq += 1
        extra = self._extra() if tick or full else None  # a registration bumps CHANGES without a node
        data = frame(("delta", self.seq, time.monotonic(), calls, full, records, heard, extra))
        for w in self.workers:
            if w.synced and w.proc is not None and w.proc.stdin is not None:
                transport = w.proc.stdin.transport
                if transport.is_closing():  # it exited: restarted by the tick loop
                    w.synced = False
                    continue
                if transport.get_write_buffer_size() > BACKLOG_BYTES:
                    w.synced = False  # resynced by a snapshot once drained (the tick loop)
                    log.warning("lookup worker %d fell behind its feed; it gets a snapshot", w.number)
                    continue
                w.proc.stdin.write(data)

    def _snapshot(self, w: _Worker) -> None:
        """Bring ``w`` to the current state: everything pending is flushed first, then the whole index."""
        assert w.proc is not None and w.proc.stdin is not None
        self.flush()
        self.index.reclaim_sync()
        image = self.index.export_all_sync()
        records = {rec.node_id: rec for rec in self.state.registry}
        self._extras = ()
        w.proc.stdin.write(frame(("snapshot", self.seq, time.monotonic(), image, records, self._extra())))
        w.synced = True

    # --- processes ---------------------------------------------------------------------------
    async def _spawn(self, w: _Worker) -> None:
        w.started = time.monotonic()
        w.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvcoord.coordinator.lookup_worker", stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        assert w.proc.stdin is not None and w.proc.stdout is not None
        w.reading = asyncio.get_running_loop().create_task(self.reports.read(w.number, w.proc.stdout),
                                                           name=f"kvcoord-lookup-worker-{w.number}-reports")
        cfg: CoordinatorConfig = self.state.config
        w.proc.stdin.write(frame(("hello", cfg, w.number, self.host, self.port, self.main_port)))
        self._snapshot(w)

    async def _tick_loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(TICK)
            self.flush(tick=True)
            for w in self.workers:
                await self._look_after(w)

    async def _look_after(self, w: _Worker) -> None:
        proc = w.proc
        if proc is None or _exited(w):
            if time.monotonic() - w.started < RESTART_EVERY or self._stopping:
                return
            if proc is not None:
                if proc.returncode is None:  # gone, or as good as gone: make sure
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
                log.warning("lookup worker %d exited (code %s); restarting it", w.number, proc.returncode)
            self.reports.restarted(w.number)
            w.synced = False
            await self._spawn(w)
            return
        if not w.synced and proc.stdin is not None and proc.stdin.transport.get_write_buffer_size() == 0:
            self._snapshot(w)

    async def stop(self, timeout: float = 1.5) -> None:
        """SIGTERM every worker, wait up to ``timeout``, then kill what is left."""
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        live = [w for w in self.workers if w.proc is not None and not _exited(w)]
        for w in live:
            assert w.proc is not None
            with contextlib.suppress(ProcessLookupError):
                w.proc.terminate()
        left = await _all_exit(live, timeout) if live else []
        for w in left:
            assert w.proc is not None
            with contextlib.suppress(ProcessLookupError):
                w.proc.kill()
        if left:
            await _all_exit(left, 1.0)
        reading = [w.reading for w in self.workers if w.reading is not None]
        if reading:  # their pipes closed with them: the last reports are taken, then the tasks end
            _, late = await asyncio.wait(reading, timeout=1.0)
            for task in late:
                task.cancel()
