"""kvcoord._native through its one switch (kvcoord.native): the build and the switch, regression tests of
the defects fuzzing found under ASan/UBSan, and a bounded fuzz of every native function that reads
bytes or sequences from the network or from Redis, checked against pure-Python models.

The defect tests that need a use-after-free to show run in a fresh interpreter whose allocator poisons
freed memory (``PYTHONMALLOC=debug``; ``malloc_debug`` under ASan, so ASan sees every free): before the
fixes they crashed it (SIGSEGV) or read garbage. ``scripts/sanitize.sh`` runs this file, and the fuzz
for longer (``python -m tests.test_native --seconds S``), against an ASan/UBSan build.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pickle
import random
import re
import subprocess
import sys
import time
from array import array
from collections.abc import Callable
from types import SimpleNamespace
from typing import Annotated, Any, NamedTuple

import cbor2
import msgspec
import pytest
import xxhash

from kvcoord import native as switch
from kvcoord import sglang_hash
from kvcoord.index.base import NodeMatch
from kvcoord.native import native
from tests.coordinator.test_fastpath import MALFORMED, fuzz_answer
from tests.procs import REPO

needs_native = pytest.mark.skipif(native is None, reason="native code not built or KVCOORD_NATIVE=0")


# --- the build and the switch ---------------------------------------------------------------------
def test_native_is_built_when_required() -> None:
    """CI sets KVCOORD_REQUIRE_SPEEDUPS=1, so a silently skipped C build fails instead of hiding."""
    if native is None:
        if os.environ.get("KVCOORD_REQUIRE_SPEEDUPS") and switch.enabled:
            pytest.fail("kvcoord._native is not built (needs a C compiler and the Python headers)")
        pytest.skip("native code not built or KVCOORD_NATIVE=0: every hot path runs in Python")
    assert switch.PATHS == ("hash", "index", "walk", "json")
    digests = "+".join(sorted(native.C_DIGESTS))
    assert switch.native_paths() == (f"hash({digests})", "index", "walk", "json")
    assert "sha256" in native.C_DIGESTS or os.environ.get("KVCOORD_OPENSSL") == "0"  # CI builds with OpenSSL
    for name in ("cbor_chain", "pickle_chain", "Table", "validate_u64_seq", "u64_view", "mirror_walk",
                 "json_take_ints", "Tally"):
        assert hasattr(native, name), name


@pytest.mark.parametrize("value", ["0", "off", "False", " no "])
def test_the_switch_turns_every_native_path_off(value: str) -> None:
    code = """
from kvcoord import native
from kvcoord.hashing import HashProfile, hash_request_tokens
from kvcoord.index.memory import HAVE_C_CORE, MemoryIndex
from kvcoord.index.redis import mirror
assert native.native is None and not native.enabled and native.native_paths() == ()
assert not HAVE_C_CORE and MemoryIndex().core == "python" and mirror._mirror_walk is None
print(hash_request_tokens(HashProfile("xxhash_cbor", 4, "0"), range(12))[-1].hex())
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env={**os.environ, switch.ENV: value})
    assert proc.returncode == 0, proc.stderr
    from kvcoord.hashing import HashProfile, hash_request_tokens

    assert proc.stdout.strip() == hash_request_tokens(HashProfile("xxhash_cbor", 4, "0"), range(12))[-1].hex()


# --- defects found by fuzzing under ASan/UBSan, each with the test that failed before its fix ------
def _isolated(code: str) -> None:
    """Run ``code`` in a fresh interpreter with a poisoning allocator; it must print ok and exit 0."""
    env = dict(os.environ)
    env["PYTHONMALLOC"] = "malloc_debug" if "asan" in env.get("LD_PRELOAD", "") else "debug"
    env["PYTHONFAULTHANDLER"] = "1"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120,
                          env=env)
    tail = proc.stderr[-2000:]
    assert (proc.returncode, proc.stdout.strip()) == (0, "ok"), f"exit {proc.returncode}: {tail}"


_WALK_PRELUDE = """
from kvcoord.index.base import NodeMatch
from kvcoord.native import native
def rec(*ids):
    return b"".join(i.to_bytes(4, "big") + b"\\x01" for i in ids)
"""


@needs_native
def test_mirror_walk_survives_an_int_subclass_whose_hash_empties_the_list() -> None:
    """mirror_walk kept pointers into ``hashes`` and took int subclasses: a ``__hash__`` that empties the
    list freed the items under it (SIGSEGV). Now it takes exact ints only (the Python walk gets the
    rest)."""
    _isolated(_WALK_PRELUDE + """
hashes = []
class Evil(int):
    def __hash__(self):
        hashes.clear()
        return int.__hash__(self)
hashes.extend(Evil(i) for i in range(1, 200))
copy = {i: rec(1) for i in range(1, 200)}
assert native.mirror_walk(copy, hashes, {1: ("m", "n", 0)}, None, NodeMatch) is None
print("ok")
""")


