"""Fleet benchmark: a ramp of simulated engines at vLLM's step rate against a real ``kvcoord serve``.

Why: docs/scaling.md extrapolates from per-unit costs; this checks the sum on one machine and shows which
limit is reached first as the fleet grows.

- Engines: ``--client-procs`` processes, each hosting its share of the engines, one real
  :class:`~kvcoord.agent.reporter.Reporter` (its own gRPC ``Ingest`` stream) per engine on one asyncio loop.
  Like vLLM's scheduler, an engine emits one event batch per step (``--step-ms``, default 40, engines
  staggered): ``--events`` events, each a ``BlockStored`` of 1-``--max-blocks`` blocks (16 tokens each,
  token ids included, chained on the engine's last block, a new prefix 30% of the time) or, once the
  engine holds ``--capacity`` blocks, a ``BlockRemoved`` of its oldest 1-``--max-blocks``.
- Ramp: ``--stages`` engine counts (default: ``--engines`` / 8, / 4, / 2, / 1), ``--stage-seconds`` each;
  the first third of a stage is warm-up, the rest is measured.
- Measured per stage: offered and applied batches/s (``kvcoord_batches{outcome="applied"}``), ingest lag
  p50/p99 from the coordinator's ``kvcoord_ingest_lag_seconds`` histogram (engine timestamp to applied,
  bucket upper bounds), coordinator CPU (cores) and RSS, index entries, the engine processes' CPU and how
  late their steps ran, and the latency of ``--lookup-rate`` lookups/s (``POST /query_by_hash``, 64
  blocks of a live engine's chain, one keep-alive connection, from a separate process).
- Saturation: the first stage where lag p99 passes 1 s, applied falls under 95% of offered, the coordinator
  uses over 0.9 core, or the engines' steps run over one step late (then the machine, not the
  coordinator, is the limit; the coordinator's CPU per batch still extrapolates).

Usage: ``python benchmarks/bench_fleet.py [--engines 1000] [--step-ms 40] [--events 3] [--max-blocks 16]
[--stage-seconds 15] [--client-procs 2] [--lookup-rate 200] [--index memory|redis://...] [--quick]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import multiprocessing as mp
import os
import random
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.reporter import Reporter
from kvcoord.events import BlockRemoved, BlockStored
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

MODEL = "fleet-model"
BLOCK = 16
LOOKUP_BLOCKS = 64


def engine_hash(engine: int, n: int) -> int:
    """Block ``n`` of engine ``engine``: distinct per engine, computable by the lookup process."""
    return (engine + 1) << 36 | n


# --- engines -----------------------------------------------------------------------------------
class Engine:
    """One simulated engine's KV cache: a FIFO of held blocks and the events of one scheduler step."""

    def __init__(self, idx: int, args: argparse.Namespace, rng: random.Random) -> None:
        self.idx = idx
        self.args = args
        self.rng = rng
        self.next_n = 0
        self.last: int | None = None
        self.held: deque[int] = deque()
        self.tokens = tuple(rng.getrandbits(17) for _ in range(args.max_blocks * BLOCK))

    def step(self) -> list[Any]:
        a = self.args
        out: list[Any] = []
        for _ in range(a.events):
            n = self.rng.randint(1, a.max_blocks)
            if len(self.held) >= a.capacity:
                out.append(BlockRemoved(block_hashes=tuple(self.held.popleft() for _ in range(n))))
                continue
            parent = self.last if self.rng.random() >= 0.3 else None
            hashes = tuple(engine_hash(self.idx, self.next_n + i) for i in range(n))
            self.next_n += n
            self.last = hashes[-1]
            self.held.extend(hashes)
            out.append(BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                   token_ids=self.tokens[:n * BLOCK], block_size=BLOCK))
        return out


