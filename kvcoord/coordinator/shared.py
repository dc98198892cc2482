"""What coordinator replicas share about nodes, so that any replica answers a lookup like the others.

The index lives in Redis, but liveness (lease), state (resyncing, draining, ...) and load live in the
registry of the replica that owns the node's ingest stream. A replica without the stream would
otherwise filter the node out. So each replica publishes its nodes to a :class:`NodeDirectory`
(one Redis hash, ``{<prefix>}:nodes``: node id -> a small JSON record) and reads the others' records
back every :data:`REFRESH_SECONDS`. The lease is carried as a wall-clock *deadline*, so a replica that
dies leaves records that expire on their own.

Ownership: a record names the replica that wrote it, its fencing token for the node and when it last
heard the node. A write only replaces a record of the same owner or one it outranks (a lower token, or
without tokens an earlier heard; one Lua script, atomic), so a replica holding a stale record of a
node that moved to another replica cannot overwrite the new owner's record.

Fencing: a record also carries the owner's fencing token for the node (see
:meth:`kvcoord.index.base.Index.claim`). Any replica that reads a record long past its deadline, of a
node it does not hold, reclaims the node's entries with that token: the backend removes them only if
nobody claimed the node since (``CoordinatorState._reclaim_dead``).

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

from kvcoord.coordinator.registry import ACTIVE, HASH_MISMATCH
from kvcoord.index.uri import IndexSpec, parse_index_uri
from kvcoord.load import EXACT, NodeLoad

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


_PUBLISH_LUA = r"""
for i = 1, #ARGV, 5 do
  local cur = redis.call('HGET', KEYS[1], ARGV[i])
  local write = true
  if cur then
    local ok, c = pcall(cjson.decode, cur)
    if ok and type(c) == 'table' and c.owner ~= ARGV[i + 1] then
      local cf, f = tonumber(c.fence or 0) or 0, tonumber(ARGV[i + 3])
      if cf > 0 and f > 0 and cf ~= f then
        write = f > cf
      else
        write = not (tonumber(c.heard or 0) > tonumber(ARGV[i + 2]))
      end
    end
  end
  if write then redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 4]) end
end
return 1
"""

class RedisDirectory:
    """The directory as one Redis hash (one key: on a Cluster it lives on one shard, which is fine for
    a few thousand small records read twice a second)."""

    def __init__(self, client: Any, key: str) -> None:
        self._r = client
        self.key = key
        self._script = client.register_script(_PUBLISH_LUA)

    @classmethod
    def from_uri(cls, uri: str, *, key_prefix: str = "kvcoord") -> RedisDirectory:
        return cls.from_spec(parse_index_uri(uri, key_prefix=key_prefix))

    @classmethod
    def from_spec(cls, spec: IndexSpec) -> RedisDirectory:
        if spec.redis is None:
            raise ValueError(f"index URI {spec.uri!r} is not a Redis one")
        return cls(spec.redis.client(), f"{{{spec.key_prefix}}}:nodes")

    async def publish(self, nodes: Sequence[SharedNode]) -> None:
        if not nodes:
            return
        args: list[object] = []
        for n in nodes:
            args += [n.node_id, n.owner, repr(n.heard), str(n.fence), n.encode()]
        try:
            await self._script(keys=[self.key], args=args)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc

    async def fetch_all(self) -> dict[str, SharedNode]:
        try:
            raw: dict[bytes, bytes] = await self._r.hgetall(self.key)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc
        out: dict[str, SharedNode] = {}
        stale: list[bytes] = []
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
                await self._r.hdel(self.key, *stale)
            except Exception:
                log.debug("deleting stale node records failed", exc_info=True)
        return out

    async def fetch(self, node_id: str) -> SharedNode | None:
        try:
            raw = await self._r.hget(self.key, node_id)
        except Exception as exc:
            raise ConnectionError(f"node directory: {exc}") from exc
        if raw is None:
            return None
        try:
            return SharedNode.decode(raw)
        except (ValueError, KeyError, TypeError, IndexError):
            return None

    async def close(self) -> None:
        try:
            await self._r.aclose()
        except Exception:
            log.debug("closing the node directory failed", exc_info=True)


def open_directory(spec: IndexSpec) -> NodeDirectory | None:
    """The directory that goes with an index: Redis for ``redis://``/``redis+cluster://``, else None."""
    if spec.redis is not None:
        return RedisDirectory.from_spec(spec)
    return None
