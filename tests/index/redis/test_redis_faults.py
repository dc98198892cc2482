"""Issue 6's fault test: Redis dies (or hangs) under a steady stream of events, and comes back.

Real processes only: ``redis-server``, ``kvcoord serve --index redis://...``, ``kvcoord sim-engine`` and
``kvcoord agent``. While Redis is gone the coordinator reports NOT_SERVING on grpc.health.v1 (the
liveness service stays SERVING), keeps the agent's batches unacked and retries them; afterwards it is
SERVING again and the index equals the engine's pool block for block (see tests/engine/test_relay_e2e.py for
how that is checked). A Redis back *empty* makes every agent resend a snapshot; a Redis back *intact*
(SIGSTOP/SIGCONT) resumes without one.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvcoord.router.client import CoordinatorClient, CoordinatorError
from tests.engine.test_relay_e2e import MODEL, Checker, Cluster, poll, read_json
from tests.http_util import flat, metrics
from tests.procs import kvcoord_cmd, wait_for_port
from tests.redis_servers import RedisServer, start_server, stop_server

STEADY = ("--model", MODEL, "--requests", "240", "--rate", "60", "--linger", "--num-blocks", "512",
          "--block-size", "16", "--concurrency", "4", "--prefixes", "4", "--prefix-len", "128",
          "--suffix-len", "256", "--output-len", "64", "--removal-events", "last_copy", "--hash-seed", "0",
          "--state-interval", "0.1")
"""About 4 s of steady load (60 requests/s), then the engine lingers with its pool."""


class RedisCluster(Cluster):
    """The relay e2e trio with the coordinator on a real Redis."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack, redis: RedisServer, options: str = "") -> None:
        super().__init__(tmp, stack)
        self.redis = redis
        self.options = options
        """Extra index URI options (``&mirror=1``: lookups answered from the change-fed copy)."""

    def start_serve(self) -> None:
        self.serve = self._start("serve", kvcoord_cmd(
            "serve", "--listen", f"127.0.0.1:{self.grpc}", "--metrics-listen", f"127.0.0.1:{self.metrics}",
            "--index", f"{self.redis.url}?timeout=1{self.options}"))
        wait_for_port(self.grpc)

    def start_steady_engine(self, seed: int) -> None:
        self.state.unlink(missing_ok=True)
        self.engine = self._start("engine", kvcoord_cmd(
            "sim-engine", "--zmq-bind", f"tcp://*:{self.pub}", "--replay-bind", f"tcp://*:{self.replay}",
            "--seed", str(seed), "--state-file", str(self.state), *STEADY))
        self.target = 240

    def health(self, service: str = "") -> str:
        with grpc.insecure_channel(f"127.0.0.1:{self.grpc}") as ch:
            try:
                reply = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=2.0
                )
            except grpc.RpcError as exc:
                return f"error: {exc.code().name}"
            return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))

    def link(self) -> dict[str, int]:
        ag = read_json(self.agent_stats)
        assert ag is not None
        links: list[dict[str, int]] = ag["reporter"]["links"]
        return links[0]

    def scrape(self) -> dict[str, float]:
        return flat(metrics(f"http://127.0.0.1:{self.metrics}/metrics", timeout=5))

    def last_seq(self) -> int:
        ag = read_json(self.agent_stats)
        return int(ag["reporter"]["last_seq"]) if ag is not None else 0

    def batches_sent(self) -> int:
        return self.link()["batches_sent"] if read_json(self.agent_stats) is not None else 0