async def run_engines(proc: int, args: argparse.Namespace, address: str, t0: float,
                      stages: list[int]) -> dict[str, Any]:
    """This process's engines (``idx % client_procs == proc``), activated stage by stage, stepping on time."""
    rng = random.Random(proc)
    mine = [i for i in range(stages[-1]) if i % args.client_procs == proc]
    opts = ReporterOptions(max_unacked_batches=100_000, linger=args.linger)
    reps: dict[int, Reporter] = {}
    engines: dict[int, Engine] = {}
    due: dict[int, float] = {}
    step = args.step_ms / 1000
    late: list[list[float]] = [[] for _ in stages]
    steps = [0] * len(stages)
    blocks = [0] * len(stages)
    end = t0 + len(stages) * args.stage_seconds
    cpu = [0.0] * (len(stages) + 1)
    await asyncio.sleep(max(0.0, t0 - time.time()))
    last_stage = -1
    while (now := time.time()) < end:
        stage = min(int((now - t0) // args.stage_seconds), len(stages) - 1)
        if stage != last_stage:
            cpu[stage] = cpu_seconds(os.getpid())
            last_stage = stage
        for i in mine:
            if i < stages[stage] and i not in reps:
                reps[i] = Reporter([address], node_id=f"engine-{i}", model=MODEL, epoch=1,
                                   snapshot=lambda r: [], options=opts)
                await reps[i].start()
                engines[i] = Engine(i, args, rng)
                due[i] = now + step * rng.random()
        for i, rep in reps.items():
            if due[i] <= now:
                events = engines[i].step()
                rep.submit(0, events)
                blocks[stage] += sum(len(ev.block_hashes) for ev in events)
                behind = now - due[i]
                late[stage].append(behind)
                steps[stage] += 1
                due[i] = due[i] + step if behind < step else now + step
        await asyncio.sleep(0.002)
    cpu[-1] = cpu_seconds(os.getpid())
    reconnects = sum(link.reconnects for rep in reps.values() for link in rep.stats().links)
    for rep in reps.values():
        await rep.close(timeout=0.5)
    return {"cpu_stage": [(b - a) / args.stage_seconds for a, b in itertools.pairwise(cpu)],
            "reconnects": reconnects, "steps": steps, "blocks": blocks,
            "late_p99": [pct(x, 99) if x else 0.0 for x in late],
            }


def engine_proc(proc: int, args: argparse.Namespace, address: str, t0: float, stages: list[int],
                q: Any) -> None:
    logging.getLogger("kvcoord.agent").setLevel(logging.ERROR)  # reconnects are counted, not logged
    q.put((proc, asyncio.run(run_engines(proc, args, address, t0, stages))))


# --- lookups -----------------------------------------------------------------------------------
def lookup_proc(args: argparse.Namespace, hport: int, t0: float, stages: list[int], q: Any) -> None:
    """Open-loop-ish lookups at ``--lookup-rate`` over one keep-alive socket, one write per request (the
    fast path's condition); ``(time, latency)`` pairs go back to the parent."""
    rng = random.Random(7)
    end = t0 + len(stages) * args.stage_seconds
    out: list[tuple[float, float]] = []
    s = socket.create_connection(("127.0.0.1", hport))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    gap = 1 / args.lookup_rate
    time.sleep(max(0.0, t0 - time.time()))
    nxt = time.time()
    while (now := time.time()) < end:
        stage = min(int((now - t0) // args.stage_seconds), len(stages) - 1)
        e = rng.randrange(stages[stage])
        start = rng.randrange(0, 2 * args.capacity)
        body = json.dumps({"model_name": MODEL, "block_hashes": [engine_hash(e, start + k)
                                                                 for k in range(LOOKUP_BLOCKS)]}).encode()
        req = (b"POST /query_by_hash HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n" % len(body)) + body
        t1 = time.perf_counter()
        s.sendall(req)
        status = read_response(s)
        if status is None:
            break
        if status == 200:
            out.append((now, time.perf_counter() - t1))
        nxt += gap
        time.sleep(max(0.0, nxt - time.time()))
    s.close()
    q.put(("lookups", out))


def read_response(s: socket.socket) -> int | None:
    """One HTTP/1.1 response with a content-length: its status, None when the server closed the connection."""
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            return None
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split(b" ", 2)[1])


# --- the coordinator's side --------------------------------------------------------------------
def pct(xs: list[float], p: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(len(ys) * p / 100))]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(mport: int, pid: int) -> dict[str, Any]:
    """The figures a stage needs, at one instant: lag buckets, applied batches, entries, CPU, RSS."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=30).read().decode()
    lag: dict[float, float] = {}
    snap: dict[str, Any] = {"lag": lag, "applied": 0.0, "entries": 0.0, "blocks_applied": 0.0}
    for line in text.splitlines():
        if line.startswith("kvcoord_ingest_lag_seconds_bucket{"):
            le = line.split('le="')[1].split('"')[0]
            lag[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
        elif line.startswith('kvcoord_batches_total{outcome="applied"}'):
            snap["applied"] = float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvcoord_events_applied_total{"):
            snap["blocks_applied"] += float(line.rsplit(" ", 1)[1])
        elif line.startswith("kvcoord_index_entries"):
            snap["entries"] += float(line.rsplit(" ", 1)[1])
    snap["cpu"] = cpu_seconds(pid)
    snap["rss"] = rss_mb(pid)
    snap["t"] = time.time()
    return snap


def lag_quantile(a: dict[float, float], b: dict[float, float], q: float) -> float:
    """The upper bound of the bucket holding quantile ``q`` of the observations between two scrapes."""
    bounds = sorted(b)
    total = b[float("inf")] - a.get(float("inf"), 0.0)
    if total <= 0:
        return float("nan")
    for le in bounds:
        if b[le] - a.get(le, 0.0) >= q * total:
            return le
    return float("inf")


@contextlib.contextmanager
def server(args: argparse.Namespace) -> Iterator[tuple[int, str, int, int]]:
    port, mport, hport = free_port(), free_port(), free_port()
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
                      "--http-listen", f"127.0.0.1:{hport}", "--index", args.index,
                      "--lease-seconds", "3600")
    log = Path(tempfile.gettempdir()) / "kvcoord-bench-fleet-server.log"
    with running(cmd, log=log) as proc:
        wait_for_port(port, timeout=60)
        wait_for_port(hport, timeout=60)
        yield proc.pid, f"127.0.0.1:{port}", mport, hport


def stage_row(n: int, a: dict[str, Any], b: dict[str, Any], args: argparse.Namespace,
              lookups: list[float]) -> dict[str, Any]:
    dt = b["t"] - a["t"]
    return {
        "engines": n,
        "offered_batches_s": n * 1000 / args.step_ms,
        "offered_events_s": n * args.events * 1000 / args.step_ms,
        "applied_batches_s": (b["applied"] - a["applied"]) / dt,
        "events_s": (b["blocks_applied"] - a["blocks_applied"]) / dt,
        "blocks_per_event": 0.0,
        "lag_p50": lag_quantile(a["lag"], b["lag"], 0.5),
        "lag_p99": lag_quantile(a["lag"], b["lag"], 0.99),
        "coord_cpu": (b["cpu"] - a["cpu"]) / dt,
        "rss_mb": b["rss"],
        "entries": b["entries"],
        "lookup_p50_ms": pct(lookups, 50) * 1e3 if lookups else float("nan"),
        "lookup_p99_ms": pct(lookups, 99) * 1e3 if lookups else float("nan"),
    }


def saturated(row: dict[str, Any], late_p99: float, step: float) -> str:
    """Which limit this stage passed, if any (the first one checked that holds)."""
    if late_p99 > step:
        return f"engines' own process: steps ran {late_p99 * 1e3:.0f} ms late (p99)"
    if row["lag_p99"] > 1.0:
        return "ingest lag p99 > 1 s"
    if row["events_s"] < 0.95 * row["offered_events_s"]:
        return "events applied < 95% of offered"
    if row["coord_cpu"] > 0.9:
        return "coordinator CPU > 0.9 core"
    return ""


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    stages = args.stages or sorted({max(1, args.engines // d) for d in (8, 4, 2, 1)})
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    with server(args) as (pid, address, mport, hport):
        t0 = time.time() + 3.0 + stages[-1] / 300  # the children import and start before the first stage
        kids = [ctx.Process(target=engine_proc, args=(p, args, address, t0, stages, q))
                for p in range(args.client_procs)]
        if args.lookup_rate > 0:
            kids.append(ctx.Process(target=lookup_proc, args=(args, hport, t0, stages, q)))
        for k in kids:
            k.start()
        marks: list[tuple[dict[str, Any], dict[str, Any]]] = []
        for s in range(len(stages)):
            time.sleep(max(0.0, t0 + s * args.stage_seconds + args.stage_seconds / 3 - time.time()))
            a = scrape(mport, pid)
            time.sleep(max(0.0, t0 + (s + 1) * args.stage_seconds - 0.2 - time.time()))
            marks.append((a, scrape(mport, pid)))
        results = dict(q.get(timeout=120) for _ in kids)
        for k in kids:
            k.join(60)
    lookups: list[tuple[float, float]] = results.get("lookups", [])
    rows = []
    for s, (a, b) in enumerate(marks):
        lat = [x for t, x in lookups if a["t"] <= t <= b["t"]]
        row = stage_row(stages[s], a, b, args, lat)
        late = max(results[p]["late_p99"][s] for p in range(args.client_procs))
        row["engine_late_p99_ms"] = late * 1e3
        row["reconnects"] = sum(results[p]["reconnects"] for p in range(args.client_procs))
        row["engines_cpu"] = sum(results[p]["cpu_stage"][s] for p in range(args.client_procs))
        steps = sum(results[p]["steps"][s] for p in range(args.client_procs))
        blocks = sum(results[p]["blocks"][s] for p in range(args.client_procs))
        row["blocks_per_event"] = blocks / max(1, steps * args.events)
        row["block_events_s"] = row["events_s"] * row["blocks_per_event"]
        row["saturated"] = saturated(row, late, args.step_ms / 1000)
        rows.append(row)
    return rows


def report(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"kvcoord serve --index {args.index}; step {args.step_ms} ms, {args.events} events a step of "
          f"1-{args.max_blocks} blocks, linger {args.linger} s, capacity {args.capacity} blocks an engine, "
          f"{args.client_procs} engine processes, {args.lookup_rate} lookups/s of {LOOKUP_BLOCKS} blocks; "
          f"load {os.getloadavg()[0]:.1f}")
    print("engines  batches/s offered/applied  events/s (blocks)  lag p50/p99 (s, bucket)  coord CPU  "
          "us/batch  RSS MB  entries  lookup p50/p99 ms  engines CPU / late p99 ms  saturated")
    for r in rows:
        per = r["coord_cpu"] / r["applied_batches_s"] * 1e6 if r["applied_batches_s"] else float("nan")
        print(f"{r['engines']:7d}  {r['offered_batches_s']:9.0f} / {r['applied_batches_s']:7.0f}  "
              f"{r['events_s']:7.0f} ({r['block_events_s']:7.0f})  {r['lag_p50']:>7} / {r['lag_p99']:<7}  "
              f"{r['coord_cpu']:9.2f}  "
              f"{per:8.0f}  {r['rss_mb']:6.0f}  {r['entries']:7.0f}  {r['lookup_p50_ms']:6.2f} / "
              f"{r['lookup_p99_ms']:6.2f}  {r['engines_cpu']:4.2f} / {r['engine_late_p99_ms']:6.1f}  "
              f"{r['saturated'] or '-'}")
    first = next((r for r in rows if r["saturated"]), None)
    print(f"Reporter reconnects (Welcome not in time, streams broken): "
          f"{sum(r['reconnects'] for r in rows[-1:])}")
    print(f"first saturation: {first['engines']} engines, {first['saturated']}" if first
          else "no stage saturated")
    ok = [r for r in rows if r["applied_batches_s"] > 0]
    if ok:
        per = statistics.median(r["coord_cpu"] / r["applied_batches_s"] for r in ok)
        print(f"coordinator CPU per applied batch (median over stages): {per * 1e6:.0f} us -> one core "
              f"~{1 / per:,.0f} batches/s = ~{1 / per * args.step_ms / 1000:,.0f} engines at this step rate")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", type=int, default=1000, help="engines in the last stage")
    ap.add_argument("--stages", type=lambda s: [int(x) for x in s.split(",")], default=None,
                    help="engine counts per stage, comma-separated (default: engines/8,/4,/2,/1)")
    ap.add_argument("--step-ms", type=float, default=40.0, help="scheduler step interval per engine")
    ap.add_argument("--events", type=int, default=3, help="events per step (the batch size)")
    ap.add_argument("--max-blocks", type=int, default=16, help="blocks per event, 1..N uniformly")
    ap.add_argument("--linger", type=float, default=0.0,
                    help="seconds a Reporter holds a batch for more steps (kvcoord agent --linger)")
    ap.add_argument("--capacity", type=int, default=2000, help="blocks an engine holds before evicting")
    ap.add_argument("--stage-seconds", type=float, default=15.0)
    ap.add_argument("--client-procs", type=int, default=2, help="processes hosting the engines")
    ap.add_argument("--lookup-rate", type=float, default=200.0, help="lookups/s (0: none)")
    ap.add_argument("--index", default="memory", help="memory | redis://host:port/db (a running Redis)")
    ap.add_argument("--quick", action="store_true", help="5 engines, 3 s: a smoke run")
    ap.add_argument("--json", default=None, metavar="FILE", help="write the rows as JSON too")
    args = ap.parse_args()
    if args.quick:
        args.engines, args.stages, args.stage_seconds, args.client_procs = 5, [5], 3.0, 1
        args.lookup_rate = min(args.lookup_rate, 50.0)
    if min(args.engines, args.events, args.max_blocks, args.client_procs) < 1 or args.step_ms <= 0:
        sys.exit("bench_fleet: --engines, --events, --max-blocks, --client-procs >= 1 and --step-ms > 0")
    rows = run(args)
    report(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