@needs_native
def test_mirror_walk_survives_dict_keys_whose_eq_changes_its_inputs() -> None:
    """Exact-int hashes still reach Python code through the dicts' own keys (an int subclass's ``__eq__``
    on a hash collision): one that empties ``hashes`` (the walk re-reads the list at every block, and
    holds the hash it probes), one that empties the copy while its holder string is being read (the walk
    holds a reference to it)."""
    _isolated(_WALK_PRELUDE + """
hashes = list(range(1000, 1200))
class EmptiesHashes(int):
    __hash__ = int.__hash__
    def __eq__(self, other):
        hashes.clear()
        return int.__eq__(self, other)
copy = {EmptiesHashes(h): rec(7) for h in range(1000, 1200)}
got = native.mirror_walk(copy, hashes, {7: ("m", "n", 0)}, None, NodeMatch)
assert got == [NodeMatch("n", 0, 1, (1, 0, 0))], got  # the list was emptied after block 0

copy = {5000: rec(*range(1, 41)), 5001: rec(*range(1, 41))}
class EmptiesCopy(int):
    __hash__ = int.__hash__
    def __eq__(self, other):
        copy.clear()  # frees the holder string of block 0 while its records are read
        return int.__eq__(self, other)
live = {EmptiesCopy(i): ("m", f"n{i}", 0) for i in range(1, 41)}
got = native.mirror_walk(copy, [5000, 5001], live, None, NodeMatch)
assert sorted(got) == [NodeMatch(f"n{i}", 0, 1, (1, 0, 0)) for i in sorted(range(1, 41), key=str)], got
print("ok")
""")


@needs_native
def test_table_match_holds_the_keys_the_gc_replaces() -> None:
    """Table.match held a borrowed ``keys[slot]`` across the allocations of each answer row; a collection
    they start may run code (here a gc callback) that replaces the key and frees it (SIGSEGV). Now the
    row's key is a strong reference."""
    _isolated("""
import gc
from kvcoord.native import native
class Key(tuple):  # not recycled by the tuple free list: freed memory is poisoned at once
    __slots__ = ()
N = 64
t = native.Table()
for s in range(N):
    t.set_live(s, True)
    t.store(s, 0, [1, 2, 3])
keys = [Key((f"node-{s}", s)) for s in range(N)]
def replace_keys(phase, info):
    if phase == "start":
        for s in range(N):
            keys[s] = Key((f"node-{s}", s))
gc.callbacks.append(replace_keys)
gc.set_threshold(1)
for _ in range(20):
    rows = t.match([1, 2, 3], None, keys, None)
gc.set_threshold(700)
gc.callbacks.remove(replace_keys)
assert sorted(rows) == sorted((f"node-{s}", s, 3, (3, 0, 0)) for s in range(N)), rows
print("ok")
""")


@needs_native
def test_table_refuses_a_released_memoryview() -> None:
    """Found by this file's fuzz: Table read a memoryview's buffer through PyMemoryView_GET_BUFFER, which
    a released view still answers with a dangling pointer (the store read freed memory). The buffer
    protocol refuses released views."""
    assert native is not None
    view = memoryview(bytearray(b"\x01" * 16)).cast("Q")
    view.release()
    t = native.Table()
    for op in (t.store, t.remove):
        with pytest.raises(ValueError, match="released"):
            op(0, 0, view)
    assert len(t) == 0 and t.export(0) == []


