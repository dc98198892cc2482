"""Engines registered over HTTP (``POST /register``) get an agent node's lease: real ``kvcoord serve`` and
``kvcoord sim-engine`` subprocesses. A SIGKILLed engine leaves every lookup answer (HTTP ``/query``, gRPC
Lookup, ``place()``) once it has answered neither events nor replay probes for a lease, ``/workers``,
ListNodes and ``kvcoord_registered_engines{state}`` say ``unreachable``, and a new engine on the same ports
comes back by itself, ``exact``. A registration where nothing listens is never ``active``. Its load comes
from the engine's ``/metrics``; with ``--state-dir`` registrations survive a restart of ``serve``.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvcoord.router.client import CoordinatorClient, NodeStatus
from kvcoord.router.policy import place
from tests.http_util import by_label, http_json, metrics
from tests.procs import free_port, kvcoord_cmd, running, until, wait_for_port
from tests.redis_servers import redis_server

MODEL = "reg-model"
BS = 8
SPEC = f"{MODEL},algo=sha256_cbor,block_size={BS},seed=0"
LEASE = 6.0
"""Short, so a death shows quickly; several replay probes fit in it (the relays probe every lease/4)."""
DEADLINE = 60.0
TOKENS = list(range(17_000, 17_000 + 8 * BS))
"""One prompt of 8 full blocks, sent to the engine so it stores them (and publishes the events)."""


@dataclass
class Sim:
    pub: int
    replay: int
    http: int

    def cmd(self) -> list[str]:
        """A sim-engine with a synthetic workload (8 requests running: a load to scrape) and HTTP."""
        return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{self.pub}",
                           "--replay-bind", f"tcp://127.0.0.1:{self.replay}",
                           "--http-listen", f"127.0.0.1:{self.http}", "--model", MODEL,
                           "--algo", "sha256_cbor", "--hash-seed", "0", "--block-size", str(BS),
                           "--num-blocks", "16384", "--rate", "20")

    def registration(self, instance_id: int, *, replay: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"instance_id": instance_id, "endpoint": f"tcp://127.0.0.1:{self.pub}",
                                "model_name": MODEL, "block_size": BS,
                                "metrics_url": f"http://127.0.0.1:{self.http}/metrics"}
        if replay:
            body["replay_endpoint"] = f"tcp://127.0.0.1:{self.replay}"
        return body


@dataclass
class Serve:
    grpc: int
    http: int
    metrics: int
    log: Path
    proc: subprocess.Popen[bytes]

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        return http_json(method, f"http://127.0.0.1:{self.http}{path}", body)

    def workers(self) -> dict[int, dict[str, Any]]:
        status, body = self.call("GET", "/workers")
        assert status == 200, body
        return {w["instance_id"]: w for w in body}

    def answer(self) -> dict[str, dict[str, Any]]:
        """HTTP /query's nodes for TOKENS, unmatched live nodes included, by node id."""
        status, body = self.call("POST", "/query", {"token_ids": TOKENS, "model_name": MODEL,
                                                    "include_unmatched": True})
        assert status == 200, body
        return {n["node_id"]: n for n in body["nodes"]}

    def grpc_answer(self) -> set[str]:
        """gRPC Lookup's nodes for TOKENS (unmatched live ones too), and place()'s choice among them."""
        with CoordinatorClient(f"127.0.0.1:{self.grpc}", timeout=10) as client:
            result = client.lookup(MODEL, tokens=TOKENS, include_unmatched=True)
        nodes = {n.node_id for n in result.nodes}
        if nodes:
            assert place(result).node_id in nodes
        return nodes

    def nodes(self) -> dict[str, NodeStatus]:
        with CoordinatorClient(f"127.0.0.1:{self.grpc}", timeout=10) as client:
            return {n.node_id: n for n in client.list_nodes(MODEL)}

    def gauge(self) -> dict[str, float]:
        """``kvcoord_registered_engines{state}``."""
        page = metrics(f"http://127.0.0.1:{self.metrics}/metrics")
        return by_label(page, "kvcoord_registered_engines", "state")

    def diagnose(self) -> str:
        return (f"answer {self.answer()}\nworkers {self.workers()}\nnodes {self.nodes()}\n"
                f"--- serve log\n{self.log.read_text()[-3000:]}")


