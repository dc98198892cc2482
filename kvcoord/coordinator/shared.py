"""What coordinator replicas share about nodes, so that any replica answers a lookup like the others.

The index lives in Redis, but liveness (lease), state (resyncing, draining, ...) and load live in the
registry of the replica that owns the node's ingest stream. A replica without the stream would
otherwise filter the node out. So each replica publishes its nodes to a :class:`NodeDirectory`
(the index's ``node_directory``, one Redis hash ``{<prefix>}:nodes``: node id -> a small JSON record)
and reads the others' records back every :data:`REFRESH_SECONDS`. The lease is carried as a wall-clock
*deadline*, so a replica that dies leaves records that expire on their own.

Ownership: a record names the replica that wrote it, its fencing token for the node and when it last
heard the node. A write only replaces a record of the same owner or one it outranks (a lower token, or
without tokens an earlier heard; one Lua script of ``kvcoord.index.redis``, atomic), so a replica
holding a stale record of a node that moved to another replica cannot overwrite the new owner's record.

Fencing: a record also carries the owner's fencing token for the node (see
:meth:`kvcoord.index.base.Fencing.claim`). Any replica that reads a record long past its deadline, of a
node it does not hold, reclaims the node's entries with that token: the backend removes them only if
nobody claimed the node since (``Replicas._reclaim_dead``).

The memory backend is single-process: it has no directory (``open_directory`` returns None) and the
registry alone decides, exactly as before.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcoord.coordinator.registry import ACTIVE
from kvcoord.index.base import Index, NodeRecords
from kvcoord.load import EXACT, HASH_MISMATCH, NodeLoad

log = logging.getLogger("kvcoord.coordinator.shared")

REFRESH_SECONDS = 0.5
"""How often a replica re-reads the directory (its view of other replicas' nodes lags by this)."""
PUBLISH_SECONDS = 0.1
"""How often a replica writes its changed records."""
RETAIN_SECONDS = 60.0
"""Records whose deadline passed this long ago are deleted by whichever replica reads them."""
_SERVED = (ACTIVE, HASH_MISMATCH)


@dataclass(slots=True)
class SharedNode:
    """One node as its owning replica last published it."""

    node_id: str
    model: str
    dp_ranks: tuple[int, ...]
    state: str
    epoch: int
    deadline: float
    """Wall-clock time after which the node is out of lookups unless the owner republished."""
    owner: str
    """Replica id of the publisher."""
    heard: float
    """Wall-clock time the owner last heard from the node (orders two replicas' records)."""
    load: NodeLoad = field(default_factory=NodeLoad)
    url: str = ""
    """The engine's serving URL its agent announced."""
    fence: int = 0
    """The owner's fencing token for the node (0: none yet): what a reclaim of a dead owner's node
    checks, so that it never removes a node that was claimed again since."""
    trust: str = EXACT
    """The owner's ``NodeRecord.trust`` (a record of a replica that predates it: ``exact``, what that
    replica answers)."""
    trust_reason: str = ""
    trust_cause: str = ""
    """The owner's ``Trust.cause`` (a replica that predates it: empty, a degraded node taken as before)."""
    generation: str = ""
    """The index generation the owner had accepted when it published (empty: a replica that predates
    it). A reader in another generation leaves the node out: one of the two has not yet seen the index
    lose its contents, and the node's entries (or the record's state) are from before the loss."""
    role: str = ""
    """The node's P/D role (``NodeRecord.role``; a replica that predates it: none)."""
    pools: tuple[str, ...] = ()
    """Shared pools its Hello said it reaches (a replica that predates it: none): every replica credits
    the node with those pools' blocks (:meth:`kvcoord.coordinator.pools.Pools.announce`)."""
    publisher: str = ""
    """Set: the node is that pool's storage daemon (its Hello's ``pool_publisher``), never routable."""

    def live(self, now_wall: float) -> bool:
        return self.state in _SERVED and now_wall <= self.deadline

    def outranks(self, fence: int, heard: float) -> bool:
        """Whether this record wins over another owner's with ``fence`` and ``heard``: the later claim
        (higher fencing token) when both have one, else the later heard. The token decides first
        because a stale owner woken up may hear the node later (messages it had buffered)."""
        if self.fence and fence and self.fence != fence:
            return self.fence > fence
        return self.heard > heard

    def encode(self) -> str:
        return json.dumps(
            {
                "node_id": self.node_id,
                "model": self.model,
                "dp_ranks": list(self.dp_ranks),
                "state": self.state,
                "epoch": self.epoch,
                "deadline": self.deadline,
                "owner": self.owner,
                "heard": self.heard,
                "load": [self.load.running_requests, self.load.waiting_requests, self.load.kv_usage],
                "url": self.url,
                "fence": self.fence,
                "trust": self.trust,
                "trust_reason": self.trust_reason,
                "trust_cause": self.trust_cause,
                "generation": self.generation,
                **({"role": self.role} if self.role else {}),
                **({"pools": list(self.pools)} if self.pools else {}),
                **({"publisher": self.publisher} if self.publisher else {}),
            },
            separators=(",", ":"),
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> SharedNode:
        d: dict[str, Any] = json.loads(raw)
        ld = d.get("load") or [0, 0, 0.0]
        return cls(
            node_id=str(d["node_id"]),
            model=str(d["model"]),
            dp_ranks=tuple(int(r) for r in d.get("dp_ranks", ())),
            state=str(d["state"]),
            epoch=int(d.get("epoch", 0)),
            deadline=float(d["deadline"]),
            owner=str(d["owner"]),
            heard=float(d["heard"]),
            load=NodeLoad(int(ld[0]), int(ld[1]), float(ld[2])),
            url=str(d.get("url", "")),
            fence=int(d.get("fence", 0)),
            trust=str(d.get("trust") or EXACT),
            trust_reason=str(d.get("trust_reason", "")),
            trust_cause=str(d.get("trust_cause", "")),
            generation=str(d.get("generation", "")),
            role=str(d.get("role", "")),
            pools=tuple(str(p) for p in d.get("pools", ())),
            publisher=str(d.get("publisher", "")),
        )


class NodeDirectory(Protocol):
    """Where replicas publish and read node records. Methods raise ``ConnectionError`` when down."""

    async def publish(self, nodes: Sequence[SharedNode]) -> None:
        """Write ``nodes``; a record of another owner that outranks one (``SharedNode.outranks``) is kept."""
        ...

    async def fetch_all(self) -> dict[str, SharedNode]:
        """Every record (undecodable ones skipped); records long past their deadline are deleted."""
        ...

    async def fetch(self, node_id: str) -> SharedNode | None: ...

    async def close(self) -> None: ...


class SharedDirectory:
    """The directory on a shared index's node records (the index's ``node_directory``): records are
    encoded here, and read back with the long-expired ones deleted."""

    def __init__(self, records: NodeRecords) -> None:
        self._records = records

    async def publish(self, nodes: Sequence[SharedNode]) -> None:
        await self._records.publish([(n.node_id, n.owner, n.heard, n.fence, n.encode()) for n in nodes])

    async def fetch_all(self) -> dict[str, SharedNode]:
        raw = await self._records.fetch_all()
        out: dict[str, SharedNode] = {}
        stale: list[str] = []
        cutoff = time.time() - RETAIN_SECONDS
        for k, v in raw.items():
            try:
                node = SharedNode.decode(v)
            except (ValueError, KeyError, TypeError, IndexError):
                log.debug("skipping an undecodable node record %r", k)
                continue
            if node.deadline < cutoff:
                stale.append(k)
                continue
            out[node.node_id] = node
        if stale:
            try:
                await self._records.delete(stale)
            except Exception:
                log.debug("deleting stale node records failed", exc_info=True)
        return out

    async def fetch(self, node_id: str) -> SharedNode | None:
        raw = await self._records.fetch(node_id)
        if raw is None:
            return None
        try:
            return SharedNode.decode(raw)
        except (ValueError, KeyError, TypeError, IndexError):
            return None

    async def close(self) -> None:
        """Nothing to release: the records share the index's connection, which the index closes."""


def open_directory(index: Index) -> NodeDirectory | None:
    """The directory of replicas sharing ``index`` (its ``node_directory``: Redis), else None."""
    records = index.node_directory
    return None if records is None else SharedDirectory(records)
