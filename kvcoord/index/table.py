"""The memory index's two cores, one model's keyspace each: ``PyTable`` (pure Python, the fallback and
the tests' oracle) and ``NativeTable`` (the block table in C). They share the slot registry, group
memory and sweep bookkeeping; they differ only in where the blocks live (see :mod:`kvcoord.index.memory`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvcoord._native import Table

import heapq
import itertools
import sys
from collections.abc import Callable, Collection, Sequence
from operator import and_, eq, itemgetter, ne, or_
from typing import Literal, TypeAlias, cast

from kvcoord.events import Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey, NodeMatch
from kvcoord.native import native
from kvcoord.validate import SnapshotEntry

__all__ = ["Core", "NativeTable", "PyTable", "RawMatch", "slots_of", "table_type"]

_NTIERS = len(Tier)

_Tiers: TypeAlias = tuple[int, int, int]
"""``(gpu, cpu, storage)`` slot masks of one block."""

RawMatch: TypeAlias = tuple[str, int, int, tuple[int, ...]]
"""``(node_id, dp_rank, matched_blocks, tiers)``: a ``NodeMatch`` without the object cost."""

Core: TypeAlias = Literal["auto", "c", "python"]

_TIERS = tuple(Tier)
_BITS01 = bytes.maketrans(b"01", b"\x00\x01")
_FIRST_CHUNK = 16
_MAX_CHUNK = 512


def slots_of(mask: int) -> list[int]:
    """Bit positions set in ``mask``, ascending (C-level for dense masks)."""
    if mask & (mask - 1) == 0:
        return [mask.bit_length() - 1] if mask else []
    return list(itertools.compress(itertools.count(), bin(mask)[:1:-1].encode().translate(_BITS01)))


class PyTable:
    """Everything one model's keyspace holds: the block maps and the slot registry."""

    __slots__ = (
        "bits",
        "blocks",
        "counts",
        "dead",
        "dps",
        "free",
        "live",
        "names",
        "order",
        "perm",
        "skip_groups",
        "slot_key",
        "slot_of",
        "sweep_keys",
        "sweep_mask",
        "sweep_pos",
        "tiered",
    )

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.tiered: dict[int, _Tiers] = {}
        self.slot_of: dict[NodeKey, int] = {}
        self.slot_key: list[NodeKey | None] = []
        self.names: list[str] = []
        self.dps: list[int] = []
        self.order: list[int] | None = None
        self.perm: Callable[[bytes], tuple[int, ...]] | None = None
        self.bits: list[int] = []
        self.counts: list[list[int]] = []
        self.live = 0
        self.dead = 0
        self.free: list[int] = []
        self.skip_groups: dict[NodeKey, set[int]] = {}
        self.sweep_keys: list[int] | None = None
        self.sweep_mask = 0
        self.sweep_pos = 0

    def new_slot(self) -> int:
        """A slot id that no value mentions (never one still waiting for a sweep)."""
        if self.free:
            slot = heapq.heappop(self.free)
            self.counts[slot] = [0] * _NTIERS
            return slot
        slot = len(self.bits)
        self.bits.append(1 << slot)
        self.slot_key.append(None)
        self.names.append("")
        self.dps.append(0)
        self.counts.append([0] * _NTIERS)
        return slot

    def bind(self, slot: int, key: NodeKey) -> None:
        self.slot_of[key] = slot
        self.slot_key[slot] = key
        self.names[slot], self.dps[slot] = key
        self.live |= self.bits[slot]
        self.order = None
        self.perm = None

    def slot_for_store(self, key: NodeKey) -> int:
        slot = self.slot_of.get(key)
        if slot is None:
            slot = self.new_slot()
            self.bind(slot, key)
        return slot

    def sort_order(self) -> list[int]:
        """Live slots sorted by ``(node_id, dp_rank)`` (the tie-break order of match results)."""
        order = self.order
        if order is None:
            order = [s for _k, s in sorted((k, s) for s, k in enumerate(self.slot_key) if k is not None)]
            self.order = order
        return order

    def ordered_slots(self, mask: int) -> list[int]:
        """The slots of ``mask`` (live ones only) in tie-break order, mostly in C."""
        if mask & (mask - 1) == 0:
            return [mask.bit_length() - 1]
        if mask.bit_count() <= max(8, len(self.slot_key) >> 4):
            # sparse: peel bits, then sort by (node_id, dp_rank); live slots always have a key
            slots = []
            while mask:
                low = mask & -mask
                slots.append(low.bit_length() - 1)
                mask ^= low
            slots.sort(key=cast("Callable[[int], NodeKey]", self.slot_key.__getitem__))
            return slots
        perm = self.perm
        order = self.sort_order()
        if perm is None:
            perm = self.perm = itemgetter(*order) if len(order) > 1 else (lambda b: (b[order[0]],))
        sel = bin(mask)[:1:-1].encode().translate(_BITS01).ljust(len(self.slot_key), b"\x00")
        return list(itertools.compress(order, perm(sel)))

    def nkeys(self) -> int:
        """Keys physically present, dead slots' included (what reclamation frees)."""
        return len(self.blocks)

    def retire(self, slot: int) -> int:
        """Take ``slot`` out of answers now; returns how many entries it held. O(1)."""
        key = self.slot_key[slot]
        if key is not None and self.slot_of.get(key) == slot:
            del self.slot_of[key]
        self.slot_key[slot] = None
        self.order = None
        self.perm = None
        bit = self.bits[slot]
        self.live &= ~bit
        held = sum(self.counts[slot])
        self.counts[slot] = [0] * _NTIERS
        if held:
            self.dead |= bit
        else:
            heapq.heappush(self.free, slot)
        return held

    def sweep(self, budget: int) -> tuple[int, bool]:
        """Strip dead slot bits from up to ``budget`` keys. Returns (keys visited, sweep finished)."""
        if self.sweep_keys is None:
            if not self.dead:
                return 0, True
            self.sweep_mask = self.dead
            self.sweep_keys = list(self.blocks)
            self.sweep_pos = 0
        keys = self.sweep_keys
        start = self.sweep_pos
        end = min(start + budget, len(keys))
        keep = ~self.sweep_mask
        blocks = self.blocks
        tiered = self.tiered
        get = blocks.get
        for h in keys[start:end]:
            v = get(h)
            if v is None:
                continue
            tv = tiered.get(h) if tiered else None
            if tv is not None:
                g, c, s = tv[0] & keep, tv[1] & keep, tv[2] & keep
                if c or s:
                    tiered[h] = (g, c, s)
                    blocks[h] = g | c | s
                    continue
                del tiered[h]
                v = g
            nv = v & keep
            if nv:
                if nv != v or tv is not None:
                    blocks[h] = nv
            else:
                del blocks[h]
        self.sweep_pos = end
        if end < len(keys):
            return end - start, False
        self.sweep_keys = None
        return end - start, self.end_sweep()

    def end_sweep(self) -> bool:
        """A sweep pass finished: the slots dead when it began are free again. True when none is left
        dead (slots retired during the pass wait for the next one)."""
        done = self.sweep_mask
        self.sweep_mask = 0
        self.dead &= ~done
        for slot in slots_of(done):
            heapq.heappush(self.free, slot)
        return not self.dead

    def store(self, slot: int, tier: int, hashes: Sequence[int]) -> int:
        """Add ``hashes`` on ``tier`` for ``slot``; returns entries actually added."""
        bit = self.bits[slot]
        blocks = self.blocks
        tiered = self.tiered
        added = 0
        if tier == 0 and (not tiered or tiered.keys().isdisjoint(hashes)):
            # GPU-only blocks: one C-level setdefault per key inserts the new ones (mostly all of them:
            # engines publish blocks they just computed); keys other slots hold get OR-ed in bulk.
            before = len(blocks)
            vals = list(map(blocks.setdefault, hashes, itertools.repeat(bit)))
            added = len(blocks) - before
            if vals.count(bit) != len(vals):
                sel = list(map(ne, vals, itertools.repeat(bit)))
                fix = dict(zip(itertools.compress(hashes, sel), itertools.compress(vals, sel), strict=True))
                news = list(map(or_, fix.values(), itertools.repeat(bit)))
                added += len(fix) - list(map(eq, fix.values(), news)).count(True)
                blocks.update(zip(fix, news, strict=True))
        else:
            get = blocks.get
            for h in hashes:
                tv = tiered.get(h)
                if tv is None:
                    cur = get(h)
                    if tier == 0:
                        if cur is None:
                            blocks[h] = bit
                        elif cur & bit:
                            continue
                        else:
                            blocks[h] = cur | bit
                        added += 1
                        continue
                    g, c, st = cur or 0, 0, 0
                else:
                    g, c, st = tv
                if tier == 0:
                    if g & bit:
                        continue
                    g |= bit
                elif tier == 1:
                    if c & bit:
                        continue
                    c |= bit
                else:
                    if st & bit:
                        continue
                    st |= bit
                tiered[h] = (g, c, st)
                blocks[h] = g | c | st
                added += 1
        self.counts[slot][tier] += added
        return added

    def remove(self, slot: int, tier: int, hashes: Sequence[int]) -> int:
        """Drop ``hashes`` on ``tier`` for ``slot``; returns entries actually removed."""
        bit = self.bits[slot]
        blocks = self.blocks
        tiered = self.tiered
        get = blocks.get
        done = 0
        for h in hashes:
            v = get(h)
            if v is None or not v & bit:
                continue
            tv = tiered.get(h) if tiered else None
            if tv is None:
                if tier:
                    continue
                v ^= bit
                if v:
                    blocks[h] = v
                else:
                    del blocks[h]
            else:
                t = list(tv)
                if not t[tier] & bit:
                    continue
                t[tier] ^= bit
                g, c, st = t
                if c or st:
                    tiered[h] = (g, c, st)
                    blocks[h] = g | c | st
                else:
                    del tiered[h]
                    if g:
                        blocks[h] = g
                    else:
                        del blocks[h]
            done += 1
        self.counts[slot][tier] -= done
        return done

    def match(
        self, hashes: Sequence[int], candidates: Collection[NodeKey] | None, cls: type[NodeMatch] | None
    ) -> list[RawMatch]:
        """See ``MemoryIndex.match_sync``; rows built as ``cls`` or plain tuples when None."""
        raw = self.match_raw(hashes, candidates)
        return list(itertools.starmap(cls, raw)) if cls is not None else raw

    def candidate_mask(self, candidates: Collection[NodeKey] | None) -> int:
        """The live slots a match may answer with: all of them, or those of ``candidates``."""
        m = self.live
        if candidates is not None:
            cand = 0
            slot_of = self.slot_of
            bits = self.bits
            for nk in candidates:
                s = slot_of.get(nk)
                if s is not None:
                    cand |= bits[s]
            m &= cand
        return m

    def match_raw(self, hashes: Sequence[int], candidates: Collection[NodeKey] | None) -> list[RawMatch]:
        """The prefix walk: where each slot's run of held blocks ends, then :meth:`rows` for the answer.

        The walk stays in this one function, with no call per block: the mask of slots still matching
        is AND-ed over chunks of lookups that double while nothing changes, bisecting where it does."""
        m = self.candidate_mask(candidates)
        if not m:
            return []
        get = self.blocks.get
        total = len(hashes)
        runs: list[tuple[int, int]] = []  # (length, slots whose run ends there), lengths ascending
        n = 0
        step = _FIRST_CHUNK
        zeros = itertools.repeat(0)
        while n < total:
            chunk = hashes[n : n + step]
            vals = list(map(get, chunk, zeros))
            n += len(chunk)
            if vals.count(m) == len(vals):
                # Every block held by exactly the surviving slots (a single holder stores the shared
                # slot-bit object, so this is mostly an identity check): nothing changes.
                step = min(step * 2, _MAX_CHUNK)
                continue
            acc = list(itertools.accumulate(vals, and_, initial=m))
            last = acc[-1]
            if last == m:
                step = min(step * 2, _MAX_CHUNK)
                continue
            # acc is a chain of shrinking masks: bisect for each point where it changes.
            base = n - len(chunk) - 1
            i = 1
            while m != last:
                lo, hi = i, len(acc) - 1
                while lo < hi:
                    mid = (lo + hi) // 2
                    if acc[mid] != m:
                        hi = mid
                    else:
                        lo = mid + 1
                a = acc[lo]
                if base + lo > 0:
                    runs.append((base + lo, m ^ a))
                m = a
                i = lo + 1
            if not m:
                break
        if m and n:
            runs.append((n, m))
        return self.rows(hashes, runs) if runs else []

    def rows(self, hashes: Sequence[int], runs: list[tuple[int, int]]) -> list[RawMatch]:
        """One row per slot from the walk's ``runs`` (``(length, mask)``, lengths ascending), longest
        first; per-tier counts only where a block of the run sits on another tier than GPU."""
        names, dps = self.names, self.dps
        tiered = self.tiered
        odd: list[tuple[int, _Tiers]] = []
        if tiered:
            longest = runs[-1][0]
            tget = tiered.get
            odd = [(p, t) for p, t in enumerate(map(tget, hashes[:longest])) if t is not None]
        out: list[RawMatch] = []
        for length, mask in reversed(runs):
            slots = self.ordered_slots(mask)
            if not odd or odd[0][0] >= length:
                tiers: tuple[int, ...] = (length, 0, 0)
                out.extend(
                    zip(
                        map(names.__getitem__, slots),
                        map(dps.__getitem__, slots),
                        itertools.repeat(length),
                        itertools.repeat(tiers),
                        strict=False,
                    )
                )
                continue
            for slot in slots:
                bit = 1 << slot
                g, c, st = length, 0, 0
                for p, t in odd:
                    if p >= length:
                        break
                    if t[0] & bit:
                        continue
                    g -= 1
                    if t[1] & bit:
                        c += 1
                    else:
                        st += 1
                out.append((names[slot], dps[slot], length, (g, c, st)))
        return out

    def export(self, slot: int) -> list[SnapshotEntry]:
        """Every (block, tier) of ``slot``, sorted. O(blocks of the model): rare path."""
        out = [(BlockHash64(h), t) for t, hs in zip(_TIERS, self.columns(slot), strict=True) for h in hs]
        out.sort()
        return out

    def columns(self, slot: int) -> tuple[list[int], list[int], list[int]]:
        """The hashes ``slot`` holds on each tier (GPU, CPU, STORAGE), unsorted. O(blocks of the model);
        C-level calls only while ``slot`` is the table's one holder (the relay's mirror: one node)."""
        bit = self.bits[slot]
        blocks, tiered = self.blocks, self.tiered
        gpu: list[int]
        cpu: list[int] = []
        sto: list[int] = []
        if self.live == bit and not self.dead:  # every key is the slot's (no other slot holds bits)
            if not tiered:
                return list(blocks), cpu, sto
            gpu = list(blocks.keys() - tiered.keys())
            for h, (g, c, st) in tiered.items():
                if g:
                    gpu.append(h)
                if c:
                    cpu.append(h)
                if st:
                    sto.append(h)
            return gpu, cpu, sto
        gpu = []
        tget = tiered.get
        for h, v in blocks.items():
            if not v & bit:
                continue
            tv = tget(h)
            if tv is None:
                gpu.append(h)
                continue
            if tv[0] & bit:
                gpu.append(h)
            if tv[1] & bit:
                cpu.append(h)
            if tv[2] & bit:
                sto.append(h)
        return gpu, cpu, sto

    def nbytes(self, sample: int = 512) -> int:
        """Dict tables + a sample of keys/values extrapolated (shared slot-bit objects count as free)."""
        size = sys.getsizeof(self.blocks) + sys.getsizeof(self.tiered) + sys.getsizeof(self.slot_of)
        size += sum(sys.getsizeof(b) for b in self.bits) + 200 * len(self.slot_key)
        n = len(self.blocks)
        if n:
            per = 0
            seen = 0
            bits = self.bits
            for h, v in itertools.islice(self.blocks.items(), sample):
                seen += 1
                per += sys.getsizeof(h)
                if not (v <= 256 or (v & (v - 1) == 0 and bits[v.bit_length() - 1] is v)):
                    per += sys.getsizeof(v)
            size += per * n // seen
        if self.tiered:
            per = 0
            seen = 0
            for tv in itertools.islice(self.tiered.values(), sample):
                seen += 1
                per += sys.getsizeof(tv) + sum(sys.getsizeof(x) for x in tv if x > 256)
            size += per * len(self.tiered) // seen
        return size