@contextlib.contextmanager
def serve(tmp: Path, name: str, *extra: str) -> Iterator[Serve]:
    grpc, http, metrics = free_port(), free_port(), free_port()
    log = tmp / f"serve-{name}.log"
    with running(kvcoord_cmd("serve", "--listen", f"127.0.0.1:{grpc}", "--http-listen", f"127.0.0.1:{http}",
                             "--metrics-listen", f"127.0.0.1:{metrics}", "--lease-seconds", str(LEASE),
                             "--model", SPEC, *extra), log=log) as proc:
        wait_for_port(http)
        wait_for_port(metrics)
        yield Serve(grpc, http, metrics, log, proc)


@contextlib.contextmanager
def sim_engine(tmp: Path, sim: Sim, name: str) -> Iterator[subprocess.Popen[bytes]]:
    with running(sim.cmd(), log=tmp / f"sim-{name}.log") as proc:
        wait_for_port(sim.http)
        yield proc


def store_prompt(sim: Sim) -> None:
    """One completion of TOKENS on the engine: it stores their 8 blocks and publishes them."""
    status, body = http_json("POST", f"http://127.0.0.1:{sim.http}/v1/completions",
                             {"model": MODEL, "prompt": TOKENS, "max_tokens": 1})
    assert status == 200, body


def new_sim() -> Sim:
    return Sim(free_port(), free_port(), free_port())


def serving(srv: Serve, node: str, *, exact: bool = True) -> bool:
    """``node`` is in every lookup answer with its engine's scraped load; ``exact``: holding TOKENS, exact."""
    entry = srv.answer().get(node)
    return (entry is not None and (not exact or (entry["matched_blocks"] == 8 and entry["trust"] == "exact"))
            and entry["load"]["running_requests"] > 0 and entry["load"]["kv_usage"] > 0
            and node in srv.grpc_answer())


def both_serving(srv: Serve) -> bool:
    """7 holds TOKENS, exact. 8 (no replay socket) misses what the engine published before its relay joined
    (TOKENS among it, maybe), so it is only in the answers."""
    return serving(srv, "7") and serving(srv, "8", exact=False)


@pytest.mark.slow
def test_a_killed_engine_leaves_the_answers_and_comes_back_by_itself(tmp_path: Path) -> None:
    sim = new_sim()
    with serve(tmp_path, "a") as srv, contextlib.ExitStack() as stack:
        engine = stack.enter_context(sim_engine(tmp_path, sim, "1"))
        # 7 with the replay socket (probed); 8 on the PUB endpoint alone (its connection watched).
        for body in (sim.registration(7), sim.registration(8, replay=False)):
            status, reply = srv.call("POST", "/register", body)
            assert status == 201, reply
        store_prompt(sim)
        until(lambda: both_serving(srv), "both registrations in the answers with the engine's load", DEADLINE,
              srv.diagnose)
        listed = srv.nodes()
        assert all(listed[n].state == "active" and listed[n].load.running_requests for n in "78"), listed
        assert {w["status"] for w in srv.workers().values()} == {"active"}
        assert srv.workers()[7]["metrics_url"] == f"http://127.0.0.1:{sim.http}/metrics"
        until(lambda: srv.gauge().get("active") == 2, "registered_engines{active} 2", DEADLINE, srv.gauge)

        engine.send_signal(signal.SIGKILL)
        engine.wait(timeout=10)

        def gone() -> bool:
            return (not {"7", "8"} & set(srv.answer()) and not {"7", "8"} & srv.grpc_answer()
                    and {w["status"] for w in srv.workers().values()} == {"unreachable"}
                    and all(srv.nodes()[n].state == "unreachable" for n in ("7", "8"))
                    and srv.gauge().get("unreachable") == 2)

        until(gone, "the killed engine out of every answer, unreachable everywhere", DEADLINE, srv.diagnose)
        reason = srv.nodes()["7"].trust_reason
        assert "unreachable" in reason and f"tcp://127.0.0.1:{sim.pub}" in reason, reason
        out = subprocess.run(kvcoord_cmd("nodes", "--coordinator", f"127.0.0.1:{srv.grpc}", "--model", MODEL),
                             capture_output=True, timeout=30, check=True)
        assert {n["node_id"]: n["state"] for n in json.loads(out.stdout)["nodes"]} == {
            "7": "unreachable", "8": "unreachable"}
        until(lambda: "answered neither events nor replay probes" in srv.log.read_text(), "the log line",
              DEADLINE, srv.diagnose)

        # A new engine on the same ports: the relays find it and resync, nobody registers anything again.
        with sim_engine(tmp_path, sim, "2"):
            store_prompt(sim)
            until(lambda: both_serving(srv), "both back after the restart, 7 exact", DEADLINE, srv.diagnose)
            assert {w["status"] for w in srv.workers().values()} == {"active"}
            until(lambda: srv.gauge().get("active") == 2, "2 active again", DEADLINE, srv.gauge)


