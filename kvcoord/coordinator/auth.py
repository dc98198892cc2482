"""Bearer-token auth: agent tokens bound to node ids, router tokens that may only query, admin tokens.

What each role may call (docs/operations.md, "TLS and tokens"; ``tests/coordinator/test_roles.py`` checks
every
cell): every token may query (Lookup, ListNodes, Stats, Ping, and the HTTP lookups, ``/workers``,
``/dump``); an agent token may also publish (Ingest, Heartbeat) for the nodes it is bound to; only an
admin token may DrainNode and RemoveNode, and register engines over HTTP (or an agent token bound to ``"*"``).

Tokens arrive in the ``authorization: Bearer <token>`` metadata. They are stored as SHA-256
digests, so lookups do not leak timing about the token text. Health and reflection are not
authenticated (probes must work without secrets).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import grpc

from kvcoord.coordinator.config_auth import AuthConfig

AGENT = "agent"
ROUTER = "router"
ADMIN = "admin"
OPEN = "open"


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling, and what they may do."""

    role: str
    nodes: frozenset[str] = frozenset()

    def may_publish(self, node_id: str) -> bool:
        """Ingest / Heartbeat for ``node_id``."""
        if self.role in (OPEN, ADMIN):
            return True
        return self.role == AGENT and ("*" in self.nodes or node_id in self.nodes)

    def may_manage(self) -> bool:
        """DrainNode / RemoveNode: admins only. An agent may not take its own node out of lookups:
        operators decide that, and a leaked agent token must not be able to hide a healthy node."""
        return self.role in (OPEN, ADMIN)


OPEN_PRINCIPAL = Principal(OPEN)


class AuthError(Exception):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _digest(token: str) -> bytes:
    return hashlib.sha256(token.encode()).digest()


class Authenticator:
    """Maps a call's metadata to a :class:`Principal`."""

    def __init__(self, cfg: AuthConfig) -> None:
        self.enabled = cfg.enabled
        self._by_digest: dict[bytes, Principal] = {}
        for token, nodes in cfg.agent_tokens.items():
            self._by_digest[_digest(token)] = Principal(AGENT, frozenset(nodes))
        for token in cfg.router_tokens:
            self._by_digest[_digest(token)] = Principal(ROUTER)
        for token in cfg.admin_tokens:
            self._by_digest[_digest(token)] = Principal(ADMIN)

    def principal(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """Raises :class:`AuthError` (UNAUTHENTICATED) for a missing, malformed or unknown token."""
        if not self.enabled:
            return OPEN_PRINCIPAL
        header: str | None = None
        for key, value in metadata or ():
            if key.lower() == "authorization":
                header = value.decode() if isinstance(value, bytes) else value
                break
        if header is None:
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED, "missing 'authorization: Bearer <token>' metadata"
            )
        scheme, _, token = header.strip().partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED, "authorization metadata must be 'Bearer <token>'"
            )
        found = self._by_digest.get(_digest(token.strip()))
        if found is None:
            raise AuthError(grpc.StatusCode.UNAUTHENTICATED, "unknown token")
        return found
