"""Flow control for ``kvcoord epp``, after llm-d's (``llm-d/llm-d-router``, ``pkg/epp/flowcontrol`` and
``pkg/epp/requestcontrol/admission.go``): what a request asks for in its headers, and the queue a request
waits in while every eligible endpoint is saturated.

Headers (``pkg/epp/metadata/consts.go``; the current name first, then the deprecated alias, as
``GetLowerCaseHeaderValue`` reads them): the objective ``x-llm-d-inference-objective``
(``x-gateway-inference-objective``) names a priority (an InferenceObjective's ``priority`` there, a
``--objective NAME=PRIORITY`` here; unknown or absent: 0); the fairness id
``x-llm-d-inference-fairness-id`` (``x-gateway-inference-fairness-id``; absent: ``default-flow``); the queue
TTL ``x-llm-d-inference-ttl`` (a Go duration, ``2s``, ``150ms``; invalid or not positive: the default, as
llm-d ignores it); the TTFT SLO ``x-llm-d-slo-ttft-ms`` (``x-slo-ttft-ms``; milliseconds). A bad value is
counted, logged in one line, and ignored.

The queue: bands by priority, the highest served first; in a band, one FIFO per fairness id, taken in
round-robin (llm-d's ``round-robin-fairness-policy``); a request waits at most its TTL. Outcomes, with
llm-d's ``x-llm-d-request-dropped-reason`` (``pkg/common/error/error.go``, ``translateFlowControlOutcome``):
queue full 429 ``rejected-saturated``, TTL expired 429 ``rejected-ttl-expired``, no endpoint 503
``rejected-no-endpoints``, shutting down 503 ``rejected-shutting-down``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from kvcoord.waits import wait_event

__all__ = [
    "DROPPED_HEADER",
    "Dropped",
    "FlowControl",
    "RequestMeta",
    "parse_duration",
    "request_meta",
]

log = logging.getLogger("kvcoord.gateway.epp")

DROPPED_HEADER = "x-llm-d-request-dropped-reason"
OBJECTIVE = ("x-llm-d-inference-objective", "x-gateway-inference-objective")
FAIRNESS = ("x-llm-d-inference-fairness-id", "x-gateway-inference-fairness-id")
TTL = ("x-llm-d-inference-ttl",)
TTFT_SLO = ("x-llm-d-slo-ttft-ms", "x-slo-ttft-ms")
DEFAULT_FAIRNESS_ID = "default-flow"

SATURATED = "rejected-saturated"
TTL_EXPIRED = "rejected-ttl-expired"
NO_ENDPOINTS = "rejected-no-endpoints"
SHUTTING_DOWN = "rejected-shutting-down"

T = TypeVar("T")


class Dropped(Exception):
    """A request flow control will not dispatch: the HTTP status, a metrics reason, llm-d's dropped reason."""

    def __init__(self, status: int, reason: str, dropped: str, message: str) -> None:
        super().__init__(message)
        self.status, self.reason, self.dropped, self.message = status, reason, dropped, message


@dataclass(frozen=True, slots=True)
class RequestMeta:
    """What one request's headers ask of the picker."""

    objective: str = ""
    priority: int = 0
    fairness_id: str = DEFAULT_FAIRNESS_ID
    ttl: float | None = None
    """Seconds it may wait in the queue (None: the picker's ``--queue-ttl``)."""
    ttft_slo: float | None = None
    """Seconds; endpoints predicted slower are left out while any meets it."""
    bad: tuple[str, ...] = field(default=())
    """Header names whose values were ignored (counted by the caller)."""


_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)")
_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float | None:
    """A Go ``time.ParseDuration`` string (``1h2m``, ``1.5s``, ``300ms``) in seconds; None when malformed."""
    text = text.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if not body:
        return None
    if body == "0":
        return 0.0
    pos, total = 0, 0.0
    while pos < len(body):
        m = _DURATION.match(body, pos)
        if m is None:
            return None
        total += float(m.group(1)) * _UNIT[m.group(2)]
        pos = m.end()
    return sign * total if total < 1e9 else None


def _first(headers: Mapping[str, str], names: tuple[str, ...]) -> tuple[str, str] | None:
    for name in names:
        if name in headers:
            return name, headers[name]
    return None


def request_meta(headers: Mapping[str, str], objectives: Mapping[str, int]) -> RequestMeta:
    """The flow control and SLO headers of a request (``headers`` lower-cased)."""
    bad: list[str] = []
    objective = (_first(headers, OBJECTIVE) or ("", ""))[1].strip()
    fairness = (_first(headers, FAIRNESS) or ("", ""))[1].strip()[:128] or DEFAULT_FAIRNESS_ID
    ttl: float | None = None
    got = _first(headers, TTL)
    if got is not None:
        ttl = parse_duration(got[1])
        if ttl is None or ttl <= 0:
            bad.append(got[0])
            ttl = None
    slo: float | None = None
    got = _first(headers, TTFT_SLO)
    if got is not None:
        try:
            slo = float(got[1].strip()) / 1000.0
        except ValueError:
            slo = None
        if slo is None or not 0 < slo < 1e7:
            bad.append(got[0])
            slo = None
    return RequestMeta(objective, objectives.get(objective, 0), fairness, ttl, slo, tuple(bad))