@pytest.mark.slow
def test_a_registration_where_nothing_listens_is_never_active(tmp_path: Path) -> None:
    dead = new_sim()  # free ports: nothing listens on them
    with serve(tmp_path, "a") as srv:
        for body in (dead.registration(20), dead.registration(21, replay=False)):
            status, reply = srv.call("POST", "/register", body)
            assert status == 201, reply
        seen: set[str] = set()

        def unreachable() -> bool:
            """Never active nor in an answer on the way: connecting, then unreachable after a lease."""
            workers, nodes = srv.workers(), srv.nodes()
            for iid in (20, 21):
                seen.add(workers[iid]["status"])
                assert workers[iid]["status"] in ("connecting", "unreachable"), workers[iid]
                assert nodes[str(iid)].state in ("connecting", "unreachable"), nodes
                assert nodes[str(iid)].trust == "resyncing", nodes
            assert not {"20", "21"} & (set(srv.answer()) | srv.grpc_answer())
            return {w["status"] for w in workers.values()} == {"unreachable"}

        until(unreachable, "both dead registrations unreachable", DEADLINE, srv.diagnose)
        want = {"failed": 0, "unreachable": 2, "connecting": 0, "pending": 0, "active": 0}
        until(lambda: srv.gauge() == want, "2 unreachable, the rest 0", DEADLINE, srv.gauge)
        why = srv.workers()[20]["listeners"]["0"]["last_error"]
        assert f"tcp://127.0.0.1:{dead.pub}" in why and "nothing answered" in why, why


@pytest.mark.slow
def test_registrations_survive_a_restart_of_serve_with_a_state_dir(tmp_path: Path) -> None:
    sim = new_sim()
    state = tmp_path / "state"
    kept = state / "engines.json"
    with sim_engine(tmp_path, sim, "1"):
        store_prompt(sim)
        with serve(tmp_path, "a", "--state-dir", str(state)) as srv:
            until(lambda: f"engine registrations: 0 at start, kept in {kept}" in srv.log.read_text(),
                  "the start-up line", DEADLINE, srv.diagnose)
            for body in (sim.registration(7), {**sim.registration(9), "endpoint": "tcp://127.0.0.1:1"}):
                status, reply = srv.call("POST", "/register", body)
                assert status == 201, reply
            status, reply = srv.call("POST", "/unregister", {"instance_id": 9, "model_name": MODEL})
            assert status == 200, reply
            # A change that cannot be written is refused, and changes nothing.
            saved = kept.read_bytes()
            kept.unlink()
            kept.mkdir()  # nothing can be renamed over a directory
            status, reply = srv.call("POST", "/register", sim.registration(11))
            assert status == 503 and "cannot write" in reply["error"], reply
            assert set(srv.workers()) == {7}
            kept.rmdir()
            kept.write_bytes(saved)
            until(lambda: serving(srv, "7"), "engine 7 in the answers", DEADLINE, srv.diagnose)
            assert [e["instance_id"] for e in json.loads(kept.read_text())["engines"]] == [7]
        assert not list(state.glob(".*.tmp"))  # written by rename: no temporary file left behind

        # A new serve on the same state_dir relays engine 7 again: nobody registers it.
        with serve(tmp_path, "b", "--state-dir", str(state)) as srv:
            until(lambda: f"engine registrations: 1 at start, kept in {kept}" in srv.log.read_text(),
                  "the start-up line", DEADLINE, srv.diagnose)
            until(lambda: serving(srv, "7"), "engine 7 back in the answers after the restart", DEADLINE,
                  srv.diagnose)
            assert srv.workers()[7]["metrics_url"] == f"http://127.0.0.1:{sim.http}/metrics"

    # Without --state-dir they are forgotten (as Dynamo's indexer forgets them).
    with serve(tmp_path, "c") as srv:
        assert srv.workers() == {}


