"""kvcoord's coordinator vs NVIDIA Dynamo's standalone KV indexer, as services: ingest from the same vLLM
publishers, then lookups by token ids and by hashes from a separate client process (issue 13).

One run, both services, the same data:

- Services: ``kvcoord serve`` (memory index, HTTP API on, ``--model bench,algo=ALGO,block_size=16,seed=42``)
  and Dynamo's ``python -m dynamo.indexer --threads N`` (ai-dynamo-runtime, default 4 threads), each a
  subprocess on free ports.
- Engines: ``--engines`` vLLM-exact ZMQ publishers in this process (``ZmqEventPublisher``, PUB + ROUTER
  replay, bound), each registered with BOTH services over ``POST /register`` (same instance ids 1..N),
  so both subscribe to the same sockets. Events come from one real ``BlockPool`` per engine (vLLM v1's
  prefix cache: LRU eviction, tail-first frees) serving a synthetic shared-prefix workload, generated
  before the services start: 32 system prompts (32-256 blocks, Zipf-like popularity), user turns of
  8-256 blocks, 40% follow-up turns of a conversation on the same engine (prompt = previous prompt +
  its output + a new turn, up to 1024 blocks), 1-512 output tokens cached as vLLM caches decode blocks,
  4 requests running per engine, requests routed to engines at random, until ``--events`` block events
  (stored + removed hashes) exist. One scheduler step = one ``KVEventBatch``.
- Ingest: each engine first publishes a one-block "hello" batch; once both services answer for every
  hello (so every SUB is connected; an engine a side missed publishes its hello again, since Dynamo
  replays a gap only when a later live batch reveals it), the rest is published as fast as the
  publishers send, or with ``--rate R`` as engines publish, R batches a second each, all stepping at once
  (vLLM's data-parallel ranks) or with ``--stagger`` each in its own phase (independent replicas)
  (payloads msgpack-encoded beforehand, byte for byte what ``ZmqEventPublisher`` would
  encode, so the benchmark's own encoding is not in the window), and each side is polled (``POST
  /query`` every 20 ms for a one-block sentinel each engine stores last) until it has applied
  everything. Both services ingest at the same time, from the same sockets. Reported per side: wall
  time from the first publish to caught-up, block events/s, and the CPU seconds its process used
  meanwhile (the scheduler's runtime of every thread, ``/proc/<pid>/task/*/schedstat``); the CPU figure
  is the one to compare on a shared 2-core machine. Published as fast as possible, a relay drains many
  batches a wakeup; paced, it wakes for every one, which is what it costs next to a real engine.
- Lookups: a SEPARATE client process (this file with ``--run-client``), one keep-alive connection per
  service, sequential requests, the two services interleaved request by request (alternating which
  goes first), ``--warmup`` then ``--requests`` timed requests per case, on the same prompts for both.
  Each timed request covers the HTTP/1.1 exchange on a minimal raw-socket client (identical for both;
  ``--client once`` writes a request at once, ``--client split`` its head and then its body, as
  ``http.client`` and ``requests`` do) and parsing the JSON answer (orjson). The JSON bodies are built
  before (the faster of orjson and msgspec for that case's bodies, the same for both sides).
  Cases: by tokens for 64/128/256/512-block prompts (``/query``), by hashes for 64/512 blocks
  (``/query_by_hash``: Dynamo's own block-local hashes, xxh3_64 seed 1337 of each block's
  little-endian u32 tokens, as i64, for Dynamo; the engine's block hashes, as i64, for kvcoord), and
  ``GET /health`` on both (the empty call). Then the same cases on kvcoord's gRPC ``Lookup`` (the
  blocking ``CoordinatorClient.lookup``: it packs the token ids and converts the answer) interleaved
  with Dynamo's HTTP again, and gRPC ``Ping`` as its empty call. Service CPU per request is read from
  ``/proc`` around each case (warm-up requests included).
- Answers: for every request, the best (instance, tokens) of Dynamo's ``scores`` must equal kvcoord's
  (``scores`` over HTTP, ``nodes`` over gRPC): the highest score and the set of instances having it.
  Any difference fails the run. Each prompt's first answers are also checked against the engines'
  own pools (the truth), and the count of differences is printed.

Query prompts (``--prompts`` distinct per case): one of the last requests sent (prompt + output), cut
to the case's size; a quarter keep only 50-100% of it and end in fresh tokens; prompts shorter than
the case are filled with fresh tokens. So matches vary, as a router's queries do.

The run records which kvcoord it measured (commit, and a digest of the working tree's sources and
built extensions), the load average, and with ``--json`` everything printed. Service logs go to
``$TMPDIR/kvcoord-bench-vs-dynamo-{serve,indexer}.log``. Everything started is killed on exit, on
Ctrl-C and on SIGTERM. About a minute with the defaults.

``--pin same|split`` fixes where the lookups run (see :func:`pin`): on a VM a wakeup across vCPUs costs
more than a small lookup, and where the kernel puts the processes otherwise decides the comparison.

Usage: ``python benchmarks/bench_vs_dynamo_service.py [--algo sha256_cbor] [--engines 8] [--events 300000]
[--requests 2000] [--threads 4] [--cases tokens512,...] [--no-grpc] [--client once|split]
[--pin none|same|split] [--json out.json]``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pickle
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import orjson

MODEL = "bench"
BLOCK = 16
VOCAB = 151_936
DYNAMO_SEED = 1337
HELLO_BASE = 3_000_000_000
"""Token ids of the hello and sentinel blocks: outside the vocabulary, so they match nothing else."""
TOKEN_BLOCKS = (64, 128, 256, 512)
HASH_BLOCKS = (64, 512)
CASES = ("empty", *(f"tokens{b}" for b in TOKEN_BLOCKS), *(f"hashes{b}" for b in HASH_BLOCKS))
LOG_DIR = Path(tempfile.gettempdir())
KV, DYN, KV_GRPC = "kvcoord", "Dynamo", "kvcoord gRPC"


def as_i64(h: int) -> int:
    return h - (1 << 64) if h >= 1 << 63 else h


def cpu_seconds(pid: int) -> float:
    """CPU time of a process so far, all its threads: the scheduler's nanosecond runtimes of its live
    threads (``/proc/<pid>/task/*/schedstat``); ``/proc/<pid>/stat``'s user + system time (10 ms steps,
    threads that exited included) where schedstat is missing. Nine processes read in 10 ms steps can be
    ~50 ms off in all, a fifth of the ingest CPU this benchmark compares."""
    total, seen = 0, False
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError, ValueError):
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
                seen = True
    if seen:
        return total / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: Sequence[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


# --- a minimal HTTP/1.1 keep-alive client (the same for both services) --------------------------
class Http:
    """One keep-alive connection; Content-Length framing only (both services send it)."""

    def __init__(self, host: str, port: int, timeout: float = 30.0, split: bool = False) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.split = split
        """Send a request's head and body in two writes, as ``http.client`` and ``requests`` do."""
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.host = f"{host}:{port}".encode()
        self.buf = bytearray()

    def close(self) -> None:
        self.sock.close()

    def get(self, path: str) -> tuple[int, bytes]:
        self.sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nhost: " + self.host + b"\r\n\r\n")
        return self._read()

    def post(self, path: bytes, body: bytes) -> tuple[int, bytes]:
        head = (b"POST " + path + b" HTTP/1.1\r\nhost: " + self.host
                + b"\r\ncontent-type: application/json\r\ncontent-length: " + str(len(body)).encode()
                + b"\r\n\r\n")
        if self.split:
            self.sock.sendall(head)
            self.sock.sendall(body)
        else:
            self.sock.sendall(head + body)
        return self._read()

    def _read(self) -> tuple[int, bytes]:
        buf, recv = self.buf, self.sock.recv
        while (end := buf.find(b"\r\n\r\n")) < 0:
            chunk = recv(262144)
            if not chunk:
                raise ConnectionError("connection closed by the server")
            buf += chunk
        head = bytes(buf[:end]).lower()
        status = int(head[9:12])
        at = head.find(b"\r\ncontent-length:")
        if at < 0:
            if b"transfer-encoding" in head:
                raise RuntimeError("chunked answer: this client reads Content-Length bodies only")
            length = 0
        else:
            stop = head.find(b"\r\n", at + 2)
            length = int(head[at + 17:stop if stop >= 0 else len(head)])
        total = end + 4 + length
        while len(buf) < total:
            chunk = recv(262144)
            if not chunk:
                raise ConnectionError("connection closed by the server mid-answer")
            buf += chunk
        body = bytes(buf[end + 4:total])
        del buf[:total]
        return status, body


def call_json(conn: Http, path: str, data: Any) -> tuple[int, Any]:
    """A set-up call (not timed)."""
    status, body = conn.post(path.encode(), orjson.dumps(data))
    return status, (orjson.loads(body) if body else None)


# --- the workload -------------------------------------------------------------------------------
@dataclass
class Workload:
    batches: list[list[Any]]
    """Per engine, its KVEventBatches in order: [0] is the hello, [-1] holds the sentinel."""
    hello: list[list[int]]
    sentinel: list[list[int]]
    recent: list[list[int]]
    """Token ids (prompt + output) of the last requests, for query prompts."""
    cached: list[set[int]]
    """Per engine, the uint64 hashes its pool holds at the end (the truth)."""
    stored: int = 0
    removed: int = 0
    requests: int = 0
    seconds: float = 0.0
    hit_tokens: int = 0
    prompt_tokens: int = 0

    @property
    def events(self) -> int:
        return self.stored + self.removed


def count_blocks(events: Sequence[Any]) -> tuple[int, int]:
    """(stored, removed) block hashes in ``events``."""
    from kvcoord.events import BlockRemoved, BlockStored

    s = r = 0
    for ev in events:
        if isinstance(ev, BlockStored):
            s += len(ev.block_hashes)
        elif isinstance(ev, BlockRemoved):
            r += len(ev.block_hashes)
    return s, r


def make_workload(args: argparse.Namespace, profile: Any, rng: random.Random) -> Workload:
    from kvcoord.agent.kv_cache_manager import KVCacheManager
    from kvcoord.agent.pool import BlockPool
    from kvcoord.events import KVEventBatch

    t0 = time.perf_counter()
    n = args.engines
    engines = [KVCacheManager(BlockPool(args.engine_blocks, profile)) for _ in range(n)]
    pools = [kv.pool for kv in engines]

    def fresh(k: int) -> list[int]:
        return [rng.randrange(VOCAB) for _ in range(k)]

    prefixes = [fresh(rng.randint(32, 256) * BLOCK) for _ in range(32)]
    weights = [1 / (i + 1) for i in range(len(prefixes))]
    hello = [[HELLO_BASE + 2 * BLOCK * e + i for i in range(BLOCK)] for e in range(n)]
    sentinel = [[HELLO_BASE + 2 * BLOCK * e + BLOCK + i for i in range(BLOCK)] for e in range(n)]
    wl = Workload([[] for _ in range(n)], hello, sentinel, [], [])
    running: list[list[tuple[str, list[int]]]] = [[] for _ in range(n)]
    convs: list[list[list[int]]] = [[] for _ in range(n)]
    recent: list[list[int]] = []
    seq = 0

    def emit(e: int) -> None:
        events = pools[e].take_events()
        if events:
            s, r = count_blocks(events)
            wl.stored += s
            wl.removed += r
            wl.batches[e].append(KVEventBatch(ts=time.time(), events=tuple(events), data_parallel_rank=0))

    def finish(e: int, rid: str, tokens: list[int]) -> None:
        out = fresh(rng.randint(1, 512))
        with contextlib.suppress(Exception):  # PoolExhausted: finish without caching the output
            engines[e].extend(rid, out)
            tokens = tokens + out
        engines[e].finish(rid)
        convs[e].append(tokens)
        del convs[e][:-16]
        recent.append(tokens)
        del recent[:-400]

    for e in range(n):  # hello: one block (+1 token: vLLM recomputes the last one)
        engines[e].admit("hello", hello[e] + [1])
        engines[e].finish("hello")
        emit(e)
    while wl.events < args.events:
        e = rng.randrange(n)
        if len(running[e]) >= 4:
            finish(e, *running[e].pop(0))
        prompt: list[int] | None = None
        if convs[e] and rng.random() < 0.4:
            base = convs[e].pop(rng.randrange(len(convs[e])))
            turn = fresh(rng.randint(8, 128) * BLOCK + rng.randrange(BLOCK))
            if (len(base) + len(turn)) // BLOCK <= 1024:
                prompt = base + turn
        if prompt is None:
            user = fresh(rng.randint(8, 256) * BLOCK + rng.randrange(BLOCK))
            prompt = rng.choices(prefixes, weights)[0] + user
        seq += 1
        rid = f"r{seq}"
        adm = engines[e].admit(rid, prompt)
        while adm is None and running[e]:
            finish(e, *running[e].pop(0))
            adm = engines[e].admit(rid, prompt)
        if adm is None:
            continue
        wl.requests += 1
        wl.prompt_tokens += len(prompt)
        wl.hit_tokens += adm.num_cached_tokens
        running[e].append((rid, prompt))
        emit(e)
    for e in range(n):  # the sentinel, last: a side has applied everything when it answers for it
        engines[e].admit("sentinel", sentinel[e] + [1])
        emit(e)
    wl.recent = recent
    wl.cached = [{int(h) for h in p.cached_hashes()} for p in pools]
    wl.seconds = time.perf_counter() - t0
    return wl


def dynamo_hashes(tokens: Sequence[int]) -> list[int]:
    """Dynamo's block-local hashes (xxh3_64, seed 1337, of each full block's LE u32 tokens), as i64."""
    import xxhash

    arr = array("I", tokens[: len(tokens) // BLOCK * BLOCK])
    if sys.byteorder != "little":
        arr.byteswap()
    raw, step = arr.tobytes(), 4 * BLOCK
    return [as_i64(xxhash.xxh3_64_intdigest(raw[i:i + step], DYNAMO_SEED)) for i in range(0, len(raw), step)]


def truth(cached: list[set[int]], hashes: Sequence[int]) -> tuple[int, tuple[str, ...]]:
    """(best matched tokens, instance ids holding that many), from the engines' own pools."""
    best, who = 0, list[str]()
    for e, held in enumerate(cached):
        k = 0
        for h in hashes:
            if h not in held:
                break
            k += 1
        if k and k >= best:
            if k > best:
                best, who = k, []
            who.append(str(e + 1))
    return best * BLOCK, tuple(sorted(who))


def make_cases(args: argparse.Namespace, wl: Workload, profile: Any,
               rng: random.Random) -> list[dict[str, Any]]:
    from kvcoord.hashing import block_hashes64

    def prompts(nblocks: int) -> list[list[int]]:
        need = nblocks * BLOCK
        long = [t for t in wl.recent if len(t) >= need] or wl.recent
        out = []
        for _ in range(args.prompts):
            src = rng.choice(long)
            keep = min(nblocks, len(src) // BLOCK)
            if rng.random() < 0.25:
                keep = rng.randint(keep // 2, keep)
            toks = src[:keep * BLOCK]
            out.append(toks + [rng.randrange(VOCAB) for _ in range(need - len(toks))])
        return out

    cases: list[dict[str, Any]] = []
    for kind, sizes in (("tokens", TOKEN_BLOCKS), ("hashes", HASH_BLOCKS)):
        for nb in sizes:
            ps = prompts(nb)
            kv = [block_hashes64(profile, p) for p in ps]
            case: dict[str, Any] = {"name": f"{kind} {nb:>3} blocks", "kind": kind, "blocks": nb,
                                    "prompts": ps, "truth": [truth(wl.cached, h) for h in kv]}
            if kind == "hashes":
                case["kv_hashes"] = [[as_i64(h) for h in x] for x in kv]
                case["kv_hashes_u64"] = [list(map(int, x)) for x in kv]
                case["dyn_hashes"] = [dynamo_hashes(p) for p in ps]
            cases.append(case)
    return cases


# --- publishers ---------------------------------------------------------------------------------
class _Payload(bytes):
    """A batch already encoded by ``encode_vllm_batch`` (byte for byte what the publisher would send)."""


def publishers() -> type[Any]:
    """``ZmqEventPublisher`` that can also send pre-encoded batches, so the benchmark's own msgpack
    encoding stays out of the ingest window (frames, seqs, buffering and replay are the publisher's)."""
    from kvcoord.engine import zmq_wire

    names = vars(zmq_wire)
    encode = names["encode_vllm_batch"]
    if not getattr(encode, "_passes_payloads", False):
        def encode_or_pass(batch: Any, *, form: Any = "map") -> bytes:
            return batch if isinstance(batch, _Payload) else encode(batch, form=form)

        encode_or_pass._passes_payloads = True  # type: ignore[attr-defined]
        names["encode_vllm_batch"] = encode_or_pass

    class Publisher(zmq_wire.ZmqEventPublisher):
        def publish_encoded(self, payload: _Payload) -> None:
            self._queue.put(payload)  # type: ignore[arg-type]

    return Publisher


# --- the services -------------------------------------------------------------------------------
@dataclass
class Side:
    name: str
    pid: int
    http_port: int
    log: Path | None
    agents: tuple[int, ...] = ()
    """``--agents``: the pids of kvcoord's ``kvcoord agent`` processes (their CPU counts in its ingest)."""

    def ingest_cpu(self) -> float:
        return cpu_seconds(self.pid) + sum(cpu_seconds(p) for p in self.agents)


def start_agents(stack: contextlib.ExitStack, args: argparse.Namespace, gport: int,
                 pubs: list[tuple[str, str]]) -> tuple[int, ...]:
    """``--agents``: one ``kvcoord agent`` per engine (node id = its instance id), as on GPU hosts."""
    from tests.procs import kvcoord_cmd, running

    pids = []
    for i, (ep, rep) in enumerate(pubs):
        cmd = kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", str(i + 1),
                          "--model", MODEL, "--zmq-endpoint", ep, "--replay-endpoint", rep,
                          "--algo", args.algo, "--block-size", str(BLOCK), "--hash-seed", "42",
                          *(("--linger", str(args.linger)) if args.linger else ()))
        log = LOG_DIR / f"kvcoord-bench-vs-dynamo-agent{i + 1}.log"
        pids.append(stack.enter_context(running(cmd, log=log)).pid)
    return tuple(pids)


def kv_serve_cmd(args: argparse.Namespace, gport: int, kport: int, workers: int) -> list[str]:
    """``kvcoord serve`` as benchmarked (``workers``: its ``--lookup-workers``)."""
    from tests.procs import kvcoord_cmd

    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--http-listen", f"127.0.0.1:{kport}",
                       "--metrics-listen", "", "--index", "memory",
                       "--model", f"{MODEL},algo={args.algo},block_size={BLOCK},seed=42",
                       *(("--lookup-workers", str(workers)) if workers else ()))


@contextlib.contextmanager
def kv_service(args: argparse.Namespace, workers: int, name: str) -> Iterator[Side]:
    """One more ``kvcoord serve`` (``--lookup-workers workers``), as side ``name``."""
    from tests.procs import free_port, running, wait_for_port

    gport, kport = free_port(), free_port()
    log = LOG_DIR / f"kvcoord-bench-serve-{name.replace(' ', '-')}.log"
    with running(kv_serve_cmd(args, gport, kport, workers), log=log) as kv:
        for port in (kport, gport):
            try:
                wait_for_port(port, timeout=60)
            except TimeoutError:
                raise SystemExit(f"kvcoord serve did not start (exit {kv.poll()}); see {log}") from None
        yield Side(name, kv.pid, kport, log)


@contextlib.contextmanager
def services(args: argparse.Namespace) -> Iterator[tuple[Side, Side, int]]:
    from tests.procs import free_port, running, wait_for_port

    gport, kport, dport = free_port(), free_port(), free_port()
    kv_log = LOG_DIR / "kvcoord-bench-vs-dynamo-serve.log"
    dyn_log = LOG_DIR / "kvcoord-bench-vs-dynamo-indexer.log"
    kv_cmd = kv_serve_cmd(args, gport, kport, getattr(args, "workers", [0])[0])
    if args.profile_kvcoord:
        kv_cmd = [kv_cmd[0], "-m", "cProfile", "-o", args.profile_kvcoord, *kv_cmd[1:]]
    dyn_cmd = [sys.executable, "-m", "dynamo.indexer", "--port", str(dport), "--threads", str(args.threads)]
    with running(kv_cmd, log=kv_log) as kv, running(dyn_cmd, log=dyn_log) as dyn:
        for port, proc, log in ((kport, kv, kv_log), (gport, kv, kv_log), (dport, dyn, dyn_log)):
            try:
                wait_for_port(port, timeout=60)
            except TimeoutError:
                raise SystemExit(f"a service did not start (exit {proc.poll()}); see {log}") from None
        yield Side(KV, kv.pid, kport, kv_log), Side(DYN, dyn.pid, dport, dyn_log), gport


def register(side: Side, pubs: list[tuple[str, str]]) -> None:
    """Every publisher as instance 1..N, dp 0; then wait until every listener is active."""
    conn = Http("127.0.0.1", side.http_port)
    try:
        for i, (ep, rep) in enumerate(pubs):
            st, body = call_json(conn, "/register", {
                "instance_id": i + 1, "endpoint": ep, "replay_endpoint": rep, "model_name": MODEL,
                "block_size": BLOCK, "dp_rank": 0})
            if st != 201:
                raise SystemExit(f"{side.name}: /register {ep} -> {st} {body}")
        deadline = time.monotonic() + 30
        while True:
            _, raw = conn.get("/workers")
            workers = orjson.loads(raw)
            if len(workers) == len(pubs) and all(w["status"] == "active" for w in workers):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"{side.name}: listeners not active after 30 s: {workers}")
            time.sleep(0.05)
    finally:
        conn.close()


def holds(conn: Http, tokens: list[int], instance: int) -> bool:
    st, ans = call_json(conn, "/query", {"token_ids": tokens, "model_name": MODEL})
    if st != 200:
        raise RuntimeError(f"/query -> {st} {ans}")
    return bool(ans["scores"].get(str(instance), {}).get("0") == len(tokens))


def wait_applied(sides: list[Side], probes: list[list[int]], timeout: float,
                 on_done: Callable[[Side], None] = lambda s: None, poll: float = 0.02,
                 fail: bool = True) -> dict[str, set[int]]:
    """Poll each side until it answers every engine's probe block; ``on_done`` as each side finishes.
    On timeout: exit (``fail``) or return the engines each side still lacks."""
    conns = {s.name: Http("127.0.0.1", s.http_port) for s in sides}
    pending = {s.name: set(range(len(probes))) for s in sides}
    deadline = time.monotonic() + timeout
    try:
        while any(pending.values()):
            for s in sides:
                left = pending[s.name]
                if not left:
                    continue
                for e in sorted(left):
                    if not holds(conns[s.name], probes[e], e + 1):
                        break  # one miss is enough for this round
                    left.discard(e)
                if not left:
                    on_done(s)
            if time.monotonic() > deadline:
                if not fail:
                    return pending
                lacking = ", ".join(f"{k}: {sorted(x + 1 for x in v)}" for k, v in pending.items() if v)
                raise SystemExit(f"timed out after {timeout:.0f} s; engines not applied: {lacking}")
            time.sleep(poll)
    finally:
        for c in conns.values():
            c.close()
    return pending


def dynamo_metrics(port: int) -> dict[str, float]:
    conn = Http("127.0.0.1", port)
    try:
        _, body = conn.get("/metrics")
    finally:
        conn.close()
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(("dynamo_kvrouter_kv_cache_event", "dynamo_kvindexer_errors_total")):
            name, _, val = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(val)
    return out


# --- the client process -------------------------------------------------------------------------
def pick_encoder(samples: list[dict[str, Any]]) -> tuple[Callable[[Any], bytes], str]:
    """The faster of orjson and msgspec for these request bodies (best of 5 x 50)."""
    import msgspec

    encoders: dict[str, Callable[[Any], bytes]] = {"orjson": orjson.dumps,
                                                   "msgspec": msgspec.json.Encoder().encode}
    best = {}
    for name, enc in encoders.items():
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for i in range(50):
                enc(samples[i % len(samples)])
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    name = min(best, key=best.__getitem__)
    return encoders[name], name


def http_best(ans: Any) -> tuple[int, tuple[str, ...]]:
    best, who = 0, list[str]()
    for inst, ranks in ans["scores"].items():
        v = max(ranks.values(), default=0)
        if v and v >= best:
            if v > best:
                best, who = v, []
            who.append(inst)
    return best, tuple(sorted(who))


def grpc_best(res: Any) -> tuple[int, tuple[str, ...]]:
    nodes = [n for n in res.nodes if n.matched_blocks]
    if not nodes:
        return 0, ()
    top = max(n.matched_blocks for n in nodes)
    return top * res.block_size, tuple(sorted(n.node_id for n in nodes if n.matched_blocks == top))


def run_client(spec_path: str, out_path: str) -> None:
    """Client mode: time every case, the transports interleaved request by request."""
    from kvcoord.router.client import CoordinatorClient

    spec = pickle.loads(Path(spec_path).read_bytes())
    if "client_cpus" in spec:
        os.sched_setaffinity(0, spec["client_cpus"])
    n, warm = spec["requests"], spec["warmup"]
    split = spec.get("client") == "split"
    kv = Http("127.0.0.1", spec["kv_port"], split=split)
    dyn = Http("127.0.0.1", spec["dyn_port"], split=split)
    grpc_client = CoordinatorClient(f"127.0.0.1:{spec['grpc_port']}", timeout=30)
    pids = {KV: spec["kv_pid"], DYN: spec["dyn_pid"]}
    rows: list[dict[str, Any]] = []
    mismatches: list[str] = []
    truth_misses: dict[str, int] = {}

    def measure(row: str, calls: dict[str, Callable[[int], Any]],
                summarise: Mapping[str, Callable[[Any], Any]], nprompts: int,
                truth_of: Callable[[int], Any] | None, extra: dict[str, Any]) -> None:
        names = list(calls)
        lat: dict[str, list[float]] = {k: [] for k in names}
        cpu0 = {k: cpu_seconds(p) for k, p in pids.items()}
        t_start = time.perf_counter()
        answers: dict[str, Any] = {}
        for i in range(warm + n):
            p = i % nprompts
            for k in names if i % 2 == 0 else names[::-1]:
                t0 = time.perf_counter()
                ans = calls[k](p)
                dt = time.perf_counter() - t0
                if i >= warm:
                    lat[k].append(dt)
                answers[k] = ans
            if summarise:  # outside the timed part
                got = {k: summarise[k](answers[k]) for k in names}
                if len(set(got.values())) != 1 and len(mismatches) < 20:
                    mismatches.append(f"{row}, prompt {p}: " + "; ".join(f"{k} {v}" for k, v in got.items())
                                      + (f"; engines' pools {truth_of(p)}" if truth_of else ""))
                if truth_of is not None and i < nprompts:
                    for k, v in got.items():
                        if v != truth_of(p):
                            truth_misses[k] = truth_misses.get(k, 0) + 1
        wall = time.perf_counter() - t_start
        out: dict[str, Any] = {"case": row, "wall_s": wall, **extra,
                               "cpu_per_request_s": {k: (cpu_seconds(p) - cpu0[k]) / (warm + n)
                                                     for k, p in pids.items()}}
        for k in names:
            out[k] = {"p50": pct(lat[k], 50), "p90": pct(lat[k], 90), "p99": pct(lat[k], 99),
                      "mean": statistics.fmean(lat[k]), "min": min(lat[k])}
        rows.append(out)
        print(f"  {row:<34} " + "  ".join(f"{k} p50 {out[k]['p50'] * 1e6:7.1f} us" for k in names),
              file=sys.stderr, flush=True)

    def health(conn: Http) -> Callable[[int], Any]:
        def call(_: int) -> None:
            st, _body = conn.get("/health")
            if st != 200:
                raise RuntimeError(f"/health -> {st}")
        return call

    def http_call(conn: Http, path: bytes, bodies: list[Any],
                  enc: Callable[[Any], bytes]) -> Callable[[int], Any]:
        encoded = [enc(b) for b in bodies]  # the client's JSON building is the same for both: not timed

        def call(p: int) -> Any:
            st, raw = conn.post(path, encoded[p])
            if st != 200:
                raise RuntimeError(f"{path.decode()} -> {st} {raw[:200]!r}")
            return orjson.loads(raw)
        return call

    def grpc_call(args: list[dict[str, Any]]) -> Callable[[int], Any]:
        def call(p: int) -> Any:
            return grpc_client.lookup(MODEL, **args[p])
        return call

    def ping(_: int) -> None:
        grpc_client.ping()

    for phase in spec["phases"]:
        print(f"client: {phase} phase", file=sys.stderr, flush=True)
        if spec["empty"]:
            ours, f = (KV, health(kv)) if phase == "http" else (KV_GRPC, ping)
            measure(f"empty call ({'GET /health' if phase == 'http' else 'gRPC Ping'} | GET /health)",
                    {ours: f, DYN: health(dyn)}, {}, 1, None, {"kind": "empty", "phase": phase})
        for case in spec["cases"]:
            ps = case["prompts"]
            if case["kind"] == "tokens":
                path = b"/query"
                dyn_bodies = [{"token_ids": t, "model_name": MODEL} for t in ps]
                kv_bodies = dyn_bodies
                grpc_args = [{"tokens": t} for t in ps]
            else:
                path = b"/query_by_hash"
                dyn_bodies = [{"block_hashes": h, "model_name": MODEL} for h in case["dyn_hashes"]]
                kv_bodies = [{"block_hashes": h, "model_name": MODEL} for h in case["kv_hashes"]]
                grpc_args = [{"hashes": h} for h in case["kv_hashes_u64"]]
            enc, codec = pick_encoder(dyn_bodies + kv_bodies)
            extra: dict[str, Any] = {
                "kind": case["kind"], "blocks": case["blocks"], "phase": phase, "codec": codec,
                "request_bytes": {KV: statistics.fmean(len(enc(b)) for b in kv_bodies),
                                  DYN: statistics.fmean(len(enc(b)) for b in dyn_bodies)},
                "matched_tokens_mean": statistics.fmean(t[0] for t in case["truth"])}
            summarise: dict[str, Callable[[Any], Any]]
            if phase == "http":
                calls = {KV: http_call(kv, path, kv_bodies, enc), DYN: http_call(dyn, path, dyn_bodies, enc)}
                summarise = {KV: http_best, DYN: http_best}
                extra["answer_bytes"] = {KV: len(kv.post(path, enc(kv_bodies[0]))[1]),
                                         DYN: len(dyn.post(path, enc(dyn_bodies[0]))[1])}
            else:
                calls = {KV_GRPC: grpc_call(grpc_args), DYN: http_call(dyn, path, dyn_bodies, enc)}
                summarise = {KV_GRPC: grpc_best, DYN: http_best}
            measure(case["name"], calls, summarise, len(ps), case["truth"].__getitem__, extra)
    kv.close()
    dyn.close()
    grpc_client.close()
    Path(out_path).write_bytes(pickle.dumps({"rows": rows, "mismatches": mismatches,
                                             "truth_misses": truth_misses}))


# --- the run ------------------------------------------------------------------------------------
def pin(how: str, pids: Sequence[int]) -> set[int] | None:
    """``--pin``: set the services' CPUs (every thread) for the lookups; the client's CPUs, or None.

    On a VM, a wakeup across vCPUs (the client's request waking a server parked on the other one, and the
    answer waking the client) costs tens of microseconds, more than a small lookup; where each process runs
    is up to the kernel and what else runs. ``same`` puts the client and both services on one CPU (no
    cross-CPU wakeup: the requests' own work decides), ``split`` the services on one and the client on
    another (every exchange crosses), ``none`` leaves it to the kernel."""
    if how == "none":
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2 and how == "split":
        raise SystemExit("--pin split needs two CPUs")
    server, client = {cpus[-1]}, ({cpus[-1]} if how == "same" else {cpus[0]})
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), server)
    return client


def code_state() -> dict[str, Any]:
    """Which kvcoord was measured: the commit, and a digest of the working tree's package sources and
    built extensions (the tree may hold uncommitted work), with the newest file's time."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        head = ""
    digest, newest = hashlib.sha256(), 0.0
    for f in sorted((root / "kvcoord").rglob("*")):
        if f.is_file() and f.suffix in (".py", ".c", ".h", ".so") and "__pycache__" not in f.parts:
            digest.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
            newest = max(newest, f.stat().st_mtime)
    return {"head": head, "tree_digest": digest.hexdigest()[:12],
            "newest_file": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(newest))}


def main(args: argparse.Namespace) -> int:
    from kvcoord.events import encode_vllm_batch
    from kvcoord.hashing import HashProfile
    from kvcoord.router.client import CoordinatorClient
    from tests.procs import free_port, spawn, stop

    bad = [c for c in args.cases if c not in CASES]
    if bad:
        raise SystemExit(f"unknown case(s) {', '.join(bad)}: choose from {', '.join(CASES)}")
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    out: dict[str, Any] = {"started": started, "args": vars(args), "loadavg_start": os.getloadavg(),
                           "code": code_state()}
    rng = random.Random(args.seed)
    profile = HashProfile(algo=args.algo, block_size=BLOCK, seed="42")
    wl = make_workload(args, profile, rng)
    held = sum(len(c) for c in wl.cached)
    print(f"workload: {args.engines} engines x {args.engine_blocks} blocks, {wl.requests} requests, "
          f"{sum(len(b) for b in wl.batches)} batches, {wl.events:,} block events ({wl.stored:,} stored, "
          f"{wl.removed:,} removed), prefix-cache hit rate {wl.hit_tokens / max(1, wl.prompt_tokens):.0%}, "
          f"{held:,} blocks held at the end (generated in {wl.seconds:.1f} s)", file=sys.stderr)
    t_enc = time.perf_counter()
    payloads = [[_Payload(encode_vllm_batch(b, form="map")) for b in bs] for bs in wl.batches]
    print(f"encoded {sum(len(p) for ps in payloads for p in ps) / 1e6:.1f} MB of vLLM msgpack (map form) "
          f"beforehand in {time.perf_counter() - t_enc:.2f} s", file=sys.stderr)
    cases = make_cases(args, wl, profile, rng)
    out["workload"] = {"engines": args.engines, "requests": wl.requests, "batches": sum(map(len, wl.batches)),
                       "block_events": wl.events, "stored": wl.stored, "removed": wl.removed,
                       "held_at_end": held}

    publisher = publishers()
    pubs: list[Any] = []
    with contextlib.ExitStack() as stack:
        addrs = []
        for _ in range(args.engines):
            ep, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            pub = publisher(0, ep, rep, bind=True, buffer_steps=1_000_000, hwm=1_000_000,
                            max_queue_size=1_000_000)
            stack.callback(pub.shutdown)
            pubs.append(pub)
            addrs.append((ep, rep))
        kv, dyn, gport = stack.enter_context(services(args))
        sides = [kv, dyn]
        print(f"services: kvcoord serve pid {kv.pid} (HTTP :{kv.http_port}, gRPC :{gport}; log {kv.log}), "
              f"Dynamo indexer pid {dyn.pid} --threads {args.threads} (HTTP :{dyn.http_port}; log {dyn.log})",
              file=sys.stderr)
        if args.agents:
            kv.agents = start_agents(stack, args, gport, addrs)
            register(dyn, addrs)
        else:
            for s in sides:
                register(s, addrs)

        # Hello: until both sides hold every engine's hello block. A SUB that was not subscribed yet
        # loses it, and Dynamo replays a gap only when the next live batch shows it, so an engine
        # missing on a side publishes its hello again (a new seq: the gap brings the first back).
        time.sleep(0.5)
        missing = set(range(args.engines))
        for attempt in range(10):
            for e in sorted(missing):
                pubs[e].publish_encoded(payloads[e][0])
            left = wait_applied(sides, wl.hello, 5, fail=False)
            missing = set().union(*left.values())
            if not missing:
                break
            lacking = {k: sorted(x + 1 for x in v) for k, v in left.items() if v}
            out.setdefault("hello_republished", []).append(lacking)
            print(f"hello not applied after 5 s (attempt {attempt + 1}), publishing it again: {lacking}",
                  file=sys.stderr)
        else:
            raise SystemExit("the services never applied every engine's hello batch")

        # Ingest: everything else, as fast as the publishers send; each side polled until caught up.
        cpu0 = {s.name: s.ingest_cpu() for s in sides}
        agents0 = sum(cpu_seconds(p) for p in kv.agents)
        me0 = time.process_time()
        done: dict[str, tuple[float, float]] = {}
        t0 = time.perf_counter()
        if args.rate:  # as engines do: one batch per scheduler step; all at once, or each in its own phase
            phase = [e / args.engines if args.stagger else 0.0 for e in range(args.engines)]
            steps = sorted((i + phase[e], e, i) for e in range(args.engines)
                           for i in range(1, len(payloads[e])))
            for at, e, i in steps:
                time.sleep(max(0.0, t0 + (at - 1) / args.rate - time.perf_counter()))
                pubs[e].publish_encoded(payloads[e][i])
        else:
            for e, pub in enumerate(pubs):
                for b in payloads[e][1:]:
                    pub.publish_encoded(b)
        for pub in pubs:
            pub.flush(60)
        t_pub = time.perf_counter() - t0

        def caught_up(s: Side) -> None:
            done.setdefault(s.name, (time.perf_counter() - t0, s.ingest_cpu() - cpu0[s.name]))
            if s is kv and kv.agents:
                out["agents_cpu_s"] = sum(cpu_seconds(p) for p in kv.agents) - agents0

        wait_applied(sides, wl.sentinel, args.ingest_timeout, on_done=caught_up)
        events = wl.events - sum(count_blocks(wl.batches[e][0].events)[0] for e in range(args.engines))
        out["ingest"] = {s: {"wall_s": w, "block_events_per_s": events / w, "cpu_s": c}
                         for s, (w, c) in done.items()}
        out["ingest"]["publisher_process_cpu_s"] = time.process_time() - me0
        out["ingest"]["published_s"] = t_pub
        time.sleep(0.5)
        with CoordinatorClient(f"127.0.0.1:{gport}", timeout=30) as c:
            st = c.stats()
        out["kvcoord_stats"] = {"entries": st.entries, "blocks": st.blocks,
                                "events_applied": st.events_applied, "events_rejected": st.events_rejected,
                                "hash_mismatches": st.hash_mismatches,
                                "snapshots_requested": st.snapshots_requested}
        out["dynamo_metrics"] = dynamo_metrics(dyn.http_port)

        # Lookups, from a separate process.
        spec = {"requests": args.requests, "warmup": args.warmup, "kv_port": kv.http_port,
                "dyn_port": dyn.http_port, "grpc_port": gport, "kv_pid": kv.pid, "dyn_pid": dyn.pid,
                "empty": "empty" in args.cases,
                "cases": [c for c in cases if f"{c['kind']}{c['blocks']}" in args.cases],
                "phases": ["http"] if args.no_grpc else ["http", "grpc"], "client": args.client}
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-vs-dynamo-")))
        client_cpus = pin(args.pin, [s.pid for s in sides])
        if client_cpus is not None:
            spec["client_cpus"] = client_cpus
        (tmp / "spec.pkl").write_bytes(pickle.dumps(spec))
        cpu1 = {s.name: cpu_seconds(s.pid) for s in sides}
        t1 = time.perf_counter()
        client = spawn([sys.executable, str(Path(__file__).resolve()), "--run-client", str(tmp / "spec.pkl"),
                        str(tmp / "out.pkl")])  # stderr inherited: its progress shows as it goes
        try:
            rc = client.wait(timeout=args.client_timeout)
        except subprocess.TimeoutExpired:
            rc = -1
        finally:
            stop(client)
        if rc != 0:
            raise SystemExit(f"the client process failed (exit {rc})")
        out["lookup_phase"] = {s.name: {"cpu_s": cpu_seconds(s.pid) - cpu1[s.name]} for s in sides}
        out["lookup_phase"]["wall_s"] = time.perf_counter() - t1
        res = pickle.loads((tmp / "out.pkl").read_bytes())
    for r in res["rows"]:
        ours = KV if KV in r else KV_GRPC
        r["ratio_p50"] = r[ours]["p50"] / r[DYN]["p50"]
        r["ratio_p99"] = r[ours]["p99"] / r[DYN]["p99"]
    out["rows"], out["mismatches"], out["truth_misses"] = res["rows"], res["mismatches"], res["truth_misses"]
    out["loadavg_end"] = os.getloadavg()
    report(out)
    if args.json:
        import json

        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    if out["mismatches"]:
        print("\nANSWERS DIFFER (kvcoord vs Dynamo):\n  " + "\n  ".join(out["mismatches"]), file=sys.stderr)
        return 1
    return 0


def report(out: dict[str, Any]) -> None:
    a, w, code = out["args"], out["workload"], out["code"]
    print(f"\nkvcoord vs Dynamo indexer service: algo {a['algo']}, {w['engines']} engines, "
          f"{w['block_events']:,} block events ({w['stored']:,} stored, {w['removed']:,} removed, "
          f"{w['held_at_end']:,} held at the end), Dynamo --threads {a['threads']}, "
          f"--pin {a.get('pin', 'none')}; {a['requests']} timed requests per case after {a['warmup']}; "
          f"started {out['started']}, load average "
          f"{out['loadavg_start'][0]:.2f} -> {out['loadavg_end'][0]:.2f}; kvcoord {code['head']} + working "
          f"tree {code['tree_digest']} (newest file {code['newest_file']})")
    print("\n| case | kvcoord p50 / p99 (µs) | Dynamo p50 / p99 (µs) | ratio p50 | ratio p99 "
          "| server CPU / req, kvcoord / Dynamo (µs) | matched tokens (mean) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in out["rows"]:
        ours = KV if KV in r else KV_GRPC
        k, d, cpu = r[ours], r[DYN], r["cpu_per_request_s"]

        def mark(x: float, r: dict[str, Any] = r) -> str:
            target = r["kind"] != "empty" and r["phase"] == "http"
            return f"**{x:.2f}**" if target and x <= 0.8 else f"{x:.2f}"

        matched = f"{r['matched_tokens_mean']:.0f}" if "matched_tokens_mean" in r else ""
        print(f"| {'gRPC' if ours == KV_GRPC else 'HTTP'} {r['case']} "
              f"| {k['p50'] * 1e6:.0f} / {k['p99'] * 1e6:.0f} | {d['p50'] * 1e6:.0f} / {d['p99'] * 1e6:.0f} "
              f"| {mark(r['ratio_p50'])} | {mark(r['ratio_p99'])} "
              f"| {cpu[KV] * 1e6:.0f} / {cpu[DYN] * 1e6:.0f} | {matched} |")
    print("\n(ratio = kvcoord / Dynamo; target <= 0.8 on the HTTP tokens and hashes rows. gRPC rows: "
          "kvcoord's gRPC Lookup against Dynamo's HTTP, measured interleaved with it; Dynamo's CPU there "
          "is its HTTP again. Server CPU per request includes the warm-up requests.)")
    http_rows = [r for r in out["rows"] if r["phase"] == "http" and "codec" in r]
    print("request encoder: " + "; ".join(f"{r['case'].strip()} {r['codec']}" for r in http_rows))
    print("request / answer bytes, kvcoord / Dynamo: " + "; ".join(
        f"{r['case'].strip()} {r['request_bytes'][KV]:,.0f} / {r['request_bytes'][DYN]:,.0f} -> "
        f"{r['answer_bytes'][KV]:,} / {r['answer_bytes'][DYN]:,}" for r in http_rows))
    ing = out["ingest"]
    print("\n| ingest | wall (s) | block events/s | service CPU (s) | CPU µs per block event |")
    print("|---|---:|---:|---:|---:|")
    for s in (KV, DYN):
        x = ing[s]
        print(f"| {s} | {x['wall_s']:.2f} | {x['block_events_per_s']:,.0f} | {x['cpu_s']:.2f} "
              f"| {x['cpu_s'] / w['block_events'] * 1e6:.2f} |")
    lk = out["lookup_phase"]
    print(f"(all batches sent {ing['published_s']:.2f} s after the first; this process, publishers + "
          f"polling: {ing['publisher_process_cpu_s']:.2f} s CPU; both services ingest at once, from the same "
          "sockets)")
    if "agents_cpu_s" in out:
        agents = out["agents_cpu_s"]
        print(f"kvcoord ingests through {w['engines']} `kvcoord agent` processes (--agents): agents "
              f"{agents:.2f} s CPU, coordinator {ing[KV]['cpu_s'] - agents:.2f} s (the kvcoord row is both)")
    else:
        print("kvcoord relays the registered engines itself (in-process, no agents)")
    print(f"lookup phase, {lk['wall_s']:.1f} s: service CPU kvcoord {lk[KV]['cpu_s']:.2f} s (HTTP and gRPC "
          f"rows), Dynamo {lk[DYN]['cpu_s']:.2f} s")
    st = out["kvcoord_stats"]
    print(f"kvcoord stats: {st['blocks']:,} blocks, {st['entries']:,} entries, applied "
          f"{st['events_applied']}, rejected {st['events_rejected']}, hash mismatches "
          f"{st['hash_mismatches']}, snapshots requested {st['snapshots_requested']}")
    print("Dynamo metrics (non-zero): "
          + ", ".join(f"{k} {v:g}" for k, v in out["dynamo_metrics"].items() if v))
    if out.get("hello_republished"):
        print(f"hello batches published again: {out['hello_republished']}")
    print(f"answers: kvcoord == Dynamo on every request: {'yes' if not out['mismatches'] else 'NO'}; "
          f"first answers differing from the engines' own pools: {out['truth_misses'] or 'none'}")


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    if len(sys.argv) == 4 and sys.argv[1] == "--run-client":
        run_client(sys.argv[2], sys.argv[3])
        sys.exit(0)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--algo", default="sha256_cbor",
                    choices=("sha256_cbor", "xxhash_cbor", "sha256", "xxhash"),
                    help="the engines' (and kvcoord's) block hash (default sha256_cbor)")
    ap.add_argument("--engines", type=int, default=8, help="publishers / instances (default 8)")
    ap.add_argument("--events", type=int, default=300_000, help="block events to publish (default 300000)")
    ap.add_argument("--engine-blocks", type=int, default=16384, help="KV blocks per engine (default 16384)")
    ap.add_argument("--requests", type=int, default=2000, help="timed requests per case and side (2000)")
    ap.add_argument("--warmup", type=int, default=200, help="untimed requests first (default 200)")
    ap.add_argument("--prompts", type=int, default=64, help="distinct prompts per case (default 64)")
    ap.add_argument("--threads", type=int, default=4, help="Dynamo indexer --threads (default 4)")
    ap.add_argument("--seed", type=int, default=42, help="workload RNG seed (default 42)")
    ap.add_argument("--cases", type=lambda v: v.split(","), default=list(CASES),
                    help=f"comma-separated subset of {','.join(CASES)} (default: all)")
    ap.add_argument("--no-grpc", action="store_true", help="skip the gRPC rows")
    ap.add_argument("--agents", action="store_true",
                    help="kvcoord ingests through one `kvcoord agent` process per engine (as on GPU hosts) "
                         "instead of relaying registered engines itself; its ingest CPU is the coordinator's "
                         "plus the agents'")
    ap.add_argument("--linger", type=float, default=0.0,
                    help="with --agents: their --linger (seconds a batch waits for more events; default 0)")
    ap.add_argument("--rate", type=float, default=0.0,
                    help="batches per second each engine publishes (a vLLM engine publishes one per "
                         "scheduler step, every 10-50 ms); default 0: as fast as the publishers send")
    ap.add_argument("--stagger", action="store_true",
                    help="with --rate: each engine steps in its own phase (independent replicas) rather than "
                         "all at once (vLLM's data-parallel ranks step together)")
    ap.add_argument("--pin", choices=("none", "same", "split"), default="none",
                    help="lookups: the client and both services on one CPU (same), the services on one and "
                         "the client on another (split), or wherever the kernel puts them (none, default)")
    ap.add_argument("--client", choices=("once", "split"), default="once",
                    help="how the HTTP client writes a request: head and body at once (default), or in two "
                         "writes, head then body, as http.client, requests and urllib3 do")
    ap.add_argument("--ingest-timeout", type=float, default=300.0, help="seconds (default 300)")
    ap.add_argument("--client-timeout", type=float, default=900.0, help="seconds (default 900)")
    ap.add_argument("--profile-kvcoord", default=None, metavar="PATH",
                    help="run kvcoord serve under cProfile, writing PATH")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON here")
    try:
        sys.exit(main(ap.parse_args()))
    except KeyboardInterrupt:
        sys.exit(130)
