"""What the benchmarks that run ``kvcoord`` as real processes on this machine share, so a flag of the
commands they start, or a way of measuring, is changed in one place: the sim-engines' model and hash
profile, starting sim-engines, ``kvcoord serve`` and an agent, ``kvcoord route``'s command line, a
process's CPU seconds from ``/proc``, a percentile, and the command line's common part.

A benchmark puts the repository on ``sys.path`` first, then ``from benchmarks.common import ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from pathlib import Path

from kvcoord.hashing import HashProfile
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port

MODEL = "sim-model"
PROFILE = HashProfile("sha256_cbor", 16, seed="0")
"""The sim-engines' hash profile, unless a benchmark passes its own (``replay_route``'s xxhash)."""
_TICK = os.sysconf("SC_CLK_TCK")


def bench_parser(doc: str, *, requests: int, requests_help: str,
                 token_interval: float | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line: its docstring's first paragraph as the description, ``--requests``
    and, given a default, the sim-engines' ``--token-interval``."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=requests, help=requests_help)
    if token_interval is not None:
        ap.add_argument("--token-interval", type=float, default=token_interval,
                        help="the sim-engines' seconds per token")
    return ap


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid`` and its threads so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / _TICK, int(fields[12]) / _TICK


def pct(xs: list[float], q: float) -> float:
    """The ``q`` quantile of ``xs`` (the nearest rank at or below)."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def model_spec(profile: HashProfile = PROFILE, tokenizer: str = "") -> str:
    """The coordinator's ``--model`` for MODEL's engines hashing with ``profile`` (tokenizing through
    ``tokenizer``'s ``/tokenize``, given one)."""
    return (f"{MODEL},algo={profile.algo},block_size={profile.block_size},seed={profile.seed}"
            + (f",tokenizer={tokenizer}" if tokenizer else ""))


def start_engine(stack: contextlib.ExitStack, log: Path, *flags: str, profile: HashProfile = PROFILE,
                 blocks: int = 65536, replay: bool = False) -> tuple[str, int]:
    """A ``kvcoord sim-engine`` (``profile``'s hashes, ``blocks`` blocks, serving HTTP, publishing KV events
    on ZMQ, with ``replay`` a replay socket on the PUB port + 1; ``flags`` last), stopped with ``stack``:
    its URL and its PUB port. Not waited for: :func:`wait_url` (several engines start side by side)."""
    http, pub = free_port(), free_port_pair() if replay else free_port()
    replay_bind = ("--replay-bind", f"tcp://127.0.0.1:{pub + 1}") if replay else ()
    stack.enter_context(running(kvcoord_cmd(
        "sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", *replay_bind, "--model", MODEL,
        "--algo", profile.algo, "--hash-seed", str(profile.seed), "--block-size", str(profile.block_size),
        "--http-listen", f"127.0.0.1:{http}", "--rate", "0", "--requests", "0", "--num-blocks", str(blocks),
        *flags), log=log))
    return f"http://127.0.0.1:{http}", pub


def start_engines(stack: contextlib.ExitStack, tmp: Path, tag: str, n: int, blocks: int, *flags: str,
                  profile: HashProfile = PROFILE) -> dict[str, tuple[str, int]]:
    """``n`` engines of :func:`start_engine` (``node-0``, ...) with replay sockets, once each answers on
    HTTP: node -> (URL, PUB port; replay on PUB + 1). Logs go to ``tmp/{tag}-{node}.log``."""
    engines = {f"node-{i}": start_engine(stack, tmp / f"{tag}-node-{i}.log", *flags, profile=profile,
                                         blocks=blocks, replay=True) for i in range(n)}
    for url, _ in engines.values():
        wait_url(url)
    return engines


def wait_url(url: str) -> None:
    """Block until something accepts at ``url``'s port."""
    wait_for_port(int(url.rsplit(":", 1)[1]), timeout=60)


def start_serve(stack: contextlib.ExitStack, log: Path, tokenizer: str = "", *, http_port: int = 0,
                quiet: bool = False, profile: HashProfile = PROFILE,
                metrics_port: int = 0, workers: int = 0, index: str = "") -> tuple[str, int]:
    """``kvcoord serve`` for MODEL's engines hashing with ``profile`` (tokenizing through ``tokenizer``'s
    ``/tokenize``, given one), its /metrics on ``metrics_port`` (0: none), its HTTP API on ``http_port``
    (0: none) answered by ``workers`` lookup workers too (``--lookup-workers``), on ``index`` (its
    ``--index``; "": the memory index), warnings only with ``quiet``; once it listens: its gRPC address
    and its pid."""
    gport = free_port()
    level = ("--log-level", "WARNING") if quiet else ()
    metrics = f"127.0.0.1:{metrics_port}" if metrics_port else ""
    proc = stack.enter_context(running(kvcoord_cmd(
        *level, "serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", metrics, "--model",
        model_spec(profile, tokenizer), *(("--lookup-workers", str(workers)) if workers else ()),
        *(("--index", index) if index else ())),
        env={"KVCOORD_HTTP_LISTEN": f"127.0.0.1:{http_port}" if http_port else ""}, log=log))
    wait_for_port(gport, timeout=60)
    if http_port:
        wait_for_port(http_port, timeout=60)
    return f"127.0.0.1:{gport}", proc.pid


def start_agent(stack: contextlib.ExitStack, log: Path, coordinator: str, node: str, engine: str,
                pub: int, *, replay: bool = False) -> None:
    """``kvcoord agent`` relaying the events of the engine at ``engine`` (PUB port ``pub``, with ``replay``
    its replay socket on ``pub + 1``) as ``node``."""
    replay_endpoint = ("--replay-endpoint", f"tcp://127.0.0.1:{pub + 1}") if replay else ()
    stack.enter_context(running(kvcoord_cmd(
        "agent", "--coordinator", coordinator, "--node-id", node, "--model", MODEL,
        "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", *replay_endpoint, "--serving-url", engine), log=log))


def route_cmd(port: int, *args: str) -> list[str]:
    """``kvcoord route`` on ``port`` for MODEL, logging warnings only."""
    return kvcoord_cmd("--log-level", "WARNING", "route", "--listen", f"127.0.0.1:{port}", "--model", MODEL,
                       *args)
