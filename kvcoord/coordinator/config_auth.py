"""The coordinator's bearer tokens: ``[auth]`` of the config file and the ``--*-token`` flags, read into
an :class:`AuthConfig` (a token given inline, from an environment variable or from a file; never twice)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

from kvcoord.coordinator.config_values import ConfigError, as_str, as_table, check_keys


@dataclass(frozen=True, slots=True)
class AuthConfig:
    """Bearer tokens by role. Empty everywhere means auth is off."""

    agent_tokens: Mapping[str, frozenset[str]] = field(default_factory=dict)
    router_tokens: frozenset[str] = frozenset()
    admin_tokens: frozenset[str] = frozenset()

    @property
    def enabled(self) -> bool:
        return bool(self.agent_tokens or self.router_tokens or self.admin_tokens)


def _read_token(where: str, item: Mapping[str, Any], base: Path, env: Mapping[str, str]) -> str:
    sources = [k for k in ("token", "token_env", "token_file") if k in item]
    if len(sources) != 1:
        raise ConfigError(f"{where}: give exactly one of token, token_env, token_file")
    if "token" in item:
        token = as_str(f"{where}.token", item["token"])
    elif "token_env" in item:
        var = as_str(f"{where}.token_env", item["token_env"])
        if var not in env:
            raise ConfigError(f"{where}.token_env: environment variable {var} is not set")
        token = env[var]
    else:
        path = base / as_str(f"{where}.token_file", item["token_file"])
        try:
            token = path.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"{where}.token_file: {exc}") from None
    if not token:
        raise ConfigError(f"{where}: empty token")
    return token


def parse_auth(where: str, table: Mapping[str, Any], base: Path, env: Mapping[str, str]) -> AuthConfig:
    check_keys(where, table, {"agent_tokens", "router_tokens", "admin_tokens"})
    agents: dict[str, frozenset[str]] = {}
    routers: set[str] = set()
    admins: set[str] = set()
    for role in ("agent_tokens", "router_tokens", "admin_tokens"):
        items = table.get(role, [])
        if not isinstance(items, list):
            raise ConfigError(f"{where}.{role}: expected an array of tables ([[{where}.{role}]])")
        for i, raw in enumerate(items):
            w = f"{where}.{role}[{i}]"
            item = as_table(w, raw)
            allowed = {"token", "token_env", "token_file", "name"} | (
                {"nodes"} if role == "agent_tokens" else set()
            )
            check_keys(w, item, allowed)
            token = _read_token(w, item, base, env)
            if token in agents or token in routers or token in admins:
                raise ConfigError(f"{w}: the same token is configured twice")
            if role == "agent_tokens":
                nodes = item.get("nodes")
                if (
                    not isinstance(nodes, list)
                    or not nodes
                    or not all(isinstance(n, str) and n for n in nodes)
                ):
                    raise ConfigError(f'{w}.nodes: expected a non-empty list of node ids (or ["*"])')
                agents[token] = frozenset(nodes)
            elif role == "router_tokens":
                routers.add(token)
            else:
                admins.add(token)
    return AuthConfig(agents, frozenset(routers), frozenset(admins))


def merge_flag_tokens(auth: AuthConfig, key: str, raw: object) -> AuthConfig:
    items = [raw] if isinstance(raw, str) else list(cast(list[str], raw))
    if key == "agent_tokens":
        agents = dict(auth.agent_tokens)
        for item in items:
            token, eq, nodes = item.partition("=")
            if not eq or not token or not nodes:
                raise ConfigError(f"--agent-token {item!r}: expected TOKEN=NODE[,NODE...]")
            agents[token] = frozenset(n.strip() for n in nodes.split(",") if n.strip())
        return dataclasses.replace(auth, agent_tokens=agents)
    if key == "router_tokens":
        return dataclasses.replace(auth, router_tokens=auth.router_tokens | frozenset(items))
    return dataclasses.replace(auth, admin_tokens=auth.admin_tokens | frozenset(items))
