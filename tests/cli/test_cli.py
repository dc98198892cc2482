"""The command line as an operator meets it: every mistake is one line on stderr and a non-zero exit,
the same flag means the same thing in every command, and the admin commands work on a live coordinator.

Every case runs the real ``kvcoord`` in a subprocess; servers, engines and agents are real processes on
free ports, and each is stopped when its test ends.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.procs import REPO, free_port, kvcoord_cmd, running, stop, wait_for_port


def run(*args: str, env: dict[str, str] | None = None, timeout: float = 60
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(kvcoord_cmd(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, **(env or {})})


def one_line(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> str:
    """The command failed with ``code`` and said why in exactly one line (no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == ""
    return lines[0]


def poll(read: Callable[[], Any], ok: Callable[[Any], bool], what: str, timeout: float = 45) -> Any:
    """Until ``ok(read())``; fails naming ``what`` (the condition, never a fixed sleep)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError, KeyError, IndexError):
            value = read()
            if ok(value):
                return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not reached in {timeout}s (last: {value!r})")


# --- bad input: one line, exit 2 -----------------------------------------------------------------
@pytest.mark.parametrize(("args", "needles"), [
    (("--log-level", "LOUD", "stats", "--coordinator", "127.0.0.1:1"), ("--log-level", "LOUD")),
    (("stats", "--coordinator", "127.0.0.1"), ("--coordinator", "HOST:PORT")),
    (("lookup", "--coordinator", "127.0.0.1", "--model", "m", "--hashes", "1"), ("HOST:PORT",)),
    (("nodes", "--coordinator", "localhost"), ("HOST:PORT",)),
    (("drain", "n1", "--coordinator", "h:0"), ("HOST:PORT",)),
    (("remove", "n1", "--coordinator", "h:99999"), ("HOST:PORT",)),
    (("health", "--coordinator", "h"), ("HOST:PORT",)),
    (("simulate", "--coordinator", "h", "--limit", "1"), ("HOST:PORT",)),
    (("agent", "--coordinator", "127.0.0.1", "--node-id", "n", "--model", "m",
      "--zmq-endpoint", "tcp://127.0.0.1:5557"), ("HOST:PORT",)),
    (("sim-engine", "--lookup-coordinator", "127.0.0.1"), ("HOST:PORT",)),
    (("lookup", "--coordinator", "127.0.0.1:1", "--model", "m", "--hashes", "1", "--timeout", "-1"),
     ("--timeout", "-1 must be > 0")),
    (("stats", "--coordinator", "127.0.0.1:1", "--timeout", "soon"), ("--timeout", "not a number")),
    (("lookup", "--coordinator", "127.0.0.1:1", "--model", "m", "--hashes", "1,2", "--mm", "bogus"),
     ("--mm", "token queries only")),
    (("lookup", "--coordinator", "127.0.0.1:1", "--model", "m", "--tokens", "1,2", "--mm", "bogus"),
     ("bad --mm 'bogus'",)),
    (("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m", "--zmq-endpoint", "tcp://h"),
     ("--zmq-endpoint", "tcp://HOST:PORT")),
    (("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m",
      "--zmq-endpoint", "127.0.0.1:5557"), ("invalid ZMQ endpoint", "missing scheme")),
    (("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m"),
     ("--zmq-endpoint is required", "--no-kv-events")),
    (("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m", "--no-kv-events",
      "--zmq-endpoint", "tcp://127.0.0.1:5557"), ("--no-kv-events relays no events: drop --zmq-endpoint",)),
    (("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m", "--no-kv-events",
      "--replay-endpoint", "tcp://127.0.0.1:5558"), ("drop --replay-endpoint",)),
    (("agent", "--coordinator", "127.0.0.1:1", "--node-id", "n", "--model", "m", "--no-kv-events",
      "--algo", "xxhash", "--block-size", "16"), ("drop --algo",)),
    (("sim-engine", "--zmq-bind", "tcp://*:notaport"), ("--zmq-bind",)),
    (("serve", "--index", "redis://127.0.0.1:6379/0?bucket=4"),
     ("unknown option 'bucket'", "allowed: buckets")),
    (("serve", "--index", "redis://127.0.0.1:6379/0?buckets=abc"), ("buckets must be an integer",)),
    (("serve", "--index", "redis+cluster://h:1,h:2?mirror=yes"), ("mirror must be 0 or 1",)),
    (("serve", "--index", "postgres://h/db"), ("unknown index backend",)),
    (("serve", "--index", "redis+sentinel://h:1,h:2"), ("no master name",)),
    (("serve", "--index", "redis+sentinel://h:1/m?sentinel_pass=x"), ("unknown option 'sentinel_pass'",)),
    (("serve", "--listen", "nowhere"), ("listen",)),
])
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], needles: tuple[str, ...]) -> None:
    one_line(run(*args), 2, *needles)


def test_the_seed_flag_has_one_name_and_the_hint_uses_it() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    proc = subprocess.run(kvcoord_cmd("hash", "--algo", "sha256_cbor", "--block-size", "4"),
                          input="[1,2,3,4]", capture_output=True, text=True, timeout=60, cwd=REPO, env=env)
    one_line(proc, 2, "--hash-seed S")
    for args in (("hash", "--algo", "sha256_cbor", "--block-size", "4", "--hash-seed", "7"),
                 ("hash", "--algo", "sha256_cbor", "--block-size", "4", "--seed", "7")):  # DESIGN's alias
        proc = subprocess.run(kvcoord_cmd(*args), input="[1,2,3,4]", capture_output=True, text=True,
                              timeout=60, cwd=REPO, env=env)
        assert proc.returncode == 0 and len(json.loads(proc.stdout)) == 1, proc.stderr
    for command in ("agent", "sim-engine", "simulate"):
        assert "--hash-seed" in run(command, "--help").stdout, command


# --- operations that fail: one line, exit 1 ------------------------------------------------------
@contextlib.contextmanager
def taken_port() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


def test_ports_in_use_are_one_line() -> None:
    with taken_port() as port:
        one_line(run("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{port}", "--hash-seed", "0"), 1,
                 f"cannot bind tcp://127.0.0.1:{port}", "in use")
        one_line(run("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", ""), 1,
                 f"cannot listen on 127.0.0.1:{port}: Address already in use")
        one_line(run("serve", "--listen", "127.0.0.1:0", "--metrics-listen", f"127.0.0.1:{port}"), 1,
                 f"cannot listen on 127.0.0.1:{port}: Address already in use")


def test_unreachable_coordinator_is_one_line() -> None:
    port = free_port()
    one_line(run("stats", "--coordinator", f"127.0.0.1:{port}", "--timeout", "1"), 1, "UNAVAILABLE")


# --- the agent: permanent refusals end it, mismatches reach it -----------------------------------
def _serve(port: int, *extra: str) -> list[str]:
    return kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", *extra)


def _agent(port: int, tmp: Path, *extra: str, node: str = "node-a", model: str = "m") -> list[str]:
    return kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{port}", "--node-id", node, "--model", model,
                       "--zmq-endpoint", f"tcp://127.0.0.1:{free_port()}",
                       "--stats-file", str(tmp / "agent.json"), *extra)


@pytest.mark.parametrize(("serve_flags", "agent_flags", "needle"), [
    (("--strict-models", "--model", "m,algo=sha256_cbor,block_size=16,seed=0"), ("--model", "other"),
     "NOT_FOUND: unknown model 'other'"),
    (("--agent-token", "tok=node-b",), ("--token", "tok"), "PERMISSION_DENIED"),
    (("--agent-token", "tok=node-a",), ("--token", "wrong"), "UNAUTHENTICATED"),
])
def test_agent_refused_for_good_exits_1_with_one_line(tmp_path: Path, serve_flags: tuple[str, ...],
                                                      agent_flags: tuple[str, ...], needle: str) -> None:
    port = free_port()
    with running(_serve(port, *serve_flags), log=tmp_path / "serve.log"):
        wait_for_port(port, timeout=30)
        args = list(agent_flags)
        model = "m"
        if args[:1] == ["--model"]:
            model, args = args[1], args[2:]
        proc = subprocess.run(_agent(port, tmp_path, *args, model=model), capture_output=True, text=True,
                              timeout=60, cwd=REPO)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvcoord agent: every coordinator refused this node") and needle in last, last
    assert proc.stderr.count("refused node node-a for good") == 1, proc.stderr  # said once, not retried
    status = json.loads((tmp_path / "agent.json").read_text())
    assert status["state"] == "refused" and needle in status["reporter"]["links"][0]["refused"]


def test_agent_is_told_of_a_hash_mismatch(tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "agent.log"
    profile = ("--algo", "sha256_cbor", "--block-size", "16")
    serve = _serve(port, "--model", "m,algo=sha256_cbor,block_size=16,seed=1")
    with running(serve, log=tmp_path / "serve.log"):
        wait_for_port(port, timeout=30)
        with running(_agent(port, tmp_path, *profile, "--hash-seed", "2"), log=log):
            status = poll(lambda: json.loads((tmp_path / "agent.json").read_text()),
                          lambda s: s["reporter"]["links"][0]["hash_mismatch"],
                          "the agent's stats show the mismatch")
    assert "seed" in status["reporter"]["links"][0]["hash_mismatch"]
    assert "do not match its profile" in log.read_text()


# --- client commands: one token rule, the admin RPCs ---------------------------------------------
def test_every_client_command_takes_the_token_from_the_environment(tmp_path: Path) -> None:
    port = free_port()
    with running(_serve(port, "--router-token", "rtok", "--admin-token", "atok"), log=tmp_path / "serve.log"):
        wait_for_port(port, timeout=30)
        where = ("--coordinator", f"127.0.0.1:{port}")
        one_line(run("stats", *where), 1, "UNAUTHENTICATED")
        for args in (("stats", *where), ("nodes", *where),
                     ("lookup", *where, "--model", "m", "--hashes", "1,2")):
            proc = run(*args, env={"KVCOORD_TOKEN": "rtok"})
            assert proc.returncode == 0, (args, proc.stderr)
            json.loads(proc.stdout)
        one_line(run("drain", "n1", *where, env={"KVCOORD_TOKEN": "rtok"}), 1, "PERMISSION_DENIED")
        one_line(run("drain", "n1", *where, env={"KVCOORD_TOKEN": "atok"}), 1, "NOT_FOUND", "'n1'")
        proc = run("stats", *where, "--token", "atok", env={"KVCOORD_TOKEN": "wrong"})  # the flag wins
        assert proc.returncode == 0, proc.stderr


def test_nodes_drain_and_remove(tmp_path: Path) -> None:
    port, pub, replay = free_port(), free_port(), free_port()
    where = ("--coordinator", f"127.0.0.1:{port}")
    with contextlib.ExitStack() as stack:
        stack.enter_context(running(_serve(port), log=tmp_path / "serve.log"))
        wait_for_port(port, timeout=30)
        stack.enter_context(running(kvcoord_cmd(
            "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--replay-bind", f"tcp://127.0.0.1:{replay}",
            "--model", "m", "--hash-seed", "0", "--rate", "50"), log=tmp_path / "engine.log"))
        agent = stack.enter_context(running(kvcoord_cmd(
            "agent", *where, "--node-id", "node-a", "--model", "m", "--zmq-endpoint", f"tcp://127.0.0.1:{pub}",
            "--replay-endpoint", f"tcp://127.0.0.1:{replay}"), log=tmp_path / "agent.log"))

        def nodes() -> list[dict[str, Any]]:
            proc = run("nodes", *where)
            assert proc.returncode == 0, proc.stderr
            result: list[dict[str, Any]] = json.loads(proc.stdout)["nodes"]
            return result

        poll(nodes, lambda ns: [n["state"] for n in ns] == ["active"], "node-a active")
        drained = run("drain", "node-a", *where)
        assert drained.returncode == 0
        assert json.loads(drained.stdout) == {"node_id": "node-a", "draining": True}
        assert [n["state"] for n in nodes()] == ["draining"]
        assert run("drain", "node-a", *where, "--undrain").returncode == 0
        poll(nodes, lambda ns: [n["state"] for n in ns] == ["active"], "node-a active again")
        # A removed node whose agent still runs comes back with its next Hello: stop the agent first.
        assert stop(agent) == 0
        removed = run("remove", "node-a", *where)
        assert removed.returncode == 0
        assert json.loads(removed.stdout) == {"node_id": "node-a", "removed": True}
        assert nodes() == []
        one_line(run("remove", "nobody", *where), 1, "NOT_FOUND")
