"""Hash profiles learned from the events, end to end: ``kvcoord sim-engine`` publishing vLLM-format events,
``kvcoord agent`` relaying them, ``kvcoord serve`` with the model named without a profile. Lookups by tokens
hit once the profile is learned (said in the log, ``kvcoord nodes`` and a metric); two engines of one model
with different seeds: the one the learned profile does not fit is flagged as a hash mismatch."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from tests.http_util import get_text, http_json
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

MODEL = "learn-model"
WORKLOAD = ("--seed", "3", "--prefixes", "32", "--prefix-len", "64", "--suffix-len", "16",
            "--output-len", "4")


def _state(path: Path) -> dict[str, Any] | None:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data


def _poll(cond: Any, what: str, logs: dict[str, Path], timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.1)
    tails = "\n".join(f"--- {n}\n{p.read_text()[-2000:]}" for n, p in logs.items() if p.exists())
    raise AssertionError(f"timed out waiting for {what}\n{tails}")


def _engine(gport: int, pub: int, replay: int, state: Path, algo: str, seed: str, node: str) -> list[str]:
    return kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--replay-bind",
                       f"tcp://127.0.0.1:{replay}", "--model", MODEL, "--block-size", "8", "--algo", algo,
                       "--hash-seed", seed, *WORKLOAD, "--rate", "50", "--state-file", str(state),
                       "--lookup-coordinator", f"127.0.0.1:{gport}", "--lookup-node-id", node)


def _agent(gport: int, pub: int, replay: int, node: str) -> list[str]:
    return kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{gport}", "--node-id", node, "--model", MODEL,
                       "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint",
                       f"tcp://127.0.0.1:{replay}")


def _nodes(gport: int) -> dict[str, dict[str, Any]]:
    out = subprocess.run(kvcoord_cmd("nodes", "--coordinator", f"127.0.0.1:{gport}", "--model", MODEL),
                         capture_output=True, timeout=30, check=True)
    return {n["node_id"]: n for n in json.loads(out.stdout)["nodes"]}


def _metrics(mport: int) -> str:
    return get_text(f"http://127.0.0.1:{mport}/metrics")


def _serve(gport: int, mport: int, model: str) -> list[str]:
    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", f"127.0.0.1:{mport}",
                       "--http-listen", f"127.0.0.1:{free_port()}", "--model", model)


def test_profile_learned_from_the_events_then_lookups_hit(tmp_path: Path) -> None:
    """vLLM's default seed and sha256 (pickle): nothing configured but the model's name."""
    gport, mport, pub, replay = free_port(), free_port(), free_port(), free_port()
    state = tmp_path / "engine.json"
    logs = {n: tmp_path / f"{n}.log" for n in ("serve", "agent", "engine")}
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve(gport, mport, MODEL), log=logs["serve"]))
        wait_for_port(gport, timeout=30)
        # The agent first: learning reads chain heads (new prompt prefixes) as they are published.
        stack.enter_context(running(_agent(gport, pub, replay, "node-a"), log=logs["agent"]))
        stack.enter_context(running(_engine(gport, pub, replay, state, "sha256", "vllm-none-hash", "node-a"),
                                    log=logs["engine"]))
        st = _poll(lambda: (s := _state(state)) is not None and s["lookup"]["best_is_self"] >= 5 and s,
                   "token lookups that hit the engine", logs)
        assert st["lookup"]["best_matched_blocks"] > 0
        text = logs["serve"].read_text()
        assert "hash profile learned from the events: algo=sha256 block_size=8" in text, text[-3000:]
        assert "seed=vLLM's default seed" in text
        node = _nodes(gport)["node-a"]
        assert node["model_profile"] == {"algo": "sha256", "block_size": 8, "style": "tagged",
                                         "source": "learned"}
        assert not node["hash_mismatch"] and node["trust"] == "exact", node
        assert f'kvcoord_hash_profile_learned_total{{algo="sha256",model="{MODEL}"}} 1.0' in _metrics(mport)


def test_engines_of_one_model_that_disagree_are_flagged(tmp_path: Path) -> None:
    """xxhash_cbor with the configured seed 0 on one engine, seed 1 (known to nobody) on the other: the
    profile learned fits the first; the second is flagged as a mismatch, as with a configured profile."""
    gport, mport = free_port(), free_port()
    ports = {n: (free_port(), free_port()) for n in ("node-a", "node-b")}
    logs = {n: tmp_path / f"{n}.log" for n in ("serve", "agent-a", "agent-b", "engine-a", "engine-b")}
    states = {n: tmp_path / f"{n}.json" for n in ports}
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve(gport, mport, f"{MODEL},seed=0"), log=logs["serve"]))
        wait_for_port(gport, timeout=30)
        for node, seed in (("node-a", "0"), ("node-b", "1")):
            pub, replay = ports[node]
            tag = node[-1]
            stack.enter_context(running(_agent(gport, pub, replay, node), log=logs[f"agent-{tag}"]))
            stack.enter_context(running(_engine(gport, pub, replay, states[node], "xxhash_cbor", seed, node),
                                        log=logs[f"engine-{tag}"]))
        nodes = _poll(lambda: (n := _nodes(gport)).get("node-b", {}).get("hash_mismatch") and n,
                      "node-b flagged", logs)
        assert nodes["node-b"]["trust"] == "degraded" and nodes["node-b"]["trust_cause"] == "hash_mismatch"
        assert nodes["node-a"]["model_profile"]["source"] == "learned"
        assert nodes["node-a"]["model_profile"]["algo"] == "xxhash_cbor"
        assert not nodes["node-a"]["hash_mismatch"], nodes["node-a"]
        st = _poll(lambda: (s := _state(states["node-a"])) is not None
                   and s["lookup"]["best_is_self"] >= 3 and s, "node-a's lookups hit", logs)
        assert st["lookup"]["best_matched_blocks"] > 0
        assert "seed=the configured seed" in logs["serve"].read_text()


def test_a_registered_engine_learns_too_and_workers_say_so(tmp_path: Path) -> None:
    """``POST /register`` (the coordinator relays the engine itself): ``/workers`` shows the learned profile
    and the engine's lookups by tokens hit."""
    gport, mport, hport, pub, replay = free_port(), free_port(), free_port(), free_port(), free_port()
    state = tmp_path / "engine.json"
    logs = {n: tmp_path / f"{n}.log" for n in ("serve", "engine")}
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", f"127.0.0.1:{mport}",
                        "--http-listen", f"127.0.0.1:{hport}", "--model", MODEL)
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(serve, log=logs["serve"]))
        wait_for_port(hport, timeout=30)
        status, answer = http_json("POST", f"http://127.0.0.1:{hport}/register", {
            "instance_id": 7, "endpoint": f"tcp://127.0.0.1:{pub}", "model_name": MODEL,
            "replay_endpoint": f"tcp://127.0.0.1:{replay}", "block_size": 8})
        assert status == 201, answer
        stack.enter_context(running(_engine(gport, pub, replay, state, "sha256_cbor", "vllm-none-hash", "7"),
                                    log=logs["engine"]))

        def workers() -> list[dict[str, Any]]:
            status, listed = http_json("GET", f"http://127.0.0.1:{hport}/workers")
            assert status == 200, listed
            return list(listed)

        listed = _poll(lambda: (w := workers()) and w[0]["hash_profile"] is not None and w,
                       "/workers showing the learned profile", logs)
        assert listed[0]["hash_profile"] == {"algo": "sha256_cbor", "block_size": 8, "style": "tagged",
                                             "source": "learned"}
        _poll(lambda: (s := _state(state)) is not None and s["lookup"]["best_is_self"] >= 3,
              "the registered engine's lookups hit", logs)
