"""Issue 5's end-to-end test: ``kvcoord sim-engine`` -> ``kvcoord agent`` -> ``kvcoord serve``, all real
processes over real ZMQ and gRPC. After steady load, a forced gap, an engine restart and a coordinator
restart, the coordinator's index must equal the engine's block pool, block for block.

How "equal" is checked without an export RPC: the engine's ``--state-file`` lists its pool as
``(hash, tier)``; one hash Lookup over all of them must match every block on the right tier (a lookup
counts the leading query blocks a node holds without a gap), and the index's entry count (``Stats``)
must equal the pool's, so nothing else is held. Hashes the pool held earlier but no longer holds are
looked up one by one and must not be reported.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcoord.engine.relay import REPLAY_ONLY_PROBES_WARN
from kvcoord.hashing import HashProfile
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorClient
from tests.procs import free_port, kvcoord_cmd, make_certs, running, stop, wait_for_port

MODEL = "sim-model"
NODE = "node-e2e"
BURST = 700
"""Requests per engine run or SIGUSR1 burst: ~4 KB batches, enough to overflow a paused agent's socket."""
CHUNK = 4096

ENGINE_FLAGS = ("--model", MODEL, "--requests", str(BURST), "--rate", "0", "--linger", "--hwm", "1",
                "--num-blocks", "512", "--block-size", "16", "--concurrency", "4", "--prefixes", "4",
                "--prefix-len", "256", "--suffix-len", "512", "--output-len", "256",
                "--removal-events", "last_copy", "--hash-seed", "0", "--state-interval", "0.1")


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def poll(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)


class Cluster:
    """The three processes, their ports and files; restartable one at a time."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack) -> None:
        self.tmp = tmp
        self.stack = stack
        self.pub, self.replay, self.grpc, self.metrics = (free_port() for _ in range(4))
        self.state = tmp / "engine-state.json"
        self.agent_stats = tmp / "agent-stats.json"
        self.engine: subprocess.Popen[bytes] | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.runs = 0
        self.target = 0

    def _start(self, name: str, cmd: list[str]) -> subprocess.Popen[bytes]:
        self.runs += 1
        return self.stack.enter_context(running(cmd, log=self.tmp / f"{self.runs:02d}-{name}.log"))

    def start_engine(self, seed: int) -> None:
        self.state.unlink(missing_ok=True)  # a dead engine's last state must not pass for the new one's
        self.engine = self._start("engine", kvcoord_cmd(
            "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{self.pub}",  # as the README: bound, not connected
            "--replay-bind", f"tcp://127.0.0.1:{self.replay}",
            "--seed", str(seed), "--state-file", str(self.state), *ENGINE_FLAGS))
        self.target = BURST

    def burst(self) -> None:
        """Ask the running engine for another BURST requests."""
        assert self.engine is not None
        os.kill(self.engine.pid, signal.SIGUSR1)
        self.target += BURST
        poll(lambda: (self.engine_state() or {}).get("target") == self.target, "the engine to take the burst")

    def start_agent(self) -> None:
        self.agent = self._start("agent", kvcoord_cmd(
            "agent", "--coordinator", f"127.0.0.1:{self.grpc}", "--node-id", NODE, "--model", MODEL,
            "--zmq-endpoint", f"tcp://127.0.0.1:{self.pub}", "--replay-endpoint", f"tcp://127.0.0.1:{self.replay}",
            "--stats-file", str(self.agent_stats), "--stats-interval", "0.1"))

    def start_serve(self) -> None:
        self.serve = self._start("serve", kvcoord_cmd(
            "serve", "--listen", f"127.0.0.1:{self.grpc}", "--metrics-listen", f"127.0.0.1:{self.metrics}"))
        wait_for_port(self.grpc)

    def engine_state(self) -> dict[str, Any] | None:
        st = read_json(self.state)
        if st is None or self.engine is None or st.get("pid") != self.engine.pid:
            return None
        return st

    def relay_stats(self) -> dict[str, Any]:
        st = read_json(self.agent_stats)
        assert st is not None, "the agent wrote no stats"
        relays: list[dict[str, Any]] = st["relays"]
        return relays[0]

    def engine_finished(self) -> bool:
        st = self.engine_state()
        return st is not None and bool(st["finished"]) and st["target"] == self.target

    def quiescent(self) -> bool:
        """Engine done, the relay at its last batch, the coordinator acked everything the agent sealed."""
        st, ag = self.engine_state(), read_json(self.agent_stats)
        if st is None or ag is None or not st["finished"] or st["target"] != self.target:
            return False
        rep = ag["reporter"]
        return (ag["relays"][0]["expected_seq"] == st["next_seq"]
                and all(lk["connected"] and lk["unacked"] == 0 and lk["acked_seq"] == rep["last_seq"]
                        for lk in rep["links"]))

    def pool(self) -> set[tuple[int, int]]:
        st = self.engine_state()
        assert st is not None
        assert set(st["blocks"]) <= {"0"}, st["blocks"].keys()
        return {(int(h), int(t)) for h, t in st["blocks"].get("0", [])}

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.tmp.glob("*.log")))


async def index_diff(addr: str, pool: set[tuple[int, int]], gone: set[int]) -> list[str]:
    """Ways the coordinator's index differs from ``pool`` (empty: equal, block for block)."""
    problems: list[str] = []
    tiers = {0: "GPU", 1: "CPU", 2: "STORAGE"}
    async with AsyncCoordinatorClient(addr, timeout=5.0) as client:
        stats = await client.stats()
        if stats.entries != len(pool):
            problems.append(f"index holds {stats.entries} entries, the pool {len(pool)}")
        for tier, name in tiers.items():
            hashes = sorted(h for h, t in pool if t == tier)
            for i in range(0, len(hashes), CHUNK):
                chunk = hashes[i:i + CHUNK]
                res = await client.lookup(MODEL, hashes=chunk)
                held = {(n.node_id, n.dp_rank): n for n in res.nodes}
                node = held.get((NODE, 0))
                if (node is None or node.matched_blocks != len(chunk)
                        or node.tiers_by_name()[name] != len(chunk)):
                    missing = [h for h in chunk if not await _holds(client, h, name)]
                    problems.append(f"{len(missing)} pool blocks on {name} missing from the index, "
                                    f"e.g. {missing[:3]}")
                if set(held) - {(NODE, 0)}:
                    problems.append(f"unexpected nodes {set(held)}")
        gate = asyncio.Semaphore(16)

        async def held_anywhere(h: int) -> bool:
            async with gate:
                return await _holds(client, h, None)

        stale = await asyncio.gather(*(held_anywhere(h) for h in sorted(gone)))
        still = [h for h, s in zip(sorted(gone), stale, strict=True) if s]
        if still:
            problems.append(f"{len(still)} removed blocks still reported, e.g. {still[:3]}")
    return problems


