"""A stock-vLLM-style fleet with no agent process: engines registered over HTTP with two ``kvcoord serve``
replicas on one Redis. Exactly one replica relays each engine; lookups by tokens on either replica find
it; when the relaying replica is killed, the other takes the engine over and keeps the index current.
Real ``redis-server``, real ``kvcoord serve`` subprocesses, vLLM-exact ZMQ publishers.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import BlockStored, KVEventBatch
from kvcoord.hashing import HashProfile, block_hashes64
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import redis_server

MODEL = "fleet-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="42")
DEADLINE = 30.0


@dataclass
class Replica:
    name: str
    http: int
    proc: subprocess.Popen[bytes]

    def replica_id(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=10) as resp:
            return str(resp.headers["x-kvcoord-replica"])

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.http}{path}", data=data, method=method,
                                     headers={"content-type": "application/json"} if data else {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                raw = resp.read()
                return resp.status, json.loads(raw) if raw else None
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"null")


@contextlib.contextmanager
def fleet(tmp: Path) -> Iterator[list[Replica]]:
    with redis_server() as redis, contextlib.ExitStack() as stack:
        replicas = []
        for name in ("a", "b"):
            grpc, http = free_port(), free_port()
            proc = stack.enter_context(running(kvcoord_cmd(
                "serve", "--listen", f"127.0.0.1:{grpc}", "--metrics-listen", "",
                "--http-listen", f"127.0.0.1:{http}", "--index", f"{redis.url}?timeout=2",
                "--lease-seconds", "2", "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42",
            ), log=tmp / f"serve-{name}.log"))
            wait_for_port(http)
            replicas.append(Replica(name, http, proc))
        yield replicas


def until(cond: Any, what: str) -> Any:
    deadline = time.monotonic() + DEADLINE
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def stored(tokens: list[int]) -> KVEventBatch:
    hashes = block_hashes64(PROFILE, tokens)
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tuple(tokens), block_size=BS,
        lora_id=None, medium="GPU")])


def best(replica: Replica, tokens: list[int]) -> tuple[str, int] | None:
    status, body = replica.call("POST", "/query", {"token_ids": tokens, "model_name": MODEL})
    assert status == 200, body
    if not body["nodes"]:
        return None
    top = body["nodes"][0]
    return top["node_id"], top["matched_blocks"]


def test_registered_engines_survive_their_relaying_replica(tmp_path: Path) -> None:
    ports = [(free_port(), free_port()) for _ in range(2)]
    pubs = [ZmqEventPublisher(0, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}", bind=True) for p, r in ports]
    first = [list(range(1000 * (i + 1), 1000 * (i + 1) + 3 * BS)) for i in range(2)]
    try:
        for pub, tokens in zip(pubs, first, strict=True):
            pub.publish(stored(tokens))
        with fleet(tmp_path) as (a, b):
            for i, (p, r) in enumerate(ports):
                status, body = a.call("POST", "/register", {
                    "instance_id": 10 + i, "endpoint": f"tcp://127.0.0.1:{p}",
                    "replay_endpoint": f"tcp://127.0.0.1:{r}", "model_name": MODEL, "block_size": BS})
                assert status == 201, body
            # Both replicas answer for both engines, whichever of them relays each.
            for replica in (a, b):
                for i, tokens in enumerate(first):
                    until(lambda r=replica, t=tokens, n=str(10 + i): best(r, t) == (n, 3),
                          f"engine {10 + i} on replica {replica.name}")
            def all_active() -> list[Any]:  # a replica publishes its relays' status every second
                _, ws = b.call("GET", "/workers")
                return ws if len(ws) == 2 and all(w["status"] == "active" for w in ws) else []

            workers = until(all_active, "both engines active in /workers")
            owners = {w["instance_id"]: w["relayed_by"] for w in workers}
            assert set(owners) == {10, 11} and all(owners.values()), workers
            # Kill whichever replica relays engine 10 (no clean shutdown: its owner record must lapse).
            victim, survivor = (a, b) if owners[10] == a.replica_id() else (b, a)
            assert owners[10] == victim.replica_id() != survivor.replica_id()
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(timeout=10)

            def taken_over() -> bool:
                _, ws = survivor.call("GET", "/workers")
                return all(w["relayed_by"] and w["status"] == "active" for w in ws) and len(ws) == 2

            until(taken_over, "the surviving replica relaying both engines")
            later = list(range(5000, 5000 + 5 * BS))
            pubs[0].publish(stored(later))
            until(lambda: best(survivor, later) == ("10", 5), "a block stored after the takeover")
            for i, tokens in enumerate(first):
                assert best(survivor, tokens) == (str(10 + i), 3)
    finally:
        for pub in pubs:
            pub.shutdown()