@needs_native
def test_table_rows_are_its_matches_packed() -> None:
    """``Table.rows`` (the HTTP fast path's) gives ``Table.match``'s rows, in its order, as packed
    (slot, matched, cpu, storage), for bytes and 'Q' memoryviews, aligned or not."""
    assert native is not None
    rng = random.Random(12)
    table = native.Table()
    chain = [rng.randrange(1 << 64) for _ in range(40)]
    keys: list[tuple[str, int] | None] = []
    for slot in range(6):
        keys.append((f"n{slot}", slot % 2))
        cut = rng.randrange(0, 41)
        table.store(slot, 0, chain[:cut // 2])
        table.store(slot, rng.randrange(3), chain[cut // 2:cut])
        table.set_live(slot, slot != 3)
    table.set_order(sorted(range(6), key=lambda s: keys[s] or ("", 0)))
    for query in (chain, chain[:7], chain[:0], [*chain[:5], 1, *chain[6:]]):
        packed = array("Q", query).tobytes()
        expected = []
        for node_id, rank, matched, tiers in table.match(query, None, keys, None):
            slot = keys.index((node_id, rank))
            expected += [slot, matched, tiers[1], tiers[2]]
        for buf in (packed, memoryview(array("Q", query)), memoryview(b"x" + packed)[1:]):
            assert memoryview(table.rows(buf)).cast("I").tolist() == expected
    with pytest.raises(ValueError):
        table.rows(b"1234567")


@needs_native
def test_table_sweep_of_no_slots_on_an_empty_table() -> None:
    """Found by this file's fuzz under UBSan: the end of a sweep pass called memset(NULL, 0, 0) on a
    table that never had a slot (undefined behaviour, reported as a nonnull-attribute error)."""
    assert native is not None
    t = native.Table()
    t.sweep_begin([])
    assert t.sweep_step(10) == (0, True)
    assert t.sweep_step(10) == (0, True) and len(t) == 0


# --- fuzz: inputs ---------------------------------------------------------------------------------------
class _IntSub(int):
    """An int subclass without Python methods: C may read it as the int it is."""


class _Seq:
    """An ordered sequence that is neither list nor tuple (as a protobuf repeated field)."""

    def __init__(self, items: list[object]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> object:
        return self._items[i]


class _Row(NamedTuple):
    a: object
    b: object
    c: object
    d: object


class _WithDict(tuple):  # type: ignore[type-arg]
    """A tuple subclass with a __dict__: not a class the native code may build rows of."""


_ODD_HASHES: list[object] = [-1, 2**64, True, False, 1.5, "x", None, b"x", 2**70]
_BAD_SLOTS: list[object] = [-1, 2**31, 2**64, True, "0", 1.0, None]
_ERRORS = (TypeError, ValueError, OverflowError, BufferError, NotImplementedError, RuntimeError)


def _u64(rng: random.Random) -> int:
    return rng.choice([rng.randrange(256), rng.randrange(2**32), rng.getrandbits(64), 2**64 - 1, 2**63, 0])


def _is_u64(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64


def _hashes_arg(rng: random.Random, pool: list[int]) -> tuple[object, list[int] | None]:
    """A ``hashes`` argument for Table.store/remove and the uint64s it stands for (None: must raise)."""
    vals = [rng.choice(pool) for _ in range(rng.randrange(0, 40 if rng.random() < 0.1 else 10))]
    kind = rng.randrange(12)
    if kind == 0:
        return memoryview(array("Q", vals)), vals
    if kind == 1:  # unaligned: a bytes slice cast to 'Q'
        k = rng.randrange(1, 8)
        return memoryview(bytes(k) + array("Q", vals).tobytes())[k:].cast("Q"), vals
    if kind == 2:  # strided
        view = memoryview(array("Q", [v for v in vals for _ in (0, 1)]))[::2]
        return view, (vals if len(vals) <= 1 else None)  # (PyBuffer_IsContiguous: 0 or 1 items are)
    if kind == 3 and len(vals) >= 2 and len(vals) % 2 == 0:  # 2-D
        return memoryview(array("Q", vals)).cast("B").cast("Q", [2, len(vals) // 2]), None
    if kind == 4:  # another format of the same width
        return memoryview(array("L", vals)), None
    if kind == 5:
        view = memoryview(bytearray(array("Q", vals).tobytes())).cast("Q")
        view.release()
        return view, None
    if kind == 6:
        return tuple(vals), vals
    if kind == 7:
        return _Seq(list(vals)), vals
    if kind == 8:
        bad: list[object] = list(vals)
        bad.insert(rng.randrange(len(bad) + 1), rng.choice(_ODD_HASHES))
        return (bad if rng.random() < 0.5 else tuple(bad)), None
    if kind == 9:
        return [_IntSub(v) for v in vals], vals
    if kind == 10:
        return rng.choice([set(vals), dict.fromkeys(vals), "ab", b"ab", 7, None, bytearray(b"ab")]), None
    return list(vals), vals


def _match_query(rng: random.Random, pool: list[int], recent: list[int]) -> object:
    if recent and rng.random() < 0.6:  # a prefix of what was stored, maybe running on past it
        q: list[object] = [*recent[: rng.randrange(len(recent) + 1)], *rng.sample(pool, rng.randrange(2))]
    else:
        q = [rng.choice(pool) for _ in range(rng.randrange(0, 12))]
    if rng.random() < 0.2:
        q.insert(rng.randrange(len(q) + 1), rng.choice(_ODD_HASHES))
    kind = rng.randrange(6)
    if kind == 0:
        return tuple(q)
    if kind == 1 and all(_is_u64(x) for x in q):
        return memoryview(array("Q", q))  # type: ignore[arg-type]
    if kind == 2:
        return _Seq(q)
    if kind == 3:
        return iter(q)
    return q


# --- fuzz: Table, against a dict model ---------------------------------------------------------------
def _slot_ok(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= 0x7FFFFFFF


class _TableModel:
    """What kvcoord._native.Table answers, in plain dicts: key -> {slot: tier mask}."""

    def __init__(self) -> None:
        self.h: dict[int, dict[int, int]] = {}
        self.live: set[int] = set()
        self.nslots = 0
        self.sweeping: set[int] | None = None

    def ensure(self, slot: int) -> None:
        if slot >= self.nslots:
            n = self.nslots or 64
            while n <= slot:
                n *= 2
            self.nslots = n

    def store(self, slot: int, tier: int, hashes: list[int]) -> int:
        self.ensure(slot)
        added = 0
        for key in hashes:
            holders = self.h.setdefault(key, {})
            mask = holders.get(slot, 0)
            if not mask & (1 << tier):
                holders[slot] = mask | (1 << tier)
                added += 1
        return added

    def remove(self, slot: int, tier: int, hashes: list[int]) -> int:
        done = 0
        for key in hashes:
            holders = self.h.get(key)
            if holders is not None and holders.get(slot, 0) & (1 << tier):
                holders[slot] &= ~(1 << tier)
                if not holders[slot]:
                    del holders[slot]
                if not holders:
                    del self.h[key]
                done += 1
        return done

    def export(self, slot: int) -> list[tuple[int, int]]:
        return sorted((k, t) for k, hs in self.h.items() for t in range(3) if hs.get(slot, 0) & (1 << t))

    def strip(self, slots: set[int]) -> None:
        for key in list(self.h):
            hs = self.h[key]
            for s in slots & set(hs):
                del hs[s]
            if not hs:
                del self.h[key]

    def match(self, query: list[object], cands: list[int] | None) -> list[tuple[int, int, int, int]]:
        """(slot, matched, cpu, storage) of every live candidate holding the query's first block."""
        state = self.live if cands is None else self.live & set(cands)
        counts: dict[int, list[int]] = {}
        done: list[tuple[int, int, int, int]] = []
        stop = len(query)
        for i, x in enumerate(query):
            holders = self.h.get(int(x)) if _is_u64(x) else None  # type: ignore[call-overload]
            if holders is None:
                stop = i
                break
            if i == 0:
                counts = {s: [0, 0] for s in holders if s in state}
            else:
                for s in [s for s in counts if s not in holders]:
                    done.append((s, i, *counts.pop(s)))
            for s, c in counts.items():
                m = holders[s]
                if not m & 1:
                    c[0 if m & 2 else 1] += 1
            if not counts:
                stop = i
                break
        return done + [(s, stop, c[0], c[1]) for s, c in counts.items()]


def _check_match(t: Any, model: _TableModel, rng: random.Random, pool: list[int], recent: list[int],
                 keys: list[object]) -> None:
    query = _match_query(rng, pool, recent)
    cands: object = None
    if rng.random() < 0.3:
        cands = [rng.choice([*range(8), *([rng.choice(_BAD_SLOTS)] if rng.random() < 0.1 else [])])
                 for _ in range(rng.randrange(4))]
    cls = rng.choice([None, None, None, NodeMatch, NodeMatch, NodeMatch, _Row, _WithDict, dict])
    qlist = list(query) if not isinstance(query, memoryview) else query.tolist()
    if isinstance(query, type(iter([]))):
        query = iter(qlist)
    cut = next((i for i, x in enumerate(qlist) if not _is_u64(x)), len(qlist))
    try:
        got = t.match(query, cands, keys, cls)
    except _ERRORS as e:
        got = e
    if cls in (_WithDict, dict):
        assert isinstance(got, TypeError), got
        return
    early = model.nslots == 0 or not qlist or len(t) == 0  # (mid-sweep the model keeps stripped keys)
    if not early and cands is not None and not all(_slot_ok(c) for c in cands):  # type: ignore[attr-defined]
        assert isinstance(got, (TypeError, ValueError, OverflowError)), got
        return
    want = [] if early else model.match(qlist[:cut], cands)  # type: ignore[arg-type]
    bad_key = any(
        not (s < len(keys) and isinstance(keys[s], tuple) and len(keys[s]) == 2) for s, *_ in want  # type: ignore[arg-type]
    )
    if bad_key:
        assert isinstance(got, RuntimeError), got
        return
    assert isinstance(got, list), got
    rows = [(*keys[s], m, (m - c - st, c, st)) for s, m, c, st in want]  # type: ignore[misc]
    assert sorted(map(tuple, got)) == sorted(rows)
    assert [r[2] for r in got] == sorted((r[2] for r in got), reverse=True)
    assert all(type(r) is (cls or tuple) for r in got)


def fuzz_table(rng: random.Random, steps: int) -> None:
    """Random Table calls (odd arguments included), every answer checked against :class:`_TableModel`."""
    assert native is not None
    t, model = native.Table(), _TableModel()
    pool = [_u64(rng) for _ in range(rng.randrange(1, 24))]
    keys: list[object] = [(f"n{s}", s % 3) for s in range(8)]
    recent: list[int] = []
    for s in rng.sample(range(8), rng.randrange(1, 6)):
        t.set_live(s, True)
        model.ensure(s)
        model.live.add(s)
    if rng.random() < 0.2:
        keys[rng.randrange(8)] = rng.choice([None, ("x",), "ab", _IntSub(3)])
    for _ in range(steps):
        op = rng.choice(["store", "store", "remove", "match", "match", "export", "live", "order", "sweep",
                         "step", "len"])
        sweeping = model.sweeping or set()
        slot: object = rng.choice([s for s in range(8) if s not in sweeping] or [0])
        if rng.random() < 0.05:
            slot = rng.choice(_BAD_SLOTS)
        if op in ("store", "remove"):
            tier: object = rng.choice([0, 1, 2, 2, 3, -1, True]) if rng.random() < 0.1 else rng.randrange(3)
            arg, vals = _hashes_arg(rng, pool)
            if recent and rng.random() < (0.5 if op == "remove" else 0.3):  # shared and partial chains
                cut = rng.randrange(len(recent))
                arg = vals = recent[cut:] if op == "remove" else recent[: cut + 1]
            ok = _slot_ok(slot) and tier in (0, 1, 2) and type(tier) is int and vals is not None
            if ok and slot in sweeping:
                continue
            try:
                got: object = getattr(t, op)(slot, tier, arg)
            except _ERRORS as e:
                got = e
            if ok:
                assert got == getattr(model, op)(slot, tier, vals), (op, got)
                if op == "store" and vals:
                    recent = list(vals)
            else:
                assert isinstance(got, _ERRORS), (op, slot, tier, arg, got)
        elif op == "match":
            _check_match(t, model, rng, pool, recent, keys)
        elif op == "export":
            try:
                got = t.export(slot)
            except _ERRORS as e:
                got = e
            if not _slot_ok(slot):
                assert isinstance(got, _ERRORS)
            elif slot not in sweeping:
                assert got == model.export(slot)  # type: ignore[arg-type]
        elif op == "live" and _slot_ok(slot):
            flag = rng.random() < 0.8
            t.set_live(slot, flag)
            model.ensure(slot)  # type: ignore[arg-type]
            (model.live.add if flag else model.live.discard)(slot)  # type: ignore[arg-type]
        elif op == "order":
            order: list[object] = rng.sample(range(8), rng.randrange(9))
            if rng.random() < 0.1:
                order.append(rng.choice(_BAD_SLOTS))
            try:
                t.set_order(order if rng.random() < 0.7 else tuple(order))
                if order:
                    model.ensure(max(order))  # type: ignore[type-var]
            except _ERRORS:
                assert not all(_slot_ok(s) for s in order)
        elif op == "sweep":
            slots = rng.sample(range(8), rng.randrange(4))
            try:
                t.sweep_begin(slots)
            except RuntimeError:
                assert model.sweeping is not None
                continue
            assert model.sweeping is None
            if slots:
                model.ensure(max(slots))
            model.sweeping = set(slots)
            for s in slots:
                t.set_live(s, False)
                model.live.discard(s)
        elif op == "step":
            _visited, finished = t.sweep_step(rng.choice([0, 1, 5, 1000, -3]))
            if finished and model.sweeping is not None:
                model.strip(model.sweeping)
                model.sweeping = None
        elif op == "len" and model.sweeping is None:
            assert len(t) == len(model.h)
        t.nbytes()


def fuzz_u64(rng: random.Random, steps: int) -> None:
    """validate_u64_seq and u64_view (the ingest's check-and-pack) on odd sequences."""
    assert native is not None
    for _ in range(steps):
        vals: list[object] = [_u64(rng) for _ in range(rng.choice([0, 1, 5, 31, 32, 33, 100]))]
        if rng.random() < 0.3:
            vals.insert(rng.randrange(len(vals) + 1), rng.choice([*_ODD_HASHES, _IntSub(4)]))
        ok = all(_is_u64(v) for v in vals)
        kind = rng.randrange(5)
        arg: object = [list(vals), tuple(vals), _Seq(list(vals))][kind] if kind < 3 else None
        if kind == 3:
            arg, ok = rng.choice([memoryview(b"x" * 8), "ab", b"ab", set(), {1: 2}, 5, None]), False
        elif kind == 4 and ok:
            arg = array("Q", vals)  # type: ignore[arg-type]
        elif kind == 4:
            arg = list(vals)
        assert native.validate_u64_seq(arg) is ok
        view = native.u64_view(arg)
        assert (view is None) if not ok else (view is not None and list(view) == [int(v) for v in vals])  # type: ignore[call-overload]
        assert not (ok and isinstance(arg, list | tuple) and len(vals) < 32) or view is arg  # short: as given


# --- fuzz: mirror_walk, against the Python walk ---------------------------------------------------------
def _holder_string(rng: random.Random, ids: list[int]) -> object:
    chosen = sorted(set(rng.sample(ids, rng.randrange(len(ids) + 1))))
    good = b"".join(i.to_bytes(4, "big") + bytes((rng.randrange(1, 8),)) for i in chosen)
    roll = rng.random()
    if roll < 0.75:
        return good
    if roll < 0.8:
        return good[::-1][: len(good) // 5 * 5]  # unsorted records
    if roll < 0.85:
        return good + good[:5]  # a repeated id
    if roll < 0.92:
        return rng.randbytes(rng.randrange(12))
    return rng.choice(["ab", 5, None, bytearray(good)])


def fuzz_walk(rng: random.Random, steps: int) -> None:
    """mirror_walk on random copies, holder bytes (malformed ones included) and hashes: any list it
    returns is the Python walk's answer."""
    assert native is not None
    from kvcoord.index.redis.walk import _runs_of, _walk_runs

    for _ in range(steps):
        ids = rng.sample([rng.randrange(2**32) for _ in range(10)] + list(range(6)), rng.randrange(1, 8))
        keys = [_u64(rng) for _ in range(rng.randrange(1, 10))]
        strings = [_holder_string(rng, ids) for _ in range(rng.randrange(1, 4))]
        copy: dict[int, Any] = {k: rng.choice(strings) for k in keys if rng.random() < 0.8}
        hashes: list[object] = [rng.choice(keys) for _ in range(rng.randrange(0, 16))]
        if rng.random() < 0.1:
            hashes.insert(rng.randrange(len(hashes) + 1), rng.choice([*_ODD_HASHES, _IntSub(keys[0])]))
        live: dict[int, Any] = {i: ("m", f"node{i % 3}", i % 2) for i in ids if rng.random() < 0.7}
        if live and rng.random() < 0.05:
            live[rng.choice(list(live))] = rng.choice([None, ("m", "n"), "abc"])
        allowed = rng.choice([None, None, set(rng.sample(ids, rng.randrange(len(ids) + 1))), frozenset(ids)])
        cls = rng.choice([NodeMatch, NodeMatch, _Row, _WithDict, tuple])
        arg: object = hashes if rng.random() < 0.7 else tuple(hashes)
        try:
            got = native.mirror_walk(copy, arg, live, allowed, cls)  # type: ignore[arg-type]
        except _ERRORS as e:
            got = e  # type: ignore[assignment]
        if cls is _WithDict:
            assert isinstance(got, TypeError), got
            continue
        if not isinstance(got, list):
            assert got is None or isinstance(got, ValueError), got
            continue
        assert all(type(h) is int and 0 <= h < 2**64 for h in hashes)  # type: ignore[operator]
        want = _walk_runs(_runs_of([copy.get(h) for h in hashes]), SimpleNamespace(by_id=live), allowed)  # type: ignore[arg-type, call-overload]
        assert sorted(map(tuple, got)) == sorted(map(tuple, want))
        assert all(type(r) is cls for r in got)


# --- fuzz: the hash chains, against the serialisations they stand for -----------------------------------
def _tokens_arg(rng: random.Random, tokens: list[int]) -> tuple[object, bool]:
    """A token buffer for the chains and whether they must accept it."""
    kind = rng.randrange(8)
    if kind == 0:
        k = rng.randrange(1, 8)
        return memoryview(bytes(k) + array("Q", tokens).tobytes())[k:].cast("Q"), True
    if kind == 1:
        return rng.choice([tokens, bytes(8 * len(tokens)), array("q", [t >> 1 for t in tokens]),
                           array("H", [t & 0xFFFF for t in tokens]), None]), False
    if kind == 2 and len(tokens) > 1:
        return memoryview(array("Q", tokens * 2))[::2], False
    if kind == 3:
        view = memoryview(array("Q", tokens))
        view.release()
        return view, False
    return array("Q", tokens), True


def fuzz_chains(rng: random.Random, steps: int) -> None:
    """cbor_chain and pickle_chain on random token arrays, parents, tails and hash functions: every
    message they hash is the definition's serialisation, byte for byte; bad arguments raise."""
    assert native is not None
    for _ in range(steps):
        block_size = rng.choice([0, 1, 2, 3, 4, 5, 16, 23, 24, 255, 256])
        count = rng.randrange(0, 6)
        tokens = [_u64(rng) for _ in range(block_size * count + rng.randrange(3))]
        tok, tok_ok = _tokens_arg(rng, tokens)
        parent = rng.randbytes(rng.choice([0, 1, 16, 32, 255, 256, 300]))
        sizes = rng.choice([[32], [16], [0, 1, 255], [256]])
        messages: list[bytes] = []

        def recorder(msg: bytes, sizes: list[int] = sizes, messages: list[bytes] = messages) -> bytes:
            messages.append(msg)
            digest = hashlib.sha256(msg).digest() * 8
            return digest[: rng.choice(sizes)]

        hash_fn: Callable[[bytes], object] | int = recorder
        call_digest = False
        reference: Callable[[bytes], bytes] | None = None  # the digest the chain must produce
        roll = rng.random()
        if roll < 0.1:
            hash_fn, call_digest, reference = hashlib.sha256, True, lambda m: hashlib.sha256(m).digest()
        elif roll < 0.15:
            hash_fn = reference = xxhash.xxh3_128_digest
        elif roll < 0.18:
            hash_fn = rng.choice([lambda m: "str", lambda m: bytearray(32), lambda m: 1 / 0])
        elif roll < 0.3:  # hashed in C: a digest code
            name = rng.choice(sorted(native.C_DIGESTS))
            hash_fn = rng.choice([native.C_DIGESTS[name], native.C_DIGESTS[name], 0, 99, -1])
            reference = (lambda m: hashlib.sha256(m).digest()) if name == "sha256" else xxhash.xxh3_128_digest
        keys_only = reference is not None and rng.random() < 0.5
        cbor = rng.random() < 0.5
        tails: object = b"\xf6"
        tail_list: list[bytes] = [b"\xf6"] * count
        if cbor and rng.random() < 0.5:
            tail_list = [cbor2.dumps(rng.choice([None, ("lora",), [1, "x"], b"d"])) for _ in range(count)]
            tails = list(tail_list)
            if rng.random() < 0.1:
                tails = rng.choice([tail_list[:-1], [*tail_list[:-1], "x"], "x", None])
        if rng.random() < 0.05:
            parent, block_size = rng.choice([("p", block_size), (parent, -1), (parent, 2**70)])  # type: ignore[assignment]
        try:
            if cbor:
                got = native.cbor_chain(hash_fn, call_digest, parent, tok, block_size, count, tails,  # type: ignore[arg-type]
                                        keys_only)
            else:
                got = native.pickle_chain(hash_fn, call_digest, parent, tok, block_size, count, keys_only)  # type: ignore[arg-type]
        except (*_ERRORS, ZeroDivisionError):
            continue
        assert tok_ok and isinstance(parent, bytes)
        assert hash_fn not in (0, 99, -1), "a bad digest code was accepted"
        assert len(got) == (8 * count if keys_only else count)
        prev = parent
        for i in range(count):
            block = tuple(tokens[i * block_size : (i + 1) * block_size])
            if cbor:
                want = b"\x83" + cbor2.dumps(prev) + cbor2.dumps(block) + tail_list[i]
            else:
                want = pickle.dumps((prev, block, None), protocol=5)
            if hash_fn is recorder:
                assert messages[i] == want, (cbor, i)
                prev = got[i]
                continue
            assert reference is not None
            prev = reference(want)
            if keys_only:
                assert memoryview(got).cast("Q")[i] == int.from_bytes(prev, "big") & (2**64 - 1)
            else:
                assert got[i] == prev


# --- the JSON integer arrays of the HTTP API, against msgspec's typed decode ------------------------------
_U32_LIST = list[Annotated[int, msgspec.Meta(ge=0, le=2**32 - 1)]]


def _json_ints_oracle(data: bytes, kind: str) -> list[int] | None:
    """What msgspec (the definition) makes of ``data``: the values as the fast path packs them, or None."""
    try:
        if kind == "I":
            return msgspec.json.decode(data, type=_U32_LIST)
        values = msgspec.json.decode(data, type=list[int])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    if any(not -(2**63) <= v <= 2**64 - 1 for v in values):
        return None
    return [v & (2**64 - 1) for v in values]


def _json_ints_case(rng: random.Random) -> bytes:
    values: list[object] = [rng.choice([rng.randrange(2**32), rng.randrange(2**64), -rng.randrange(2**63 + 1),
                                        0, 2**32, 2**64, -(2**63) - 1, 1.5, "1", None, True, [1]])
                            for _ in range(rng.randrange(0, 12))]
    ws = ["", " ", "\n", "\t", "\r\n  "]
    text = "[" + rng.choice(ws) + ("," + rng.choice(ws)).join(
        json.dumps(v) if not isinstance(v, int) or rng.random() < 0.9
        else rng.choice([f"0{v}", f"{v}e0", f"{v}.0"]) for v in values) + rng.choice(ws) + "]"
    data = bytearray((rng.choice(ws) + text + rng.choice(ws)).encode())
    if data and rng.random() < 0.2:  # corrupt a byte, drop one, or cut it short
        i = rng.randrange(len(data))
        op = rng.randrange(3)
        if op == 0:
            data[i] = rng.randrange(256)
        elif op == 1:
            del data[i]
        else:
            del data[i:]
    return bytes(data)


def _wrapped(data: bytes) -> bytes:
    """``data`` as the value of a one-member object (a ``}`` inside ``data`` may end it early)."""
    return b'{"ids":' + data + b"}"


def _take(data: bytes, kind: str) -> bytes | None:
    """The array parser through json_take_ints, on :func:`_wrapped` ``data``."""
    assert native is not None
    taken = native.json_take_ints(_wrapped(data), "ids", kind)
    return taken[0] if taken is not None else None


class _Ids(msgspec.Struct):
    ids: list[int]


def _typed(body: bytes, kind: type[Any]) -> Any:
    """``body`` decoded as the API's typed path decodes it (``httpbody.decode_body``): msgspec, with what
    follows the JSON value ignored, as Dynamo's serde ignores it; raises msgspec's errors."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError:
        raise
    except msgspec.DecodeError as exc:
        end = re.search(r"trailing characters \(byte (\d+)\)", str(exc))
        if end is None:
            raise
        return msgspec.json.decode(body[:int(end.group(1)) - 1], type=kind)


def _wrapped_oracle(data: bytes, kind: str) -> list[int] | None:
    """What the typed path makes of :func:`_wrapped` ``data``'s ids, as the fast path packs them."""
    try:
        ids = _typed(_wrapped(data), _Ids).ids
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    return _json_ints_oracle(json.dumps(ids).encode(), kind)


class _Body(msgspec.Struct):
    ids: _U32_LIST | None = None
    model_name: str = ""
    other: Any = None
    flag: bool = False


def _json_body_case(rng: random.Random) -> bytes:
    """An object holding an id array among other members: escaped strings, nesting, literals, numbers,
    repeated or escaped keys, odd whitespace, trailing bytes; sometimes corrupted."""
    ws = ["", " ", "\n", "\t"]
    members = [("ids", None), ("model_name", '"m\\"x\\u00e9"'), ("other", rng.choice(
        ['{"a": [1, {"b": "}]"}], "c": null}', "[[[]]]", "-1.5e3", "true", "NaN", '"x', "[1,]", "{}"])),
        ("flag", rng.choice(["false", "true", "1", "nul"]))]
    rng.shuffle(members)
    if rng.random() < 0.1:
        members.append(rng.choice([("ids", "[1]"), ("model_name", '"n"'), ("i\\u0064s", "[2]")]))
    parts = []
    for key, value in members:
        if value is None:
            if rng.random() < 0.1:
                continue  # no ids at all
            value = _json_ints_case(rng).decode("latin-1")
        parts.append(f'{rng.choice(ws)}"{key}"{rng.choice(ws)}:{rng.choice(ws)}{value}')
    text = "{" + ",".join(parts) + rng.choice(ws) + "}" + rng.choice(["", " ", "\n", " trailing"])
    return text.encode("latin-1")


def fuzz_json_ints(rng: random.Random, steps: int) -> None:
    """The id array is claimed only when msgspec decodes it to the same values, and the rest of the object
    handed back decodes (when it does) to what msgspec makes of the whole body; a plainly written valid
    body is always claimed (or the fast path would be dead)."""
    assert native is not None
    for _ in range(steps):
        kind = rng.choice("IQ")
        data = _json_ints_case(rng)
        got = _take(data, kind)
        want = _wrapped_oracle(data, kind)
        if got is not None:
            assert want is not None, data
            assert list(memoryview(got).cast(kind)) == want, data
        body = _json_body_case(rng)
        taken = native.json_take_ints(memoryview(body) if rng.random() < 0.3 else body, "ids", "I")
        if taken is None:
            continue
        packed, rest = taken
        try:
            fast = msgspec.json.decode(rest, type=_Body)
        except (msgspec.ValidationError, msgspec.DecodeError):
            continue  # the server then decodes the whole body the typed way
        whole = _typed(body, _Body)  # what the slow path decodes
        ids = list(memoryview(packed).cast("I")) if packed is not None else None
        assert (ids, fast.model_name, fast.other, fast.flag) == (whole.ids, whole.model_name, whole.other,
                                                                 whole.flag), body
    for _ in range(steps // 4 + 1):
        limit = 2**32 if rng.random() < 0.5 else 2**63
        plain = [rng.randrange(limit) for _ in range(rng.randrange(20))]
        body = json.dumps({"model_name": "m", "ids": plain, "x": {"y": [1, "]"]}}).encode()
        taken = native.json_take_ints(body, "ids", "I" if limit == 2**32 else "Q")
        assert taken is not None and taken[0] is not None
        assert list(memoryview(taken[0]).cast("I" if limit == 2**32 else "Q")) == plain
        assert msgspec.json.decode(taken[1]) == {"model_name": "m", "ids": None, "x": {"y": [1, "]"]}}
        path, malformed = rng.choice(MALFORMED)  # issue 23's malformed lookups, edited: read, never a crash
        edited = bytearray(malformed)
        for _ in range(rng.randrange(3)):
            at = rng.randrange(len(edited))
            edited[at:at + rng.randrange(2)] = bytes([rng.randrange(256)])
        hashes = path == "/query_by_hash"
        key, kind = ("block_hashes", "Q") if hashes else ("token_ids", "I")
        native.json_take_ints(bytes(edited), key, kind)


@pytest.mark.skipif(native is None, reason="needs the C extension")
def test_json_int_arrays_are_msgspecs() -> None:
    fuzz_json_ints(random.Random(13), 3000)
    assert native is not None
    bad_inputs = (b"", b"[", b"[1,]", b"[,1]", b"[01]", b"[1 2]", b"[1]x", b"[-1]", b"{}", b"[1e3]",
                  b"[4294967296]", b"[1] [2]")
    for bad in bad_inputs:
        assert _take(bad, "I") is None, bad
    assert _take(b" [ -9223372036854775808 , 18446744073709551615 ] ", "Q") == (
        array("Q", [2**63, 2**64 - 1]).tobytes())
    for body in (b'{"ids":[1],"ids":[2]}', b'{"i\\u0064s":[1]}', b"[1]", b'{"ids":[1]', b'{"ids":[1],}'):
        assert native.json_take_ints(body, "ids", "I") is None, body
    assert native.json_take_ints(b'{"a":1}', "ids", "I") == (None, b'{"a":1}')
    with pytest.raises(ValueError, match="kind"):
        native.json_take_ints(b"{}", "ids", "q")


def fuzz_sglang_chain(rng: random.Random, steps: int) -> None:
    """sglang_chain on random token buffers (uint32, wide, beyond int64), parents and namespaces: its
    digests and keys are the reference's (kvcoord.sglang_hash), and bad arguments raise."""
    assert native is not None
    if "sha256" not in native.C_DIGESTS:
        return
    for _ in range(steps):
        block_size = rng.choice([1, 2, 3, 4, 16, 33, 1, 4, 0, -1, 2**62])
        count = rng.randrange(0, 6)
        wide = rng.random() < 0.3  # pages of ids past 2**32 (and, rarely, past SGLang's int64 limit)
        n = max(block_size, 0) % 64 * count + rng.randrange(3)
        tokens = [rng.choice([_u64(rng), rng.randrange(2**63)]) if wide and rng.random() < 0.2
                  else rng.randrange(2**32) for _ in range(n)]
        tok, tok_ok = _tokens_arg(rng, tokens)
        parent = rng.randbytes(rng.choice([0, 32, 32, 1, 33]))
        namespace = rng.randbytes(rng.choice([0, 32, 32, 31]))
        keys_only = rng.random() < 0.5
        args: list[object] = [parent, tok, block_size, count, namespace, keys_only]
        if rng.random() < 0.05:
            args[rng.randrange(5)] = rng.choice(["x", None, 2**70, -1])
        try:
            got = native.sglang_chain(*args)  # type: ignore[arg-type]
        except _ERRORS:
            continue
        assert tok_ok and len(parent) in (0, 32) and len(namespace) in (0, 32) and block_size >= 1
        arr = array("Q", tokens)
        want = sglang_hash.chain_reference(parent, arr, block_size, count)
        if keys_only:
            assert memoryview(got).cast("Q").tolist() == [  # type: ignore[arg-type]
                sglang_hash.key_reference(d, namespace) for d in want]
        else:
            assert got == want


FUZZERS: dict[str, Callable[[random.Random, int], None]] = {
    "table": fuzz_table,
    "u64": fuzz_u64,
    "walk": fuzz_walk,
    "chains": fuzz_chains,
    "sglang_chain": fuzz_sglang_chain,
    "json": fuzz_json_ints,
    "fastpath": fuzz_answer,
}


@needs_native
@pytest.mark.parametrize("name", list(FUZZERS))
def test_fuzz_smoke(name: str) -> None:
    """A few hundred fuzz steps per function in the ordinary suite (scripts/sanitize.sh runs more)."""
    for seed in range(5):
        FUZZERS[name](random.Random(seed), 60)


def main() -> None:
    """``python -m tests.test_native --seconds S [--iterations N] [--seed K]``: fuzz every function in
    turn until the time or iteration budget is spent; any failed check or sanitizer report ends it."""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--iterations", type=int, default=4000, help="rounds in all (each: one fuzzer, 40 steps)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if native is None:
        raise SystemExit("kvcoord._native is not built or KVCOORD_NATIVE=0: nothing to fuzz")
    seed = args.seed if args.seed is not None else random.randrange(2**32)
    deadline = time.monotonic() + args.seconds
    rounds = dict.fromkeys(FUZZERS, 0)
    i = 0
    while i < args.iterations and time.monotonic() < deadline:
        name = list(FUZZERS)[i % len(FUZZERS)]
        round_seed = seed * 1_000_003 + i
        try:
            FUZZERS[name](random.Random(round_seed), 40)
        except BaseException:
            print(f"fuzz {name} failed: replay with seed {round_seed} (tests.test_native.FUZZERS[{name!r}])",
                  file=sys.stderr)
            raise
        rounds[name] += 1
        i += 1
    spent = args.seconds - (deadline - time.monotonic())
    print(f"fuzz: seed {seed}, {i} rounds of 40 steps ({rounds}) in {spent:.1f} s")


if __name__ == "__main__":
    main()

