"""``kvcoord serve --lookup-workers 2`` as real processes: agents feed the main process over gRPC, lookups
over fresh connections land on both workers (``x-kvcoord-worker``), and every answer equals the main
process's own (its loopback listener) through ingest, a resync by snapshot and a node's expiry. A killed
worker is restarted; SIGTERM stops everything and a killed main process leaves no worker behind."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import grpc.aio
import pytest

from kvcoord.events import KVEvent
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.validate import pack_u64
from kvcoord.wire import events_to_proto
from tests.coordinator.test_coordinator_e2e import (
    BS,
    HASHES,
    MODEL,
    TOKENS,
    N,
    agent,
    removed,
    stored,
    write_config,
)
from tests.http_util import http_json, http_request, metrics, sample
from tests.procs import free_port, kvcoord_cmd, running, until, wait_for_port

pytestmark = pytest.mark.slow

T = TypeVar("T")
BANNER = re.compile(r"lookup workers, pids ([\d,]+); main 127\.0\.0\.1:(\d+)")


class Serve:
    def __init__(self, proc: object, port: int, http: int, main: int, pids: list[int], log: Path,
                 metrics: int) -> None:
        self.proc, self.port, self.http, self.main, self.pids, self.log = proc, port, http, main, pids, log
        self.metrics = metrics

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@contextmanager
def serve(tmp: Path, workers: int = 2, lease: float = 10.0) -> Iterator[Serve]:
    port, http, metrics = free_port(), free_port(), free_port()
    cfg = tmp / "kvcoord.toml"
    write_config(cfg, port, metrics, f"lookup_workers = {workers}", lease)
    log = tmp / "serve.log"
    with running(kvcoord_cmd("serve", "--config", str(cfg), "--http-listen", f"127.0.0.1:{http}"),
                 log=log) as proc:
        wait_for_port(port, timeout=30)
        found = until(lambda: BANNER.search(log.read_text()), "the serve banner", timeout=30,
                      diagnose=log.read_text)
        pids = [int(p) for p in found.group(1).split(",")]
        wait_for_port(http, timeout=30)
        answered: set[str] = set()
        until(lambda: answered.update({get_health(http)}) or len(answered - {""}) == workers,
              "every worker to answer", timeout=60)
        yield Serve(proc, port, http, int(found.group(2)), pids, log, metrics)


def get_health(port: int) -> str:
    """The worker that answered ``/health`` ("" when none could)."""
    try:
        reply = http_request("GET", f"http://127.0.0.1:{port}/health")
    except OSError:
        return ""
    return reply.headers.get("x-kvcoord-worker", "") if reply.status == 200 else ""


def post(port: int, path: str, body: dict[str, object]) -> tuple[int, str, bytes]:
    """One request on a fresh connection: status, the worker that answered ("" for the main), body."""
    reply = http_request("POST", f"http://127.0.0.1:{port}{path}", body)
    return reply.status, reply.headers.get("x-kvcoord-worker", ""), reply.body


QUERIES: list[tuple[str, dict[str, object]]] = [
    ("/query", {"model_name": MODEL, "token_ids": TOKENS}),
    ("/query", {"model_name": MODEL, "token_ids": TOKENS[: 6 * BS]}),
    ("/query_by_hash", {"model_name": MODEL, "block_hashes": HASHES}),
    ("/query_by_hash", {"model_name": MODEL, "block_hashes": HASHES[:3]}),
    ("/query", {"model_name": MODEL, "token_ids": TOKENS, "include_unmatched": True}),
]


def same_as_main(co: Serve, seen: set[str], rounds: int = 6) -> dict[str, object] | None:
    """Every query, asked of the main process and ``rounds`` times over fresh connections to the shared
    port: the main's first answer (parsed) when all answers equal it, else None."""
    first: dict[str, object] | None = None
    for path, body in QUERIES:
        status, _, want = post(co.main, path, body)
        assert status == 200, want
        for _ in range(rounds):
            got_status, worker, got = post(co.http, path, body)
            if got_status != 200 or got != want:
                return None
            seen.add(worker)
        if first is None:
            first = json.loads(want)
    return first


