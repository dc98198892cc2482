"""Coordinator RPC benchmark: lookup latency vs an empty RPC, and stream ingest vs in-process apply.

One run, one server: ``kvcoord serve`` (memory index) as a subprocess, reached over real gRPC on
127.0.0.1 from this process, so client and server do not share a GIL (they do share the machine).

- Load: one short ingest stream per node (Hello, a snapshot of its whole contents, Ack), 8 at a time;
  the nodes stay live afterwards (lease 3600 s). 64 nodes hold 31 private 512-block chains each and 2
  chains from a shared pool of 16 (>= 1M distinct blocks), so a query for a shared chain matches all
  512 blocks on several nodes.
- Lookup: 512-block hash queries for shared chains (``AsyncCoordinatorClient.lookup_raw``); baseline:
  ``Ping`` (no work), interleaved with them.
- Ingest: ``--agents`` agents each stream ``--batches`` batches of 64 blocks (``--events`` BlockStored
  events per batch, each chaining on the previous, with their token ids as vLLM publishes them; model not
  configured, so no hash verification), concurrently, until everything is acked. Two clients:
  ``raw`` writes pre-serialised batches, one stream message per batch (the server's worst case),
  ``reporter`` uses the real :class:`Reporter` (``submit`` of engine events: conversion, batching,
  and, when it falls behind, up to 64 queued batches per message; each batch keeps its own seq and
  outcome); ``raw stream, N batches/message`` (``--group``, default 8 and 16) writes the same batches N
  to an ``EventBatches`` message, which shows how much of the server's cost is per gRPC message.
  Baseline: the same batches applied to a fresh in-process ``MemoryIndex.apply_sync``.
  Each figure is the median of ``--repeat`` rounds (fresh node ids each round). Server and client
  CPU time per batch are printed too: on a shared 2-core machine they explain the wall-clock rate.

Usage: ``python benchmarks/bench_coordinator.py [--quick] [--profile server.prof]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc
import grpc.aio

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.reporter import Reporter
from kvcoord.agent.stream import INGEST_METHOD
from kvcoord.events import BlockStored
from kvcoord.index.memory import MemoryIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.validate import ops_of, pack_u64
from kvcoord.wire import events_to_proto, snapshot_to_proto
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

CHAIN = 512
BLOCK = 16
MODEL = "bench-model"
INGEST_MODEL = "bench-ingest"
SNAP_CHUNK = ReporterOptions().snapshot_chunk_entries
"""Blocks per Snapshot message, as ``kvcoord agent`` sends them (65,536 before 2026-12-01 21:44 UTC)."""

Batches = list[list[BlockStored]]


@contextlib.contextmanager
def server(port: int, mport: int, profile: str | None) -> Iterator[int]:
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
                      "--index", "memory",
                      "--lease-seconds", "3600", "--max-query-blocks", "8192")
    if profile:
        cmd = [cmd[0], "-m", "cProfile", "-o", profile, *cmd[1:]]
    log = Path(tempfile.gettempdir()) / "kvcoord-bench-coordinator-server.log"
    with running(cmd, log=log) as proc:
        wait_for_port(port, timeout=30)
        yield proc.pid


def handler_mean(mport: int, metric: str, labels: str) -> float:
    """Mean of a server-side histogram (the Lookup handler's own time), from /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=10).read().decode()
    vals = {}
    for line in text.splitlines():
        for part in ("_sum", "_count"):
            if line.startswith(metric + part + labels):
                vals[part] = float(line.rsplit(" ", 1)[1])
    return vals["_sum"] / vals["_count"] if vals.get("_count") else float("nan")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc; 10 ms resolution)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def node_contents(nodes: int, private: int, shared_pool: list[list[int]],
                  rng: random.Random) -> dict[str, list[int]]:
    """Each node: ``private`` chains of its own plus 2 chains from the shared pool, all on GPU."""
    out: dict[str, list[int]] = {}
    for n in range(nodes):
        hashes = [rng.getrandbits(64) for _ in range(private * CHAIN)]
        for chain in rng.sample(shared_pool, 2):
            hashes.extend(chain)
        out[f"node-{n:02d}"] = hashes
    return out


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def _raw(b: bytes) -> bytes:
    return b


