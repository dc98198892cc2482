"""Index benchmark: kvcoord's MemoryIndex vs Dynamo's Rust ``RadixTree``, one process, same data.

Workloads:
- ``mooncake``: the Mooncake FAST'25 conversation trace. Each 512-token hash id becomes 32 blocks of 16
  tokens (full blocks only, so ``input_length // 16`` blocks a request); block hashes are chained
  (``h_k = xxh3(h_{k-1}, local_k)``) so equal prefixes give equal hashes. Requests go to one of N nodes
  (seeded uniform), for N in 8, 64, 512. Each node emits one ``BlockStored`` for the blocks it did not hold
  yet (like an engine after prefill). The first 90% of requests are applied; the last 10% are the queries.
- ``shared-prefix``: 64 system prompts of 2048 tokens (128 blocks), 16 questions each of 128 tokens
  (8 blocks), spread the same way; queries are 4 new questions per prompt.

Both indexes get identical events: ours as ``BlockStored`` objects validated (``kvcoord.validate.ops_of``,
timed) into ``MemoryIndex.apply_sync``,
Dynamo's as pre-encoded JSON ``KvCacheEvent`` bytes through ``RadixTree.apply_event``. Encoding is outside
the timed region; each timed chunk ends with a ``find_matches`` so Dynamo's worker thread has drained.
A match is timed through ``MemoryIndex.match_sync`` (the protocol's sorted ``NodeMatch`` list: what the
coordinator's Lookup calls) and, as "raw", the C table's own call with plain tuples for rows (through
``MemoryIndex.native_view``; the pure-Python core has none) vs
``RadixTree.find_matches(...).scores``; results are cross-checked.

``--core`` picks the MemoryIndex core (``auto``: the C extension when built, else pure Python).

Run: ``.venv/bin/python benchmarks/bench_index.py [--quick] [--core auto|c|python]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import struct
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from kvcoord.events import BlockStored
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.table import Core
from kvcoord.validate import ops_of

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation.jsonl"
MODEL = "bench-model"
BLOCK_TOKENS = 16
SUB_BLOCKS = 512 // BLOCK_TOKENS
CHUNK_EVENTS = 4000
CORE: Core = "auto"

_pack = struct.Struct("<QQ").pack
_xxh = xxhash.xxh3_64_intdigest


def _h(a: int, b: int) -> int:
    return _xxh(_pack(a, b))


@dataclass(slots=True)
class Request:
    local: list[int]
    """Per-block content hashes (Dynamo's ``tokens_hash``, the keys its radix tree walks)."""
    chained: list[int]
    """Prefix-chained block hashes (vLLM-style; our index key, Dynamo's ``block_hash``)."""


class Expander:
    """Turns hash ids into 16-token blocks; caches per (parent, id) so shared prefixes share objects."""

    def __init__(self) -> None:
        self._cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def chain(self, ids: Sequence[int], nblocks: int, salt: int = 0) -> Request:
        local: list[int] = []
        chained: list[int] = []
        parent = 0
        for hid in ids:
            if len(chained) >= nblocks:
                break
            got = self._cache.get((parent, hid))
            if got is None:
                loc = [_h(hid ^ salt, j) for j in range(SUB_BLOCKS)]
                ch: list[int] = []
                p = parent
                for x in loc:
                    p = _h(p, x)
                    ch.append(p)
                got = self._cache[(parent, hid)] = (loc, ch)
            local.extend(got[0])
            chained.extend(got[1])
            parent = got[1][-1]
        return Request(local[:nblocks], chained[:nblocks])


def load_mooncake(path: Path, limit: int | None) -> list[tuple[list[int], int]]:
    out = []
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            out.append((r["hash_ids"], r["input_length"] // BLOCK_TOKENS))
            if limit is not None and len(out) >= limit:
                break
    return out


def mooncake_requests(path: Path, limit: int | None) -> list[Request]:
    ex = Expander()
    return [ex.chain(ids, n) for ids, n in load_mooncake(path, limit)]


def shared_prefix_requests(
    prompts: int = 64, questions: int = 16, extra: int = 4
) -> tuple[list[Request], list[Request]]:
    """Applied requests (prompt + question) and held-out queries (prompt + a new question)."""
    ex = Expander()
    sys_blocks = 2048 // 512  # in 512-token units: 4 ids of 32 blocks = 128 blocks
    q_blocks = 128 // BLOCK_TOKENS  # 8 blocks
    applied: list[Request] = []
    queries: list[Request] = []
    next_id = 1_000_000
    for p in range(prompts):
        prompt_ids = [p * 10 + i for i in range(sys_blocks)]
        for q in range(questions + extra):
            ids = [*prompt_ids, next_id]
            next_id += 1
            req = ex.chain(ids, sys_blocks * SUB_BLOCKS + q_blocks)
            (applied if q < questions else queries).append(req)
    random.Random(7).shuffle(applied)
    return applied, queries


@dataclass(slots=True)
class Event:
    node: int
    parent: int | None
    local: list[int]
    chained: list[int]


def node_events(reqs: Sequence[Request], nodes: int, seed: int) -> list[Event]:
    """What each node's engine would publish: only the blocks it did not hold yet (no eviction)."""
    rng = random.Random(seed)
    held: list[set[int]] = [set() for _ in range(nodes)]
    out = []
    for r in reqs:
        n = rng.randrange(nodes)
        h = held[n]
        ch = r.chained
        lo, hi = 0, len(ch)  # held blocks form a prefix-closed set: binary search the first miss
        while lo < hi:
            mid = (lo + hi) // 2
            if ch[mid] in h:
                lo = mid + 1
            else:
                hi = mid
        if lo == len(ch):
            continue
        out.append(Event(n, ch[lo - 1] if lo else None, r.local[lo:], ch[lo:]))
        h.update(ch[lo:])
    return out


def _chunks(events: Sequence[Event], size: int) -> Iterator[Sequence[Event]]:
    for i in range(0, len(events), size):
        yield events[i : i + size]


@dataclass
class Result:
    name: str
    blocks_applied: int = 0
    ours_apply_s: float = 0.0
    dyn_apply_s: float = 0.0
    ours_apply_cpu: float = 0.0
    dyn_apply_cpu: float = 0.0
    ours_lat: list[float] = field(default_factory=list)
    dyn_lat: list[float] = field(default_factory=list)
    raw_lat: list[float] = field(default_factory=list)
    entries: int = 0
    est_bytes: int = 0
    agree: int = 0
    queries: int = 0
    matched_nodes: int = 0
    matched_blocks: int = 0


_ROTATIONS = ((0, 1, 2), (1, 2, 0), (2, 0, 1))


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_workload(name: str, reqs: Sequence[Request], queries: Sequence[Request], nodes: int) -> Result:
    from dynamo._core import RadixTree

    names = [f"node-{i}" for i in range(nodes)]
    events = node_events(reqs, nodes, seed=nodes)
    ours = MemoryIndex(core=CORE)
    tree = RadixTree()
    res = Result(name)
    eid = 0
    for ci, chunk in enumerate(_chunks(events, CHUNK_EVENTS)):
        mine = [
            (names[e.node], [BlockStored(list(e.chained), e.parent, (), BLOCK_TOKENS)]) for e in chunk
        ]
        theirs = []
        for e in chunk:
            eid += 1
            blocks = [{"block_hash": c, "tokens_hash": x} for c, x in zip(e.chained, e.local, strict=True)]
            stored = {"parent_hash": e.parent, "blocks": blocks}
            body = {"event_id": eid, "data": {"stored": stored}, "dp_rank": 0}
            theirs.append((e.node, json.dumps(body).encode()))
        res.blocks_applied += sum(len(e.chained) for e in chunk)
        gc.collect()
        for turn in ((0, 1) if ci % 2 == 0 else (1, 0)):
            if turn == 0:
                apply = ours.apply_sync
                c0, t0 = time.process_time(), time.perf_counter()
                for node, evs in mine:
                    apply(MODEL, node, 0, ops_of(evs))  # validation timed too, as the events arrive
                res.ours_apply_s += time.perf_counter() - t0
                res.ours_apply_cpu += time.process_time() - c0
            else:
                apply_event = tree.apply_event
                c0, t0 = time.process_time(), time.perf_counter()
                for wid, payload in theirs:
                    apply_event(wid, payload)
                tree.find_matches([0])  # drain the tree's worker thread
                res.dyn_apply_s += time.perf_counter() - t0
                res.dyn_apply_cpu += time.process_time() - c0  # includes Dynamo's worker thread
    st = ours.stats_sync()
    res.entries, res.est_bytes = st.entries, st.bytes
    gc.collect()
    match = ours.match_sync
    view = ours.native_view(MODEL)

    def raw(model: str, hashes: Sequence[int]) -> object:  # the C table's rows as plain tuples
        return view[0].match(hashes, None, view[1], None) if view is not None else match(model, hashes)
    find = tree.find_matches
    perf = time.perf_counter
    for qi, q in enumerate(queries):
        ch, loc = q.chained, q.local
        for turn in _ROTATIONS[qi % 3]:
            t0 = perf()
            if turn == 0:
                got = match(MODEL, ch)
                res.ours_lat.append(perf() - t0)
            elif turn == 1:
                raw(MODEL, ch)
                res.raw_lat.append(perf() - t0)
            else:
                scores = find(loc).scores
                res.dyn_lat.append(perf() - t0)
        mine_scores = {(int(m.node_id[5:]), m.dp_rank): m.matched_blocks for m in got}
        theirs_scores: dict[object, int] = {k: v for k, v in scores.items() if v}
        res.agree += mine_scores == theirs_scores
        res.queries += 1
        res.matched_nodes += len(got)
        res.matched_blocks += max((m.matched_blocks for m in got), default=0)
    return res


def report(r: Result) -> dict[str, object]:
    ours_tput = r.blocks_applied / r.ours_apply_s
    dyn_tput = r.blocks_applied / r.dyn_apply_s
    o50, o99 = _pct(r.ours_lat, 0.5) * 1e6, _pct(r.ours_lat, 0.99) * 1e6
    r50, r99 = _pct(r.raw_lat, 0.5) * 1e6, _pct(r.raw_lat, 0.99) * 1e6
    d50, d99 = _pct(r.dyn_lat, 0.5) * 1e6, _pct(r.dyn_lat, 0.99) * 1e6
    row = {
        "workload": r.name,
        "blocks_applied": r.blocks_applied,
        "apply_ours_blocks_per_s": round(ours_tput),
        "apply_dynamo_blocks_per_s": round(dyn_tput),
        "apply_ratio": round(ours_tput / dyn_tput, 2),
        "apply_cpu_ours_blocks_per_s": round(r.blocks_applied / r.ours_apply_cpu),
        "apply_cpu_dynamo_blocks_per_s": round(r.blocks_applied / r.dyn_apply_cpu),
        "apply_cpu_ratio": round(r.dyn_apply_cpu / r.ours_apply_cpu, 2),
        "match_ours_p50_us": round(o50, 1),
        "match_ours_p99_us": round(o99, 1),
        "match_raw_p50_us": round(r50, 1),
        "match_raw_p99_us": round(r99, 1),
        "match_dynamo_p50_us": round(d50, 1),
        "match_dynamo_p99_us": round(d99, 1),
        "match_p50_ratio": round(o50 / d50, 2),
        "match_p99_ratio": round(o99 / d99, 2),
        "match_raw_p50_ratio": round(r50 / d50, 2),
        "match_raw_p99_ratio": round(r99 / d99, 2),
        "entries": r.entries,
        "est_bytes_per_entry": round(r.est_bytes / max(1, r.entries), 1),
        "queries": r.queries,
        "results_agree": f"{r.agree}/{r.queries}",
        "avg_nodes_matched": round(r.matched_nodes / max(1, r.queries), 1),
        "avg_best_match_blocks": round(r.matched_blocks / max(1, r.queries), 1),
    }
    print(
        f"{r.name:<24} apply {ours_tput / 1e6:5.2f}M vs {dyn_tput / 1e6:5.2f}M blk/s"
        f" (x{ours_tput / dyn_tput:4.2f}; CPU-time x{row['apply_cpu_ratio']:4.2f})"
        f" | match p50 {o50:6.1f} [raw {r50:6.1f}] vs {d50:6.1f} us"
        f" (x{o50 / d50:4.2f} [raw x{r50 / d50:4.2f}]) p99 {o99:6.1f} [raw {r99:6.1f}] vs {d99:6.1f} us"
        f" (x{o99 / d99:4.2f} [raw x{r99 / d99:4.2f}]) | {row['est_bytes_per_entry']} B/entry est,"
        f" {r.entries} entries, {row['avg_nodes_matched']} nodes/query, agree {row['results_agree']}",
        flush=True,
    )
    return row


# ------------------------------------------------------------------------------ 5M-entry memory


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(how: str, target: int, trace: Path) -> None:
    """Build an index of ``target`` entries from the trace (8 nodes) and print bytes held as JSON.

    Hashes are computed per request inside the measured region (no cache), so the key ints the index
    keeps are counted and nothing else of the generator survives.
    """
    reqs = load_mooncake(trace, None)
    rng = random.Random(8)
    gc.collect()
    if how == "tracemalloc":
        tracemalloc.start()
        base = tracemalloc.get_traced_memory()[0]
    else:
        base = _rss()
    entries = 0
    if how == "dynamo":
        from dynamo._core import RadixTree

        tree = RadixTree()
        seen: list[set[int]] = [set() for _ in range(8)]  # entries count only; not part of the measurement
        base = _rss()
    else:
        idx = MemoryIndex(core=CORE)
    eid = 0
    for ids, nblocks in reqs:
        node = rng.randrange(8)
        parent = 0
        loc: list[int] = []
        ch: list[int] = []
        for hid in ids:
            if len(ch) >= nblocks:
                break
            for j in range(SUB_BLOCKS):
                x = _h(hid, j)
                parent = _h(parent, x)
                loc.append(x)
                ch.append(parent)
        loc, ch = loc[:nblocks], ch[:nblocks]
        if not ch:
            continue
        if how == "dynamo":
            eid += 1
            blocks = [{"block_hash": c, "tokens_hash": x} for c, x in zip(ch, loc, strict=True)]
            stored = {"parent_hash": None, "blocks": blocks}
            body = {"event_id": eid, "data": {"stored": stored}, "dp_rank": 0}
            tree.apply_event(node, json.dumps(body).encode())
            before = len(seen[node])
            seen[node].update(ch)
            entries += len(seen[node]) - before
        else:
            ops = ops_of([BlockStored(tuple(ch), None, (), 16)])
            entries += idx.apply_sync(MODEL, f"node-{node}", 0, ops).stored
        if entries >= target:
            break
    del reqs
    gc.collect()
    if how == "tracemalloc":
        used = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    elif how == "dynamo":
        tree.find_matches([0])
        # the seen-sets are ours, not Dynamo's: subtract their size estimate (set table + nothing else,
        # the ints are shared with nothing and were freed? no: they are kept by the sets) -> report raw too
        raw = _rss() - base
        set_bytes = sum(sys.getsizeof(s) + 40 * len(s) for s in seen)
        used = raw - set_bytes
    else:
        used = _rss() - base
    est = idx.stats_sync().bytes if how != "dynamo" else 0
    print(json.dumps({"how": how, "entries": entries, "bytes": used, "bytes_per_entry": used / entries,
                      "stats_estimate_per_entry": est / entries if est else None}))


def run_memory(how: str, target: int, trace: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, __file__, "--memory-child", how, "--entries", str(target), "--trace", str(trace),
         "--core", CORE],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    row: dict[str, object] = json.loads(out.strip().splitlines()[-1])
    extra = ""
    if row.get("stats_estimate_per_entry"):
        extra = f" (stats() estimate {row['stats_estimate_per_entry']:.1f})"
    per = row["bytes_per_entry"]
    print(f"memory[{how}] {row['entries']} entries: {per:.1f} bytes/entry{extra}", flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="1500 trace requests, 300k-entry memory run")
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--nodes", default="8,64,512")
    ap.add_argument("--entries", type=int, default=None, help="entries for the memory measurement")
    ap.add_argument("--memory-child", choices=["rss", "tracemalloc", "dynamo"], help=argparse.SUPPRESS)
    ap.add_argument("--json", type=Path, help="also write the figures here")
    ap.add_argument("--core", choices=["auto", "c", "python"], default="auto", help="MemoryIndex core")
    args = ap.parse_args()
    global CORE
    CORE = args.core
    if args.memory_child:
        memory_child(args.memory_child, args.entries or 5_000_000, args.trace)
        return
    limit = 1500 if args.quick else None
    target = args.entries or (300_000 if args.quick else 5_000_000)
    rows: list[dict[str, object]] = []
    core = MemoryIndex(core=CORE).core
    print(f"python {sys.version.split()[0]}, quick={args.quick}, core={core}", flush=True)
    t0 = time.perf_counter()
    moon = mooncake_requests(args.trace, limit)
    split = int(len(moon) * 0.9)
    print(f"mooncake: {len(moon)} requests, {sum(len(r.chained) for r in moon)} blocks "
          f"(expanded in {time.perf_counter() - t0:.1f}s)", flush=True)
    for n in (int(x) for x in args.nodes.split(",")):
        rows.append(report(run_workload(f"mooncake/{n} nodes", moon[:split], moon[split:][:2000], n)))
        gc.collect()
    del moon
    applied, queries = shared_prefix_requests()
    for n in (int(x) for x in args.nodes.split(",")):
        rows.append(report(run_workload(f"shared-prefix/{n} nodes", applied, queries, n)))
        gc.collect()
    mem = [run_memory(how, target, args.trace) for how in ("tracemalloc", "rss", "dynamo")]
    if args.json:
        args.json.write_text(json.dumps({"workloads": rows, "memory": mem}, indent=1))


if __name__ == "__main__":
    main()
