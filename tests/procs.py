"""Test helpers for real processes and ports: every process started here is killed, every port freed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"
TRACES = SHARED / "traces"


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
    """Block until something accepts on ``host:port``; raise TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def kvcoord_cmd(*args: str) -> list[str]:
    """The ``kvcoord`` command line, run with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "kvcoord.cli", *args]


@contextlib.contextmanager
def running(cmd: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None) -> Iterator[
    subprocess.Popen[bytes]
]:
    """Run ``cmd`` in its own process group; on exit SIGTERM it (then SIGKILL) and reap it."""
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = subprocess.Popen(
        list(cmd),
        stdout=out,
        stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        start_new_session=True,
        cwd=REPO,
    )
    try:
        yield proc
    finally:
        stop(proc)
        if log is not None and not isinstance(out, int):
            out.close()


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> int:
    """SIGTERM the process group, wait, SIGKILL if needed; returns the exit status."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode
