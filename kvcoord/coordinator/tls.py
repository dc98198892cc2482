"""TLS server credentials from PEM files; a client CA turns on mutual TLS."""

from __future__ import annotations

import ssl
from pathlib import Path

import grpc

from kvcoord.coordinator.config import TlsConfig
from kvcoord.coordinator.config_values import ConfigError


def _read(what: str, path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"tls.{what}: cannot read {path}: {exc.strerror or exc}") from None


def server_credentials(cfg: TlsConfig) -> grpc.ServerCredentials:
    """Credentials for ``add_secure_port``. Raises ConfigError when a file is missing."""
    if cfg.cert is None or cfg.key is None:
        raise ConfigError("tls: cert and key are required")
    pair = (_read("key", cfg.key), _read("cert", cfg.cert))
    client_ca = _read("client_ca", cfg.client_ca) if cfg.client_ca else None
    return grpc.ssl_server_credentials(
        [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
    )


def server_ssl_context(cfg: TlsConfig) -> ssl.SSLContext:
    """The same certificate (and client CA) for the HTTP API. Raises ConfigError when a file is bad."""
    if cfg.cert is None or cfg.key is None:
        raise ConfigError("tls: cert and key are required")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cfg.cert, cfg.key)
        if cfg.client_ca:
            ctx.load_verify_locations(cfg.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"tls: cannot load the certificate: {exc}") from None
    return ctx
