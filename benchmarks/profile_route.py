"""Where ``kvcoord route``'s CPU goes per request: the lookup, HTTP proxying, SSE pass-through, metrics.

Setup (real processes on this machine): one ``kvcoord sim-engine --http-listen`` (no token delay), a
``kvcoord serve`` that tokenizes through the engine's ``/tokenize``, an agent, and ``kvcoord route``
(prefix-aware, reserving, the defaults) in front. The client sends ``--requests`` chat requests per
mode, one at a time: non-streaming (``max_tokens`` 1), then streaming (``max_tokens`` 16: 16 SSE chunks
plus usage pass through route).

Two runs of the same traffic: one plain, where route's CPU per request comes from ``/proc/PID/stat``
(user + system, ticks); one under cProfile, whose self time is summed by where the code lives (route's
own modules, grpc, aiohttp, prometheus_client, json, asyncio, ...) and whose cumulative time is read
for route's entry points. cProfile's own overhead inflates every figure about evenly, so read its shares,
not its milliseconds.

    .venv/bin/python benchmarks/profile_route.py [--requests 1000] [--configs grpc,http,...]
        [--profile http|grpc|...|none] [--top 25] [--keep PROFILE]
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pstats
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_route import SYSTEM, engine_stack
from benchmarks.common import MODEL, bench_parser, cpu_seconds, route_cmd
from tests.procs import free_port, running, wait_for_port

# (label, substring of a file path); the first that matches names a function's group.
_GROUPS = (
    ("route: lookup client (kvcoord)", "kvcoord/router/client"),
    ("route: lookup client (kvcoord)", "kvcoord/router/http_"),
    ("route: placement and policy", "kvcoord/router/"),
    ("route: gateway (proxy, SSE, metrics glue)", "kvcoord/gateway/"),
    ("kvcoord other", "kvcoord/"),
    ("grpc (lookup RPC)", "grpc"),
    ("protobuf", "google/protobuf"),
    ("aiohttp client+server", "aiohttp"),
    ("multidict/yarl", "multidict"),
    ("multidict/yarl", "yarl"),
    ("prometheus_client (metrics)", "prometheus_client"),
    ("json", "json/"),
    ("asyncio event loop", "asyncio/"),
    ("socket/ssl/selectors", "selectors"),
)
_CONFIGS = {
    "grpc": ("prefix-aware (lookup + reservation), default", ()),
    "grpc-no-reserve": ("prefix-aware, --no-reserve", ("--no-reserve",)),
    "http": ("prefix-aware, lookups over HTTP (--coordinator-http)", ("--coordinator-http", "COORD_HTTP")),
    "http-no-reserve": ("prefix-aware, over HTTP, --no-reserve", ("--coordinator-http", "COORD_HTTP",
                                                                  "--no-reserve")),
    "round-robin": ("round-robin, --backend (no lookup)", ("--policy", "round-robin", "--backend",
                                                           "node=ENGINE")),
}
_MODES = (("non-streaming", False, False), ("streaming, 16 chunks", True, False),
          ("non-streaming, 8k-token prompt", False, True))
_STARTUP = ("compile", "marshal", "importlib", "exec", "__build_class__", "set_default_verify_paths",
            "posix.stat", "_find_and_load", "get_data", "open_code", "posix.listdir")
_ENTRY = ("plan", "_forward", "_relay_whole", "_relay_stream", "_proxy", "feed", "lookup", "_attempts",
          "observe", "inc", "choose", "post", "send")


def _group(filename: str, func: str) -> str:
    if filename.endswith("asyncio/runners.py") and func == "run":
        return "uvloop run (C: I/O and idle waiting, wall time)"
    if "importlib" in filename or any(part in func for part in _STARTUP):
        return "startup (imports, TLS roots)"
    if filename == "~":  # builtins: name them by what they are
        if "socket" in func or "recv" in func or "send" in func or "select" in func or "epoll" in func:
            return "syscalls (socket, epoll)"
        if "json" in func or "loads" in func or "dumps" in func:
            return "json"
        return "builtins (other)"
    for label, part in _GROUPS:
        if part in filename:
            return label
    return "other python"


def _cpu(pid: int) -> float:
    return sum(cpu_seconds(pid))


async def _traffic(route: str, n: int, *, stream: bool, long: bool = False) -> None:
    system = SYSTEM * 60 if long else SYSTEM  # long: ~8k tokens, a Mooncake-sized prompt
    async with aiohttp.ClientSession() as s:
        for i in range(n):
            body: dict[str, Any] = {"model": MODEL, "max_tokens": 16 if stream else 1, "stream": stream,
                                    "messages": [{"role": "system", "content": system},
                                                 {"role": "user", "content": f"question {i}"}]}
            async with s.post(f"{route}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
                await resp.read()


@contextlib.contextmanager
def _fleet(tmp: Path, profile: Path | None, policy: tuple[str, ...]) -> Iterator[tuple[str, int]]:
    """(route URL, route's pid), with route under cProfile when ``profile`` is given."""
    rport, hport = free_port(), free_port()
    with engine_stack(tmp, coordinator=True, http_port=hport) as (engine, coordinator), \
            contextlib.ExitStack() as stack:
        policy = tuple(a.replace("ENGINE", engine).replace("COORD_HTTP", f"http://127.0.0.1:{hport}")
                       for a in policy)
        wait_for_port(hport, timeout=30)
        cmd = route_cmd(rport, "--coordinator", coordinator, "--deadline-ms", "1000", *policy)
        if profile is not None:
            cmd = [cmd[0], "-m", "cProfile", "-o", str(profile), *cmd[1:]]
        proc = stack.enter_context(running(cmd, log=tmp / "route.log"))
        wait_for_port(rport, timeout=30)
        yield f"http://127.0.0.1:{rport}", proc.pid


def _run(tmp: Path, n: int, profile: Path | None, policy: tuple[str, ...] = ()) -> dict[str, float]:
    """CPU seconds of route per mode (warm-up excluded)."""
    out = {}
    with _fleet(tmp, profile, policy) as (route, pid):
        asyncio.run(_traffic(route, max(20, n // 10), stream=False))  # warm-up: connections, caches
        for mode, stream, long in _MODES:
            c0 = _cpu(pid)
            asyncio.run(_traffic(route, n, stream=stream, long=long))
            out[mode] = _cpu(pid) - c0
    return out


def _breakdown(path: Path, top: int) -> None:
    stats = pstats.Stats(str(path))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(v[2] for v in raw.values())
    groups: dict[str, float] = defaultdict(float)
    for (filename, _line, func), (_cc, _nc, tt, _ct, _callers) in raw.items():
        groups[_group(filename, func)] += tt
    work = sum(tt for label, tt in groups.items() if label.startswith(("uvloop", "startup")) is False)
    print(f"\nself time by group (cProfile, {total:.2f} s in all; shares of the {work:.2f} s of "
          "per-request work, i.e. without uvloop's run and startup):")
    for label, tt in sorted(groups.items(), key=lambda kv: -kv[1]):
        share = "" if label.startswith(("uvloop", "startup")) else f"{100 * tt / work:5.1f}%"
        print(f"  {label:<48} {tt:7.2f} s  {share}")
    print("\nroute's entry points, cumulative (running time only: an awaiting coroutine is not counted):")
    rows = [(ct, f"{Path(fn).parent.name}/{Path(fn).name}:{line} {func}")
            for (fn, line, func), (_cc, _nc, _tt, ct, _c) in raw.items()
            if func in _ENTRY and ("kvcoord/gateway" in fn or "kvcoord/router/client" in fn
                                   or "kvcoord/router/http_" in fn)]
    for ct, name in sorted(rows, reverse=True)[:12]:
        print(f"  {name:<60} {ct:7.2f} s  {100 * ct / work:5.1f}%")
    print(f"\ntop {top} functions by self time:")
    stats.sort_stats("tottime").print_stats(top)


def main() -> None:
    ap = bench_parser(__doc__, requests=1000, requests_help="requests per mode")
    ap.add_argument("--top", type=int, default=25, help="functions listed by self time")
    ap.add_argument("--keep", default=None, help="copy the cProfile output here (for snakeviz etc.)")
    ap.add_argument("--configs", default=",".join(_CONFIGS),
                    help=f"route configurations measured, comma separated (default: {','.join(_CONFIGS)})")
    ap.add_argument("--profile", default="http", choices=[*_CONFIGS, "none"],
                    help="the configuration run again under cProfile (default http; none: skip)")
    args = ap.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if unknown := [c for c in configs if c not in _CONFIGS]:
        ap.error(f"--configs: unknown {', '.join(unknown)} (known: {', '.join(_CONFIGS)})")
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        print(f"kvcoord route's CPU (user + system) per request, {args.requests} requests per mode "
              f"(load average {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        for label, policy in (_CONFIGS[c] for c in configs):
            plain = _run(tmp, args.requests, None, policy)
            figures = " | ".join(f"{cpu / args.requests * 1e3:6.3f}" for cpu in plain.values())
            print(f"  {label:<44} {figures} ms  ({' | '.join(plain)})")
        print(f"  (load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())})")
        if args.profile == "none":
            return
        prof = tmp / "route.prof"
        print(f"under cProfile: {_CONFIGS[args.profile][0]}")
        profiled = _run(tmp, args.requests, prof, _CONFIGS[args.profile][1])
        for mode, cpu in profiled.items():
            print(f"  {mode:<22} under cProfile {cpu / args.requests * 1e3:6.3f} ms per request")
        for _ in range(50):  # route writes its profile as it exits
            if prof.exists():
                break
            time.sleep(0.1)
        if args.keep:
            shutil.copy(prof, args.keep)
        _breakdown(prof, args.top)


if __name__ == "__main__":
    main()
