"""What a router remembers of its own placements: the deepest recent placement of each prefix (for
:class:`~kvcoord.router.policy.PrefixAwarePolicy`), and the blocks it routed where (for
:class:`~kvcoord.router.policy.ApproximatePolicy`, when engines publish no KV events)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence
from typing import NamedTuple

from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey


class Placement(NamedTuple):
    """What :class:`PlacementMemory` remembers of the deepest recent placement of a prefix."""

    key: NodeKey
    depth: int
    """Leading blocks of the request that were part of that placement."""
    placed_at: float
    ready_at: float
    """When the node should have reported the prefix (placement time + expected TTFT)."""


class PlacementMemory:
    """Bounded LRU of ``checkpoint block hash -> (node, placed_at, ready_at)`` for the last placements.

    Only every ``stride``-th block of a prompt and its last block are keys, so recording and recalling
    a prompt of ``n`` blocks costs ``n / stride`` dict operations, and ``capacity`` entries cover about
    ``capacity * stride`` blocks of recent traffic. ``capacity`` 0 disables it.
    """

    __slots__ = ("_map", "capacity", "stride")

    def __init__(self, capacity: int = 65_536, stride: int = 32) -> None:
        self.capacity = capacity
        self.stride = stride
        self._map: OrderedDict[int, tuple[NodeKey, float, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._map)

    def _checkpoints(self, n: int) -> list[int]:
        """Block positions used as keys, deepest first."""
        if n == 0:
            return []
        points = list(range(self.stride - 1, n, self.stride))
        if not points or points[-1] != n - 1:
            points.append(n - 1)
        points.reverse()
        return points

    def record(self, hashes: Sequence[BlockHash64], key: NodeKey, now: float, ready_at: float) -> None:
        if self.capacity == 0 or not hashes:
            return
        m = self._map
        value = (key, now, ready_at)
        for i in reversed(self._checkpoints(len(hashes))):
            h = hashes[i]
            m[h] = value
            m.move_to_end(h)
        while len(m) > self.capacity:
            m.popitem(last=False)

    def recall(self, hashes: Sequence[BlockHash64]) -> Placement | None:
        """The deepest checkpoint of ``hashes`` this memory holds, or ``None``."""
        if self.capacity == 0:
            return None
        get = self._map.get
        for i in self._checkpoints(len(hashes)):
            got = get(hashes[i])
            if got is not None:
                return Placement(got[0], i + 1, got[1], got[2])
        return None


class RoutedPrefixMemory:
    """What a router without KV events believes nodes cache: the blocks it routed there, for ``ttl`` s.

    One ``hash -> expiry`` map per node. A node "holds" a block until ``ttl`` seconds after the last
    request containing it was routed there (like Dynamo's approximate indexer). A match walks each
    node's map until the first missing or expired block, so it costs the matched length, not the
    prompt length times the node count. Expired entries are pruned every ``sweep_every`` insertions,
    so memory stays proportional to the last ``ttl`` seconds of traffic.
    """

    __slots__ = ("_inserts", "_nodes", "sweep_every", "ttl")

    def __init__(self, ttl: float = 120.0, sweep_every: int = 200_000) -> None:
        if ttl <= 0:
            raise ValueError("ttl must be > 0")
        self.ttl = ttl
        self.sweep_every = sweep_every
        self._nodes: dict[NodeKey, dict[int, float]] = {}
        self._inserts = 0

    def __len__(self) -> int:
        """(block, node) entries held, expired or not yet swept."""
        return sum(len(m) for m in self._nodes.values())

    def record(self, key: NodeKey, hashes: Sequence[BlockHash64], now: float) -> None:
        m = self._nodes.get(key)
        if m is None:
            m = self._nodes[key] = {}
        m.update(dict.fromkeys(hashes, now + self.ttl))
        self._inserts += len(hashes)
        if self._inserts >= self.sweep_every:
            self._inserts = 0
            self.sweep(now)

    def sweep(self, now: float) -> None:
        """Drop every expired (block, node) entry."""
        for key, m in list(self._nodes.items()):
            alive = {h: exp for h, exp in m.items() if exp > now}
            if alive:
                self._nodes[key] = alive
            else:
                del self._nodes[key]

    def match(
        self, hashes: Sequence[BlockHash64], now: float, nodes: Collection[NodeKey]
    ) -> dict[NodeKey, int]:
        """Leading blocks of ``hashes`` each of ``nodes`` is believed to hold (gap-free, unexpired)."""
        out: dict[NodeKey, int] = {}
        for key in nodes:
            m = self._nodes.get(key)
            n = 0
            if m is not None:
                get = m.get
                for h in hashes:
                    exp = get(h)
                    if exp is None or exp <= now:
                        break
                    n += 1
            out[key] = n
        return out
