"""Redis backend vs the memory backend: lookup p50/p99, ingest throughput, and memory per entry.

Same run, same data: a synthetic shared-prefix fleet (system prompts shared by many nodes, private
conversation tails) is ingested into ``MemoryIndex`` and into ``RedisIndex`` on a private
``redis-server`` (free port, no persistence, ``maxmemory-policy noeviction``), then the same queries are
matched on both. Prints ratios (Redis / memory). Targets (issue 6): lookup p50 <= 3x memory, ingest
>= 100k block-events/s per coordinator. Memory per entry is ``INFO memory`` used_memory after loading
minus before, over the index's (block, location) entries.

    .venv/bin/python benchmarks/bench_redis.py [--quick] [--cluster]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcoord.events import BlockStored, KVEvent
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import Index
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.redis.index import RedisIndex
from kvcoord.validate import ops_of
from tests.redis_servers import redis_cluster, redis_server

MODEL = "bench"
Batch = tuple[str, int, list[KVEvent]]


def workload(
    nodes: int, prompts: int, prompt_blocks: int, convs: int, tail_blocks: int, seed: int = 1,
    query_blocks: int = 0, n_queries: int = 300,
) -> tuple[list[Batch], list[list[BlockHash64]]]:
    """Engine-like batches (16-block BlockStored events, 4 per batch) and lookup queries."""
    rng = random.Random(seed)
    sys_prompts = [[rng.getrandbits(64) for _ in range(prompt_blocks)] for _ in range(prompts)]
    batches: list[Batch] = []
    queries: list[list[BlockHash64]] = []
    chains: list[tuple[list[int], int]] = []
    for c in range(convs):
        node = f"node-{rng.randrange(nodes)}"
        p = sys_prompts[rng.randrange(prompts)]
        tail = [rng.getrandbits(64) for _ in range(tail_blocks)]
        chain = p + tail
        chains.append((chain, len(p)))
        evs: list[KVEvent] = [
            BlockStored(tuple(chain[i : i + 16]), None, (), 16) for i in range(0, len(chain), 16)
        ]
        for i in range(0, len(evs), 4):
            batches.append((node, c % 2, evs[i : i + 4]))
    for _ in range(n_queries):
        # a query shares a system prompt and part of a conversation, then diverges (new blocks up to
        # the query size: a router sends the whole prompt's hashes)
        chain, plen = chains[rng.randrange(len(chains))]
        cut = rng.randrange(plen, len(chain) + 1)
        fresh = [rng.getrandbits(64) for _ in range(max(8, query_blocks - cut))]
        queries.append([BlockHash64(h) for h in (chain[:cut] + fresh)[: max(query_blocks, cut + 8)]])
    rng.shuffle(queries)
    return batches, queries


async def ingest(index: Index, batches: Sequence[Batch], concurrency: int) -> float:
    """Block-events/s, with ``concurrency`` nodes' streams in flight (a coordinator serves many agents)."""
    per_node: dict[str, list[Batch]] = {}
    for b in batches:
        per_node.setdefault(b[0], []).append(b)
    streams = list(per_node.values())
    blocks = sum(len(e.block_hashes) for _, _, evs in batches for e in evs if isinstance(e, BlockStored))

    async def worker(mine: list[list[Batch]]) -> None:
        for stream in mine:
            for node, rank, evs in stream:
                await index.apply(MODEL, node, rank, ops_of(evs))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(streams[i::concurrency]) for i in range(concurrency)))
    return blocks / (time.perf_counter() - t0)


async def lookups(
    a: Index, b: Index, queries: Sequence[list[BlockHash64]]
) -> tuple[tuple[float, float], tuple[float, float]]:
    """p50 and p99 (microseconds) of one-at-a-time match latency on ``a`` and on ``b``.

    Interleaved query by query (alternating which goes first), so that both backends see the same
    machine load: this VM is shared, and a sequential run would compare two different moments.
    """
    for q in queries[:20]:
        await a.match(MODEL, q)
        await b.match(MODEL, q)
    lat: tuple[list[float], list[float]] = ([], [])
    for i, q in enumerate(queries):
        order = ((0, a), (1, b)) if i % 2 == 0 else ((1, b), (0, a))
        for k, index in order:
            t0 = time.perf_counter()
            await index.match(MODEL, q)
            lat[k].append((time.perf_counter() - t0) * 1e6)

    def pct(xs: list[float]) -> tuple[float, float]:
        xs.sort()
        return statistics.median(xs), xs[min(len(xs) - 1, int(len(xs) * 0.99))]

    return pct(lat[0]), pct(lat[1])


