"""TLS server credentials from PEM files; a client CA turns on mutual TLS."""

from __future__ import annotations

from pathlib import Path

import grpc

from kvcoord.coordinator.config import ConfigError, TlsConfig


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