class NativeTable(PyTable):
    """A model whose blocks live in the C core's table; the slot registry stays in ``PyTable``."""

    __slots__ = ("sweeping", "table")

    def __init__(self) -> None:
        super().__init__()
        assert native is not None
        self.table = native.Table()
        self.sweeping = False

    def nkeys(self) -> int:
        return len(self.table)

    def bind(self, slot: int, key: NodeKey) -> None:
        super().bind(slot, key)
        self.table.set_live(slot, True)

    def retire(self, slot: int) -> int:
        self.table.set_live(slot, False)
        return super().retire(slot)

    def store(self, slot: int, tier: int, hashes: Sequence[int]) -> int:
        added = self.table.store(slot, tier, hashes)
        self.counts[slot][tier] += added
        return added

    def remove(self, slot: int, tier: int, hashes: Sequence[int]) -> int:
        done = self.table.remove(slot, tier, hashes)
        self.counts[slot][tier] -= done
        return done

    def sweep(self, budget: int) -> tuple[int, bool]:
        """One step of the table's sweep pass; a pass strips the slots dead when it began."""
        if not self.sweeping:
            if not self.dead:
                return 0, True
            self.sweep_mask = self.dead
            self.table.sweep_begin(slots_of(self.dead))
            self.sweeping = True
        visited, finished = self.table.sweep_step(budget)
        if not finished:
            return visited, False
        self.sweeping = False
        return visited, self.end_sweep()

    def ordered_table(self) -> Table:
        """The C table with its tie-break order current (set again after a slot was bound)."""
        if self.order is None:
            self.table.set_order(self.sort_order())
        return self.table

    def match(
        self, hashes: Sequence[int], candidates: Collection[NodeKey] | None, cls: type[NodeMatch] | None
    ) -> list[RawMatch]:
        self.ordered_table()
        cand: list[int] | None = None
        if candidates is not None:
            get = self.slot_of.get
            cand = [s for s in map(get, candidates) if s is not None]
        return self.table.match(hashes, cand, self.slot_key, cls)

    def export(self, slot: int) -> list[SnapshotEntry]:
        return [(BlockHash64(h), _TIERS[t]) for h, t in self.table.export(slot)]

    def columns(self, slot: int) -> tuple[list[int], list[int], list[int]]:
        return self.table.columns(slot)

    def nbytes(self, sample: int = 512) -> int:
        return (
            self.table.nbytes()
            + sys.getsizeof(self.slot_of)
            + sum(sys.getsizeof(b) for b in self.bits)
            + 200 * len(self.slot_key)
        )


def table_type(core: Core) -> type[PyTable]:
    """The core ``core`` names (``auto``: C when it was built and is on)."""
    if core not in ("auto", "c", "python"):
        raise ValueError(f"core must be 'auto', 'c' or 'python', not {core!r}")
    if core == "c" and native is None:
        raise ValueError("core='c' but native code is not built or is off (KVCOORD_NATIVE=0)")
    return NativeTable if core != "python" and native is not None else PyTable