async def run(args: argparse.Namespace, url: str, used_memory: object) -> dict[str, object]:
    half = args.query_blocks // 2
    batches, queries = workload(
        nodes=args.nodes,
        prompts=32,
        prompt_blocks=half,
        convs=200 if args.quick else 800,
        tail_blocks=half,
        query_blocks=args.query_blocks,
        n_queries=300 if args.quick else 1000,
    )
    mem = MemoryIndex()
    red = RedisIndex.from_uri(url, key_prefix="bench")
    assert await red.remote.ping()
    mem_ingest = await ingest(mem, batches, 1)
    await red.apply(MODEL, "warm", 0, ops_of([BlockStored((1,), None, (), 16)]))
    before = used_memory()  # type: ignore[operator]
    red_ingest = await ingest(red, batches, args.concurrency)
    after = used_memory()  # type: ignore[operator]
    await red.remove_node("warm")
    st_mem, st_red = await mem.stats(), await red.stats()
    assert (st_mem.entries, st_mem.blocks) == (st_red.entries, st_red.blocks), (st_mem, st_red)
    answers = []
    for q in queries[:50]:  # same answers
        answers.append(await mem.match(MODEL, q))
        assert answers[-1] == await red.match(MODEL, q)
    (m50, m99), (r50, r99) = await lookups(mem, red, queries)
    mirror = await run_mirror(args, url, mem, batches, queries, answers)
    out = {
        "backend": red.backend,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "nodes": args.nodes,
        "entries": st_red.entries,
        "blocks": st_red.blocks,
        "query_blocks": args.query_blocks,
        "matched_blocks_mean": round(statistics.mean(max(m.matched_blocks for m in r) for r in answers), 1),
        "ingest_block_events_per_s": {"memory": round(mem_ingest), "redis": round(red_ingest)},
        "ingest_ratio_redis_over_memory": round(red_ingest / mem_ingest, 3),
        "ingest_target_100k_met": red_ingest >= 100_000,
        "lookup_us": {"memory": {"p50": round(m50, 1), "p99": round(m99, 1)},
                      "redis": {"p50": round(r50, 1), "p99": round(r99, 1)}},
        "lookup_p50_ratio": round(r50 / m50, 2),
        "lookup_p99_ratio": round(r99 / m99, 2),
        "lookup_p50_target_3x_met": r50 <= 3 * m50,
        "redis_bytes_per_entry": round((int(after) - int(before)) / st_red.entries, 1),
        "redis_round_trips": red.metrics.round_trips,
        **mirror,
    }
    await mem.close()
    await red.close()
    return out


async def run_mirror(args: argparse.Namespace, url: str, mem: MemoryIndex, batches: list[Any],
                     queries: Sequence[list[BlockHash64]], answers: list[Any]) -> dict[str, object]:
    """The same load into a second keyspace with the change feed on (a ``?mirror=1`` reader started
    first), written by a plain client as another replica would; then the reader's lookups, which it
    answers from its copy, against the memory backend's (interleaved, as above)."""
    reader = RedisIndex.from_uri(url + "?mirror=1", key_prefix="bench-mirror")
    writer = RedisIndex.from_uri(url, key_prefix="bench-mirror")
    try:
        assert await reader.mirror_ready()
        fed_ingest = await ingest(writer, batches, args.concurrency)
        copy = reader._mirror
        assert copy is not None
        t0 = time.perf_counter()
        for tag in reader._tags:
            while copy.seq.get(tag, 0) < int(await writer._r.get(f"{tag}:feedseq") or 0):
                await asyncio.sleep(0.001)
        lag = time.perf_counter() - t0
        for q, want in zip(queries[:50], answers, strict=True):
            assert await reader.match(MODEL, q) == want
        before = copy.lookups
        (m50, m99), (r50, r99) = await lookups(mem, reader, queries)
        assert copy.lookups > before, "lookups did not come from the copy"
        size = sum(sys.getsizeof(d) + sum(sys.getsizeof(k) + sys.getsizeof(v) for k, v in d.items())
                   for models in copy.inv.values() for d in models.values())
        entries = sum(len(d) for models in copy.inv.values() for d in models.values())
        return {
            "mirror": {
                "ingest_block_events_per_s_with_feed": round(fed_ingest),
                "ingest_target_100k_met": fed_ingest >= 100_000,
                "copy_caught_up_after_ingest_s": round(lag, 3),
                "lookup_us": {"memory": {"p50": round(m50, 1), "p99": round(m99, 1)},
                              "redis_mirror": {"p50": round(r50, 1), "p99": round(r99, 1)}},
                "lookup_p50_ratio": round(r50 / m50, 2),
                "lookup_p99_ratio": round(r99 / m99, 2),
                "lookup_p50_target_3x_met": r50 <= 3 * m50,
                "copy_bytes_per_block_est": round(size / max(1, entries), 1),
                "feed_entries_applied": copy.entries_applied,
            }
        }
    finally:
        await reader.close()
        await writer.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small data set (a few seconds)")
    ap.add_argument("--cluster", action="store_true", help="also run on a 3-shard Redis Cluster")
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--query-blocks", type=int, default=512, help="blocks per lookup query")
    ap.add_argument("--concurrency", type=int, default=16, help="agent streams in flight during ingest")
    args = ap.parse_args()
    results = []
    with redis_server() as server:
        results.append(asyncio.run(run(args, server.url, server.used_memory)))
    if args.cluster:
        with redis_cluster() as cluster:
            results.append(asyncio.run(run(args, cluster.url, cluster.used_memory)))
    for r in results:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
