"""What a front door knows of the engines, shared by ``kvcoord route`` and ``kvcoord epp``: the node table
(node id → serving address, model, ranks and last load, from the coordinator's ``ListNodes`` with static
``--backend`` addresses winning), refreshed periodically, and the requests the front door itself has in
flight per node.

The table never forgets a node it saw listed: a restarted coordinator briefly lists nobody (its agents
are reconnecting), and a coordinator shutting down may answer one last empty list; emptying the table
then left the degraded placement with no node at all (503s). So placement without a lookup uses the
nodes the last answer listed, and when it listed none of the model's, every node ever listed (by
``ListNodes`` or named in a lookup answer).

In-flight counts matter because reported load lags: a burst placed in one millisecond is invisible to
the engine's metrics, so policies see the larger of what the engine reports and what this front door
has open there.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Generic, TypeVar

from kvcoord.coordinator.pools import POOL_PREFIX
from kvcoord.load import NodeLoad
from kvcoord.roles import PREFILL
from kvcoord.router.answer import Candidate
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError, NodeStatus

__all__ = ["ROUTABLE_STATES", "InFlight", "KnownNode", "NodeTable", "Prefill"]

ROUTABLE_STATES = frozenset({"active", "resyncing", "hash_mismatch"})
"""Node states that still serve requests (their index entries may be stale; their engine is not)."""

UNLISTED_AFTER = 2
"""``ListNodes`` answers in a row that must leave a node out before it counts as unlisted."""

K = TypeVar("K", bound=Hashable)


@dataclass(slots=True)
class KnownNode:
    node_id: str
    serving_url: str = ""
    """As the coordinator last listed it (its agent's ``--serving-url``)."""
    static: str = ""
    """The ``--backend`` address; it wins over ``serving_url``."""
    model: str = ""
    """Model the coordinator lists it under ("" for a static backend it never listed: any model)."""
    listed: bool = False
    """In the coordinator's recent ``ListNodes`` answers, in a routable state. Listed in another state, it
    is out at once; left out, only after ``UNLISTED_AFTER`` answers in a row (a coordinator shutting down
    may answer one list that misses nodes whose streams it already closed)."""
    absent: int = 0
    """``ListNodes`` answers in a row that left it out."""
    ranks: set[int] = field(default_factory=set)
    load: dict[int, NodeLoad] = field(default_factory=dict)
    """Last load the coordinator reported, per dp rank."""
    role: str = ""
    """Its P/D role as ListNodes last showed it (``prefill``, ``decode``, ``both``; "" none)."""

    @property
    def address(self) -> str:
        return self.static or self.serving_url

    def serves(self, model: str | None) -> bool:
        return not (model and self.model and self.model != model)


class NodeTable:
    """Node id → :class:`KnownNode`. Single event loop: no locks."""

    def __init__(self, static: Mapping[str, str], log: logging.Logger) -> None:
        self.static = dict(static)
        self.nodes: dict[str, KnownNode] = {n: KnownNode(n, static=addr, ranks={0})
                                            for n, addr in self.static.items()}
        self.log = log
        self._failing = False
        self.roles_declared = False
        """Some node's role is ``prefill``: P/D pools may come from roles (:meth:`roles`)."""

    def learn(self, node_id: str, serving_url: str, model: str, ranks: Iterable[int],
              load: Mapping[int, NodeLoad] | None = None, *, answered: bool = False) -> KnownNode:
        """What the coordinator says of a node (in a listing or a lookup answer). ``answered``: a lookup
        answer named it, so it is live now: listed, as newer news than the last ``ListNodes`` (a node that
        joined after it would otherwise be left out of placements without a lookup)."""
        node = self.nodes.setdefault(node_id, KnownNode(node_id))
        if answered:
            node.listed, node.absent = True, 0
        if serving_url:
            node.serving_url = serving_url.rstrip("/")
        node.model = model or node.model
        node.ranks.update(ranks)
        if load:
            node.load.update(load)
        return node

    def update(self, nodes: Iterable[NodeStatus]) -> None:
        """A whole ``ListNodes`` answer. Nodes it leaves out, or lists in a state that serves nothing, are
        not listed now, but kept (see the module's docstring)."""
        seen, present = set(), set()
        for n in nodes:
            present.add(n.node_id)
            if n.state in ROUTABLE_STATES and not n.node_id.startswith(POOL_PREFIX):  # a pool's publisher
                ranks = n.dp_ranks or (0,)
                node = self.learn(n.node_id, n.serving_url, n.model, ranks, dict.fromkeys(ranks, n.load))
                node.role = n.role
                seen.add(n.node_id)
        for node_id, node in self.nodes.items():
            if node_id in seen:
                node.listed, node.absent = True, 0
            elif node_id in present:  # listed in a state that serves nothing: out at once
                node.listed = False
            else:
                node.absent += 1
                node.listed = node.listed and node.absent < UNLISTED_AFTER
        self.roles_declared = any(n.role == PREFILL for n in self.nodes.values())

    def roles(self, model: str | None) -> list[tuple[str, str]]:
        """(node id, role) of the nodes serving ``model`` now (:meth:`serving`): what P/D pools are made
        of without flags (:func:`kvcoord.gateway.disagg.pools_of`); none while no node is ``prefill``."""
        if not self.roles_declared:
            return []
        return [(n.node_id, n.role) for n in self.serving(model)]

    def serving(self, model: str | None, *, usable: Callable[[KnownNode], bool] = lambda n: True,
                ever: bool = True) -> list[KnownNode]:
        """Nodes to place ``model``'s requests on without a lookup (any model for ``None``): the usable
        ones listed now, or when none is, every usable one ever listed (``ever``); static backends always,
        unless listed under another model."""
        known = [n for _, n in sorted(self.nodes.items())
                 if not n.static and n.address and n.serves(model) and usable(n)]
        dynamic = [n for n in known if n.listed] or (known if ever else [])
        static = [n for _, n in sorted(self.nodes.items())
                  if n.static and (n.serves(model) or not n.listed) and usable(n)]
        return dynamic + static

    def only_model(self) -> str | None:
        """The one model the listed nodes serve; None when they serve none or several."""
        models = {n.model for n in self.nodes.values() if n.listed and n.model}
        return models.pop() if len(models) == 1 else None

    def candidates(self, model: str | None, *, exclude: Iterable[str] = (), ever: bool = True,
                   usable: Callable[[KnownNode], bool] = lambda n: True) -> list[Candidate]:
        """:meth:`serving` nodes not in ``exclude`` as candidates holding nothing, one per dp rank, with
        their last reported load."""
        skip = set(exclude)
        return [Candidate(n.node_id, rank, 0, (), n.load.get(rank, NodeLoad()), serving_url=n.address)
                for n in self.serving(model, usable=usable, ever=ever) if n.node_id not in skip
                for rank in sorted(n.ranks or {0})]

    async def refresh(self, client: AsyncCoordinatorClient) -> bool:
        """One ``ListNodes``; False when it failed (logged once per run of failures, the table kept)."""
        try:
            nodes = await client.list_nodes()
        except CoordinatorError as exc:
            if not self._failing:
                self.log.warning("ListNodes failed (%s): keeping the %d nodes known so far", exc,
                                 len(self.nodes))
            self._failing = True
            return False
        self.update(nodes)
        if self._failing:
            self.log.warning("ListNodes answers again: %d nodes listed",
                             sum(n.listed for n in self.nodes.values()))
        self._failing = False
        return True

    async def run(self, client: AsyncCoordinatorClient, interval: float,
                  then: Callable[[bool], Awaitable[None]] | None = None) -> None:
        """:meth:`refresh` every ``interval`` seconds until cancelled; ``then(ok)`` after each."""
        while True:
            await asyncio.sleep(interval)
            ok = await self.refresh(client)
            if then is not None:
                await then(ok)


class Prefill(Generic[K]):
    """One request's prompt tokens, counted as queued prefill on its node from placement until its first
    byte comes back, or until the cost model says the prefill is done (``seconds``), whichever is first.
    The second bound matters for non-streaming answers, whose first byte comes only after decoding:
    counted until then, a node busy decoding would look busy prefilling, and placement would shun the
    holder of a prefix for load it does not have. :meth:`done` is idempotent."""

    __slots__ = ("_key", "_then", "_timer", "_tokens", "_work")

    def __init__(self, work: InFlight[K], key: K, tokens: int, seconds: float = 0.0,
                 then: Callable[[], None] | None = None) -> None:
        self._work, self._key, self._tokens = work, key, tokens
        self._then = then
        """Called once at :meth:`done` (the router's reservation: prefill done)."""
        self._timer: asyncio.TimerHandle | None = None
        if tokens and seconds > 0:
            self._timer = asyncio.get_running_loop().call_later(seconds, self.done)

    def done(self) -> None:
        if self._then is not None:
            then, self._then = self._then, None
            then()
        if self._tokens:
            self._work.prefilled(self._key, self._tokens)
            self._tokens = 0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class InFlight(Generic[K]):
    """Requests this front door has open per key (node or endpoint), and the prompt tokens it sent
    there that have not produced a first byte yet."""

    def __init__(self) -> None:
        self._open: dict[K, int] = {}
        self._prefill: dict[K, int] = {}

    def begin(self, key: K, prefill_tokens: int = 0) -> None:
        self._open[key] = self._open.get(key, 0) + 1
        if prefill_tokens:
            self._prefill[key] = self._prefill.get(key, 0) + prefill_tokens

    def prefilled(self, key: K, prefill_tokens: int) -> None:
        """The first byte came back: the request's prefill is done."""
        self._prefill[key] = max(0, self._prefill.get(key, 0) - prefill_tokens)

    def pending(self, key: K) -> int:
        """Prompt tokens sent to ``key`` and still counted as being prefilled."""
        return self._prefill.get(key, 0)

    def end(self, key: K) -> None:
        self._open[key] = max(0, self._open.get(key, 0) - 1)

    def counts(self) -> dict[K, int]:
        """Per key ever begun (zeros included)."""
        return dict(self._open)

    def merged(self, key: K, reported: NodeLoad, others: NodeLoad | None = None) -> NodeLoad:
        """``reported`` with at least the requests open here, and at least the prefill sent from here,
        plus ``others``: what other routers reserved there (their in-flight requests and prefill)."""
        own, prefill = self._open.get(key, 0), self._prefill.get(key, 0)
        if others is not None:
            own, prefill = own + others.in_flight, prefill + others.prefill_tokens
        if own <= reported.in_flight and prefill <= reported.prefill_tokens:
            return reported
        total = max(reported.in_flight, own)
        return replace(reported, running_requests=total - reported.waiting_requests,
                       prefill_tokens=max(reported.prefill_tokens, prefill))
