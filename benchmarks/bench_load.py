"""Lookups under concurrent load: kvcoord's coordinator vs NVIDIA Dynamo's standalone KV indexer, both as
services, in one run, on the same data (issue 15 item 5).

- Services, engines, workload and ingest: as ``bench_vs_dynamo_service.py`` (its helpers are imported):
  ``kvcoord serve`` (memory index, HTTP API) and ``python -m dynamo.indexer --threads N`` as subprocesses,
  ``--engines`` vLLM-exact ZMQ publishers in this process registered with both over ``POST /register``,
  events from one real ``BlockPool`` per engine; both ingest everything and are polled until caught up.
- Load: ``--clients`` (16) concurrent closed-loop clients, each a keep-alive HTTP/1.1 connection with one
  request in flight, sending the next request as soon as the answer is in. They live in ``--client-procs``
  separate client processes (default 2, each one epoll loop over 8 sockets: with one process, every time
  that process is descheduled on a loaded 2-core machine all 16 clients stall at once). The request bytes
  (head and JSON body) are built before the run, and answers are only framed (Content-Length), not
  parsed, while timed, so a request costs the client a few tens of µs of CPU against the server's
  hundreds: the client processes' own CPU is measured and printed, so a reader can see it is not the
  bottleneck.
- Requests: ``--prompts`` distinct prompts of ``--min-blocks``..``--max-blocks`` blocks (64-512, uniform,
  mixed), cut from the last requests the engines served (a quarter keep 50-100% and end in fresh tokens),
  sent as ``POST /query`` by token ids; ``--hash-share`` of them as ``/query_by_hash`` instead (each
  side's own hashes, as in the other benchmark). Connection k starts at prompt k * P / clients and cycles.
- Phases: one service at a time (a 2-core machine cannot load two at once fairly), ``--rounds`` rounds in
  ABBA order (kvcoord first in even rounds). A phase: the clients connect, run ``--warmup`` s, then a
  ``--seconds`` window, then stop. Counted: requests completed inside the window; server CPU is
  ``/proc/<pid>/stat`` utime + stime of the service's process tree (all threads, live descendants, and
  reaped children) read at the window's edges. Per side, the median over rounds of each figure.
- ``--ingest-during``: a second workload (another seed: disjoint blocks, so the answers stay checkable)
  is published at ``--ingest-rate`` block events/s over all engines during every phase; both services
  ingest it, so the server CPU of the side under load includes its ingest.
- ``--lookup-workers 1,2``: one ``kvcoord serve`` per value (``--lookup-workers N``; 0: none), all
  ingesting the same engines, each a side of its own in every round (``kvcoord`` is the first); the
  report adds each one's lookups/s against the first's and against Dynamo's.
- Answers: the first answer each client process gets for each prompt is parsed after the phase; its best
  (instance, tokens) must equal the engines' own pools (the truth), or the run fails.

Usage: ``python benchmarks/bench_load.py [--events 300000] [--clients 16] [--seconds 8] [--rounds 3]
[--ingest-during] [--json out.json]``. About a minute with the defaults.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pickle
import random
import select
import signal
import socket
import statistics
import sys
import tempfile
import time
from array import array
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_vs_dynamo_service as bvd
import orjson

DYN, KV, MODEL, BLOCK, VOCAB = bvd.DYN, bvd.KV, bvd.MODEL, bvd.BLOCK, bvd.VOCAB
BUCKETS = ((64, 127), (128, 255), (256, 512))


def tree_cpu(pid: int) -> float:
    """CPU seconds of ``pid`` and every live descendant (all threads), plus the children it reaped."""
    return sum(tree_cpu_split(pid))


def tree_cpu_split(pid: int) -> tuple[float, float]:
    """:func:`tree_cpu` as (user, system) seconds."""
    tick = os.sysconf("SC_CLK_TCK")
    stats: dict[int, list[str]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError):
                stats[int(name)] = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()
    kids: dict[int, list[int]] = {}
    for p, f in stats.items():
        kids.setdefault(int(f[1]), []).append(p)
    user = system = 0
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            user, system = user + int(stats[p][11]), system + int(stats[p][12])
            todo.extend(kids.get(p, ()))
    if pid in stats:
        user, system = user + int(stats[pid][13]), system + int(stats[pid][14])
    return user / tick, system / tick


# --- requests -----------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace, wl: bvd.Workload, rng: random.Random) -> list[list[int]]:
    out = []
    for _ in range(args.prompts):
        nblocks = rng.randint(args.min_blocks, args.max_blocks)
        need = nblocks * BLOCK
        src = rng.choice([t for t in wl.recent if len(t) >= need] or wl.recent)
        keep = min(nblocks, len(src) // BLOCK)
        if rng.random() < 0.25:
            keep = rng.randint(keep // 2, keep)
        toks = src[:keep * BLOCK]
        out.append(toks + [rng.randrange(VOCAB) for _ in range(need - len(toks))])
    return out


def http_request(path: str, port: int, data: Any) -> bytes:
    body = orjson.dumps(data)
    return (f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def make_requests(args: argparse.Namespace, prompts: list[list[int]], cached: list[set[int]], profile: Any,
                  rng: random.Random,
                  ports: dict[str, int]) -> tuple[dict[str, list[bytes]], list[str], list[Any]]:
    """Per side, the full HTTP request of each prompt; each prompt's kind; each prompt's truth."""
    from kvcoord.hashing import block_hashes64

    reqs: dict[str, list[bytes]] = {KV: [], DYN: []}
    kinds, truths = [], []
    for p in prompts:
        kv_hashes = block_hashes64(profile, p)
        truths.append(bvd.truth(cached, kv_hashes))
        if rng.random() < args.hash_share:
            kinds.append("hashes")
            reqs[KV].append(http_request("/query_by_hash", ports[KV], {
                "block_hashes": [bvd.as_i64(h) for h in kv_hashes], "model_name": MODEL}))
            reqs[DYN].append(http_request("/query_by_hash", ports[DYN], {
                "block_hashes": bvd.dynamo_hashes(p), "model_name": MODEL}))
        else:
            kinds.append("tokens")
            for side in (KV, DYN):
                reqs[side].append(http_request("/query", ports[side], {"token_ids": p, "model_name": MODEL}))
    return reqs, kinds, truths


# --- the client process -------------------------------------------------------------------------
class _Conn:
    __slots__ = ("buf", "i", "off", "out", "sock", "t0", "want_out")

    def __init__(self, port: int, i: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setblocking(False)
        self.buf = bytearray()
        self.i, self.off, self.t0, self.want_out = i, 0, 0.0, False
        self.out = memoryview(b"")

    def send(self, ep: select.epoll, fd: int) -> None:
        """Send what the kernel takes now; wait for EPOLLOUT for the rest."""
        while self.off < len(self.out):
            try:
                self.off += self.sock.send(self.out[self.off:])
            except BlockingIOError:
                if not self.want_out:
                    ep.modify(fd, select.EPOLLIN | select.EPOLLOUT)
                    self.want_out = True
                return
        if self.want_out:
            ep.modify(fd, select.EPOLLIN)
            self.want_out = False


def run_client(spec_path: str, out_path: str) -> None:
    """Client mode: closed-loop connections on one epoll loop until the window ends; see the docstring."""
    spec = pickle.loads(Path(spec_path).read_bytes())
    reqs: list[memoryview] = [memoryview(r) for r in spec["requests"]]
    n = len(reqs)
    shift = time.time() - time.perf_counter()
    w0, w1 = spec["window"][0] - shift, spec["window"][1] - shift
    ep = select.epoll()
    conns = {}
    for k in spec["conn_ids"]:
        c = _Conn(spec["port"], k * n // spec["clients"])
        conns[c.sock.fileno()] = c
        ep.register(c.sock.fileno(), select.EPOLLIN)
    lat, idx = array("d"), array("I")
    first: dict[int, bytes] = {}
    errors: list[str] = []
    cpu = [0.0, 0.0]
    time.sleep(max(0.0, spec["start"] - time.time()))

    def start(fd: int, c: _Conn) -> None:
        c.out, c.off, c.t0 = reqs[c.i % n], 0, time.perf_counter()
        c.send(ep, fd)

    for fd, c in conns.items():
        start(fd, c)
    now, in_window = time.perf_counter(), False
    while now < w1:
        for fd, ev in ep.poll(0.5):
            c = conns[fd]
            if ev & select.EPOLLOUT:
                c.send(ep, fd)
            if not ev & (select.EPOLLIN | select.EPOLLERR | select.EPOLLHUP):
                continue
            try:
                chunk = c.sock.recv(262144)
            except BlockingIOError:
                continue
            if not chunk:
                raise ConnectionError("connection closed by the server")
            buf = c.buf
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                continue
            head = bytes(buf[:end + 2]).lower()
            at = head.find(b"\r\ncontent-length:")
            total = end + 4 + int(head[at + 17:head.find(b"\r\n", at + 2)])
            if len(buf) < total:
                continue
            done = time.perf_counter()
            if w0 <= done < w1:
                lat.append(done - c.t0)
                idx.append(c.i % n)
            if buf[9:12] != b"200" and len(errors) < 10:
                errors.append(bytes(buf[:total][:300]).decode(errors="replace"))
            elif c.i % n not in first:
                first[c.i % n] = bytes(buf[end + 4:total])
            del buf[:total]
            c.i += 1
            start(fd, c)
        now = time.perf_counter()
        if not in_window and now >= w0:
            in_window, cpu[0] = True, time.process_time()
    cpu[1] = time.process_time()
    for c in conns.values():
        c.sock.close()
    Path(out_path).write_bytes(pickle.dumps({"lat": lat, "idx": idx, "first": first, "errors": errors,
                                             "cpu_s": cpu[1] - cpu[0]}))


# --- phases -------------------------------------------------------------------------------------
class Feeder:
    """Publishes the ``--ingest-during`` stream at a steady rate of block events, round-robin over engines."""

    def __init__(self, pubs: list[Any], payloads: list[list[Any]], counts: list[list[int]], rate: float):
        self.pubs, self.rate = pubs, rate
        order = []
        at = [0] * len(pubs)
        while any(at[e] < len(payloads[e]) for e in range(len(pubs))):
            for e in range(len(pubs)):
                if at[e] < len(payloads[e]):
                    order.append((e, payloads[e][at[e]], counts[e][at[e]]))
                    at[e] += 1
        self.order, self.next, self.sent_events = order, 0, 0
        self.last, self.active_s = 0.0, 0.0

    def pump(self) -> None:
        """Publish what is due; time between phases (a gap over 50 ms) does not count."""
        now = time.perf_counter()
        self.active_s += min(now - self.last, 0.05) if self.last else 0.0
        self.last = now
        due = self.active_s * self.rate
        while self.next < len(self.order) and self.sent_events <= due:
            e, payload, count = self.order[self.next]
            self.pubs[e].publish_encoded(payload)
            self.sent_events += count
            self.next += 1
        if self.next >= len(self.order):
            raise SystemExit("the --ingest-during stream ran out: raise --ingest-events")


def run_phase(args: argparse.Namespace, side: bvd.Side, other: bvd.Side, requests: list[bytes],
              tmp: Path, feeder: Feeder | None) -> dict[str, Any]:
    from tests.procs import spawn, stop

    start = time.time() + 1.0  # the client processes start and connect meanwhile
    window = (start + args.warmup, start + args.warmup + args.seconds)
    procs, outs = [], []
    for j in range(args.client_procs):
        spec = {"requests": requests, "port": side.http_port, "clients": args.clients, "start": start,
                "window": window, "conn_ids": list(range(j, args.clients, args.client_procs))}
        path, out = tmp / f"spec{j}.pkl", tmp / f"out{j}.pkl"
        path.write_bytes(pickle.dumps(spec))
        outs.append(out)
        procs.append(spawn([sys.executable, str(Path(__file__).resolve()), "--client", str(path), str(out)]))
    load = os.getloadavg()[0]
    cpu: dict[str, list[float]] = {side.name: [], other.name: [], "bench": [], "fed": [], "sys": []}
    try:
        while any(p.poll() is None for p in procs):
            marks = len(cpu["bench"])
            if marks < 2 and time.time() >= window[marks]:
                user, system = tree_cpu_split(side.pid)
                cpu[side.name].append(user + system)
                cpu["sys"].append(system)
                cpu[other.name].append(tree_cpu(other.pid))
                cpu["bench"].append(time.process_time())
                cpu["fed"].append(feeder.sent_events if feeder else 0)
            if feeder is not None and time.time() >= start:
                feeder.pump()
            time.sleep(0.002)
        rcs = [p.wait() for p in procs]
    finally:
        for p in procs:
            stop(p)
    if any(rcs) or len(cpu["bench"]) < 2:
        raise SystemExit(f"a client process failed (exits {rcs})")
    res = [pickle.loads(o.read_bytes()) for o in outs]
    lat = [x for r in res for x in r["lat"]]
    idx = [x for r in res for x in r["idx"]]
    if not lat:
        raise SystemExit(f"{side.name}: no request completed in the window")
    server_cpu = cpu[side.name][1] - cpu[side.name][0]
    n = len(lat)
    return {"side": side.name, "lookups": n, "lookups_per_s": n / args.seconds, "server_cpu_s": server_cpu,
            "server_cores": server_cpu / args.seconds, "per_core": n / server_cpu if server_cpu else 0.0,
            "server_cpu_per_lookup_us": server_cpu / n * 1e6,
            "server_sys_share": (cpu["sys"][1] - cpu["sys"][0]) / server_cpu if server_cpu else 0.0,
            "p50_ms": bvd.pct(lat, 50) * 1e3, "p90_ms": bvd.pct(lat, 90) * 1e3,
            "p99_ms": bvd.pct(lat, 99) * 1e3, "max_ms": max(lat) * 1e3,
            "mean_ms": statistics.fmean(lat) * 1e3,
            "client_cpu_s": sum(r["cpu_s"] for r in res),
            "other_side_cpu_s": cpu[other.name][1] - cpu[other.name][0], "other_side": other.name,
            "bench_process_cpu_s": cpu["bench"][1] - cpu["bench"][0], "loadavg_1m": load,
            "ingested_events": cpu["fed"][1] - cpu["fed"][0],
            "lat": lat, "idx": idx, "first": [r["first"] for r in res],
            "errors": [e for r in res for e in r["errors"]]}


def check_answers(phase: dict[str, Any], truths: list[Any]) -> list[str]:
    bad = list(phase["errors"])
    for first in phase["first"]:
        for i, body in first.items():
            got = bvd.http_best(orjson.loads(body))
            if got != truths[i] and len(bad) < 20:
                bad.append(f"{phase['side']} prompt {i}: {got}, engines' pools {truths[i]}")
    return bad


# --- the run ------------------------------------------------------------------------------------
def ingest(args: argparse.Namespace, pubs: list[Any], payloads: list[list[Any]], sides: list[bvd.Side],
           wl: bvd.Workload) -> dict[str, Any]:
    """The hello handshake, then the whole main workload; wait until both sides applied it."""
    time.sleep(0.5)
    missing = set(range(args.engines))
    for _ in range(10):
        for e in sorted(missing):
            pubs[e].publish_encoded(payloads[e][0])
        left = bvd.wait_applied(sides, wl.hello, 5, fail=False)
        missing = set().union(*left.values())
        if not missing:
            break
    else:
        raise SystemExit("the services never applied every engine's hello batch")
    cpu0 = {s.name: tree_cpu(s.pid) for s in sides}
    done: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for e, pub in enumerate(pubs):
        for b in payloads[e][1:]:
            pub.publish_encoded(b)

    def caught_up(s: bvd.Side) -> None:
        done[s.name] = {"wall_s": time.perf_counter() - t0, "cpu_s": tree_cpu(s.pid) - cpu0[s.name]}

    bvd.wait_applied(sides, wl.sentinel, args.ingest_timeout, on_done=caught_up)
    return done


def encode_all(wl: bvd.Workload) -> tuple[list[list[Any]], list[list[int]]]:
    from kvcoord.events import encode_vllm_batch

    payloads = [[bvd._Payload(encode_vllm_batch(b, form="map")) for b in bs] for bs in wl.batches]
    counts = [[sum(bvd.count_blocks(b.events)) for b in bs] for bs in wl.batches]
    return payloads, counts


def main(args: argparse.Namespace) -> int:
    from kvcoord.hashing import HashProfile
    from tests.procs import free_port

    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                           "args": vars(args), "loadavg_start": os.getloadavg(), "code": bvd.code_state()}
    rng = random.Random(args.seed)
    profile = HashProfile(algo=args.algo, block_size=BLOCK, seed="42")
    wl = bvd.make_workload(args, profile, rng)
    payloads, _ = encode_all(wl)
    print(f"workload: {wl.events:,} block events, {sum(map(len, payloads))} batches, "
          f"{sum(len(c) for c in wl.cached):,} blocks held at the end ({wl.seconds:.1f} s)", file=sys.stderr)
    feed: tuple[list[list[Any]], list[list[int]]] | None = None
    if args.ingest_during:
        extra = argparse.Namespace(**{**vars(args), "events": args.ingest_events})
        wl2 = bvd.make_workload(extra, profile, random.Random(args.seed + 1))
        p2, c2 = encode_all(wl2)
        feed = ([p[1:-1] for p in p2], [c[1:-1] for c in c2])  # without its hello and sentinel
        print(f"--ingest-during stream: {sum(map(sum, feed[1])):,} block events", file=sys.stderr)
    prompts = make_prompts(args, wl, rng)
    out["workload"] = {"block_events": wl.events, "held_at_end": sum(len(c) for c in wl.cached),
                       "prompt_blocks_mean": statistics.fmean(len(p) for p in prompts) / BLOCK}
    publisher = bvd.publishers()
    with contextlib.ExitStack() as stack:
        pubs, addrs = [], []
        for _ in range(args.engines):
            ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            pub = publisher(0, ep, rep, bind=True, buffer_steps=1_000_000, hwm=1_000_000,
                            max_queue_size=1_000_000)
            stack.callback(pub.shutdown)
            pubs.append(pub)
            addrs.append((ep, rep))
        kv, dyn, _gport = stack.enter_context(bvd.services(args))
        sides = {KV: kv, DYN: dyn}
        for n in args.workers[1:]:
            sides[f"{KV} w{n}"] = stack.enter_context(bvd.kv_service(args, n, f"{KV} w{n}"))
        for s in sides.values():
            bvd.register(s, addrs)
        out["ingest"] = ingest(args, pubs, payloads, list(sides.values()), wl)
        reqs, kinds, truths = make_requests(args, prompts, wl.cached, profile, rng,
                                            {k: s.http_port for k, s in sides.items()})
        out["kinds"] = {k: kinds.count(k) for k in ("tokens", "hashes")}
        for name in sides:
            reqs.setdefault(name, reqs[KV])  # the same bytes (a Host header naming another port is ignored)
        feeder = Feeder(pubs, *feed, args.ingest_rate) if feed else None
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-load-")))
        phases, bad = [], []
        names = [KV, *(n for n in sides if n not in (KV, DYN)), DYN]
        for r in range(args.rounds):
            order = names[r % len(names):] + names[:r % len(names)]  # two sides: ABBA
            for i, name in enumerate(order):
                other = sides[order[i - 1]]
                ph = run_phase(args, sides[name], other, reqs[name], tmp, feeder)
                bad += check_answers(ph, truths)
                ph["round"] = r
                print(f"  round {r + 1} {name:<8} {ph['lookups_per_s']:7.0f} lookups/s  server "
                      f"{ph['server_cores']:.2f} cores, {ph['per_core']:6.0f} lookups/s per core  p50 "
                      f"{ph['p50_ms']:6.2f} ms  p99 {ph['p99_ms']:6.2f} ms  client "
                      f"{ph['client_cpu_s']:.2f} s CPU",
                      file=sys.stderr, flush=True)
                phases.append(ph)
        if feeder is not None:
            out["ingest_during_sent_events"] = feeder.sent_events
    out["buckets"] = buckets(phases, prompts, kinds)
    for ph in phases:
        for k in ("lat", "idx", "first", "errors"):
            ph.pop(k)
    out["phases"], out["mismatches"], out["loadavg_end"] = phases, bad, os.getloadavg()
    out["summary"] = summarise(phases, names)
    report(out)
    if args.json:
        Path(args.json).write_text(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode())
    if bad:
        print("\nWRONG ANSWERS:\n  " + "\n  ".join(bad), file=sys.stderr)
        return 1
    return 0


FIGURES = ("lookups_per_s", "server_cpu_s", "server_cores", "per_core", "server_cpu_per_lookup_us",
           "p50_ms", "p90_ms", "p99_ms", "max_ms", "client_cpu_s", "other_side_cpu_s", "loadavg_1m",
           "server_sys_share")


def summarise(phases: list[dict[str, Any]], names: list[str]) -> dict[str, dict[str, float]]:
    """Per side, the median over rounds of each figure; then kvcoord / Dynamo."""
    med = {s: {f: statistics.median(p[f] for p in phases if p["side"] == s) for f in FIGURES}
           for s in names}
    med["ratio"] = {f: med[KV][f] / med[DYN][f] if med[DYN][f] else float("nan") for f in FIGURES}
    return med


def buckets(phases: list[dict[str, Any]], prompts: list[list[int]], kinds: list[str]) -> list[dict[str, Any]]:
    """p50 / p99 per prompt size and kind, over all rounds of each side."""
    rows = []
    for kind in ("tokens", "hashes"):
        for lo, hi in BUCKETS:
            row: dict[str, Any] = {"kind": kind, "blocks": f"{lo}-{hi}"}
            for s in (KV, DYN):
                lat = [x for p in phases if p["side"] == s for x, i in zip(p["lat"], p["idx"], strict=True)
                       if kinds[i] == kind and lo <= len(prompts[i]) // BLOCK <= hi]
                if lat:
                    row[s] = {"n": len(lat), "p50_ms": bvd.pct(lat, 50) * 1e3,
                              "p99_ms": bvd.pct(lat, 99) * 1e3}
            if KV in row and DYN in row:
                rows.append(row)
    return rows


def report(out: dict[str, Any]) -> None:
    a, code, sm = out["args"], out["code"], out["summary"]
    during = f"{a['ingest_rate']:,.0f} block events/s" if a["ingest_during"] else "no"
    print(f"\nlookups under load: {a['clients']} concurrent clients in {a['client_procs']} client "
          f"process(es), {a['prompts']} prompts of {a['min_blocks']}-{a['max_blocks']} blocks (mean "
          f"{out['workload']['prompt_blocks_mean']:.0f}; {out['kinds']['tokens']} /query, "
          f"{out['kinds']['hashes']} /query_by_hash), {a['rounds']} rounds x {a['seconds']:g} s per side "
          f"after {a['warmup']:g} s warm-up; "
          f"algo {a['algo']}, {out['workload']['block_events']:,} block events ingested, Dynamo --threads "
          f"{a['threads']}; ingest during lookups: {during}; started "
          f"{out['started']}, load average {out['loadavg_start'][0]:.2f} -> {out['loadavg_end'][0]:.2f}; "
          f"kvcoord {code['head']} + working tree {code['tree_digest']} (newest file {code['newest_file']})")
    print("\n| median over rounds | lookups/s | server CPU (s) | server cores | lookups/s per server core "
          "| server CPU / lookup (µs) | p50 (ms) | p90 (ms) | p99 (ms) | max (ms) | client CPU (s) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    sides = [s for s in sm if s != "ratio"]
    for s in (*sides, "ratio"):
        m = sm[s]
        label = ("kvcoord / Dynamo" if s == "ratio" else f"{s} (Dynamo --threads {a['threads']})" if s == DYN
                 else f"{s} ({a['workers'][0]} lookup workers)" if s == KV else s)
        print(f"| {label} | {m['lookups_per_s']:,.{2 if s == 'ratio' else 0}f} | {m['server_cpu_s']:.2f} "
              f"| {m['server_cores']:.2f} | {m['per_core']:,.{2 if s == 'ratio' else 0}f} "
              f"| {m['server_cpu_per_lookup_us']:,.{2 if s == 'ratio' else 0}f} | {m['p50_ms']:.2f} "
              f"| {m['p90_ms']:.2f} | {m['p99_ms']:.2f} | {m['max_ms']:.2f} | {m['client_cpu_s']:.2f} |")
    for s in sides[1:-1]:
        lps = sm[s]["lookups_per_s"]
        x, d = lps / sm[KV]["lookups_per_s"], lps / sm[DYN]["lookups_per_s"]
        print(f"\n{s}: {x:.2f}x the lookups/s of {KV} ({a['workers'][0]} lookup workers), {d:.2f}x Dynamo's "
              f"--threads {a['threads']} (target with 2 workers against 1: >= 1.6x)")
    r = sm["ratio"]
    met = r["per_core"] >= 1 and r["p99_ms"] <= 2
    print(f"\ntarget (kvcoord lookups/s per core >= Dynamo's, p99 <= 2x Dynamo's): per core "
          f"{r['per_core']:.2f}x, p99 {r['p99_ms']:.2f}x -> {'MET' if met else 'NOT MET'}")
    per = {s: sm[s]["client_cpu_s"] / (sm[s]["lookups_per_s"] * a["seconds"]) * 1e6 for s in (KV, DYN)}
    cores = {s: sm[s]["client_cpu_s"] / a["seconds"] for s in (KV, DYN)}
    print(f"server CPU in the kernel (system time): kvcoord {sm[KV]['server_sys_share']:.0%}, Dynamo "
          f"{sm[DYN]['server_sys_share']:.0%}; idle side's CPU during the other's windows: kvcoord "
          f"{sm[DYN]['other_side_cpu_s']:.2f} s, Dynamo {sm[KV]['other_side_cpu_s']:.2f} s (median)")
    print(f"client process CPU per lookup: kvcoord phases {per[KV]:.0f} µs, Dynamo phases {per[DYN]:.0f} µs "
          f"(client cores used: {cores[KV]:.2f} / {cores[DYN]:.2f})")
    print("\n| prompt | kvcoord p50 / p99 (ms) | Dynamo p50 / p99 (ms) | requests per side |")
    print("|---|---:|---:|---:|")
    for b in out["buckets"]:
        k, d = b[KV], b[DYN]
        print(f"| {b['kind']} {b['blocks']} blocks | {k['p50_ms']:.2f} / {k['p99_ms']:.2f} "
              f"| {d['p50_ms']:.2f} / {d['p99_ms']:.2f} | {k['n']:,} / {d['n']:,} |")
    print("\nper phase: " + "; ".join(
        f"r{p['round'] + 1} {p['side']} {p['lookups_per_s']:.0f}/s {p['server_cores']:.2f} cores p99 "
        f"{p['p99_ms']:.1f} ms (other side {p['other_side_cpu_s']:.2f} s CPU, load {p['loadavg_1m']:.2f})"
        for p in out["phases"]))
    if a["ingest_during"]:
        print("ingest during the windows: " + "; ".join(
            f"r{p['round'] + 1} {p['side']} window {p['ingested_events']:,} block events, "
            f"{p['other_side']} (not queried) {p['other_side_cpu_s']:.2f} s CPU = "
            f"{p['other_side_cpu_s'] / max(1, p['ingested_events']) * 1e6:.1f} µs per event"
            for p in out["phases"]))
    ing = out["ingest"]
    print("ingest before the lookups: " + ", ".join(
        f"{s} {ing[s]['wall_s']:.2f} s wall, {ing[s]['cpu_s']:.2f} s CPU" for s in (KV, DYN)))
    print("answers (first per prompt and client process, vs the engines' pools): "
          + ("all correct" if not out["mismatches"] else f"{len(out['mismatches'])} WRONG"))


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        run_client(sys.argv[2], sys.argv[3])
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="sha256_cbor",
                    choices=("sha256_cbor", "xxhash_cbor", "sha256", "xxhash"))
    ap.add_argument("--engines", type=int, default=8, help="publishers / instances (default 8)")
    ap.add_argument("--events", type=int, default=300_000, help="block events first (default 300000)")
    ap.add_argument("--engine-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent connections (default 16)")
    ap.add_argument("--client-procs", type=int, default=2, help="client processes sharing them (default 2)")
    ap.add_argument("--seconds", type=float, default=8.0, help="measured window per phase (default 8)")
    ap.add_argument("--warmup", type=float, default=1.0, help="load before each window, s (default 1)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, each side once per round (default 3)")
    ap.add_argument("--prompts", type=int, default=256, help="distinct prompts (default 256)")
    ap.add_argument("--min-blocks", type=int, default=64, help="smallest prompt, blocks (default 64)")
    ap.add_argument("--max-blocks", type=int, default=512, help="largest prompt, blocks (default 512)")
    ap.add_argument("--hash-share", type=float, default=0.0, help="share of /query_by_hash (default 0)")
    ap.add_argument("--threads", type=int, default=4, help="Dynamo indexer --threads (default 4)")
    ap.add_argument("--lookup-workers", default="0", metavar="N[,N...]",
                    help="kvcoord serve --lookup-workers, one kvcoord side per value (default 0)")
    ap.add_argument("--ingest-during", action="store_true", help="keep publishing during the lookups")
    ap.add_argument("--ingest-rate", type=float, default=10_000, help="block events/s then (default 10000)")
    ap.add_argument("--ingest-events", type=int, default=0,
                    help="size of that stream (default: enough for the run at --ingest-rate)")
    ap.add_argument("--seed", type=int, default=42, help="workload RNG seed (default 42)")
    ap.add_argument("--ingest-timeout", type=float, default=300.0, help="seconds (default 300)")
    ap.add_argument("--profile-kvcoord", default=None, metavar="PATH",
                    help="run kvcoord serve under cProfile, writing PATH")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")
    ns = ap.parse_args()
    if ns.ingest_events <= 0:
        ns.ingest_events = int(ns.ingest_rate * 2 * ns.rounds * (ns.seconds + ns.warmup + 1.5) * 1.2) + 10_000
    try:
        ns.workers = [int(n) for n in ns.lookup_workers.split(",")]
    except ValueError:
        ap.error("--lookup-workers: comma-separated integers")
    if len(set(ns.workers)) != len(ns.workers) or min(ns.workers) < 0:
        ap.error("--lookup-workers: distinct integers >= 0")
    if not 1 <= ns.client_procs <= ns.clients:
        ap.error("--client-procs must be between 1 and --clients")
    try:
        sys.exit(main(ns))
    except KeyboardInterrupt:
        sys.exit(130)
