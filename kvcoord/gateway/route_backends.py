"""What ``kvcoord route`` knows of its engines: node id -> serving URL (the shared
:class:`~kvcoord.gateway.nodes.NodeTable`), its own in-flight work per node, and which nodes just failed.

URLs come from two places. Agents announce their engine's serving URL (``kvcoord agent --serving-url``),
so lookup answers and ``ListNodes`` carry it; ``--backend NODE=URL`` gives it statically and wins. The
router's own counts matter because reported load lags: a burst placed in one millisecond is invisible to
the engine's metrics, so the policy sees ``max(reported, routed here)``. A node that refused a connection
or died mid-stream is *suspect* until its ``/health`` answers again, and is left out meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from kvcoord.index.base import NodeKey
from kvcoord.load import NodeLoad
from kvcoord.router.answer import Candidate
from kvcoord.router.client import NodeStatus
from kvcoord.validate import valid_url

from .nodes import InFlight, KnownNode, NodeTable, Prefill

__all__ = ["Backends", "parse_backend"]

log = logging.getLogger("kvcoord.route")


def parse_backend(spec: str) -> tuple[str, str]:
    """``NODE=URL`` as ``(node_id, url)``."""
    node, eq, url = spec.partition("=")
    if not eq or not node.strip():
        raise ValueError(f"{spec!r} is not NODE=URL (e.g. node-a=http://10.0.0.5:8000)")
    return node.strip(), valid_url(url)


class Backends:
    """The router's view of the engines: the shared node table (URLs), its own in-flight work per node
    and rank, and which nodes are suspect. Single event loop: no locks."""

    def __init__(self, static: Mapping[str, str] | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.table = NodeTable({n: valid_url(u) for n, u in (static or {}).items()}, log)
        self.work: InFlight[NodeKey] = InFlight()
        self._suspect: dict[str, tuple[float, str]] = {}

    # ------------------------------------------------------------------ learning
    def listed(self, nodes: Iterable[tuple[str, str, str, tuple[int, ...], NodeLoad]]) -> None:
        """A whole ``ListNodes`` answer of ``(node_id, url, model, ranks, load)`` of routable nodes."""
        self.table.update(NodeStatus(node_id, model, ranks, "active", 0, 0, 0.0, load, False, "", None,
                                     serving_url=url) for node_id, url, model, ranks, load in nodes)

    def url(self, node_id: str) -> str:
        node = self.table.nodes.get(node_id)
        return node.address if node is not None else ""

    def urls(self) -> dict[str, str]:
        """Every node with a URL, suspect or not."""
        return {n: node.address for n, node in sorted(self.table.nodes.items()) if node.address}

    def multi_rank(self, node_id: str) -> bool:
        node = self.table.nodes.get(node_id)
        return node is not None and len(node.ranks) > 1

    # ------------------------------------------------------------------ health
    def mark_failed(self, node_id: str, reason: str) -> bool:
        """Leave ``node_id`` out until its ``/health`` answers; True when it was healthy until now."""
        if node_id not in self.table.nodes:
            return False
        since = self._suspect.get(node_id, (self.clock(), ""))[0]
        fresh = node_id not in self._suspect
        self._suspect[node_id] = (since, reason)
        return fresh

    def mark_healthy(self, node_id: str) -> bool:
        """True when it was suspect until now."""
        return self._suspect.pop(node_id, None) is not None

    def suspect(self) -> dict[str, str]:
        """Suspect nodes and why."""
        return {n: reason for n, (_, reason) in self._suspect.items()}

    def is_suspect(self, node_id: str) -> bool:
        return node_id in self._suspect

    def _usable(self, node: KnownNode) -> bool:
        return bool(node.address) and node.node_id not in self._suspect

    # ------------------------------------------------------------------ in-flight work
    def begin(self, key: NodeKey, prefill_tokens: int, prefill_s_per_token: float = 0.0,
              then: Callable[[], None] | None = None) -> Prefill[NodeKey]:
        """A request placed on ``key``: open, and its uncached prompt tokens queued for prefill until the
        returned handle is done (at the first byte, or at the latest once the node could have prefilled
        what was queued ahead plus these tokens at ``prefill_s_per_token``; 0: at the first byte)."""
        ahead = self.work.pending(key)
        self.work.begin(key, prefill_tokens)
        return Prefill(self.work, key, prefill_tokens, prefill_s_per_token * (ahead + prefill_tokens), then)

    def end(self, key: NodeKey) -> None:
        self.work.end(key)

    def in_flight(self) -> dict[NodeKey, int]:
        """Requests in flight per node this router ever sent to (zeros included)."""
        return self.work.counts()

    def merged_load(self, key: NodeKey, reported: NodeLoad, others: NodeLoad | None = None) -> NodeLoad:
        """``reported`` with at least the requests this router has in flight there, and the prompt tokens
        it sent there that have not produced a first byte yet, plus what ``others`` (other routers)
        reserved there."""
        return self.work.merged(key, reported, others)

    # ------------------------------------------------------------------ candidates
    def _merged(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        return [replace(c, load=self.merged_load(c.key, c.load, c.reserved)) for c in candidates]

    def routable(self, candidates: Iterable[Candidate]) -> list[Candidate]:
        """The answer's candidates that have a URL and are not suspect, with merged loads, plus every
        healthy static backend the answer does not name (holding nothing, as far as anyone knows)."""
        out: list[Candidate] = []
        named: set[str] = set()
        for c in candidates:
            named.add(c.node_id)
            if c.serving_url or c.node_id in self.table.nodes:
                self.table.learn(c.node_id, c.serving_url, "", (c.dp_rank,), {c.dp_rank: c.load},
                                 answered=True)
            if self.url(c.node_id) and not self.is_suspect(c.node_id):
                out.append(replace(c, serving_url=self.url(c.node_id)))
        static = [c for c in self.table.candidates(None, exclude=named, usable=self._usable)
                  if c.node_id in self.table.static and c.dp_rank == 0]
        return self._merged([*out, *static])

    def fallback(self, model: str) -> list[Candidate]:
        """Without a lookup: every healthy node known to serve ``model`` (see
        :meth:`~kvcoord.gateway.nodes.NodeTable.serving`: those listed now, else every one ever listed;
        static backends too), holding nothing, with merged loads."""
        return self._merged(self.table.candidates(model, usable=self._usable))