async def _holds(client: AsyncCoordinatorClient, h: int, tier: str | None) -> bool:
    res = await client.lookup(MODEL, hashes=[h])
    return any(n.matched_blocks == 1 and (tier is None or n.tiers_by_name()[tier] == 1) for n in res.nodes)


class Checker:
    """Waits for quiescence, then asserts index == pool; remembers every hash the pool ever showed."""

    def __init__(self, cluster: Cluster) -> None:
        self.c = cluster
        self.seen: set[int] = set()

    def check(self, what: str, timeout: float = 25.0) -> set[tuple[int, int]]:
        c = self.c
        try:
            poll(c.quiescent, f"quiescence after {what}", timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\nengine: {c.engine_state()}\nagent: {read_json(c.agent_stats)}\n"
                                 f"{c.logs()}") from None
        pool = c.pool()
        assert len(pool) > 100, f"{what}: the workload cached too little ({len(pool)} blocks)"
        gone = self.seen - {h for h, _ in pool}
        addr = f"127.0.0.1:{c.grpc}"
        # The coordinator applies before it acks, but poll briefly anyway: an ack may race the stats file.
        deadline = time.monotonic() + 5.0
        while True:
            problems = asyncio.run(index_diff(addr, pool, gone))
            if not problems or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert not problems, f"after {what}: {problems}\n{c.logs()}"
        self.seen |= {h for h, _ in pool}
        return pool


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    with contextlib.ExitStack() as stack:
        yield Cluster(tmp_path, stack)


