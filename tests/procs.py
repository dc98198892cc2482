"""Test helpers for real processes and ports: every process started here is killed, every port freed."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"
FIXTURES = SHARED / "fixtures"
TRACES = SHARED / "traces"


_LIVE: set[subprocess.Popen[bytes]] = set()
"""Every process a test started and has not reaped yet; killed at exit whatever happened."""


def spawn(cmd: Sequence[str], **kwargs: object) -> subprocess.Popen[bytes]:
    """``Popen`` in a new process group, remembered until :func:`stop` reaps it."""
    proc: subprocess.Popen[bytes] = subprocess.Popen(list(cmd), start_new_session=True, **kwargs)  # type: ignore[call-overload]
    _LIVE.add(proc)
    return proc


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_LIVE):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)


_HANDED_OUT: set[int] = set()
"""Ports this process was given: the kernel may give a released port again at once, and a test that asks
for several before its servers bind them got the same one twice (two servers, one port)."""


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1, and not given out before in this process."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def free_port_pair() -> int:
    """A port ``p`` with ``p + 1`` free too (an engine's ZMQ PUB and replay)."""
    while True:
        p = free_port()
        if p + 1 in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 1))
            except OSError:
                continue
        _HANDED_OUT.add(p + 1)
        return p


def wait_for_port(port: int, host: str = "127.0.0.1", timeout: float = 60.0) -> None:
    """Block until something accepts on ``host:port``; raise TimeoutError otherwise. The bound is generous:
    a process starting on a loaded machine (imports, a C extension) took over 15 s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.2):
            return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listening on {host}:{port} after {timeout}s")


def until(cond: Callable[[], Any], what: str, timeout: float = 30.0,
          diagnose: Callable[[], object] = lambda: "", interval: float = 0.05) -> Any:
    """Poll ``cond`` (from a thread or synchronous test) every ``interval`` seconds until it returns
    something truthy, and return that; AssertionError naming ``what`` (and ``diagnose()``) after
    ``timeout`` seconds. Conditions, never fixed sleeps."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{diagnose()}")
        time.sleep(interval)


async def until_async(cond: Callable[[], Awaitable[Any]], what: str, timeout: float = 60.0,
                      interval: float = 0.05) -> Any:
    """:func:`until` for an asyncio test: await ``cond()`` every ``interval`` seconds until it returns
    something truthy, and return that; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = await cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


def kvcoord_cmd(*args: str) -> list[str]:
    """The ``kvcoord`` command line, run with this interpreter (works without the console script)."""
    return [sys.executable, "-m", "kvcoord.cli", *args]


@contextlib.contextmanager
def running(cmd: Sequence[str], *, env: dict[str, str] | None = None, log: Path | None = None,
            cwd: Path = REPO) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``cmd`` in its own process group; on exit SIGTERM it (then SIGKILL) and reap it."""
    out = open(log, "wb") if log is not None else subprocess.DEVNULL  # noqa: SIM115
    proc = spawn(
        cmd,
        stdout=out,
        stderr=subprocess.STDOUT if log is not None else subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
        cwd=cwd,
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
    _LIVE.discard(proc)
    return proc.returncode


def make_certs(directory: Path) -> dict[str, Path]:
    """A test PKI written to ``directory`` with the ``cryptography`` package (no openssl CLI needed):
    a CA, a server cert for ``localhost``/``127.0.0.1`` and a client cert, each signed by the CA, valid
    two days. Returns paths keyed ``ca_crt``, ``ca_key``, ``server_crt``, ``server_key``, ``client_crt``,
    ``client_key`` (PEM; keys unencrypted)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.UTC)
    out: dict[str, Path] = {}

    def write(name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        out[f"{name}_key"] = directory / f"{name}.key"
        out[f"{name}_key"].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        out[f"{name}_crt"] = directory / f"{name}.crt"
        out[f"{name}_crt"].write_bytes(cert.public_bytes(serialization.Encoding.PEM))

    def builder(cn: str, issuer: x509.Name, key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
            .issuer_name(issuer)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=2))
        )

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvcoord-test-ca")])
    ca_cert = (
        builder("kvcoord-test-ca", ca_name, ca_key)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )
    write("ca", ca_key, ca_cert)
    san = x509.SubjectAlternativeName(
        [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    )
    purposes = (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH))
    for name, usage in purposes:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            builder(name, ca_name, key)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(san, critical=False)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        write(name, key, cert)
    return out
