"""A node's blocks as the index should hold them (:class:`BlockMirror`), and where a relay forwards its
batches (:class:`EventSink`): shared by every transport's relay (:mod:`kvcoord.engine.relay`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol, cast

from kvcoord import validate
from kvcoord.events import KVEvent, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import ApplyResult
from kvcoord.index.rules import apply_ops
from kvcoord.index.table import Core, PyTable, table_type

__all__ = ["BlockMirror", "EventSink", "RankSnapshot", "Snapshot"]

Snapshot = dict[int, list[tuple[BlockHash64, Tier]]]
"""``{dp_rank: [(uint64 hash, tier), ...]}``: a node's blocks, as the reporter sends them."""


class EventSink(Protocol):
    """Where the relay forwards batches (the reporter, or the coordinator's in-process feed). Neither
    method may block."""

    def submit(self, dp_rank: int, events: Sequence[Any], ts: float | None = None,
               ops: Sequence[validate.Op] | None = None, spans: Sequence[int] | None = None) -> None:
        """Forward one batch: ``events`` (model events or views), their validated ``ops`` and the
        events each op stands for (``spans``: runs of like events are one op, see
        :func:`kvcoord.validate.op_runs`; None: one op per event)."""

    def history_lost(self, dp_rank: int, reason: str) -> None:
        """The rank's history is incomplete from here on (batches the relay could not recover): the
        coordinator marks it ``degraded`` with ``reason`` until the engine clears its cache."""


_Op = validate.Op
"""``(kind, tier, hashes, group_idx, indexable)``: the index's own validated op, by the index's rules."""

_TIERS: tuple[Tier, ...] = tuple(Tier)
_KEY = ("", 0)
"""The one location of a rank's table (the mirror is one node)."""


class RankSnapshot:
    """One rank's blocks as two parallel columns: validated uint64 hashes and their tiers.

    Built with a few C-level list operations (no per-entry Python work), so a snapshot of millions of
    blocks does not stall the agent's event loop. Iterating yields ``(hash, tier)`` pairs (what
    :data:`kvcoord.agent.reporter.SnapshotProvider` asks for); :meth:`columns` hands both columns over
    as they are, for a consumer that can take them whole.
    """

    __slots__ = ("hashes", "tiers")

    def __init__(self, hashes: list[BlockHash64], tiers: list[Tier]) -> None:
        self.hashes = hashes
        self.tiers = tiers

    def columns(self) -> tuple[list[BlockHash64], list[Tier]]:
        """``(hashes, tiers)``: every hash is a uint64 int, every tier a :class:`Tier`; do not mutate."""
        return self.hashes, self.tiers

    def __len__(self) -> int:
        return len(self.hashes)

    def __iter__(self) -> Iterator[tuple[BlockHash64, Tier]]:
        return zip(self.hashes, self.tiers, strict=True)


class BlockMirror:
    """The blocks one node holds, per DP rank: what the index should hold for the node.

    Built on the memory index's own core: each rank is one location in a table of its own
    (:mod:`kvcoord.index.table`), and every batch goes through the rule set the index applies
    (:func:`kvcoord.index.table.apply_ops`: idempotent stores, removals of unknown blocks as no-ops,
    skipped groups, ``AllBlocksCleared``), so the two cannot disagree. ``core`` picks the table as
    :class:`~kvcoord.index.memory.MemoryIndex` does. A rank's snapshot reads its table's columns, at C
    speed on either core.
    """

    __slots__ = ("_ranks", "_table", "counts")

    def __init__(self, *, core: Core = "auto") -> None:
        self._table = table_type(core)
        self._ranks: dict[int, PyTable] = {}
        self.counts = ApplyResult()
        """What every batch did, summed (the index's counts of the same batches)."""

    @staticmethod
    def prepare(events: Sequence[KVEvent]) -> validate.Known:
        """Validate a whole batch without touching the mirror, by the index's rules; ValueError if bad.
        Runs of like events become one op each, events of unknown media none
        (:func:`kvcoord.validate.known_runs`): ``(events kept, ops, spans)``."""
        return validate.known_runs(events)

    def commit(self, dp_rank: int, ops: Sequence[_Op]) -> None:
        """Apply prepared operations (cannot fail). A cleared rank's old entries are swept in steps
        earned by later batches, as the index sweeps them."""
        table = self._ranks.get(dp_rank)
        if table is None:
            table = self._ranks[dp_rank] = self._table()
        work = apply_ops(table, _KEY, ops, self.counts)
        if table.dead:
            table.sweep(2 * work + 256)

    def apply(self, dp_rank: int, events: Sequence[KVEvent]) -> None:
        self.commit(dp_rank, self.prepare(events).ops)

    def clear(self, dp_rank: int) -> None:
        """Drop the rank's blocks, as the ``AllBlocksCleared`` the relay forwards drops them from the
        index (which keeps the groups it learnt not to index)."""
        if dp_rank in self._ranks:
            self.commit(dp_rank, (validate.CLEAR_OP,))

    def ranks(self) -> list[int]:
        return sorted(self._ranks)

    def num_blocks(self, dp_rank: int | None = None) -> int:
        """``(hash, tier)`` entries held (a block on two tiers counts twice, as the index stores it)."""
        if dp_rank is None:
            return sum(self.num_blocks(dp) for dp in self._ranks)
        table = self._ranks.get(dp_rank)
        slot = table.slot_of.get(_KEY) if table is not None else None
        return sum(table.counts[slot]) if table is not None and slot is not None else 0

    def rank_entries(self, dp_rank: int) -> RankSnapshot:
        """Every (hash, tier) held on one rank: the reporter's snapshot provider."""
        table = self._ranks.get(dp_rank)
        slot = table.slot_of.get(_KEY) if table is not None else None
        if table is None or slot is None:
            return RankSnapshot([], [])
        per_tier = cast("tuple[list[BlockHash64], ...]", table.columns(slot))
        hashes: list[BlockHash64] = []
        tiers: list[Tier] = []
        for tier, held in zip(_TIERS, per_tier, strict=True):
            if held:
                if hashes:
                    hashes += held
                else:
                    hashes = held  # a fresh list: the one tier held takes no copy
                tiers += [tier] * len(held)
        return RankSnapshot(hashes, tiers)

    def snapshot(self) -> Snapshot:
        """Every (hash, tier) held, per DP rank."""
        return {dp: list(self.rank_entries(dp)) for dp in self._ranks}