def test_redis_keeps_registrations_across_a_restart_of_serve(tmp_path: Path) -> None:
    """The Redis index needs no state_dir: registrations live in its ``{prefix}:engines`` hash."""
    sim = new_sim()
    with redis_server() as redis, sim_engine(tmp_path, sim, "1"):
        store_prompt(sim)
        with serve(tmp_path, "a", "--index", redis.url) as srv:
            status, reply = srv.call("POST", "/register", sim.registration(7))
            assert status == 201, reply
            until(lambda: serving(srv, "7"), "engine 7 in the answers", DEADLINE, srv.diagnose)
        with serve(tmp_path, "b", "--index", redis.url) as srv:
            until(lambda: "engine registrations: 1 at start, kept in Redis" in srv.log.read_text(),
                  "the start-up line", DEADLINE, srv.diagnose)
            until(lambda: serving(srv, "7"), "engine 7 back after the restart", DEADLINE, srv.diagnose)


def test_a_bad_metrics_or_serving_url_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    sim = new_sim()
    with serve(tmp_path, "a") as srv:
        for field in ("metrics_url", "serving_url"):
            for url in ("ftp://127.0.0.1/metrics", "http://", "not a url", "http://h:1/metrics?x=1",
                        "h" * 5000):
                status, reply = srv.call("POST", "/register", {**sim.registration(7), field: url})
                assert status == 400 and f"invalid {field}" in reply["error"], reply
                assert "\n" not in reply["error"] and len(reply["error"]) < 400, reply
        assert srv.workers() == {}


def test_a_state_dir_that_cannot_be_used_refuses_the_start(tmp_path: Path) -> None:
    (tmp_path / "engines.json").write_text("{not json")
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    for state_dir, words in ((tmp_path, "is not a registrations file"), (not_a_dir, "cannot create")):
        out = subprocess.run(kvcoord_cmd("serve", "--listen", f"127.0.0.1:{free_port()}", "--http-listen",
                                         f"127.0.0.1:{free_port()}", "--metrics-listen", "",
                                         "--state-dir", str(state_dir)),
                             capture_output=True, timeout=60, text=True)
        lines = out.stderr.strip().splitlines()
        assert out.returncode != 0 and words in lines[-1] and "Traceback" not in out.stderr, out.stderr
    assert (tmp_path / "engines.json").read_text() == "{not json"  # left as it was


def test_state_dir_in_the_config_file_is_relative_to_it(tmp_path: Path) -> None:
    from kvcoord.coordinator.config import load_config

    conf = tmp_path / "kvcoord.toml"
    conf.write_text('state_dir = "state"\n')
    assert load_config(conf, env={}).state_dir == str(tmp_path / "state")
    assert load_config(conf, env={"KVCOORD_STATE_DIR": "/elsewhere"}).state_dir == "/elsewhere"
    assert load_config(None, env={}).state_dir == ""
