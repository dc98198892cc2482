"""Redis as it fails in production (issue 29): acknowledged writes wait for a replica (``?wait_replicas``),
every endpoint tells the truth while the index is down, and a lookup never hangs past its deadline.

Real processes only: ``redis-server`` (a primary and a ``--replicaof`` replica, paused with SIGSTOP),
``kvcoord serve`` as a subprocess, and a hand-driven ingest stream so that each test knows which batch is
acked when. Timing is never asserted tightly: conditions are polled with generous bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvcoord import validate
from kvcoord.events import STORE
from kvcoord.index.base import WriteNotReplicated
from kvcoord.index.redis.index import RedisIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from tests.coordinator.test_coordinator_ingest import MODEL, Agent, ack_seq, stored
from tests.http_util import http_json, metrics, sample
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import (
    RedisCluster,
    RedisServer,
    start_cluster,
    start_server,
    stop_cluster,
    stop_server,
)

HASHES = [101, 102, 103, 104]
MORE = [201, 202]


def _signal(server: RedisServer, sig: signal.Signals) -> None:
    assert server.proc is not None
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.proc.pid, sig)


def _poll(cond: Any, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


@pytest.fixture
def pair() -> Iterator[tuple[RedisServer, RedisServer, Path]]:
    """A primary (also on the unix socket returned third) and its replica, in sync."""
    sock_dir = Path(tempfile.mkdtemp(prefix="kvc-"))  # short: a unix socket path has ~100 bytes at most
    sock = sock_dir / "r.sock"
    primary = start_server("--unixsocket", str(sock), "--unixsocketperm", "700")
    replica = None
    try:
        replica = start_server("--replicaof", "127.0.0.1", str(primary.port))
        _poll(lambda: "state=online" in primary.cli("INFO", "replication"), "the replica in sync")
        yield primary, replica, sock
    finally:
        for s in (replica, primary):
            if s is not None:
                _signal(s, signal.SIGCONT)  # a paused server must not hang the kill
                stop_server(s)
        shutil.rmtree(sock_dir, ignore_errors=True)


# ------------------------------------------------------------------------------ WAIT, the library


@pytest.mark.slow
@pytest.mark.parametrize("path", ["tcp", "unix"], ids=["fast-path", "redis-py"])
async def test_short_wait_is_not_acknowledged_and_reapplies(pair: tuple[RedisServer, RedisServer, Path],
                                                            path: str) -> None:
    primary, replica, sock = pair
    if path == "unix":  # redis-py's pipeline (as TLS and Cluster): the WAIT rides with the script
        uri = f"unix://localhost{sock}?wait_replicas=1&wait_timeout=1"
    else:
        uri = f"{primary.url}?wait_replicas=1&wait_timeout=1"
    ix = RedisIndex.from_uri(uri)
    batch = [(STORE, 0, HASHES, None, True)]
    try:
        assert (await ix.apply(MODEL, "n1", 0, batch)).stored == len(HASHES)
        assert ix.metrics.waits >= 1 and ix.metrics.wait_short == 0
        _signal(replica, signal.SIGSTOP)
        with pytest.raises(WriteNotReplicated, match="0 of 1 replicas"):
            await ix.apply(MODEL, "n1", 0, [(STORE, 0, MORE, None, True)])
        assert ix.metrics.wait_short == 1
        with pytest.raises(WriteNotReplicated):
            await ix.remove_node("n9")  # the other writes WAIT too
        _signal(replica, signal.SIGCONT)
        _poll(lambda: "state=online" in primary.cli("INFO", "replication"), "the replica back")
        # The caller retries the same batch: applying it again is idempotent.
        await ix.apply(MODEL, "n1", 0, [(STORE, 0, MORE, None, True)])
        await ix.apply(MODEL, "n1", 0, [(STORE, 0, MORE, None, True)])
        got = await ix.match(MODEL, HASHES + MORE)
        assert [(m.node_id, m.matched_blocks) for m in got] == [("n1", len(HASHES) + len(MORE))]
        assert await ix.export_node(MODEL, "n1", 0) == sorted((h, 0) for h in HASHES + MORE)
    finally:
        await ix.close()


def test_wait_options_refused_with_one_line(tmp_path: Path) -> None:
    for query, says in [("wait_replicas=x", "wait_replicas must be an integer"),
                        ("wait_timeout=0.1", "wait_timeout needs wait_replicas"),
                        ("wait_replicas=1&wait_timeout=0", "wait_timeout must be"),
                        ("wait_replicas=1&wait_timeout=9", "below timeout")]:
        out = subprocess.run(kvcoord_cmd("serve", "--index", f"redis://127.0.0.1:1/0?{query}"),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0, query
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and says in lines[0], out.stderr


@pytest.mark.parametrize("flag", [("--lookup-deadline", "0"), ("--lookup-deadline", "soon")])
def test_bad_lookup_deadline_flag(flag: tuple[str, str]) -> None:
    out = subprocess.run(kvcoord_cmd("serve", *flag), capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert len(out.stderr.strip().splitlines()) == 1 and "lookup-deadline" in out.stderr, out.stderr


def test_bad_lookup_deadline_in_config(tmp_path: Path) -> None:
    cfg = tmp_path / "kvcoord.toml"
    cfg.write_text("lookup_deadline = -1\n")
    out = subprocess.run(kvcoord_cmd("serve", "--config", str(cfg)), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode != 0
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "lookup_deadline" in lines[0], out.stderr


# ------------------------------------------------------------------------------ serve, end to end


@dataclass
class Serve:
    """``kvcoord serve`` (a subprocess) and a gRPC channel to it."""

    grpc_port: int
    http_port: int
    metrics_port: int
    channel: grpc.aio.Channel
    stub: pbg.CoordinatorStub

    def http(self, method: str, path: str, body: object = None) -> tuple[int, Any, float]:
        """(status, JSON body or None, seconds taken)."""
        t0 = time.monotonic()
        status, answer = http_json(method, f"http://127.0.0.1:{self.http_port}{path}", body)
        return status, answer, time.monotonic() - t0

    def metric(self, name: str) -> float:
        return sample(metrics(f"http://127.0.0.1:{self.metrics_port}/metrics"), name)

    async def lookup(self) -> tuple[pb.LookupResponse | grpc.aio.AioRpcError, float]:
        req = pb.LookupRequest(model=MODEL, hashes=pb.HashQuery(block_hashes=validate.pack_u64(HASHES)))
        t0 = time.monotonic()
        try:
            res: pb.LookupResponse | grpc.aio.AioRpcError = await self.stub.Lookup(req, timeout=30)
        except grpc.aio.AioRpcError as exc:
            res = exc
        return res, time.monotonic() - t0

    async def health(self) -> bool:
        return self.http("GET", "/health")[0] == 200


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, index: str, *flags: str) -> AsyncIterator[Serve]:
    ports = [free_port() for _ in range(3)]
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{ports[0]}", "--http-listen", f"127.0.0.1:{ports[1]}",
                      "--metrics-listen", f"127.0.0.1:{ports[2]}", "--index", index, *flags)
    with running(cmd, log=tmp_path / "serve.log"):
        wait_for_port(ports[0])
        wait_for_port(ports[1])
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{ports[0]}")
        try:
            s = Serve(ports[0], ports[1], ports[2], channel, pbg.CoordinatorStub(channel))
            _poll(lambda: s.http("GET", "/health")[0] == 200, "serve up")
            yield s
        finally:
            await channel.close()


async def _live_node(s: Serve) -> Agent:
    agent = Agent(s)  # type: ignore[arg-type]  # duck-typed: Agent reads only .stub
    await agent.start()
    await agent.send(batch=pb.EventBatch(seq=1, dp_rank=0, events=[stored(HASHES)]))
    assert ack_seq(await agent.recv()) == 1
    return agent


@pytest.mark.slow
async def test_short_wait_keeps_the_batch_unacked_until_the_replica_is_back(
        pair: tuple[RedisServer, RedisServer, Path], tmp_path: Path) -> None:
    primary, replica, _ = pair
    async with serve(tmp_path, f"{primary.url}?timeout=2&wait_replicas=1&wait_timeout=1") as s:
        agent = await _live_node(s)
        assert s.metric("kvcoord_redis_wait_total") >= 1
        assert s.metric("kvcoord_redis_wait_short_total") == 0
        _signal(replica, signal.SIGSTOP)
        await agent.send(batch=pb.EventBatch(seq=2, dp_rank=0, events=[stored(MORE)]))
        ack = asyncio.ensure_future(agent.recv())
        try:
            _poll(lambda: s.metric("kvcoord_redis_wait_short_total") >= 2, "short WAITs, retried")
            assert not ack.done(), "a write no replica confirmed must not be acked"
            assert await s.health(), "a short WAIT does not take the index down (it serves lookups)"
        finally:
            _signal(replica, signal.SIGCONT)
        msg = await asyncio.wait_for(ack, 30)
        assert ack_seq(msg) == 2
        res, _ = await s.lookup()
        assert isinstance(res, pb.LookupResponse) and res.nodes[0].matched_blocks == len(HASHES)
        st, body, _ = s.http("POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": MORE})
        assert st == 200, body
        await agent.close()
    # The replica holds what was acknowledged.
    replica_keys = replica.cli("KEYS", "*")
    assert "inv" in replica_keys


@pytest.mark.parametrize("outage", ["paused", "killed"])
async def test_endpoints_say_unavailable_while_the_index_is_down(tmp_path: Path, outage: str) -> None:
    redis = start_server()
    try:
        async with serve(tmp_path, f"{redis.url}?timeout=1&mirror=1") as s:
            agent = await _live_node(s)
            st, dump, _ = s.http("GET", "/dump")
            assert st == 200 and dump, dump
            if outage == "paused":
                _signal(redis, signal.SIGSTOP)
            else:
                redis.kill()
            _poll(lambda: s.http("GET", "/health")[0] == 503, "/health 503", 30)
            for path in ("/dump", "/workers"):
                st, body, _ = s.http("GET", path)
                assert st == 503 and set(body) == {"error"} and "unavailable" in body["error"], (path, body)
            nodes = await s.stub.ListNodes(pb.ListNodesRequest(), timeout=10)
            assert nodes.index_stale and [n.node_id for n in nodes.nodes] == ["n1"]
            stats = await s.stub.Stats(pb.StatsRequest(), timeout=10)
            assert stats.index_stats_stale
            res, _ = await s.lookup()
            assert isinstance(res, grpc.aio.AioRpcError) and res.code() == grpc.StatusCode.UNAVAILABLE
            if outage == "paused":
                _signal(redis, signal.SIGCONT)
            else:
                redis.restart()
            _poll(lambda: s.http("GET", "/health")[0] == 200, "/health 200 again", 30)
            st, body, _ = s.http("GET", "/dump")
            assert st == 200, body
            st, body, _ = s.http("GET", "/workers")
            assert st == 200 and body == [], body
            nodes = await s.stub.ListNodes(pb.ListNodesRequest(), timeout=10)
            assert not nodes.index_stale
            stats = await s.stub.Stats(pb.StatsRequest(), timeout=10)
            assert not stats.index_stats_stale
            await agent.close()
    finally:
        _signal(redis, signal.SIGCONT)
        stop_server(redis)


@pytest.mark.parametrize("options", ["", "&buckets=2"], ids=["fast-path", "two-buckets"])
async def test_lookup_bounded_by_its_deadline_while_redis_hangs(tmp_path: Path, options: str) -> None:
    redis = start_server()
    cfg = tmp_path / "kvcoord.toml"
    cfg.write_text("stats_interval = 600.0\n")  # no health ping: the deadline alone must bound the lookup
    try:
        async with serve(tmp_path, f"{redis.url}?timeout=20{options}", "--lookup-deadline", "0.3",
                         "--config", str(cfg)) as s:
            agent = await _live_node(s)
            res, _ = await s.lookup()
            assert isinstance(res, pb.LookupResponse) and res.nodes[0].matched_blocks == len(HASHES)
            _signal(redis, signal.SIGSTOP)
            try:
                for _ in range(2):
                    res, took = await s.lookup()
                    assert isinstance(res, grpc.aio.AioRpcError), res
                    assert res.code() == grpc.StatusCode.UNAVAILABLE and "deadline" in (res.details() or "")
                    assert took < 3.0, took
                    st, body, took = s.http("POST", "/query_by_hash", {"model_name": MODEL,
                                                                       "block_hashes": HASHES})
                    assert st == 503 and "deadline" in body["error"] and took < 3.0, (st, body, took)
                assert s.metric("kvcoord_lookup_deadline_exceeded_total") >= 4
            finally:
                _signal(redis, signal.SIGCONT)
            # The same server answers again: the cancelled calls left its connection usable.
            give_up = time.monotonic() + 20
            while not isinstance(res := (await s.lookup())[0], pb.LookupResponse):
                if time.monotonic() > give_up:
                    break
                await asyncio.sleep(0.2)
            assert isinstance(res, pb.LookupResponse) and res.nodes[0].matched_blocks == len(HASHES), res
            st, body, _ = s.http("POST", "/query_by_hash", {"model_name": MODEL, "block_hashes": HASHES})
            assert st == 200 and body["nodes"][0]["matched_blocks"] == len(HASHES), body
            await agent.close()
    finally:
        _signal(redis, signal.SIGCONT)
        stop_server(redis)


@pytest.fixture
def cluster_with_replicas() -> Iterator[tuple[RedisCluster, list[RedisServer]]]:
    """A 3-shard Cluster, each primary with one replica (``replicas[i]`` follows ``cluster.servers[i]``)."""
    cluster = start_cluster()
    replicas: list[RedisServer] = []
    try:
        for primary in cluster.servers:
            primary_id = primary.cli("CLUSTER", "MYID").strip()
            bus = primary.extra[primary.extra.index("--cluster-port") + 1]
            r = start_server("--cluster-enabled", "yes", "--cluster-port", str(free_port()),
                             "--cluster-node-timeout", "2000")
            replicas.append(r)
            r.cli("CLUSTER", "MEET", "127.0.0.1", str(primary.port), bus)
            _poll(lambda r=r, pid=primary_id: pid in r.cli("CLUSTER", "NODES"), "the replica to meet")
            r.cli("CLUSTER", "REPLICATE", primary_id)
            _poll(lambda p=primary: "state=online" in p.cli("INFO", "replication"), "the replica in sync", 30)
        _poll(lambda: all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in cluster.servers + replicas),
              "cluster_state:ok", 30)
        yield cluster, replicas
    finally:
        for r in replicas:
            _signal(r, signal.SIGCONT)
            stop_server(r)
        stop_cluster(cluster)


@pytest.mark.slow
async def test_cluster_wait_goes_to_the_shard_of_the_write(
        cluster_with_replicas: tuple[RedisCluster, list[RedisServer]]) -> None:
    cluster, replicas = cluster_with_replicas
    ix = RedisIndex.from_uri(f"{cluster.url}?wait_replicas=1&wait_timeout=1")
    try:
        owner: dict[str, int] = {}  # node -> index of the shard holding its bucket
        for n in range(40):
            node = f"n{n}"
            await ix.apply(MODEL, node, 0, [(STORE, 0, HASHES, None, True)])
            tag = ix.tag_of(node)
            owner[node] = next(i for i, s in enumerate(cluster.servers)
                               if s.cli("EXISTS", tag + ":loc").strip() == "1")
        assert ix.metrics.wait_short == 0 and ix.metrics.waits >= 40
        assert set(owner.values()) == {0, 1, 2}, owner
        _signal(replicas[0], signal.SIGSTOP)
        try:
            paused = next(n for n, i in owner.items() if i == 0)
            other = next(n for n, i in owner.items() if i != 0)
            with pytest.raises(WriteNotReplicated):
                await ix.apply(MODEL, paused, 0, [(STORE, 0, MORE, None, True)])
            await ix.apply(MODEL, other, 0, [(STORE, 0, MORE, None, True)])  # its replica confirms
            assert ix.metrics.wait_short == 1
        finally:
            _signal(replicas[0], signal.SIGCONT)
        await ix.apply(MODEL, paused, 0, [(STORE, 0, MORE, None, True)])
        got = await ix.match(MODEL, HASHES + MORE, [(paused, 0)])
        assert [m.matched_blocks for m in got] == [len(HASHES) + len(MORE)]
    finally:
        await ix.close()
