"""Whether ``kvcoord route`` is ready for traffic (``GET /health``: 200, or 503 with the reason), and the
warm-up that makes a fresh fleet's first requests prefix-aware.

A fresh router's first lookups used to miss the placement deadline (50 ms) and go least-loaded: the lookup
channel connected within the first request's deadline, and the coordinator opened the model's tokenizer
(an engine's ``/tokenize``: a new connection) within it too. So before it reports ready the router looks
up one short prompt and one chat per model it serves (``--model``, and every model ``ListNodes`` names,
as they appear), with the RPC timeout rather than the deadline: the channel is connected and the
coordinator's tokenizer warm when the first client request comes.

Not ready, with the reason in ``/health``, while:

* the coordinator never answered this router (it knows no engine then, unless given ``--backend``); a
  coordinator lost later leaves the router ready, placing least-loaded visibly (:mod:`.outage`);
* the coordinator refuses its token (UNAUTHENTICATED, PERMISSION_DENIED): definitive until the token or
  the coordinator's configuration changes, so one ERROR line, and the check is repeated;
* a model's warm-up lookups have not been answered yet.

A model whose tokenizer fails, or that the coordinator refuses (no profile, no tokenizer), counts as warm:
its requests are placed least-loaded with their reason, which is no cause to take the router out.
``GET /live`` answers 200 while the process runs, for liveness probes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from kvcoord.router.client import CoordinatorError
from kvcoord.router.http_lookup import LookupClient
from kvcoord.transport import TOKENIZER_CAUSE

from .outage import is_outage
from .route_place import AUTH_REFUSALS, Placer

__all__ = ["Readiness"]

log = logging.getLogger("kvcoord.route")

WARM_QUERIES = ({"prompt": "kvcoord route warm-up"},
                {"messages": [{"role": "user", "content": "kvcoord route warm-up"}]})
"""What a model is warmed with: the completion and the chat path (their tokenizer calls differ)."""


class Readiness:
    """Warm-up and readiness of one router; :meth:`run` until cancelled. Single event loop."""

    def __init__(self, client: LookupClient | None, placer: Placer,
                 models: Callable[[], Iterable[str]], *, timeout: float, pause: float) -> None:
        self.client = client
        self.placer = placer
        self.models = models
        """The models this router serves now (``--model`` and those ListNodes names)."""
        self.timeout = timeout
        self.pause = pause
        self.answered = client is None
        """The coordinator answered this router at least once (or there is none)."""
        self.warm: set[str] = set()
        self.waiting = "waiting for the coordinator's first answer"
        self._said_waiting = False

    def cold(self) -> list[str]:
        """Models not warmed yet (none when the policy asks no lookup)."""
        if self.client is None or not self.placer.policy.uses_index:
            return []
        return sorted({m for m in self.models() if m} - self.warm)

    def state(self) -> tuple[bool, str, str]:
        """``(ready, status, reason)``: status ``ok``, ``starting`` or ``unauthorized``."""
        refused = self.placer.refused
        if refused is not None:
            return False, "unauthorized", f"the coordinator refuses this router's token ({refused})"
        if not self.answered:
            return False, "starting", self.waiting
        cold = self.cold()
        if cold:
            return False, "starting", f"warming up lookups of model {', '.join(cold)}"
        return True, "ok", ""

    async def run(self) -> None:
        while True:
            await self.once()
            self.placer.metrics.ready.set(1 if self.state()[0] else 0)
            await asyncio.sleep(self.pause)

    async def once(self) -> None:
        """Warm the cold models, or check the token when nothing is cold and it was refused or never
        answered; records the outcome."""
        if self.client is None:
            return
        cold = self.cold()
        try:
            if not cold and not (self.answered and self.placer.refused is None):
                await self._probe()
            for model in cold:
                await self._warm(model)
        except CoordinatorError as exc:
            self._not_answered(exc)
            return
        self._answer(cold)

    async def _probe(self) -> None:
        """One cheap authenticated call: a lookup of no blocks when a model is known (it needs the router
        role, as placement does), else a Ping."""
        assert self.client is not None
        model = next(iter(sorted(m for m in self.models() if m)), None)
        try:
            if model is None:
                await self.client.ping(timeout=self.timeout)
            else:
                await self.client.lookup(model, hashes=[], timeout=self.timeout)
        except CoordinatorError as exc:
            if _kind(exc) != "answer":
                raise

    async def _warm(self, model: str) -> None:
        assert self.client is not None
        for query in WARM_QUERIES:
            try:
                await self.client.lookup(model, timeout=self.timeout, **query)
            except CoordinatorError as exc:
                if _kind(exc) != "answer":
                    raise
                log.info("route: warm-up lookup of model %s answered %s; its requests are placed as "
                         "such answers say", model, exc)
                break
        self.warm.add(model)

    def _not_answered(self, exc: CoordinatorError) -> None:
        if _kind(exc) == "auth":
            if self.placer.refused is None:
                log.error("route: the coordinator refuses this router's token (%s); /health reports not "
                          "ready until it accepts it", exc)
            self.placer.refused = exc
            return
        self.waiting = f"waiting for the coordinator's answer ({exc})"
        if not self.answered and not self._said_waiting:
            self._said_waiting = True
            log.warning("route: the coordinator does not answer yet (%s); /health reports not ready until "
                        "it does", exc)

    def _answer(self, warmed: list[str]) -> None:
        if self.placer.refused is not None:
            log.warning("route: the coordinator accepts this router's token again")
            self.placer.refused = None
        first = not self.answered
        self.answered = True
        if first or warmed:
            log.info("route: ready%s", f" (lookups warm for model {', '.join(warmed)})" if warmed else "")


def _kind(exc: CoordinatorError) -> str:
    """``auth`` (the token is refused), ``outage`` (no answer), or ``answer`` (the coordinator answered,
    refusing this query or failing in its tokenizer)."""
    code = str(getattr(exc.code, "name", exc.code))
    if code in AUTH_REFUSALS:
        return "auth"
    if exc.cause != TOKENIZER_CAUSE and is_outage(exc.code):
        return "outage"
    return "answer"
