"""Lookups and memory while hostile agents flood a coordinator with snapshots that never finish (issue 15,
item 2: "8 concurrent oversized snapshots: RSS stays under the budget, memory returns to within 10% of its
baseline afterwards, and lookup p99 stays under 20 ms meanwhile").

Timing and RSS targets live here, never in the test suite (``tests/coordinator/test_snapshot_budget.py``
proves the
refusal itself). One run:

- Server: ``kvcoord serve`` (memory index, HTTP API on,
  ``--model flood-model,algo=xxhash,block_size=16,seed=42``,
  ``--max-staged-snapshot-blocks BUDGET``) on free ports, optionally with the glibc knobs an operator would
  set (``--malloc-arena-max``, ``--malloc-trim-threshold``).
- Index: ``--nodes`` agent streams (Hello, then a finished snapshot: some of 32 shared 512-block "system
  prompts" plus unique blocks, in chunks of the size ``kvcoord agent`` sends), kept alive with
  heartbeats for the whole run.
- Lookups: a separate client process sends sequential HTTP ``/query_by_hash`` lookups (a shared prefix cut
  at 256-512 blocks plus 64 unknown blocks; every answer must match) at ``--lookup-rate`` per second, from
  the baseline phase to the end; latencies are split by phase afterwards.
- Baseline: ``--baseline-s`` seconds of lookups, no flood; the server's RSS before it is the baseline.
- Flood: ``--waves`` waves of ``--streams`` concurrent gRPC streams, each on its own connection: Hello,
  then Snapshot chunks never marked ``final`` until the stream is refused (RESOURCE_EXHAUSTED) or it sent
  ``--blocks-per-stream``; then the streams still open are cancelled (their staging is released). A stream
  stops writing as soon as its reader sees the refusal (a chunk already in flight may still go out: a
  hostile agent does not wait either). The server's VmRSS is sampled every 50 ms.
- After: ``--settle-s`` seconds with no flood, then RSS again.

``--quick`` is a short smoke run. Prints one table; exits 0 whatever the figures (they are reported, not
asserted). Every process started here is stopped at the end (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvcoord.agent.link import ReporterOptions  # noqa: E402
from kvcoord.proto.v2 import kvcoord_pb2 as pb  # noqa: E402
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg  # noqa: E402
from kvcoord.wire import snapshot_to_proto  # noqa: E402
from tests.coordinator.test_hardening import hello  # noqa: E402
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port  # noqa: E402

MODEL = "flood-model"
PREFIXES, PREFIX_BLOCKS = 32, 512
AGENT_CHUNK = ReporterOptions().snapshot_chunk_entries
"""``kvcoord agent``'s default ``snapshot_chunk_entries``."""
BYTES_PER_BLOCK = 9
"""What the config documents for a staged block (8 bytes of hash, 1 of tier when one is sent)."""
GRPC_OPTS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


