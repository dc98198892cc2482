"""Whether the index serves, and the retry of index calls through its outages.

The first failed call marks the index down, which flips gRPC health to NOT_SERVING at once. Ingest sessions
keep their batch unacked and retry it with backoff (:meth:`IndexHealth.call`); lookups answer UNAVAILABLE.
A write that fewer replicas confirmed than ``?wait_replicas`` asks (``WriteNotReplicated``) is retried the
same way, but the index stays up: it answers correctly, only the write's durability is in doubt.
It is declared up again only after a ping *and* a generation check succeed, so a backend that came back
empty is noticed (every node is then asked for a snapshot) before anything is written to it or read from
it. A backend that came back intact resumes where it stopped.

A backend that lost its contents while up (a Redis flushed, or restarted empty between two calls) is
noticed by the next lookup or write itself: the backend raises ``IndexReset`` instead of answering from,
or writing into, the emptied keyspace (:meth:`IndexHealth.index_reset` then re-reads the generation, which
makes every node resync). The periodic generation check only catches a loss nobody touched.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from kvcoord.coordinator.metrics import Metrics
from kvcoord.coordinator.registry import NodeRecord
from kvcoord.index.base import FencedWrite, Index, IndexReset, WriteNotReplicated, ping
from kvcoord.validate import InvalidEvent

log = logging.getLogger("kvcoord.coordinator")

HealthHook = Callable[[bool], Awaitable[None]]
LogOnce = Callable[..., None]
"""``CoordinatorState.log_once``: ``(key, level, msg, *args)``."""
_T = TypeVar("_T")
RETRY_INITIAL = 0.05
RETRY_MAX = 1.0
"""Backoff bounds (seconds) of index calls retried through an outage."""


class IndexHealth:
    """The index's availability as this replica sees it. Lives on one event loop."""

    def __init__(self, index: Index, metrics: Metrics, log_once: LogOnce, *,
                 on_reset: Callable[[str], int], on_fenced: Callable[[FencedWrite, NodeRecord | None], None],
                 heard: Callable[[NodeRecord], None]) -> None:
        self.index = index
        self.metrics = metrics
        self.log_once = log_once
        self.on_reset = on_reset
        """Every node resyncs (the backend lost its contents); returns the nodes affected."""
        self.on_fenced = on_fenced
        self.heard = heard
        """Renews a node's lease while its call waits for the index."""
        self.up = True
        self.down_reason = ""
        self.generation: str | None = None
        self.on_health: HealthHook | None = None
        self._gen_lock = asyncio.Lock()
        self._probe_lock = asyncio.Lock()
        self.metrics.index_up.labels(index.backend).set(1)

    async def check_generation(self, lost: bool = False) -> None:
        """Compare the backend's generation with the last one seen; a change means it lost its data
        (``lost``: the backend said so; then a first reading counts as a change too). Reading it makes
        the backend accept the new lifetime. Raises (ConnectionError) when the backend is unreachable."""
        index = self.index
        if index.remote is None:
            return  # in-process: its contents live exactly as long as it does
        async with self._gen_lock:  # a slow stale answer must not overwrite a newer one
            gen = await index.remote.generation()
            old, self.generation = self.generation, gen
        if gen != old and (old is not None or lost):
            if not lost:
                self.metrics.index_resets.labels("generation_check").inc()
            n = self.on_reset(f"index_reset: the {index.backend} index lost its contents")
            log.warning(
                "index backend %s lost its contents (generation %s -> %s); asked %d nodes for snapshots",
                index.backend,
                old,
                gen,
                n,
            )

    async def index_reset(self, exc: IndexReset, noticed_by: str) -> None:
        """A lookup or write found the backend's contents lost (``exc``): re-read the generation at once
        (the nodes resync, and the backend accepts the new lifetime, so the next call may proceed).
        When it cannot be read, the index is down (NOT_SERVING until a probe reads it)."""
        self.metrics.index_resets.labels(noticed_by).inc()
        self.log_once(f"index-reset:{noticed_by}", logging.WARNING,
                      "index %s noticed by a %s: %s (logged once per kind)", self.index.backend, noticed_by,
                      exc)
        try:
            await self.check_generation(lost=True)
        except Exception as e:
            await self.down(f"generation check after a reset failed: {e}")

    async def _set_up(self, up: bool) -> None:
        if up == self.up:
            return
        self.up = up
        if up:
            log.warning("index backend %s is up again", self.index.backend)
            self.down_reason = ""
        else:
            log.warning("index backend %s is DOWN (%s)", self.index.backend, self.down_reason)
        self.metrics.index_up.labels(self.index.backend).set(1 if up else 0)
        if self.on_health is not None:
            await self.on_health(up)

    async def down(self, reason: str) -> None:
        """An index call failed for lack of a backend: NOT_SERVING until a probe succeeds."""
        if self.up:
            self.down_reason = reason
        await self._set_up(False)

    async def probe(self) -> bool:
        """True when the index serves. When it was down: ping, then check its generation (a backend
        back empty makes every node resync before anything else touches it), then SERVING again."""
        if self.up:
            return True
        async with self._probe_lock:
            if self.up:
                return True
            try:
                async with asyncio.timeout(2.0):  # not wait_for: the refresh loop runs this (kvcoord.waits)
                    ok = await ping(self.index)
                if ok:
                    await self.check_generation()
            except Exception as exc:
                log.debug("index probe failed: %s", exc)
                return False
            if ok:
                await self._set_up(True)
            return ok

    async def check(self, timeout: float) -> None:
        """The refresh loop's health check: ping a serving index (and check its generation), probe a
        down one."""
        if not self.up:
            await self.probe()
            return
        try:
            async with asyncio.timeout(timeout):
                up = await ping(self.index)
        except Exception:
            up = False
        if not up:
            await self.down("ping failed")
            return
        try:
            await self.check_generation()
        except Exception as exc:
            await self.down(f"generation check failed: {exc}")

    async def call(self, fn: Callable[[], Awaitable[_T]], what: str, keep_alive: NodeRecord | None,
                   still_wanted: Callable[[], bool] | None = None) -> tuple[bool, _T | None]:
        """Run an index call, retrying through outages with backoff until it succeeds.

        ``InvalidEvent`` propagates (bad input, never retried). Any other failure marks the index
        down and retries once a probe says it is back; meanwhile ``keep_alive``'s lease is renewed
        (its stream is open, it is the coordinator that stalls it). ``still_wanted`` is asked before
        each retry; when it says no (e.g. the backend came back empty and the node now resyncs, or the
        stream was superseded) the call is abandoned: returns ``(False, None)``. So is a write the
        backend refused because another replica took the node over (fencing): see ``on_fenced``.
        A write the backend refused because it lost its contents (``IndexReset``, nothing applied) makes
        the generation be re-read (the nodes resync) and is retried with the same backoff while still
        wanted: it cannot spin, and a write of a node now resyncing is abandoned (a snapshot follows).
        """
        backoff = RETRY_INITIAL
        while True:
            try:
                return True, await fn()
            except (asyncio.CancelledError, InvalidEvent):
                raise
            except FencedWrite as exc:
                self.on_fenced(exc, keep_alive)
                return False, None
            except IndexReset as exc:
                await self.index_reset(exc, "write")
            except WriteNotReplicated as exc:
                # Applied on the primary, not confirmed by its replicas: unacked and retried (idempotent)
                # with the backoff below, but health stays up (lookups answer; only durability is short),
                # so the probe there passes at once.
                self.log_once("index-wait-short", logging.WARNING, "index %s: %s; keeping the work unacked "
                              "and retrying (logged once)", what, exc)
            except Exception as exc:
                self.log_once(
                    f"index-fail:{type(exc).__name__}",
                    logging.WARNING,
                    "index %s failed (%s: %s); keeping the work unacked and retrying (logged once per kind)",
                    what,
                    type(exc).__name__,
                    exc,
                )
                await self.down(f"{type(exc).__name__}: {exc}")
            while True:
                if keep_alive is not None:
                    self.heard(keep_alive)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, RETRY_MAX)
                if still_wanted is not None and not still_wanted():
                    return False, None
                if await self.probe():
                    break
            if still_wanted is not None and not still_wanted():
                return False, None
