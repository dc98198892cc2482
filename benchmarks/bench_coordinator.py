"""Coordinator RPC benchmark: lookup latency vs an empty RPC, and stream ingest vs in-process apply.

One run, one server: an in-process ``CoordinatorServer`` (memory index) on its own thread and event
loop, reached over real gRPC on 127.0.0.1 from the benchmark's loop.

- The index is loaded through the stream: 64 reporters connect, and each answers the coordinator's
  snapshot request with its whole contents (>= 1M distinct blocks in total).
  Each node holds 31 private 512-block chains and 2 chains from a shared pool of 16, so a query
  for a shared chain matches all 512 blocks on several nodes.
- Lookup: 512-block hash queries for shared chains; baseline: ``Ping`` (no work), interleaved with them.
- Ingest: a ``Reporter`` streams BlockStored batches of 64 blocks (one node, unconfigured model, so no
  hash verification) until all are acked; baseline: the same batches applied to a fresh in-process
  ``MemoryIndex``.

Usage: ``python benchmarks/bench_coordinator.py [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcoord.agent.reporter import Reporter, ReporterOptions
from kvcoord.coordinator.config import CoordinatorConfig, Limits
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.events import BlockStored, Tier
from kvcoord.index.memory import MemoryIndex
from kvcoord.proto.v1 import kvcoord_pb2 as pb
from kvcoord.router.client import AsyncCoordinatorClient
from tests.procs import free_port

CHAIN = 512
MODEL = "bench-model"


class ServerThread:
    """A CoordinatorServer on its own thread and loop, so client and server do not share a loop."""

    def __init__(self, config: CoordinatorConfig, index: MemoryIndex) -> None:
        self.config = config
        self.index = index
        self.loop = asyncio.new_event_loop()
        self.server: CoordinatorServer | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="coordinator", daemon=True)

    def _run(self) -> None:
        self.loop.run_until_complete(self._main())

    async def _main(self) -> None:
        self._stop = asyncio.Event()
        self.server = CoordinatorServer(self.config, self.index)
        await self.server.start()
        self._ready.set()
        await self._stop.wait()
        await self.server.stop()

    def start(self) -> None:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("server did not start")

    def stop(self) -> None:
        assert self._stop is not None
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


def stored(hashes: list[int], parent: int | None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=(), block_size=16)


def node_contents(nodes: int, private: int, shared_pool: list[list[int]],
                  rng: random.Random) -> dict[str, list[tuple[int, Tier]]]:
    """Each node: ``private`` chains of its own plus 2 chains from the shared pool, all on GPU."""
    out: dict[str, list[tuple[int, Tier]]] = {}
    for n in range(nodes):
        hashes = [rng.getrandbits(64) for _ in range(private * CHAIN)]
        for chain in rng.sample(shared_pool, 2):
            hashes.extend(chain)
        out[f"node-{n:02d}"] = [(h, Tier.GPU) for h in hashes]
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


async def bench_lookup(address: str, queries: list[list[int]],
                       samples: int) -> tuple[list[float], list[float]]:
    async with AsyncCoordinatorClient(address, timeout=30) as client:
        reqs = [pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=c)) for c in queries]
        resp = await client.lookup_raw(reqs[0])
        assert resp.num_blocks == CHAIN and resp.nodes and resp.nodes[0].matched_blocks == CHAIN, resp
        for i in range(min(200, samples)):  # warm up
            await client.ping()
            await client.lookup_raw(reqs[i % len(reqs)])
        ping: list[float] = []
        look: list[float] = []
        for i in range(samples):
            t0 = time.perf_counter()
            await client.ping()
            t1 = time.perf_counter()
            await client.lookup_raw(reqs[i % len(reqs)])
            t2 = time.perf_counter()
            ping.append(t1 - t0)
            look.append(t2 - t1)
        return ping, look


async def bench_ingest(address: str, batches: int, rng: random.Random) -> tuple[float, float]:
    events = []
    parent = None
    for _ in range(batches):
        hashes = [rng.getrandbits(64) for _ in range(64)]
        events.append(stored(hashes, parent))
        parent = hashes[-1]
    blocks = batches * 64

    # baseline: the same batches applied in-process to a fresh index
    index = MemoryIndex()
    t0 = time.perf_counter()
    for ev in events:
        await index.apply("bench-ingest", "ingest-node", 0, [ev])
    apply_rate = blocks / (time.perf_counter() - t0)
    await index.close()

    opts = ReporterOptions(max_batch_blocks=64, flush_interval=0.001, max_unacked_batches=batches + 16)
    rep = Reporter([address], node_id="ingest-node", model="bench-ingest", epoch=1, snapshot=lambda r: [],
                   options=opts)
    await rep.start()
    try:
        await rep.wait_connected(30)  # welcomed, empty snapshot applied
        t0 = time.perf_counter()
        for ev in events:
            rep.submit(0, [ev])
        await rep.wait_acked(300)
        stream_rate = blocks / (time.perf_counter() - t0)
        st = rep.stats().links[0]
        assert st.batches_acked >= batches, st
    finally:
        await rep.close()
    return stream_rate, apply_rate


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(42)
    nodes = 8 if args.quick else 64
    private = 4 if args.quick else 31
    shared_pool = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(16)]
    contents = node_contents(nodes, private, shared_pool, rng)

    cfg = CoordinatorConfig(listen=f"127.0.0.1:{free_port()}", metrics_listen="",
                            limits=Limits(max_query_blocks=8192), lease_seconds=3600.0)
    srv = ServerThread(cfg, MemoryIndex())
    srv.start()
    reporters: list[Reporter] = []
    try:
        assert srv.server is not None
        address = srv.server.address
        # Load through the stream: each node's Hello is answered with snapshot_required, and its
        # snapshot (its whole contents) replaces its entries. The reporters stay connected (live nodes).
        t0 = time.perf_counter()
        for node, entries in contents.items():
            rep = Reporter([address], node_id=node, model=MODEL, epoch=1,
                           snapshot=lambda rank, e=entries: e,  # type: ignore[misc]
                           options=ReporterOptions(welcome_timeout=120.0))
            await rep.start()
            reporters.append(rep)
        for rep in reporters:
            await rep.wait_connected(300)
        async with AsyncCoordinatorClient(address) as client:
            st = await client.stats()
        print(f"index: {st.blocks:,} distinct blocks, {st.entries:,} entries over {nodes} nodes "
              f"(loaded through the stream as snapshots in {time.perf_counter() - t0:.1f}s)")

        samples = 300 if args.quick else 2000
        held = {h for entries in contents.values() for h, _ in entries}
        queries = [c for c in shared_pool if c[0] in held]
        ping, look = await bench_lookup(address, queries, samples)
        p50p, p99p = pct(ping, 50), pct(ping, 99)
        p50l, p99l = pct(look, 50), pct(look, 99)
        print(f"ping   p50 {p50p * 1e6:8.1f} us  p99 {p99p * 1e6:8.1f} us  ({samples} samples)")
        print(f"lookup p50 {p50l * 1e6:8.1f} us  p99 {p99l * 1e6:8.1f} us  (512-block hash queries)")
        print(f"lookup/ping: p50 {p50l / p50p:.2f}x (target <= 1.5x), p99 {p99l / p99p:.2f}x; "
              f"mean {statistics.fmean(look) / statistics.fmean(ping):.2f}x")
        batches = 300 if args.quick else 3000
        stream_rate, apply_rate = await bench_ingest(address, batches, rng)
        print(f"ingest: stream {stream_rate:,.0f} blocks/s, in-process apply {apply_rate:,.0f} blocks/s, "
              f"ratio {stream_rate / apply_rate:.2f}x (target >= 0.5x; {batches} batches of 64 blocks)")
    finally:
        for rep in reporters:
            await rep.close()
        srv.stop()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 nodes, fewer samples (for development)")
    asyncio.run(main(ap.parse_args()))