def pct(xs: Sequence[float], p: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


class RssSampler(threading.Thread):
    """The server's VmRSS every ``period`` seconds, as (monotonic time, kB)."""

    def __init__(self, pid: int, period: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.pid, self.period = pid, period
        self.samples: list[tuple[float, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            with contextlib.suppress(OSError, ValueError):
                self.samples.append((time.monotonic(), rss_kb(self.pid)))
            self.halt.wait(self.period)

    def peak(self, t0: float, t1: float) -> int:
        return max((kb for t, kb in self.samples if t0 <= t <= t1), default=0)

    def median(self, t0: float, t1: float) -> float:
        xs = [kb for t, kb in self.samples if t0 <= t <= t1]
        return statistics.median(xs) if xs else float("nan")


# --- the lookup client (its own process) -----------------------------------------------------------------
def run_client(spec_path: str, out_path: str) -> None:
    """Sequential ``/query_by_hash`` lookups until stdin closes; writes (start, seconds) pairs and errors."""
    spec = json.loads(Path(spec_path).read_text())
    bodies = [json.dumps({"model_name": MODEL, "block_hashes": q}).encode() for q in spec["queries"]]
    gap = 1.0 / spec["rate"] if spec["rate"] > 0 else 0.0
    stop = threading.Event()
    def wait_stdin() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    conn = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=30)
    starts, took = array("d"), array("d")
    errors, misses, k = 0, 0, 0
    nxt = time.monotonic()
    while not stop.is_set():
        body = bodies[k % len(bodies)]
        k += 1
        t0 = time.monotonic()
        try:
            conn.request("POST", "/query_by_hash", body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            data = resp.read()
            dt = time.monotonic() - t0
            if resp.status != 200:
                errors += 1
            elif not json.loads(data).get("scores"):
                misses += 1
            starts.append(t0)
            took.append(dt)
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", spec["port"], timeout=30)
        if gap:
            nxt = max(nxt + gap, time.monotonic() - gap)
            delay = nxt - time.monotonic()
            if delay > 0:
                stop.wait(delay)
    Path(out_path).write_text(json.dumps({"starts": list(starts), "took": list(took),
                                          "errors": errors, "misses": misses}))


# --- index and flood streams --------------------------------------------------------------------------
@dataclass
class Fleet:
    prefixes: list[list[int]]
    calls: list[Any] = field(default_factory=list)
    entries: int = 0
    held: set[int] = field(default_factory=set)
    """Prefixes some node holds (lookups ask for those)."""


def chunk_msgs(hashes: Sequence[int], seq: int, chunk: int, final: bool) -> list[pb.AgentMessage]:
    out = []
    for start in range(0, len(hashes), chunk):
        last = final and start + chunk >= len(hashes)
        snap = snapshot_to_proto(1, seq, 0, hashes[start:start + chunk], (), last)
        out.append(pb.AgentMessage(snapshot=snap))
    return out


async def load_index(stub: pbg.CoordinatorStub, fleet: Fleet, nodes: int, unique: int,
                     rng: random.Random) -> None:
    """``nodes`` agents, each with a finished snapshot of 8 shared prefixes plus ``unique`` own blocks."""
    for n in range(nodes):
        call = stub.Ingest()
        await call.write(hello(f"node-{n}", MODEL))
        msg = await call.read()
        assert msg.WhichOneof("msg") == "welcome", msg
        held: list[int] = []
        for p in rng.sample(range(PREFIXES), 8):
            held += fleet.prefixes[p]
            fleet.held.add(p)
        held += [rng.getrandbits(64) for _ in range(unique)]
        for m in chunk_msgs(held, 1, AGENT_CHUNK, final=True):
            await call.write(m)
        msg = await call.read()
        assert msg.WhichOneof("msg") == "ack", msg
        fleet.calls.append(call)
        fleet.entries += len(set(held))


async def heartbeats(fleet: Fleet, stop: asyncio.Event) -> None:
    beat = pb.AgentMessage(heartbeat=pb.AgentHeartbeat())
    while not stop.is_set():
        for call in fleet.calls:
            await call.write(beat)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), 1.0)


@dataclass
class StreamResult:
    sent: int = 0
    code: str = "open"


async def flood_stream(target: str, node: str, chunks: list[pb.AgentMessage], blocks: int,
                       quiet: asyncio.Event, done: asyncio.Event) -> StreamResult:
    """One hostile agent: Hello, then unfinished snapshot chunks until refused or ``blocks`` sent (then
    ``quiet`` is set); a stream still open waits for ``done`` (the wave's end) and goes away."""
    res = StreamResult()
    async with grpc.aio.insecure_channel(target, options=GRPC_OPTS) as ch:
        call = pbg.CoordinatorStub(ch).Ingest()
        await call.write(hello(node, MODEL))
        msg = await call.read()
        assert msg.WhichOneof("msg") == "welcome", msg
        ended = asyncio.Event()

        async def reader() -> None:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                while await call.read() is not grpc.aio.EOF:
                    pass
            ended.set()

        rtask = asyncio.create_task(reader())
        k = 0
        while res.sent < blocks and not ended.is_set():
            m = chunks[k % len(chunks)]
            k += 1
            try:
                await call.write(m)
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                break
            res.sent += len(m.snapshot.block_hashes) // 8
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(ended.wait()), 0.3)  # a refusal in flight arrives
        quiet.set()
        if ended.is_set():
            code = await call.code()
            res.code = code.name if code is not None else "ended"
            if code != grpc.StatusCode.RESOURCE_EXHAUSTED:
                res.code += f" ({(await call.details())[:80]})"
        else:
            await done.wait()
            call.cancel()
        rtask.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await rtask
    return res


def flood_chunks(rng: random.Random, chunk: int, distinct: int = 4) -> list[pb.AgentMessage]:
    return [pb.AgentMessage(snapshot=pb.Snapshot(epoch=1, seq=0, dp_rank=0,
                                                 block_hashes=rng.randbytes(8 * chunk), final=False))
            for _ in range(distinct)]


# --- the run --------------------------------------------------------------------------------------------
@dataclass
class Wave:
    t0: float
    t1: float
    results: list[StreamResult]
    refused: int
    """Streams the server counted as refused (``snapshot_budget``) in this wave."""
    peak_kb: int = 0


def refused_total(mport: int) -> float:
    """``kvcoord_ingest_streams_refused_total{reason="snapshot_budget"}`` (the client may see a refusal
    as INTERNAL when a chunk it wrote crossed the server's RESOURCE_EXHAUSTED)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30) as r:
        for line in r.read().decode().splitlines():
            if line.startswith('kvcoord_ingest_streams_refused_total{reason="snapshot_budget"}'):
                return float(line.split()[1])
    return 0.0


async def drive(args: argparse.Namespace, port: int, hport: int, mport: int, proc: subprocess.Popen[bytes],
                sampler: RssSampler, work: Path) -> dict[str, Any]:
    rng = random.Random(args.seed)
    fleet = Fleet([[rng.getrandbits(64) for _ in range(PREFIX_BLOCKS)] for _ in range(PREFIXES)])
    target = f"127.0.0.1:{port}"
    stop_beats = asyncio.Event()
    async with grpc.aio.insecure_channel(target, options=GRPC_OPTS) as ch:
        stub = pbg.CoordinatorStub(ch)
        await load_index(stub, fleet, args.nodes, args.unique_blocks, rng)
        stats = await stub.Stats(pb.StatsRequest(), timeout=30)
        beats = asyncio.create_task(heartbeats(fleet, stop_beats))
        queries = []
        for _ in range(256):
            p = fleet.prefixes[rng.choice(sorted(fleet.held))]
            queries.append(p[:rng.randint(256, PREFIX_BLOCKS)] + [rng.getrandbits(64) for _ in range(64)])
        spec, out = work / "client.json", work / "client-out.json"
        spec.write_text(json.dumps({"port": hport, "rate": args.lookup_rate, "queries": queries}))
        chunks = flood_chunks(rng, args.chunk_blocks)
        await asyncio.sleep(1.0)
        t_rss0 = time.monotonic()
        await asyncio.sleep(1.0)
        rss_base = sampler.median(t_rss0, time.monotonic())
        client = subprocess.Popen([sys.executable, __file__, "--client", str(spec), str(out)],
                                  stdin=subprocess.PIPE, start_new_session=True)
        try:
            t_base0 = time.monotonic()
            await asyncio.sleep(args.baseline_s)
            t_base1 = t_flood0 = time.monotonic()
            spy = start_py_spy(args, proc.pid)
            waves: list[Wave] = []
            for w in range(args.waves):
                refused0 = refused_total(mport)
                done = asyncio.Event()
                quiet = [asyncio.Event() for _ in range(args.streams)]
                t0 = time.monotonic()
                tasks = [asyncio.create_task(flood_stream(target, f"flood-{w}-{i}", chunks,
                                                          args.blocks_per_stream, quiet[i], done))
                         for i in range(args.streams)]
                await asyncio.gather(*(q.wait() for q in quiet))  # each refused, or holding all it sent
                await asyncio.sleep(args.hold_s)  # the staged blocks held a moment: the RSS peak
                done.set()
                results = await asyncio.gather(*tasks)
                await asyncio.sleep(0.3)
                waves.append(Wave(t0, time.monotonic(), list(results), int(refused_total(mport) - refused0)))
            t_flood1 = time.monotonic()
            if spy is not None:
                spy.send_signal(2)  # py-spy writes its profile on SIGINT
                spy.wait(timeout=60)
            await asyncio.sleep(args.settle_s)
            t_after = time.monotonic()
            await asyncio.sleep(1.0)
            rss_after = sampler.median(t_after, time.monotonic())
        finally:
            assert client.stdin is not None
            client.stdin.close()
            try:
                client.wait(timeout=30)
            except subprocess.TimeoutExpired:
                client.kill()
                client.wait()
            stop_beats.set()
            await beats
            for call in fleet.calls:
                call.cancel()
    for wv in waves:
        wv.peak_kb = sampler.peak(wv.t0, wv.t1)
    lookups = json.loads(out.read_text())
    return {"stats_entries": stats.entries, "fleet_entries": fleet.entries, "rss_base_kb": rss_base,
            "rss_after_kb": rss_after, "waves": waves, "lookups": lookups,
            "phases": {"baseline": (t_base0, t_base1), "flood": (t_flood0, t_flood1)}}


def start_py_spy(args: argparse.Namespace, pid: int) -> subprocess.Popen[bytes] | None:
    """``py-spy record`` of the server over the flood (``--py-spy OUT``; 500 Hz, idle samples kept)."""
    if not args.py_spy:
        return None
    spy = ROOT / ".venv" / "bin" / "py-spy"
    return subprocess.Popen([str(spy), "record", "--pid", str(pid), "--format", args.py_spy_format,
                             "--nonblocking", "--idle", "--rate", "500", "-o", args.py_spy],
                            start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def phase(lookups: dict[str, Any], t0: float, t1: float) -> list[float]:
    return [d * 1e3 for s, d in zip(lookups["starts"], lookups["took"], strict=True) if t0 <= s < t1]


def report(args: argparse.Namespace, r: dict[str, Any], load: tuple[float, float, float]) -> None:
    base = phase(r["lookups"], *r["phases"]["baseline"])
    flood = phase(r["lookups"], *r["phases"]["flood"])
    mb = 1 / 1024
    budget_mb = args.budget * BYTES_PER_BLOCK / 2**20
    peak = max(w.peak_kb for w in r["waves"])
    print(f"\nsnapshot flood: {args.streams} streams x {args.blocks_per_stream:,} blocks x "
          f"{args.waves} waves, "
          f"chunks of {args.chunk_blocks:,} blocks; budget {args.budget:,} blocks "
          f"(~{budget_mb:.1f} MB at {BYTES_PER_BLOCK} B/block, {args.budget * 8 / 2**20:.1f} MB of hashes); "
          f"index {r['stats_entries']:,} entries on {args.nodes} nodes; env {server_env(args) or '-'}; "
          f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")
    print("\n| figure | baseline | flood | flood / baseline |\n|---|---:|---:|---:|")
    for name, p in (("lookup p50 ms", 50), ("lookup p99 ms", 99)):
        b, f = pct(base, p), pct(flood, p)
        print(f"| {name} | {b:.2f} | {f:.2f} | {f / b:.2f}x |")
    b, f = max(base, default=float("nan")), max(flood, default=float("nan"))
    print(f"| lookup max ms | {b:.2f} | {f:.2f} | {f / b:.2f}x |")
    print(f"| lookups (errors {r['lookups']['errors']}, empty answers {r['lookups']['misses']}) | "
          f"{len(base)} | {len(flood)} | |")
    rb, ra = r["rss_base_kb"], r["rss_after_kb"]
    print(f"| RSS MB (baseline / peak of all waves / after {args.settle_s:g} s) | {rb * mb:.1f} | "
          f"{peak * mb:.1f} (+{(peak - rb) * mb:.1f}) | after {ra * mb:.1f} = {ra / rb:.2f}x baseline |")
    for i, w in enumerate(r["waves"]):
        codes: dict[str, int] = {}
        for s in w.results:
            codes[s.code] = codes.get(s.code, 0) + 1
        sent = sum(s.sent for s in w.results)
        print(f"| wave {i + 1}: peak RSS MB, blocks sent, ends | | {w.peak_kb * mb:.1f} "
              f"(+{(w.peak_kb - rb) * mb:.1f}) | {sent:,} sent; server refused {w.refused}; "
              f"client saw {codes} |")
    lk = r["lookups"]
    t_f0, t_f1 = r["phases"]["flood"]
    slow = sorted(((d, t) for t, d in zip(lk["starts"], lk["took"], strict=True) if t_f0 <= t < t_f1),
                  reverse=True)[:5]

    def when(t: float) -> str:
        i = max((k for k, w in enumerate(r["waves"]) if w.t0 <= t), default=0)
        return f"wave {i + 1} +{t - r['waves'][i].t0:.2f} s"

    print("slowest flood lookups: " + ", ".join(f"{d * 1e3:.1f} ms ({when(t)})" for d, t in slow))
    print(f"\ntargets: peak growth {(peak - rb) * mb:.1f} MB vs budget {budget_mb:.1f} MB: "
          f"{'met' if (peak - rb) * mb <= budget_mb else 'MISSED'}; after/baseline {ra / rb:.2f} (<= 1.10): "
          f"{'met' if ra / rb <= 1.10 else 'MISSED'}; flood lookup p99 {pct(flood, 99):.2f} ms (< 20 ms): "
          f"{'met' if pct(flood, 99) < 20 else 'MISSED'}")


def server_env(args: argparse.Namespace) -> dict[str, str]:
    env = {}
    if args.malloc_arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.malloc_arena_max)
    if args.malloc_trim_threshold is not None:
        env["MALLOC_TRIM_THRESHOLD_"] = str(args.malloc_trim_threshold)
    for kv in args.server_env:
        k, _, v = kv.partition("=")
        env[k] = v
    return env


def main(args: argparse.Namespace) -> int:
    port, hport, mport = free_port(), free_port(), free_port()
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--http-listen", f"127.0.0.1:{hport}",
                      "--metrics-listen", f"127.0.0.1:{mport}", "--index", "memory",
                      "--model", f"{MODEL},algo=xxhash,block_size=16,seed=42",
                      "--max-staged-snapshot-blocks", str(args.budget))
    with tempfile.TemporaryDirectory() as tmp, \
            running(cmd, env=server_env(args), log=Path(args.log or Path(tmp) / "serve.log")) as proc:
        try:
            for p in (port, hport, mport):
                wait_for_port(p, timeout=30)
            sampler = RssSampler(proc.pid)
            sampler.start()
            try:
                result = asyncio.run(drive(args, port, hport, mport, proc, sampler, Path(tmp)))
            finally:
                sampler.halt.set()
                sampler.join()
        except BaseException:
            sys.stderr.write(Path(args.log or Path(tmp) / "serve.log").read_text()[-3000:])
            raise
    report(args, result, os.getloadavg())
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="short smoke run")
    ap.add_argument("--budget", type=int, default=6_000_000, help="--max-staged-snapshot-blocks")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--waves", type=int, default=4)
    ap.add_argument("--blocks-per-stream", type=int, default=2_000_000)
    ap.add_argument("--chunk-blocks", type=int, default=AGENT_CHUNK, help="blocks per Snapshot message")
    ap.add_argument("--nodes", type=int, default=16, help="agents of the loaded index")
    ap.add_argument("--unique-blocks", type=int, default=30_000, help="own blocks per loaded node")
    ap.add_argument("--lookup-rate", type=float, default=200.0, help="lookups/s (0: back to back)")
    ap.add_argument("--baseline-s", type=float, default=10.0)
    ap.add_argument("--hold-s", type=float, default=0.5, help="staged blocks held before a wave ends")
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--malloc-arena-max", type=int, default=0, help="MALLOC_ARENA_MAX for the server")
    ap.add_argument("--malloc-trim-threshold", type=int, default=None,
                    help="MALLOC_TRIM_THRESHOLD_ (bytes) for the server")
    ap.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for the server (repeatable)")
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--py-spy", default="", metavar="OUT", help="py-spy record the server over the flood")
    ap.add_argument("--py-spy-format", default="raw", choices=("raw", "speedscope", "flamegraph"))
    ap.add_argument("--log", default="", metavar="PATH", help="keep the server's log here")
    args = ap.parse_args(argv)
    if args.quick:
        args.waves, args.blocks_per_stream, args.budget = 1, 500_000, 2_000_000
        args.nodes, args.unique_blocks, args.baseline_s, args.settle_s = 4, 5_000, 2.0, 2.0
    return args


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        run_client(sys.argv[2], sys.argv[3])
        sys.exit(0)
    sys.exit(main(parse()))