def held(answer: dict[str, object] | None) -> dict[str, int]:
    assert answer is not None
    nodes = answer["nodes"]
    assert isinstance(nodes, list)
    return {n["node_id"]: n["matched_blocks"] for n in nodes}


async def eventually(fn: Callable[[], T | None], what: str, timeout: float = 30.0) -> T:
    """Poll ``fn`` (blocking HTTP, run in a thread: the agents' reporters share this loop) until truthy."""
    deadline = time.monotonic() + timeout
    while True:
        got = await asyncio.to_thread(fn)
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(0.1)


async def test_workers_answer_as_the_main_index_through_ingest_resync_and_expiry(tmp_path: Path) -> None:
    seen: set[str] = set()

    def agreed() -> dict[str, object] | None:
        return same_as_main(co, seen)

    with serve(tmp_path, lease=1.5) as co:
        async with agent(co.address, "node-b", 1) as b:
            b.submit([stored(0, 5)])
            async with agent(co.address, "node-a", 1) as a:
                a.submit([stored(0, N)])
                await a.reporter.wait_acked(10)
                await b.reporter.wait_acked(10)
                assert held(await eventually(agreed, "workers to answer as the main")) == {"node-a": N,
                                                                                            "node-b": 5}
                a.submit([removed(N - 1, N - 2)])
                await a.reporter.wait_acked(10)
                answer = await eventually(
                    lambda: (got := agreed()) and held(got).get("node-a") == N - 2 and got,
                    "the removal in every worker")
                assert held(answer) == {"node-a": N - 2, "node-b": 5}
                channel = grpc.aio.insecure_channel(co.address)
                call = pbg.CoordinatorStub(channel).Ingest()
                await _resync_by_snapshot(call, agreed)
            # node-a stopped heart-beating: it expires from the main's answers and the workers' alike
            beats = asyncio.ensure_future(_heartbeats(call, 4))
            try:
                answer = await eventually(lambda: (got := agreed()) and "node-a" not in held(got) and got,
                                          "node-a to expire everywhere")
                assert held(answer) == {"node-b": 5, "node-g": N}
            finally:
                beats.cancel()
                call.cancel()
                await channel.close()
    assert seen == {"1", "2"}, seen


def _batch(seq: int, *events: KVEvent) -> pb.AgentMessage:
    return pb.AgentMessage(batch=pb.EventBatch(seq=seq, ts=time.time(), dp_rank=0,
                                               events=events_to_proto(events)))


async def _heartbeats(call: Any, seq: int) -> None:
    while True:
        await call.write(_batch(seq))
        await call.read()
        seq += 1
        await asyncio.sleep(0.3)