@pytest.fixture(params=["", "&mirror=1"], ids=["redis", "redis-mirror"])
def cluster(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[RedisCluster]:
    redis = start_server()
    try:
        with contextlib.ExitStack() as stack:
            yield RedisCluster(tmp_path, stack, redis, request.param)
    finally:
        with contextlib.suppress(ProcessLookupError):
            if redis.proc is not None:
                os.killpg(redis.proc.pid, signal.SIGCONT)  # a failed SIGSTOP variant must not hang the kill
        stop_server(redis)


def _start(c: RedisCluster) -> None:
    c.start_serve()
    poll(lambda: c.health() == "SERVING", "SERVING at start")
    c.start_steady_engine(seed=11)
    c.start_agent()
    poll(lambda: c.batches_sent() > 20, "the agent to stream")


@pytest.mark.slow
def test_redis_killed_and_restarted_empty(cluster: RedisCluster) -> None:
    c, checker = cluster, Checker(cluster)
    _start(c)
    snapshots = c.link()["snapshots_sent"]
    c.redis.kill()
    poll(lambda: c.health() == "NOT_SERVING", "NOT_SERVING while Redis is down", 10)
    assert c.health("kvcoord.liveness") == "SERVING"
    assert c.health("kvcoord.v2.Coordinator") == "NOT_SERVING"
    # Lookups say why instead of answering from a partial view.
    with CoordinatorClient(f"127.0.0.1:{c.grpc}") as client, pytest.raises(CoordinatorError) as err:
        client.lookup(MODEL, hashes=[1, 2, 3])
    assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert "index backend redis is unavailable" in err.value.details
    # The engine keeps producing; nothing more is acked (the stats file may lag an ack that was
    # already on its way when Redis died, so the count is taken once the agent is well ahead).
    poll(lambda: c.last_seq() > c.link()["acked_seq"] + 5, "the agent to queue batches while Redis is down")
    stalled = c.link()["acked_seq"]
    poll(lambda: c.last_seq() > stalled + 15, "the engine to keep producing while Redis is down")
    assert c.link()["acked_seq"] == stalled, "batches were acked while the index was down"
    c.redis.start()  # same port, no persistence: empty
    poll(lambda: c.health() == "SERVING", "SERVING after Redis came back", 15)
    checker.check("Redis restarted empty", timeout=30)
    assert c.link()["snapshots_sent"] > snapshots, "an empty Redis must be refilled by a snapshot"
    assert c.relay_stats()["lost_batches"] == 0
    # The Redis backend's own counters, through the coordinator's Prometheus endpoint.
    m = c.scrape()
    assert m['kvcoord_index_errors_total{backend="redis",kind="connection"}'] >= 1
    assert m['kvcoord_index_reconnects_total{backend="redis"}'] >= 1
    assert m['kvcoord_index_round_trip_seconds_count{backend="redis"}'] > 10
    assert m['kvcoord_index_round_trip_seconds_bucket{backend="redis",le="+Inf"}'] == m[
        'kvcoord_index_round_trip_seconds_count{backend="redis"}']
    assert m['kvcoord_index_up{backend="redis"}'] == 1
    assert m['kvcoord_snapshots_requested_total{reason="index_reset"}'] >= 1
    if "mirror=1" in c.options:  # the copy reloaded after the restart, and answered the checker's lookups
        assert m["kvcoord_index_mirror_loads_total"] >= 2
        assert m["kvcoord_index_mirror_ready"] == 1
        assert m["kvcoord_index_mirror_lookups_total"] > 0
        assert m["kvcoord_index_mirror_feed_entries_total"] > 0
    else:
        assert "kvcoord_index_mirror_ready" not in m


def test_redis_paused_and_resumed_intact(cluster: RedisCluster) -> None:
    c, checker = cluster, Checker(cluster)
    _start(c)
    poll(lambda: c.link()["snapshots_sent"] >= 1 and c.link()["acked_seq"] > 0, "the first snapshot")
    snapshots = c.link()["snapshots_sent"]
    assert c.redis.proc is not None
    os.killpg(c.redis.proc.pid, signal.SIGSTOP)
    try:
        poll(lambda: c.health() == "NOT_SERVING", "NOT_SERVING while Redis hangs", 10)
        stalled = c.link()["acked_seq"]
        t0 = time.monotonic()
        poll(lambda: c.link()["acked_seq"] == stalled and time.monotonic() - t0 > 0.5, "a stalled stream")
    finally:
        os.killpg(c.redis.proc.pid, signal.SIGCONT)
    poll(lambda: c.health() == "SERVING", "SERVING after Redis resumed", 15)
    checker.check("Redis resumed intact", timeout=30)
    assert c.link()["snapshots_sent"] == snapshots, "an intact Redis must resume without a snapshot"
    assert c.relay_stats()["lost_batches"] == 0