@pytest.mark.slow
def test_index_equals_pool_through_gaps_and_restarts(cluster: Cluster) -> None:
    c, checker = cluster, Checker(cluster)
    # The order: engine, then agent (it catches up from replay), then the coordinator.
    c.start_engine(seed=1)
    c.start_agent()
    c.start_serve()

    # 1. Steady load.
    checker.check("steady load")
    steady = c.relay_stats()
    assert steady["lost_batches"] == 0
    # Fed by live PUB frames: were both sides connecting, replay polling alone would pass the check above.
    assert steady["frames"] > 0 and steady["replay_only_probes"] < REPLAY_ONLY_PROBES_WARN, steady

    # 2. A paused agent behind a high-water mark of 1: the engine drops PUB frames; replay heals.
    before = c.relay_stats()
    assert c.agent is not None and c.engine is not None
    os.kill(c.agent.pid, signal.SIGSTOP)
    try:
        c.burst()
        poll(c.engine_finished, "the burst to finish")
    finally:
        os.kill(c.agent.pid, signal.SIGCONT)
    checker.check("dropped PUB frames")
    after = c.relay_stats()
    delta = {k: after[k] - before[k] for k in ("frames", "batches", "replayed_batches", "gaps")}
    # Frames really were dropped (fewer arrived than the engine published), and the replay socket
    # supplied them: through a detected gap, or through the catch-up probe the paused relay runs
    # when it wakes to a quiet socket.
    assert delta["frames"] < BURST and delta["batches"] == BURST, (before, after)
    assert delta["replayed_batches"] >= BURST - delta["frames"], (before, after)
    assert after["lost_batches"] == 0 and after["unrecoverable_gaps"] == 0

    # 3. Engine restart on the same ports: its sequence starts over; the relay clears and resyncs.
    first_pool = {h for h, _ in c.pool()}
    stop(c.engine)
    c.start_engine(seed=2)
    second = checker.check("engine restart")
    assert c.relay_stats()["restarts"] >= 1
    assert first_pool - {h for h, _ in second}, "the new engine's pool should differ from the old one's"

    # 4. Coordinator restart (with load while it is down): the reporter refills it from a snapshot.
    assert c.serve is not None
    stop(c.serve)
    c.burst()
    poll(c.engine_finished, "the burst to finish")
    c.start_serve()
    checker.check("coordinator restart")
    ag = read_json(c.agent_stats)
    assert ag is not None
    assert ag["reporter"]["links"][0]["snapshots_sent"] >= 2, ag["reporter"]
    assert c.relay_stats()["unrecoverable_gaps"] == 0


def _terminate(proc: subprocess.Popen[bytes], log: Path) -> float:
    """SIGTERM ``proc``; returns how long it took to exit (it must exit 0, without a traceback)."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        rc = proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running 5 s after SIGTERM\n{log.read_text()}") from None
    took = time.monotonic() - t0
    text = log.read_text(errors="replace")
    assert rc == 0 and "Traceback" not in text, text
    return took


@pytest.mark.parametrize("peers", [True, False], ids=["connected", "nothing_reachable"])
def test_agent_and_engine_stop_on_sigterm(cluster: Cluster, peers: bool) -> None:
    """Both commands exit 0 soon after SIGTERM, mid-stream or while retrying unreachable peers."""
    c = cluster
    if peers:
        c.start_serve()
        c.start_engine(seed=3)
    c.start_agent()
    assert c.agent is not None
    if peers:
        poll(lambda: (c.engine_state() or {}).get("finished") is not None, "the engine to start")
        poll(lambda: any(lk["connected"] for lk in (read_json(c.agent_stats) or {"reporter": {"links": []}})
                         ["reporter"]["links"]), "the agent to connect")
    else:
        poll(lambda: read_json(c.agent_stats) is not None, "the agent to start")
    agent_log = sorted(c.tmp.glob("*-agent.log"))[0]
    assert _terminate(c.agent, agent_log) < 5.0  # generous bounds: CI is a loaded 2-core VM
    ag = read_json(c.agent_stats)
    assert ag is not None and not any(lk["connected"] for lk in ag["reporter"]["links"])  # final write
    if peers:
        assert c.engine is not None
        c.burst()  # busy: SIGTERM lands mid-burst
        assert _terminate(c.engine, sorted(c.tmp.glob("*-engine.log"))[0]) < 5.0
        # Its sockets are closed: a new engine binds the same ports at once.
        c.start_engine(seed=4)
        poll(lambda: c.engine_state() is not None, "a new engine on the same ports")


# --- kvcoord agent flags: hash profile and mutual TLS ---------------------------------------------
def _agent_cmd(grpc_port: int, node: str, stats: Path, *extra: str) -> list[str]:
    return kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{grpc_port}", "--node-id", node,
                       "--model", MODEL, "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}",
                       "--stats-file", str(stats), "--stats-interval", "0.1", *extra)


def _link(stats: Path) -> dict[str, Any]:
    st = read_json(stats)
    links: list[dict[str, Any]] = (st or {"reporter": {"links": [{}]}})["reporter"]["links"]
    return links[0]


def test_agent_announces_its_hash_profile(tmp_path: Path) -> None:
    """--algo/--block-size/--hash-seed reach the Hello: the coordinator checks the fingerprint against the
    model's profile (the seed defaults to $PYTHONHASHSEED), and flags the agent whose seed differs."""
    gport = free_port()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "",
                        "--model", f"{MODEL},algo=sha256_cbor,block_size=16,seed=0")
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(serve, log=tmp_path / "serve.log"))
        wait_for_port(gport)
        for node, extra in (("node-same", ()), ("node-other-seed", ("--hash-seed", "1"))):
            stack.enter_context(running(
                _agent_cmd(gport, node, tmp_path / f"{node}.json", "--algo", "sha256_cbor",
                           "--block-size", "16", *extra), env=env, log=tmp_path / f"{node}.log"))
        with CoordinatorClient(f"127.0.0.1:{gport}") as client:
            def nodes() -> dict[str, Any]:
                return {n.node_id: n for n in client.list_nodes(MODEL)}
            poll(lambda: len(nodes()) == 2 and nodes()["node-other-seed"].hash_mismatch,
                 "both agents' Hellos")
            got = nodes()
        same, other = got["node-same"], got["node-other-seed"]
        want = HashProfile("sha256_cbor", 16, "0")
        assert same.hash_profile == {"algo": "sha256_cbor", "block_size": 16, "style": "untagged",
                                     "none_hash_fingerprint": want.fingerprint(), "engine_release": ""}
        assert not same.hash_mismatch
        assert other.hash_profile is not None
        other_seed = HashProfile("sha256_cbor", 16, "1").fingerprint()
        assert other.hash_profile["none_hash_fingerprint"] == other_seed
        assert "seed" in other.hash_mismatch_reason


