"""Lookup outages, for both front doors: while the coordinator (or a model's tokenizer behind it) fails,
requests are placed without the index over the last known nodes (:meth:`NodeTable.candidates
<kvcoord.gateway.nodes.NodeTable.candidates>`), the outage is logged when it starts and when it ends,
and lookups are tried again only once per ``probe_seconds``, so an outage does not cost every request a
timeout. :func:`is_outage` is the one rule, for both, of which lookup errors are an outage."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["REFUSAL_CODES", "Outage", "Outages", "is_outage"]

REFUSAL_CODES = frozenset({"INVALID_ARGUMENT", "OUT_OF_RANGE", "NOT_FOUND", "FAILED_PRECONDITION",
                           "UNIMPLEMENTED", "RESOURCE_EXHAUSTED", "UNAUTHENTICATED", "PERMISSION_DENIED",
                           "ALREADY_EXISTS", "ABORTED"})
"""The gRPC status codes that refuse one request rather than fail the coordinator (:func:`is_outage`)."""


def is_outage(code: object) -> bool:
    """Whether a failed lookup's gRPC status ``code`` (a ``grpc.StatusCode`` or its name) is an outage.

    The rule is the HTTP one an operator already knows: 5xx means the server failed, 4xx that it refused.
    An outage is a coordinator that did not answer: unreachable, shutting down, its index or tokenizer
    down (UNAVAILABLE, which gRPC also gives for a proxy's 502/503/504), slower than the deadline
    (DEADLINE_EXCEEDED), the call torn down under us (CANCELLED), or broken (UNKNOWN, as gRPC maps a
    proxy's 500 or a server exception; INTERNAL, a protocol error or a failed index match; DATA_LOSS).
    These pass by themselves and concern every request, so placement goes least-loaded visibly until a
    probe gets an answer. Every other code is an answer that refuses this request, or this router's
    credentials: a bad prompt (INVALID_ARGUMENT, OUT_OF_RANGE), a model without a profile or tokenizer
    (NOT_FOUND, FAILED_PRECONDITION), a query kind it lacks (UNIMPLEMENTED), an answer too large
    (RESOURCE_EXHAUSTED), a wrong token (UNAUTHENTICATED, PERMISSION_DENIED). Waiting does not change
    those, and they must not stop other requests' lookups: the request is placed least-loaded, counted,
    and logged once. A code this rule does not know counts as an outage, like UNKNOWN."""
    return str(getattr(code, "name", code)) not in REFUSAL_CODES


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