@dataclass(eq=False, slots=True)
class _Waiter:
    meta: RequestMeta
    woken: asyncio.Event = field(default_factory=asyncio.Event)


class FlowControl:
    """Priority bands of per-fairness-id FIFOs, for the requests no endpoint can take yet.

    A request whose band or a higher one has waiters queues behind them; otherwise it is tried at once.
    When it is shed (every eligible endpoint saturated) it queues, up to ``max_queued`` requests in all
    (0: none, the 429 at once). :meth:`wake` (a stream ended, the node list refreshed) dispatches one
    waiter: the highest band, the next fairness id in turn, the oldest of that id; a waiter that is
    still shed goes back to the head of its FIFO."""

    def __init__(self, max_queued: int, ttl: float) -> None:
        self.max_queued = max_queued
        self.ttl = ttl
        self._bands: dict[int, dict[str, deque[_Waiter]]] = {}
        """priority -> fairness id -> FIFO; a fairness id's place in the dict is its turn (round-robin)."""
        self.queued = 0
        self.closed = False

    def _ahead(self, priority: int) -> bool:
        return any(p >= priority and any(band.values()) for p, band in self._bands.items())

    async def admit(self, meta: RequestMeta, attempt: Callable[[], Awaitable[T]],
                    shed: Callable[[BaseException], bool]) -> T:
        """``attempt()`` now, or once dispatched from the queue; ``shed(exc)`` says an exception of
        ``attempt`` means saturation (queue and retry) rather than a final answer."""
        if self.closed:
            raise Dropped(503, "shutting_down", SHUTTING_DOWN, "the endpoint picker is shutting down")
        if not self._ahead(meta.priority):
            try:
                return await attempt()
            except BaseException as exc:
                if not shed(exc) or self.max_queued == 0:
                    raise
        if self.queued >= self.max_queued:
            raise Dropped(429, "shed", SATURATED, f"every eligible endpoint is saturated and the queue "
                                                  f"holds {self.queued} requests (--max-queued)")
        waiter = _Waiter(meta)
        self._push(waiter, front=False)
        ttl = meta.ttl if meta.ttl is not None else self.ttl
        deadline = time.monotonic() + ttl
        try:
            while True:
                if not await wait_event(waiter.woken, max(0.0, deadline - time.monotonic())):
                    raise Dropped(429, "ttl_expired", TTL_EXPIRED,
                                  f"waited {ttl:g} s in the queue for a free endpoint")
                if self.closed:
                    raise Dropped(503, "shutting_down", SHUTTING_DOWN, "the endpoint picker is shutting down")
                waiter.woken.clear()
                try:
                    return await attempt()
                except BaseException as exc:
                    if not shed(exc):
                        raise
                self._push(waiter, front=True)
        finally:
            self._remove(waiter)

    def _push(self, waiter: _Waiter, *, front: bool) -> None:
        """Queue ``waiter``: last of its FIFO, or (dispatched but still shed) first again, its fairness id
        given its turn back."""
        band = self._bands.setdefault(waiter.meta.priority, {})
        fid = waiter.meta.fairness_id
        fifo = band.setdefault(fid, deque())
        if front:
            fifo.appendleft(waiter)
            self._bands[waiter.meta.priority] = {fid: fifo, **{k: v for k, v in band.items() if k != fid}}
        else:
            fifo.append(waiter)
        self.queued += 1

    def _remove(self, waiter: _Waiter) -> None:
        fifo = self._bands.get(waiter.meta.priority, {}).get(waiter.meta.fairness_id)
        if fifo is not None and waiter in fifo:
            fifo.remove(waiter)
            self.queued -= 1

    def wake(self) -> None:
        """Capacity may have freed: dispatch the next waiter (if any)."""
        for priority in sorted(self._bands, reverse=True):
            band = self._bands[priority]
            for fid in list(band):
                fifo = band.pop(fid)  # re-inserted last: the next id has the next turn
                if not fifo:
                    continue
                waiter = fifo.popleft()
                self.queued -= 1
                band[fid] = fifo
                waiter.woken.set()
                return

    def close(self) -> None:
        """Shutting down: every waiter is answered 503."""
        self.closed = True
        for band in self._bands.values():
            for fifo in band.values():
                for waiter in fifo:
                    waiter.woken.set()
