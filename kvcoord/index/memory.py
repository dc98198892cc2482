"""The in-memory index: per model, a table from uint64 block hash to the slots holding it.

Every ``(node_id, dp_rank)`` of a model gets a small integer *slot*. Two interchangeable cores hold the
blocks (``MemoryIndex(core="auto"|"c"|"python")``; ``auto`` takes C when it was built):

- **C** (``Table`` of ``kvcoord._native``, built by setup.py when a compiler is present): an open-addressing
  table of 16-byte buckets (key, one inline ``(slot, tier mask)`` holder or the index of a sorted
  holder array), about 30-40 bytes per entry at millions of entries. Whole events go in per call
  (buckets prefetched ahead), and a match walks the query once, intersecting holders with the
  surviving slots, recording runs as slots drop out, counting fastest tiers, and building the
  sorted answer rows itself (``NodeMatch`` is a NamedTuple it can allocate directly).
- **Python** (the fallback, same answers): ``blocks`` maps the hash to an ``int`` bitmask of slots
  (a single holder shares its slot's ``bit`` object: 50-70 bytes an entry); ``tiered`` holds
  ``(gpu, cpu, storage)`` masks only for blocks some slot keeps off-GPU. Stores and matches run
  through C-level dict and ``itertools`` calls in chunks.

The slot registry, group memory, batch validation and sweep bookkeeping are shared Python code, so
the cores differ only in storage (tests run the backend suite on both and compare them directly).

Removing a node, clearing a ``(node, dp_rank)`` and replacing it with a snapshot *retire* its slot:
the slot leaves the live set at once (O(1) for readers) and is never handed out again until a sweep
has stripped it from every value, so re-adding the node id starts from an empty slot. The sweep runs
as a background task under the async API, in small steps piggy-backed on ``apply_sync`` otherwise,
or all at once via ``reclaim_sync``.

Group handling: ``BlockStored`` events of non-full-attention groups (sliding window, Mamba, ...) are
counted in ``skipped_group`` and not indexed. A ``BlockRemoved`` has no kind, and in hybrid models the
same hash value is published by several groups, so applying a sliding-window removal would wrongly drop
the full-attention entry. The index therefore remembers, per ``(model, node, dp_rank)``, which
``group_idx`` values were seen on non-indexable stores, and skips (counts) removals of those groups.
Removals without ``group_idx`` or of a group not yet seen are applied; if the block is not held they
are the usual counted no-op. ``remove_node`` forgets what it learnt about the node's groups. These rules
are :func:`kvcoord.index.rules.apply_ops`, which the relay's mirror of a node runs too.

Not thread-safe: use it from one thread (the coordinator's event loop).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcoord._native import Table

import asyncio
import contextlib
import sys
from array import array
from collections.abc import Collection, Sequence
from typing import Literal, cast

from kvcoord import validate
from kvcoord.events import REMOVE, STORE, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import (
    ApplyResult,
    EngineRecords,
    Fencing,
    IndexStats,
    NativeView,
    NodeKey,
    NodeMatch,
    NodeRecords,
    Remote,
    ReservationFeed,
)
from kvcoord.index.rules import apply_ops
from kvcoord.index.table import Core, NativeTable, PyTable, table_type
from kvcoord.native import native
from kvcoord.validate import Op, SnapshotEntry

__all__ = ["HAVE_C_CORE", "IndexImage", "MemoryIndex"]

IndexImage = tuple[list[tuple[str, int, tuple["array[int]", ...]]], dict[NodeKey, set[int]]]
"""One model of :meth:`MemoryIndex.export_all_sync`: ``(node_id, dp_rank, blocks per tier)`` of each bound
location, and the groups whose removals are skipped, per location."""

HAVE_C_CORE = native is not None
"""Whether the C core is in use (built, and not off by ``KVCOORD_NATIVE=0``): ``MemoryIndex(core="auto")``
then uses it."""


class MemoryIndex:
    """The embedded default backend. Async methods wrap the ``*_sync`` ones, which never block on I/O."""

    backend = "memory"
    inline = True
    fencing: Fencing | None = None
    """One process: nothing to fence."""
    remote: Remote | None = None
    node_directory: NodeRecords | None = None
    engine_store: EngineRecords | None = None
    reservation_feed: ReservationFeed | None = None

    def __init__(self, *, sweep_chunk: int = 20_000, core: Core = "auto") -> None:
        self._model_type: type[PyTable] = table_type(core)
        self.core: Literal["c", "python"] = "c" if self._model_type is NativeTable else "python"
        """The core in use (``auto`` resolves to ``c`` when the extension is built)."""
        self._models: dict[str, PyTable] = {}
        self._pending: set[str] = set()
        self._sweep_chunk = sweep_chunk
        self._sweeper: asyncio.Task[None] | None = None
        self.native: NativeView | None = self if self.core == "c" else None
        """The C core's tables (:meth:`native_view`); the Python core has none."""

    # ------------------------------------------------------------------ mutation

    def apply_sync(self, model: str, node_id: str, dp_rank: int, ops: Sequence[Op]) -> ApplyResult:
        """Apply one node's validated ops in order (see :meth:`Index.apply`).

        ``stored``/``removed`` count entries actually added/dropped (a repeated store adds nothing),
        ``removed_unknown`` removals of blocks the location did not hold, ``cleared`` entries dropped by
        ``AllBlocksCleared``, ``skipped_group`` blocks of non-full-attention groups.
        """
        validate.check_target(model, node_id, dp_rank)
        res = self._run(model, node_id, dp_rank, ops)
        if self._pending:
            self._kick()
        return res

    def _run(self, model: str, node_id: str, dp_rank: int, ops: Sequence[Op]) -> ApplyResult:
        res = ApplyResult()
        mi = self._models.get(model)
        if mi is None:
            if not any(op[0] == STORE for op in ops):  # nothing held, nothing to remember: no table
                res.removed_unknown = sum(len(op[2]) for op in ops if op[0] == REMOVE)
                return res
            mi = self._models[model] = self._model_type()
        work = apply_ops(mi, (node_id, dp_rank), ops, res)
        if mi.dead:
            self._pending.add(model)
        if self._pending:
            self._sweep_some(2 * work + 256)
        return res

    def clear_sync(self, model: str, node_id: str, dp_rank: int) -> int:
        """Drop ``(node_id, dp_rank)`` of ``model`` from answers now; returns the entries it held."""
        mi = self._models.get(model)
        if mi is None:
            return 0
        slot = mi.slot_of.get((node_id, dp_rank))
        if slot is None:
            return 0
        held = mi.retire(slot)
        if mi.dead:
            self._pending.add(model)
        return held

    def remove_node_sync(self, node_id: str) -> None:
        """Retire every slot of ``node_id`` in every model (O(slots), independent of block count)."""
        for name, mi in self._models.items():
            keys = [k for k in mi.slot_of if k[0] == node_id]
            for k in keys:
                mi.retire(mi.slot_of[k])
            for k in [k for k in mi.skip_groups if k[0] == node_id]:
                del mi.skip_groups[k]
            if mi.dead:
                self._pending.add(name)

    def replace_node_sync(
        self, model: str, node_id: str, dp_rank: int, hashes: Sequence[BlockHash64], tiers: bytes = b""
    ) -> None:
        """Fill a fresh slot with the snapshot then swap it in, so readers see old or new, never a mix."""
        validate.check_target(model, node_id, dp_rank)
        per_tier = validate.snapshot_per_tier(hashes, tiers)
        mi = self._models.get(model)
        if mi is None:
            mi = self._models[model] = self._model_type()
        key = (node_id, dp_rank)
        slot = mi.new_slot()
        for tier, hashes in enumerate(per_tier):
            if hashes:
                mi.store(slot, tier, hashes)
        old = mi.slot_of.get(key)
        if old is not None:
            mi.retire(old)
        mi.bind(slot, key)
        if mi.dead:
            self._pending.add(model)

    def export_all_sync(self) -> dict[str, IndexImage]:
        """Every model's bound locations with their blocks per tier (``columns``), and the groups whose
        removals are skipped: what :meth:`load_all_sync` makes another index hold (the lookup workers'
        snapshot, ``kvcoord.coordinator.workers``). O(locations x blocks of the model)."""
        out: dict[str, IndexImage] = {}
        for name, mi in self._models.items():
            rows = [(node_id, rank, tuple(array("Q", col) for col in mi.columns(slot)))
                    for (node_id, rank), slot in mi.slot_of.items()]
            out[name] = (rows, {k: set(v) for k, v in mi.skip_groups.items()})
        return out

    def load_all_sync(self, image: dict[str, IndexImage]) -> None:
        """Hold exactly ``image`` (from :meth:`export_all_sync`): every location not in it is cleared,
        every one in it replaced (each swap is atomic for readers, as :meth:`replace_node_sync`)."""
        for name, mi in self._models.items():
            keep = {(n, r) for n, r, _ in image.get(name, ((), {}))[0]}
            for key in [k for k in mi.slot_of if k not in keep]:
                mi.retire(mi.slot_of[key])
            if mi.dead:
                self._pending.add(name)
        for name, (rows, skip) in image.items():
            for node_id, rank, columns in rows:
                hashes = [h for col in columns for h in col]
                tiers = b"".join(bytes([t]) * len(col) for t, col in enumerate(columns))
                self.replace_node_sync(name, node_id, rank, cast("list[BlockHash64]", hashes), tiers)
            table = self._models.get(name)
            if table is not None:
                table.skip_groups = {k: set(v) for k, v in skip.items()}
        self._kick()

    # ------------------------------------------------------------------ reclamation

    def _sweep_some(self, budget: int) -> None:
        for name in list(self._pending):
            mi = self._models[name]
            visited, finished = mi.sweep(budget)
            if finished:
                self._pending.discard(name)
            budget -= visited
            if budget <= 0:
                return

    def reclaim_sync(self) -> None:
        """Finish every pending sweep now (dead slot bits stripped, their ids reusable)."""
        while self._pending:
            self._sweep_some(1 << 62)

    @property
    def reclaim_pending(self) -> bool:
        """True while retired slots still have bits in some values."""
        return bool(self._pending)

    def _kick(self) -> None:
        if not self._pending or (self._sweeper is not None and not self._sweeper.done()):
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._sweeper = loop.create_task(self._sweep_loop(), name="kvcoord-index-sweep")

    async def _sweep_loop(self) -> None:
        """Reclaim in chunks, yielding to the event loop between them, until nothing is pending."""
        while self._pending:
            self._sweep_some(self._sweep_chunk)
            await asyncio.sleep(0)

    # ------------------------------------------------------------------ reads

    def match_sync(
        self, model: str, hashes: Sequence[int], candidates: Collection[NodeKey] | None = None
    ) -> list[NodeMatch]:
        """Per live ``(node, dp_rank)``: the gap-free leading run of ``hashes`` held on any tier.

        Longest first, ties by node id then rank. ``tiers`` counts each matched block once, in its
        fastest tier (GPU, then CPU, then STORAGE), so ``sum(tiers) == matched_blocks`` and a router
        can weight the counts directly.
        """
        mi = self._models.get(model)
        if mi is None:
            return []
        return cast("list[NodeMatch]", mi.match(hashes, candidates, NodeMatch))

    def native_view(self, model: str) -> tuple[Table, list[NodeKey | None]] | None:
        """See :meth:`NativeView.native_view`: the C core's table, when this index runs it."""
        mi = self._models.get(model)
        if not isinstance(mi, NativeTable):
            return None
        return mi.ordered_table(), mi.slot_key

    def export_node_sync(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        """Every (block, tier) of ``(node_id, dp_rank)``, sorted. O(blocks of the model): rare path."""
        mi = self._models.get(model)
        if mi is None:
            return []
        slot = mi.slot_of.get((node_id, dp_rank))
        if slot is None:
            return []
        return mi.export(slot)

    def stats_sync(self) -> IndexStats:
        """Exact counts (finishing any pending sweep first) and a sampled estimate of bytes held."""
        self.reclaim_sync()
        entries = 0
        blocks = 0
        total_bytes = sys.getsizeof(self._models)
        nodes: set[str] = set()
        by_tier: dict[tuple[str, Tier], int] = {}
        by_model: dict[str, int] = {}
        for name, mi in self._models.items():
            for slot, key in enumerate(mi.slot_key):
                if key is None:
                    continue
                counts = mi.counts[slot]
                held = sum(counts)
                if not held:
                    continue
                nodes.add(key[0])
                entries += held
                for t, n in enumerate(counts):
                    if n:
                        by_tier[(name, Tier(t))] = by_tier.get((name, Tier(t)), 0) + n
            nkeys = mi.nkeys()
            if nkeys:
                blocks += nkeys
                by_model[name] = nkeys
            total_bytes += mi.nbytes()
        return IndexStats(
            entries=entries,
            blocks=blocks,
            nodes=len(nodes),
            bytes=total_bytes,
            entries_by_model_tier=by_tier,
            blocks_by_model=by_model,
        )

    # ------------------------------------------------------------------ Index protocol (async)

    async def apply(self, model: str, node_id: str, dp_rank: int, ops: Sequence[Op]) -> ApplyResult:
        return self.apply_sync(model, node_id, dp_rank, ops)

    async def match(
        self,
        model: str,
        hashes: Sequence[BlockHash64],
        candidates: Collection[NodeKey] | None = None,
    ) -> list[NodeMatch]:
        return self.match_sync(model, hashes, candidates)

    async def clear(self, model: str, node_id: str, dp_rank: int) -> None:
        self.clear_sync(model, node_id, dp_rank)
        self._kick()

    async def remove_node(self, node_id: str) -> None:
        self.remove_node_sync(node_id)
        self._kick()

    async def export_node(self, model: str, node_id: str, dp_rank: int) -> list[SnapshotEntry]:
        return self.export_node_sync(model, node_id, dp_rank)

    async def replace_node(
        self, model: str, node_id: str, dp_rank: int, hashes: Sequence[BlockHash64], tiers: bytes = b""
    ) -> None:
        self.replace_node_sync(model, node_id, dp_rank, hashes, tiers)
        self._kick()

    async def stats(self, *, exact: bool = True) -> IndexStats:
        """Exact and cheap here, whatever ``exact`` asks."""
        # Finish sweeps cooperatively so a big reclaim does not stall the event loop in one go.
        await self._sweep_loop()
        return self.stats_sync()

    async def close(self) -> None:
        task, self._sweeper = self._sweeper, None
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
