"""gRPC channels to a coordinator: the bearer token and TLS material every client shares.

Agents (the reporter), routers (the client), the command line and the simulator all dial a
coordinator the same way, so the rules live here once: TLS is on when any TLS material is given,
PEM files are read when the channel is built (a bad path fails before any RPC), and a token travels
as ``authorization: Bearer <token>`` metadata on every call.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

__all__ = ["CAUSE_METADATA", "TOKENIZER_CAUSE", "ChannelSecurity", "open_aio_channel", "open_channel"]

CAUSE_METADATA = "kvcoord-cause"
"""Trailing metadata of a failed RPC naming its cause where the status code alone cannot: a lookup's
UNAVAILABLE says ``tokenizer`` when the model's tokenizer failed, not the coordinator, so a router does
not report a coordinator outage for it."""
TOKENIZER_CAUSE = "tokenizer"


@dataclass(frozen=True, slots=True)
class ChannelSecurity:
    """How to reach a coordinator: bearer token and TLS material (PEM file paths).

    TLS is on when ``tls`` is set or any of ``root_ca``/``client_cert`` is given; without ``root_ca``
    the system roots are used. ``client_cert``+``client_key`` enable mutual TLS.
    """

    token: str | None = None
    tls: bool = False
    root_ca: str | None = None
    client_cert: str | None = None
    client_key: str | None = None
    server_name: str | None = None
    """Override the name checked against the server certificate (``ssl_target_name_override``)."""

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.root_ca is not None or self.client_cert is not None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials:
        """``grpc.ChannelCredentials`` for TLS; reads the PEM files now so a bad path fails early."""
        if (self.client_cert is None) != (self.client_key is None):
            raise ValueError("client_cert and client_key must be given together")

        def read(path: str | None) -> bytes | None:
            if path is None:
                return None
            try:
                return Path(path).read_bytes()
            except OSError as exc:
                raise ValueError(f"cannot read {path}: {exc.strerror}") from None

        return grpc.ssl_channel_credentials(
            root_certificates=read(self.root_ca),
            private_key=read(self.client_key),
            certificate_chain=read(self.client_cert),
        )

    def channel_options(self, max_message_bytes: int) -> list[tuple[str, Any]]:
        opts: list[tuple[str, Any]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.enable_retries", 0),
        ]
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return opts


def open_aio_channel(
    address: str, security: ChannelSecurity, max_message_bytes: int = 64 << 20
) -> grpc.aio.Channel:
    """A ``grpc.aio.Channel`` to ``address`` with ``security`` (token metadata is added per call)."""
    opts = security.channel_options(max_message_bytes)
    if security.uses_tls:
        return grpc.aio.secure_channel(address, security.credentials(), options=opts)
    return grpc.aio.insecure_channel(address, options=opts)


def open_channel(address: str, security: ChannelSecurity, max_message_bytes: int = 64 << 20) -> grpc.Channel:
    """A blocking ``grpc.Channel``, same options as :func:`open_aio_channel`."""
    opts = security.channel_options(max_message_bytes)
    if security.uses_tls:
        return grpc.secure_channel(address, security.credentials(), options=opts)
    return grpc.insecure_channel(address, options=opts)


class ListenError(OSError):
    """A server address that cannot be listened on (in use, not local, not resolvable): one line."""


def split_hostport(value: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[v6]:PORT`` as ``(host, port)``; ``ValueError`` without a port in 0..65535."""
    host, sep, port = value.strip().rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535 or host in ("[", "[]"):
        raise ValueError(f"{value!r} is not HOST:PORT (a port is required, e.g. 127.0.0.1:50051)")
    return host.strip("[]"), int(port)


def check_bindable(address: str) -> None:
    """Raise :class:`ListenError` unless ``address`` (``HOST:PORT``) can be listened on now.

    gRPC's C core reports a failed bind with a multi-line log of its own before Python sees the error;
    trying the address first turns the common mistakes (port in use, a host that is not this machine's)
    into one line. Port 0 (any free port) always passes."""
    import errno
    import socket

    host, port = split_hostport(address)
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ListenError(f"cannot listen on {address}: {exc.strerror}") from None
    for family, kind, proto, _, sockaddr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(sockaddr)
            except OSError as exc:
                if exc.errno == errno.EAFNOSUPPORT:
                    continue
                raise ListenError(f"cannot listen on {address}: {exc.strerror or exc}") from None