@pytest.mark.parametrize(("flags", "env_seed", "message"), [
    (("--algo", "sha256_cbor", "--block-size", "16"), None, "no NONE_HASH seed"),
    (("--algo", "sha256", "--block-size", "16", "--engine-release", "0.20"), None,
     "seeds NONE_HASH randomly"),
    (("--algo", "md5", "--block-size", "16"), "0", "unknown hash algorithm"),
    (("--algo", "sha256_cbor",), "0", "--algo needs --block-size"),
    (("--hash-seed", "0",), "0", "--hash-seed needs --algo"),
    (("--tls-cert", "/nonexistent/c.pem"), "0", "--tls-cert and --tls-key must be given together"),
    (("--tls-ca", "/nonexistent/ca.pem"), "0", "cannot read /nonexistent/ca.pem"),
])
def test_agent_bad_flags_exit_2_before_starting(tmp_path: Path, flags: tuple[str, ...],
                                               env_seed: str | None, message: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if env_seed is not None:
        env["PYTHONHASHSEED"] = env_seed
    stats = tmp_path / "stats.json"
    out = subprocess.run(_agent_cmd(free_port(), "n1", stats, *flags), env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], out.stderr
    assert not stats.exists(), "a refused agent started relaying"


def test_agent_reaches_a_mutual_tls_coordinator(tmp_path: Path) -> None:
    """--tls-ca/--tls-cert/--tls-key/--tls-server-name: the agent connects to a coordinator that demands a
    client certificate; the same agent without one is refused."""
    pki = make_certs(tmp_path / "pki")
    gport = free_port()
    env = {**os.environ, "KVCOORD_TLS_CLIENT_CA": str(pki["ca_crt"])}
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", "",
                        "--tls-cert", str(pki["server_crt"]), "--tls-key", str(pki["server_key"]))
    tls = ("--tls-ca", str(pki["ca_crt"]), "--tls-server-name", "localhost")
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(serve, env=env, log=tmp_path / "serve.log"))
        wait_for_port(gport)
        good, bad = tmp_path / "good.json", tmp_path / "bad.json"
        client = ("--tls-cert", str(pki["client_crt"]), "--tls-key", str(pki["client_key"]))
        stack.enter_context(running(_agent_cmd(gport, "node-mtls", good, *tls, *client),
                                    log=tmp_path / "good.log"))
        stack.enter_context(running(_agent_cmd(gport, "node-no-cert", bad, *tls), log=tmp_path / "bad.log"))
        poll(lambda: bool(_link(good).get("connected")), "the mTLS agent to connect")
        poll(lambda: bool(_link(bad).get("last_error")), "the agent without a client certificate to fail")
        assert not _link(bad)["connected"]