class RawStream:
    """An Ingest stream driven with pre-serialised messages (no Reporter logic)."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self.call: Any = channel.stream_stream(INGEST_METHOD, request_serializer=_raw,
                                               response_deserializer=pb.CoordinatorMessage.FromString)()

    async def expect(self, kind: str) -> pb.CoordinatorMessage:
        msg = await self.call.read()
        if msg is grpc.aio.EOF:
            raise RuntimeError(f"stream closed: {await self.call.code()} {await self.call.details()}")
        if msg.WhichOneof("msg") != kind:
            raise RuntimeError(f"expected {kind}, got {msg}")
        return msg  # type: ignore[no-any-return]

    async def open(self, node: str, model: str, hashes: list[int]) -> None:
        """Hello, then the snapshot the coordinator asks for, until it is acked."""
        hello = pb.Hello(node_id=node, model=model, dp_ranks=[0], epoch=1, next_seq=1)
        await self.call.write(pb.AgentMessage(hello=hello).SerializeToString())
        w = await self.expect("welcome")
        assert w.welcome.snapshot_required
        start = 0
        while True:
            part = hashes[start:start + SNAP_CHUNK]
            start += SNAP_CHUNK
            snap = snapshot_to_proto(1, 0, 0, part, (), start >= len(hashes))
            await self.call.write(pb.AgentMessage(snapshot=snap).SerializeToString())
            if snap.final:
                break
        await self.expect("ack")

    async def close(self) -> None:
        await self.call.done_writing()
        while await self.call.read() is not grpc.aio.EOF:
            pass


async def load_nodes(address: str, contents: dict[str, list[int]], parallel: int = 8) -> None:
    sem = asyncio.Semaphore(parallel)
    async with grpc.aio.insecure_channel(address, options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
        async def one(node: str, hashes: list[int]) -> None:
            async with sem:
                s = RawStream(ch)
                await s.open(node, MODEL, hashes)
                await s.close()

        await asyncio.gather(*(one(n, h) for n, h in contents.items()))


async def bench_lookup(address: str, queries: list[list[int]],
                       samples: int) -> tuple[list[float], list[float]]:
    async with AsyncCoordinatorClient(address, timeout=30) as client:
        reqs = [pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=pack_u64(c))) for c in queries]
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


# --- ingest ------------------------------------------------------------------------------------
def make_batches(agents: int, batches: int, events: int, rng: random.Random) -> list[Batches]:
    """Per agent, ``batches`` batches of 64 blocks split over ``events`` chained BlockStored events."""
    per_event = 64 // events
    out: list[Batches] = []
    for _ in range(agents):
        node: Batches = []
        parent: int | None = None
        for _ in range(batches):
            batch: list[BlockStored] = []
            for _ in range(events):
                hashes = tuple(rng.getrandbits(64) for _ in range(per_event))
                tokens = tuple(rng.getrandbits(17) for _ in range(per_event * BLOCK))
                batch.append(BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                                         block_size=BLOCK))
                parent = hashes[-1]
            node.append(batch)
        out.append(node)
    return out


def blocks_of(work: list[Batches]) -> int:
    return sum(len(ev.block_hashes) for node in work for batch in node for ev in batch)


def apply_rate(work: list[Batches]) -> float:
    """Baseline: the same batches applied to a fresh in-process MemoryIndex (sync API, no await)."""
    index = MemoryIndex()
    t0 = time.perf_counter()
    for a, node in enumerate(work):
        nid = f"ingest-{a}"
        for batch in node:
            index.apply_sync(INGEST_MODEL, nid, 0, ops_of(batch))
    return blocks_of(work) / (time.perf_counter() - t0)


def serialise(node: Batches, group: int = 1) -> list[bytes]:
    """One ``AgentMessage`` per ``group`` consecutive batches (``batch`` when 1, else ``batches``)."""
    eb = [pb.EventBatch(seq=i + 1, ts=time.time(), dp_rank=0, events=events_to_proto(b))
          for i, b in enumerate(node)]
    if group == 1:
        return [pb.AgentMessage(batch=b).SerializeToString() for b in eb]
    return [pb.AgentMessage(batches=pb.EventBatches(batches=eb[i:i + group])).SerializeToString()
            for i in range(0, len(eb), group)]


async def ingest_raw(address: str, work: list[Batches], tag: str, msgs: list[list[bytes]]) -> float:
    """All agents write their pre-serialised batches (``msgs``, per agent) back to back; done when
    every last seq is acked."""
    async with grpc.aio.insecure_channel(address) as ch:
        streams = [RawStream(ch) for _ in work]
        for a, s in enumerate(streams):
            await s.open(f"raw-{tag}-{a}", INGEST_MODEL, [])

        async def drive(s: RawStream, data: list[bytes]) -> None:
            async def write() -> None:
                for d in data:
                    await s.call.write(d)

            writer = asyncio.create_task(write())
            last = len(work[0])
            while True:
                m = await s.expect("ack")
                if m.ack.seq == last:
                    break
            await writer

        t0 = time.perf_counter()
        await asyncio.gather(*(drive(s, d) for s, d in zip(streams, msgs, strict=True)))
        rate = blocks_of(work) / (time.perf_counter() - t0)
        for s in streams:
            await s.close()
    return rate


async def ingest_reporters(address: str, work: list[Batches], tag: str) -> float:
    """One real Reporter per agent; ``submit`` per batch, timed until every coordinator ack is in."""
    opts = ReporterOptions(max_batch_blocks=64, flush_interval=0.005, max_unacked_batches=100_000)
    reps = [Reporter([address], node_id=f"rep-{tag}-{a}", model=INGEST_MODEL, epoch=1,
                     snapshot=lambda r: [], options=opts) for a in range(len(work))]
    for r in reps:
        await r.start()
    try:
        for r in reps:
            await r.wait_connected(30)
        t0 = time.perf_counter()
        # Interleave agents like concurrent engines: one batch per agent per round, yielding in between.
        for i in range(max(len(n) for n in work)):
            for r, node in zip(reps, work, strict=True):
                if i < len(node):
                    r.submit(0, node[i])
            if i % 8 == 7:
                await asyncio.sleep(0)
        t_sub = time.perf_counter() - t0
        await asyncio.gather(*(r.wait_acked(300) for r in reps))
        rate = blocks_of(work) / (time.perf_counter() - t0)
        if os.environ.get("BENCH_DEBUG"):
            print(f"submit {t_sub:.3f}s total {time.perf_counter() - t0:.3f}s")
        for r, node in zip(reps, work, strict=True):
            st = r.stats().links[0]
            assert st.batches_acked >= len(node) and st.snapshot_requests == 0, st
    finally:
        for r in reps:
            await r.close()
    return rate


async def main(args: argparse.Namespace) -> None:
    rng = random.Random(42)
    nodes = 8 if args.quick else 64
    private = 4 if args.quick else 31
    shared_pool = [[rng.getrandbits(64) for _ in range(CHAIN)] for _ in range(16)]
    contents = node_contents(nodes, private, shared_pool, rng)
    port, mport = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    with server(port, mport, args.profile) as pid:
        t0 = time.perf_counter()
        await load_nodes(address, contents)
        async with AsyncCoordinatorClient(address, timeout=60) as client:
            st = await client.stats()
        print(f"server: kvcoord serve subprocess (memory index); index {st.blocks:,} distinct blocks, "
              f"{st.entries:,} entries over {nodes} nodes (snapshots, {time.perf_counter() - t0:.1f}s)")

        samples = 300 if args.quick else 3000
        held = {h for hashes in contents.values() for h in hashes}
        queries = [c for c in shared_pool if c[0] in held]
        ping, look = await bench_lookup(address, queries, samples)
        p50p, p99p = pct(ping, 50), pct(ping, 99)
        p50l, p99l = pct(look, 50), pct(look, 99)
        print(f"ping   p50 {p50p * 1e6:8.1f} us  p99 {p99p * 1e6:8.1f} us  ({samples} samples)")
        print(f"lookup p50 {p50l * 1e6:8.1f} us  p99 {p99l * 1e6:8.1f} us  (512-block hash queries)")
        print(f"lookup/ping: p50 {p50l / p50p:.2f}x (target <= 1.5x), p99 {p99l / p99p:.2f}x; "
              f"mean {statistics.fmean(look) / statistics.fmean(ping):.2f}x")
        mean = handler_mean(mport, "kvcoord_lookup_latency_seconds", '{query="hashes"}')
        print(f"  server-side Lookup handler time: mean {mean * 1e6:.0f} us (the rest is gRPC, both sides)")

        batches = args.batches or (100 if args.quick else 400)
        nbatches = args.agents * batches
        base: list[float] = []
        groups = [g for g in args.group if g > 1]
        results: dict[str, list[tuple[float, float, float]]] = {"raw stream": []}
        for g in groups:
            results[f"raw stream, {g} batches/message"] = []
        results["Reporter"] = []
        for r in range(args.repeat):
            work = make_batches(args.agents, batches, args.events, rng)
            base.append(apply_rate(work))
            runs = []
            # Serialised here, outside the timed and CPU-counted part.
            if args.client in ("raw", "both"):
                single = [serialise(node) for node in work]
                runs.append(("raw stream", lambda a, w, t, m=single: ingest_raw(a, w, t, m)))
            if args.client in ("grouped", "both"):
                for g in groups:
                    multi = [serialise(node, g) for node in work]
                    runs.append((f"raw stream, {g} batches/message",
                                 lambda a, w, t, m=multi, g=g: ingest_raw(a, w, f"g{g}-{t}", m)))
            if args.client in ("reporter", "both"):
                runs.append(("Reporter", ingest_reporters))
            for name, fn in runs:
                s0, c0 = cpu_seconds(pid), time.process_time()
                rate = await fn(address, work, str(r))
                results[name].append((rate, cpu_seconds(pid) - s0, time.process_time() - c0))
        apply_med = statistics.median(base)
        print(f"ingest: {args.agents} agents x {batches} batches of 64 blocks ({args.events} BlockStored "
              f"events each, with token ids), median of {args.repeat}")
        print(f"  in-process MemoryIndex.apply_sync {apply_med:12,.0f} blocks/s "
              f"({64 / apply_med * 1e6:.0f} us per batch)")
        for name, res in results.items():
            if res:
                m = statistics.median(x[0] for x in res)
                srv = statistics.median(x[1] for x in res) / nbatches * 1e6
                cli = statistics.median(x[2] for x in res) / nbatches * 1e6
                print(f"  {name:<33} {m:12,.0f} blocks/s  ratio {m / apply_med:.2f}x (target >= 0.5x); "
                      f"CPU per batch: server {srv:.0f} us, client {cli:.0f} us (incl. stream setup)")

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="8 nodes, fewer samples (for development)")
    ap.add_argument("--agents", type=int, default=8, help="concurrent ingest agents (default 8)")
    ap.add_argument("--batches", type=int, default=0, help="batches per agent (default 400; --quick 100)")
    ap.add_argument("--events", type=int, default=4, choices=(1, 2, 4, 8, 16),
                    help="BlockStored events per 64-block batch (default 4)")
    ap.add_argument("--repeat", type=int, default=3, help="ingest rounds; medians are printed (default 3)")
    ap.add_argument("--client", choices=("raw", "grouped", "reporter", "both"), default="both")
    ap.add_argument("--group", type=lambda v: [int(x) for x in v.split(",")], default=[8, 16],
                    help="batches per EventBatches message of the grouped raw clients, comma-separated "
                         "(default 8,16; the Reporter sends up to 64 when behind; 1: none)")
    ap.add_argument("--profile", default=None, metavar="PATH", help="run the server under cProfile")
    asyncio.run(main(ap.parse_args()))
