"""The simulated fleet's caches past the GPU: a CPU tier per node, a shared pool, and peer pulls.

- **CPU tier** (vLLM's native offload, LMCache's local CPU backend): a block evicted from a node's GPU pool
  moves to that node's CPU tier (an LRU of ``cpu_blocks``), published to the index as ``BlockStored``
  medium ``CPU`` (and ``BlockRemoved`` medium ``CPU`` when the CPU tier evicts it). A request admitted on
  the node reloads the CPU blocks that continue its GPU hit, at ``cpu_reload_s`` per block, instead of
  prefilling them.
- **Shared pool** (LMCache's remote backend, Mooncake's store): every block a reaching node stores on its
  GPU is written through to one pool (an LRU of ``pool_blocks``) reached by the first ``pool_nodes`` nodes
  (0: all). The pool publishes as the storage daemon ``pool:shared`` (Mooncake RFC#1527's ``backend_id``),
  and lookups expand it with the coordinator's own :meth:`kvcoord.coordinator.pools.Pools.expand`. A
  reaching node loads pool blocks past its GPU and CPU run at ``pool_load_s`` per block.
- **Peer pulls**: the coordinator's :func:`kvcoord.coordinator.pools.pull_hints` name, per candidate, the
  peer holding a longer prefix; a policy that takes the hint (``Decision.pull``) makes the chosen node copy
  the peer's blocks still on its GPU at admission, at ``pull_s`` per block.

Every engine consults its own CPU tier and the pools it reaches whatever the router did (as a connector
does), so a router that does not see them still gets their hits when it happens to route well; only the
index-backed policy can route *to* them. Only it gets pull hints: they come from the index.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass

from kvcoord.coordinator.pools import POOL_PREFIX, PoolConfig, Pools, pull_hints
from kvcoord.events import BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.hashing import BlockHash64, to_block_hash64
from kvcoord.index.base import NodeKey, NodeMatch, run_inline
from kvcoord.load import NodeLoad
from kvcoord.router.answer import Candidate, PullSource

MatchOn = Callable[[Sequence[BlockHash64]], list[NodeMatch]]
"""The index lookup (synchronous), for the pool expansion's continuation walks."""

POOL_NAME = "shared"
POOL_NODE = POOL_PREFIX + POOL_NAME


@dataclass(frozen=True, slots=True)
class TierConfig:
    """Sizes and costs of the caches past the GPU (``kvcoord simulate --cpu-blocks-per-node`` etc.)."""

    cpu_blocks: int = 0
    """CPU-tier blocks per node (0: no CPU tier)."""
    cpu_reload_s: float = 20e-6
    """Seconds to reload one block from the CPU tier (16 tokens x 128 KiB = 2 MiB over ~100 GB/s PCIe)."""
    pool_blocks: int = 0
    """Blocks in the shared pool (0: no pool)."""
    pool_nodes: int = 0
    """Nodes reaching the pool: the first N (0: all)."""
    pool_load_s: float = 200e-6
    """Seconds to load one block from the pool (2 MiB over a ~10 GB/s network path)."""
    pull_s: float | None = None
    """Seconds to pull one block from a peer's GPU (None: no peer pulls)."""

    def __post_init__(self) -> None:
        if self.cpu_blocks < 0 or self.pool_blocks < 0 or self.pool_nodes < 0:
            raise ValueError("tier sizes must be >= 0")
        if self.cpu_reload_s < 0 or self.pool_load_s < 0 or (self.pull_s is not None and self.pull_s < 0):
            raise ValueError("tier costs must be >= 0")

    @property
    def active(self) -> bool:
        return bool(self.cpu_blocks or self.pool_blocks or self.pull_s is not None)


class _LRU:
    """Block hashes in least-recently-used order, bounded."""

    __slots__ = ("capacity", "entries")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[BlockHash64, None] = OrderedDict()

    def put(self, hashes: Sequence[BlockHash64]) -> tuple[list[BlockHash64], list[BlockHash64]]:
        """Store (or refresh) ``hashes``; ``(newly stored, evicted)``."""
        new: list[BlockHash64] = []
        for h in hashes:
            if h in self.entries:
                self.entries.move_to_end(h)
            else:
                self.entries[h] = None
                new.append(h)
        evicted: list[BlockHash64] = []
        while len(self.entries) > self.capacity:
            h, _ = self.entries.popitem(last=False)
            evicted.append(h)
        gone = set(evicted)
        return [h for h in new if h not in gone], evicted

    def run(self, hashes: Sequence[BlockHash64], start: int, stop: int) -> int:
        """How many of ``hashes[start:stop]`` it holds as a gap-free run from ``start``."""
        n = start
        while n < stop and hashes[n] in self.entries:
            self.entries.move_to_end(hashes[n])
            n += 1
        return n - start


def _h64(h: int | bytes) -> BlockHash64:
    """An event's hash as the index keys it (the simulated pools publish 64-bit ints already)."""
    return BlockHash64(h) if isinstance(h, int) else to_block_hash64(h)


