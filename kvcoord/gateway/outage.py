"""Lookup outages, for both front doors: while the coordinator (or a model's tokenizer behind it) fails,
requests are placed without the index over the last known nodes (:meth:`NodeTable.candidates
<kvcoord.gateway.nodes.NodeTable.candidates>`), the outage is logged when it starts and when it ends,
and lookups are tried again only once per ``probe_seconds``, so an outage does not cost every request a
timeout."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Outage", "Outages"]


@dataclass(slots=True)
class Outage:
    since: float
    probe_at: float
    error: Exception


class Outages:
    """Outages by key (a model, or "" for the coordinator as a whole)."""

    def __init__(self, log: logging.Logger, what: str, *, probe_seconds: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.what = what
        """How the log lines name the outage's consequence, e.g. ``placing least-loaded``."""
        self.probe_seconds = probe_seconds
        self.clock = clock
        self.current: dict[str, Outage] = {}

    def __len__(self) -> int:
        return len(self.current)

    def since(self, key: str = "") -> float | None:
        outage = self.current.get(key)
        return None if outage is None else outage.since

    def waiting(self, key: str = "") -> Outage | None:
        """The outage of ``key`` when it is not time to probe yet (skip the lookup), else None."""
        outage = self.current.get(key)
        return outage if outage is not None and self.clock() < outage.probe_at else None

    def failed(self, error: Exception, key: str = "") -> bool:
        """A lookup failed for the coordinator's sake; True when this starts an outage (logged)."""
        now = self.clock()
        outage = self.current.get(key)
        fresh = outage is None
        if outage is None:
            where = f"model {key}: " if key else ""
            self.log.warning("%scoordinator lookups failing (%s); %s until it answers again", where, error,
                             self.what)
            outage = self.current[key] = Outage(now, now, error)
        outage.probe_at, outage.error = now + self.probe_seconds, error
        return fresh

    def answered(self, key: str = "") -> bool:
        """A lookup answered; True when this ends an outage (logged)."""
        outage = self.current.pop(key, None)
        if outage is None:
            return False
        where = f"model {key}: " if key else ""
        self.log.warning("%scoordinator answering again after %.1f s; placement is prefix-aware again", where,
                         self.clock() - outage.since)
        return True
