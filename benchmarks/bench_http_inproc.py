"""The HTTP front door's Python per lookup, in process: recorded request bytes fed to one connection's
protocol object (``kvcoord.coordinator.httpd``) in a loop, answers written to a sink, no network.

What it isolates: what ``bench_vs_dynamo_service.py`` measures as server CPU per lookup, minus the
kernel's and the event loop's share (the socket reads and writes). Reported: CPU time per request, the
least of ``--rounds`` rounds. A coordinator state with ``--nodes``
nodes on one model (sha256_cbor, block size 16), each holding part of one chain on a rank; the cases
are plain lookups by tokens and by hashes, the request written at once (one ``data_received``) or head
and body apart (two), and ``GET /health`` (no work: the framing alone). ``--miss``: every answer as if
its rows were new (the view's encoded answers and rows emptied first); ``--miss answers``: as if the
query's rows had been seen in other answers (only the encoded answers emptied: a new prompt whose nodes
match as some earlier prompt's did). ``--churn K``: before each request, K nodes report a new load (as
heartbeats of a busy fleet do), in turn over the holders and ``--others`` nodes that hold nothing.

    python benchmarks/bench_http_inproc.py [--requests 20000] [--miss [rows|answers]] [--churn K
        [--others M]] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import random
import time
from typing import Any

from kvcoord.coordinator.auth import Authenticator
from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.fastpath import FastAnswers
from kvcoord.coordinator.httpapi import HttpApi
from kvcoord.coordinator.httpd import HttpServer
from kvcoord.events import STORE
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.index.memory import MemoryIndex
from kvcoord.load import NodeLoad

BS = 16


class _Sink:
    """A transport that keeps the bytes written to it."""

    def __init__(self) -> None:
        self.out = 0
        self.last = b""

    def write(self, data: bytes) -> None:
        self.out += 1
        self.last = data

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 1) if name == "peername" else None

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...

    def is_closing(self) -> bool:
        return False

    def close(self) -> None: ...


def _fleet(nodes: int, others: int = 0) -> tuple[HttpServer, list[int]]:
    cfg = load_config(None, env={}, overrides={"listen": "127.0.0.1:0", "metrics_listen": "",
                                               "http_listen": "",
                                               "models": [f"bench,algo=sha256_cbor,block_size={BS},seed=42"],
                                               "lease_seconds": 3600.0})
    state = CoordinatorState(cfg, MemoryIndex())
    api = HttpApi(state, None, Authenticator(cfg.auth))
    api.fast = FastAnswers(api, 3600.0)
    rng = random.Random(1)
    tokens = [rng.randrange(0, 1 << 17) for _ in range(512 * BS)]
    chain = block_hashes64(HashProfile(algo="sha256_cbor", block_size=BS, seed="42"), tokens)
    for i in range(nodes):
        rec, _ = state.registry.hello(str(i + 1), "bench", (0,), 1, index_ok=True)
        rec.resyncing = False
        upto = rng.randrange(len(chain) // 4, len(chain) + 1)
        ops = [(STORE, 0, chain[:upto], None, True)]
        state.index.apply_sync("bench", str(i + 1), 0, ops)  # type: ignore[attr-defined]
    for i in range(nodes, nodes + others):
        state.registry.hello(str(i + 1), "bench", (0,), 1, index_ok=True)[0].resyncing = False
        state.index.apply_sync("bench", str(i + 1), 0, [(STORE, 0, [i], None, True)])  # type: ignore[attr-defined]
    return HttpServer(api.routes(), api.authorize, [("x-kvcoord-replica", "r1")]), tokens


def _request(path: str, body: dict[str, Any]) -> tuple[bytes, bytes]:
    data = json.dumps(body, separators=(",", ":")).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    return head, data


async def _run(args: argparse.Namespace) -> None:
    server, tokens = _fleet(args.nodes, args.others)
    recs = list(server.routes["/query"].methods["POST"].__self__.state.registry)  # type: ignore[attr-defined]
    turn = [0]
    chain = block_hashes64(HashProfile(algo="sha256_cbor", block_size=BS, seed="42"), tokens)
    cases = {
        "tokens64": _request("/query", {"model_name": "bench", "token_ids": tokens[:64 * BS]}),
        "tokens512": _request("/query", {"model_name": "bench", "token_ids": tokens[:512 * BS]}),
        "hashes64": _request("/query_by_hash", {"model_name": "bench",
                                                "block_hashes": [h - (1 << 64) if h >> 63 else h
                                                                 for h in chain[:64]]}),
        "hashes512": _request("/query_by_hash", {"model_name": "bench",
                                                 "block_hashes": [h - (1 << 64) if h >> 63 else h
                                                                  for h in chain[:512]]}),
        "health": (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", b""),
    }
    from kvcoord.coordinator.httpd import _Connection

    fast = server.routes["/query"].methods["POST"].__self__.fast  # type: ignore[attr-defined]

    prof = cProfile.Profile() if args.profile else None
    for name, (head, body) in cases.items():
        if args.cases and name not in args.cases:
            continue
        for client in ("once", "split") if body else ("once",):
            conn = _Connection(server)
            sink = _Sink()
            conn.connection_made(sink)  # type: ignore[arg-type]
            whole = head + body
            feed = conn.data_received

            def one(feed: Any = feed, whole: bytes = whole, client: str = client, head: bytes = head,
                    body: bytes = body) -> None:
                for _ in range(args.churn):
                    turn[0] += 1
                    recs[turn[0] % len(recs)].load = NodeLoad(running_requests=turn[0])
                if args.miss:
                    for kept in fast._kept.values():
                        kept.answers.clear()
                        if args.miss == "rows":
                            kept.hits.clear()
                if client == "once":
                    feed(whole)
                else:
                    feed(head)
                    feed(body)

            for _ in range(200):
                one()
            assert sink.last.startswith(b"HTTP/1.1 200"), sink.last[:200]
            n = args.requests // args.rounds
            best = float("inf")
            if prof is not None:
                prof.enable()
            for _ in range(args.rounds):  # the least CPU of a few rounds: the machine may be shared
                t0 = time.process_time()
                for _ in range(n):
                    one()
                best = min(best, time.process_time() - t0)
            if prof is not None:
                prof.disable()
            conn.connection_lost(None)
            api = server.routes["/query"].methods["POST"].__self__  # type: ignore[attr-defined]
            paths = api.state.metrics.lookup_answers
            print(f"{name:10} {client:5} {best / n * 1e6:7.1f} us/request  answers by path {dict(paths)}",
                  flush=True)
    if prof is not None:
        prof.dump_stats(args.profile)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--requests", type=int, default=20000, help="timed requests per case (default 20000)")
    ap.add_argument("--rounds", type=int, default=5, help="rounds; the least CPU is reported (default 5)")
    ap.add_argument("--nodes", type=int, default=8, help="nodes holding the chain (default 8)")
    ap.add_argument("--cases", type=lambda v: v.split(","), default=None, help="e.g. tokens64,hashes64")
    ap.add_argument("--miss", nargs="?", const="rows", choices=("rows", "answers"), default=None,
                    help="every answer a miss: the view's answers and rows emptied before each request "
                         "(rows, the default), or its answers alone (answers)")
    ap.add_argument("--churn", type=int, default=0, metavar="K",
                    help="nodes reporting a new load before each request (default 0)")
    ap.add_argument("--others", type=int, default=0, metavar="M",
                    help="nodes holding none of the chain, beside --nodes (default 0)")
    ap.add_argument("--profile", default=None, metavar="PATH", help="cProfile the timed loops into PATH")
    asyncio.run(_run(ap.parse_args()))


if __name__ == "__main__":
    main()