def _stored(hashes: Sequence[BlockHash64], bs: int, medium: str | None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=bs,
                       medium=medium)


class Tiers:
    """One replay's CPU tiers, pool and reachability; the simulator calls :meth:`published` with every batch
    of a node's GPU events and :meth:`extend` at admission."""

    __slots__ = ("bs", "config", "cpu", "node_ids", "pool", "pools", "reach")

    def __init__(self, config: TierConfig, node_ids: Sequence[str], bs: int) -> None:
        self.config = config
        self.bs = bs
        self.node_ids = list(node_ids)
        self.cpu = {n: _LRU(config.cpu_blocks) for n in node_ids} if config.cpu_blocks else {}
        self.pool = _LRU(config.pool_blocks) if config.pool_blocks else None
        k = config.pool_nodes or len(node_ids)
        self.reach = frozenset(node_ids[:k]) if self.pool is not None else frozenset()
        self.pools = Pools({POOL_NAME: PoolConfig(POOL_NAME, Tier.STORAGE, self.reach)} if self.pool else {})
        if self.pool is not None:
            self.pools.publisher(POOL_NODE, POOL_NAME)

    def published(self, node_id: str, events: Sequence[KVEvent]) -> dict[str, list[KVEvent]]:
        """The index's events for one batch of ``node_id``'s GPU events: the batch itself, plus the CPU
        tier's stores and removals on the node (evicted GPU blocks move there) and the pool's (under
        :data:`POOL_NODE`: stored GPU blocks are written through)."""
        out: dict[str, list[KVEvent]] = {node_id: list(events)}
        cpu = self.cpu.get(node_id)
        to_pool = self.pool is not None and node_id in self.reach
        if cpu is None and not to_pool:
            return out
        removed = [_h64(h) for ev in events if isinstance(ev, BlockRemoved) for h in ev.block_hashes]
        if cpu is not None and removed:
            new, gone = cpu.put(removed)
            if gone:
                out[node_id].append(BlockRemoved(block_hashes=tuple(gone), medium="CPU"))
            if new:
                out[node_id].append(_stored(new, self.bs, "CPU"))
        if to_pool and self.pool is not None:
            stored = [_h64(h) for ev in events if isinstance(ev, BlockStored) for h in ev.block_hashes]
            new, gone = self.pool.put(stored)
            pool_events: list[KVEvent] = []
            if gone:
                pool_events.append(BlockRemoved(block_hashes=tuple(gone)))
            if new:
                pool_events.append(_stored(new, self.bs, None))
            if pool_events:
                out[POOL_NODE] = pool_events
        return out

    def extend(self, node_id: str, hashes: Sequence[BlockHash64], gpu: int, limit: int) -> tuple[int, int]:
        """Blocks past a GPU hit of ``gpu`` the node loads instead of prefilling: ``(from its CPU tier,
        from the pool)``, within the first ``limit`` blocks."""
        cpu = self.cpu.get(node_id)
        from_cpu = cpu.run(hashes, gpu, limit) if cpu is not None else 0
        from_pool = 0
        if self.pool is not None and node_id in self.reach:
            from_pool = self.pool.run(hashes, gpu + from_cpu, limit)
        return from_cpu, from_pool

    def candidates(self, loads: Mapping[NodeKey, NodeLoad], matches: Sequence[NodeMatch],
                   hashes: Sequence[BlockHash64], match_on: MatchOn) -> list[Candidate]:
        """One candidate per node in ``loads``, as the coordinator's lookup answers: the pool expanded
        (:meth:`Pools.expand`) and each candidate's peer-pull hint (:func:`pull_hints`)."""
        rows: list[tuple[str, int, int, tuple[int, ...], str]]
        if self.pools.active:

            async def cont(rest: Sequence[BlockHash64], keys: Collection[NodeKey]) -> list[NodeMatch]:
                wanted = set(keys)
                return [m for m in match_on(rest) if (m.node_id, m.dp_rank) in wanted]

            rows = run_inline(self.pools.expand(hashes, matches, lambda n: True, lambda n: (0,), None, cont))
        else:
            rows = [(m.node_id, m.dp_rank, m.matched_blocks, m.tiers, "") for m in matches]
        by_key = {(r[0], r[1]): r for r in rows}
        ordered = [by_key.get(k, (k[0], k[1], 0, (), "")) for k in loads]
        hints = (pull_hints([(r[0], r[2], r[3], f"http://{r[0]}:8000") for r in ordered])
                 if self.config.pull_s is not None else [None] * len(ordered))
        out: list[Candidate] = []
        for (node_id, rank, matched, tiers, pool), hint in zip(ordered, hints, strict=True):
            src = PullSource(hint.node_id, hint.host_port, hint.tier, hint.blocks) if hint else None
            out.append(Candidate(node_id, rank, matched, tiers, loads[(node_id, rank)], pool=pool,
                                 pool_tier=Tier.STORAGE.name, pull=src))
        return out