async def _resync_by_snapshot(call: Any, agreed: Callable[[], dict[str, object] | None]) -> None:
    """A node whose stream has a gap: out of answers while it resyncs, back from its snapshot (on CPU)."""
    await call.write(pb.AgentMessage(hello=pb.Hello(node_id="node-g", model=MODEL, dp_ranks=[0], epoch=5,
                                                    next_seq=1)))
    await call.read()
    await call.write(pb.AgentMessage(snapshot=pb.Snapshot(epoch=5, seq=0, dp_rank=0, final=True)))
    await call.read()
    await call.write(_batch(1, stored(0, 5)))
    assert (await call.read()).ack.seq == 1
    await eventually(lambda: (got := agreed()) and held(got).get("node-g") == 5, "node-g's batch everywhere")
    await call.write(_batch(3, stored(5, 10)))  # seq 2 never arrives: resyncing, out of answers
    assert (await call.read()).WhichOneof("msg") == "snapshot_request"
    await eventually(lambda: (got := agreed()) and "node-g" not in held(got), "node-g resyncing everywhere")
    await call.write(pb.AgentMessage(snapshot=pb.Snapshot(
        epoch=5, seq=3, dp_rank=0, block_hashes=pack_u64(HASHES), tiers=bytes([pb.TIER_CPU] * N),
        final=True)))
    assert (await call.read()).ack.seq == 3
    answer = await eventually(lambda: (got := agreed()) and held(got).get("node-g") == N and got,
                              "node-g's snapshot everywhere")
    cpu = [n["tiers"]["CPU"] for n in answer["nodes"] if n["node_id"] == "node-g"]  # type: ignore[attr-defined]
    assert cpu == [N]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().split(")")[-1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


def test_a_killed_worker_is_restarted_and_sigterm_stops_all(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        victim = co.pids[0]
        os.kill(victim, signal.SIGKILL)
        until(lambda: "lookup worker 1 exited" in co.log.read_text(), "the serve to report the dead worker",
              diagnose=co.log.read_text)
        until(lambda: len(_children(co.proc.pid)) == 2 and victim not in _children(co.proc.pid),  # type: ignore[attr-defined]
              "a new worker 1")
        answered: set[str] = set()
        until(lambda: answered.update({post(co.http, *QUERIES[0])[1]}) or answered == {"1", "2"},
              "both workers to answer")
        workers = _children(co.proc.pid)  # type: ignore[attr-defined]
        # a main process that stops feeding them: the workers answer 503, never a stale answer
        os.kill(co.proc.pid, signal.SIGSTOP)  # type: ignore[attr-defined]
        try:
            refused: set[str] = set()
            until(lambda: (got := post(co.http, *QUERIES[0]))[0] == 503 and refused.add(got[1]) is None
                  and refused == {"1", "2"}, "both workers to refuse while not fed", timeout=30)
            assert b"not current" in post(co.http, *QUERIES[0])[2]
        finally:
            os.kill(co.proc.pid, signal.SIGCONT)  # type: ignore[attr-defined]
        until(lambda: post(co.http, *QUERIES[0])[0] == 200, "answers again once fed")
        # ... and each refusal is counted, summed into the main process's /metrics from the workers' reports
        until(lambda: sample(metrics(f"http://127.0.0.1:{co.metrics}/metrics"), "kvcoord_lookup_errors_total",
                             kind="unavailable") >= 2, "the workers' 503s in kvcoord_lookup_errors_total")
        t0 = time.monotonic()
        os.kill(co.proc.pid, signal.SIGTERM)  # type: ignore[attr-defined]
        co.proc.wait(timeout=10)  # type: ignore[attr-defined]
        assert time.monotonic() - t0 < 5
        until(lambda: not any(_alive(p) for p in workers), "the workers to stop with it", timeout=5)


def test_workers_forward_registrations_and_die_with_a_killed_main_process(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        workers = _children(co.proc.pid)  # type: ignore[attr-defined]
        assert len(workers) == 2
        # /register and /workers through the shared port: a worker forwards them to the main process
        status, worker, body = post(co.http, "/register", {
            "instance_id": 7, "model_name": "other", "block_size": 16,
            "endpoint": f"tcp://127.0.0.1:{free_port()}"})
        assert status == 201 and worker in ("1", "2"), body
        assert [w["instance_id"] for w in http_json("GET", f"http://127.0.0.1:{co.http}/workers")[1]] == [7]
        # the registered partition is known to every worker: an empty answer, not a 404
        seen: set[str] = set()
        query = {"model_name": "other", "block_hashes": [1]}
        until(lambda: (got := post(co.http, "/query_by_hash", query))[0] == 200 and seen.add(got[1]) is None
              and seen == {"1", "2"}, "the partition in both workers")
        os.kill(co.proc.pid, signal.SIGKILL)  # type: ignore[attr-defined]
        until(lambda: not any(_alive(p) for p in workers), "no orphaned worker", timeout=10)


def test_lookup_workers_need_the_memory_index(tmp_path: Path) -> None:
    import subprocess

    out = subprocess.run(kvcoord_cmd("serve", "--index", "redis://127.0.0.1:1/0", "--lookup-workers", "2"),
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0 and "lookup_workers needs the memory index" in out.stderr
    assert "Traceback" not in out.stderr
