"""A stock-vLLM-style fleet with no agent process: engines registered over HTTP with two ``kvcoord serve``
replicas on one Redis. Exactly one replica relays each engine; lookups by tokens on either replica find
it; when the relaying replica is killed, the other takes the engine over and keeps the index current.
Real ``redis-server``, real ``kvcoord serve`` subprocesses, vLLM-exact ZMQ publishers.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import BlockStored, KVEventBatch
from kvcoord.hashing import HashProfile, block_hashes64
from tests.http_util import http_json, http_request
from tests.procs import free_port, kvcoord_cmd, running, until, wait_for_port
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
        return str(http_request("GET", f"http://127.0.0.1:{self.http}/health").headers["x-kvcoord-replica"])

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return http_json(method, f"http://127.0.0.1:{self.http}{path}", body)


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


def stored(tokens: list[int]) -> KVEventBatch:
    hashes = block_hashes64(PROFILE, tokens)
    return KVEventBatch(ts=time.time(), events=[BlockStored(
        block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tuple(tokens[: len(hashes) * BS]),
        block_size=BS,
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
            # (polled: with a 2 s lease a loaded machine can lapse the survivor's own engine, which then
            # resyncs from its replay; it is answered again once it has)
            for i, tokens in enumerate(first):
                until(lambda t=tokens, n=str(10 + i): best(survivor, t) == (n, 3),
                      f"engine {10 + i} on the survivor", diagnose=lambda t=tokens: best(survivor, t))
    finally:
        for pub in pubs:
            pub.shutdown()


async def test_in_process_feed_keeps_the_index_equal_to_the_pool() -> None:
    """``kvcoord serve`` relays a registered engine through its in-process feed (no gRPC): the index holds
    exactly the engine's pool, every event is counted as the engine published it (1-block removals merged
    into one op each run still count one each), and a resync request is answered with a snapshot."""
    from kvcoord.agent.kv_cache_manager import KVCacheManager
    from kvcoord.agent.pool import BlockPool
    from kvcoord.coordinator.config import load_config
    from kvcoord.coordinator.server import CoordinatorServer

    overrides: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "127.0.0.1:0",
                                 "models": [f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42"]}
    server = CoordinatorServer(load_config(None, env={}, overrides=overrides), relay_engines=True)
    await server.start()
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqEventPublisher(0, endpoint, replay, bind=True)
    pool = BlockPool(40, PROFILE)
    engine_cache = KVCacheManager(pool)
    rng = random.Random(7)
    published = {"stored": 0, "removed": 0}
    step = 0
    try:
        state, engines = server.state, server.engines
        assert state is not None and engines is not None
        await engines.register(7, MODEL, "default", BS, 0, endpoint, replay)

        async def wait_for(cond: Any, what: str) -> None:
            deadline = time.monotonic() + DEADLINE
            while not await cond():
                if time.monotonic() > deadline:
                    raise AssertionError(f"timed out waiting for {what}")
                await asyncio.sleep(0.02)

        async def in_sync() -> bool:
            rec = state.registry.get("7")
            return rec is not None and not rec.resyncing

        async def equal() -> bool:
            held = {h for h, _ in await state.index.export_node(MODEL, "7", 0)}
            return held == pool.cached_hashes()

        def publish(n: int) -> None:
            nonlocal step
            for _ in range(n):
                step += 1
                tokens = [rng.randrange(1000) for _ in range(BS * rng.randint(1, 12) + 1)]
                if engine_cache.admit(f"r{step}", tokens) is not None:
                    engine_cache.finish(f"r{step}")
                events = pool.take_events()
                for ev in events:
                    kind = "stored" if isinstance(ev, BlockStored) else "removed"
                    published[kind] += 1
                if events:
                    pub.publish(KVEventBatch(ts=time.time(), events=tuple(events)))

        await wait_for(in_sync, "the feed's first snapshot")
        publish(60)
        await wait_for(equal, "the index to hold the pool")
        applied = state.metrics.applied_by_type
        assert published["removed"] > 20  # the pool is small: evictions happened, one event per block
        assert applied["block_stored"] == published["stored"]
        assert applied["block_removed"] == published["removed"]
        reg = state.metrics.registry

        async def snapshots() -> float:
            return reg.get_sample_value("kvcoord_snapshots_applied_total") or 0.0

        before = await snapshots()
        assert state.resync_all("test: index reset") == 1
        publish(40)

        async def resynced() -> bool:
            return await snapshots() > before

        await wait_for(resynced, "the snapshot that answers the resync")
        await wait_for(in_sync, "the node back in sync")
        publish(20)
        await wait_for(equal, "the index to hold the pool after the resync")
    finally:
        pub.shutdown()
        await server.stop()


async def test_in_process_feed_replaces_an_overflowing_queue_with_a_snapshot() -> None:
    """Batches that pile up while the index stalls are bounded as a reporter's: past
    ``max_unacked_batches`` the queue is dropped and the mirror's snapshot replaces it, exactly."""
    from kvcoord.agent.link import ReporterOptions
    from kvcoord.coordinator.config import load_config
    from kvcoord.coordinator.engine_feed import LocalFeed
    from kvcoord.coordinator.server import CoordinatorServer
    from kvcoord.engine.mirror import BlockMirror
    from kvcoord.events import BlockRemoved
    from kvcoord.validate import op_runs

    overrides: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "",
                                 "models": [f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42"]}
    server = CoordinatorServer(load_config(None, env={}, overrides=overrides))
    await server.start()
    mirror = BlockMirror()
    assert server.state is not None
    feed = LocalFeed(server.state, node_id="n1", model=MODEL, snapshot=mirror.rank_entries, dp_ranks=[0],
                     options=ReporterOptions(max_unacked_batches=2))
    try:
        for i in range(5):  # not started yet: nothing drains the queue
            events = [BlockStored(block_hashes=(100 + i, 200 + i), parent_block_hash=None, token_ids=(),
                                  block_size=BS), BlockRemoved(block_hashes=(100 + i,))]
            ops, spans = op_runs(events)
            mirror.commit(0, ops)
            feed.submit(0, events, 1.0, ops, spans)
        assert feed.overflows >= 1
        await feed.start()
        deadline = time.monotonic() + DEADLINE
        while not feed.settled() or {h for h, _ in await server.state.index.export_node(MODEL, "n1", 0)} != \
                {200 + i for i in range(5)}:
            assert time.monotonic() < deadline, "the snapshot never replaced the dropped batches"
            await asyncio.sleep(0.02)
    finally:
        await feed.close()
        await server.stop()
