"""The value checks of the coordinator's configuration: one per type, each naming the source and key in
its ``ConfigError``, whether the value came from the file, the environment or a flag."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, cast

from kvcoord.transport import split_hostport


class ConfigError(ValueError):
    """The configuration is invalid; the message names the source and the key."""


def check_keys(where: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(map(repr, unknown))} (allowed: {', '.join(sorted(allowed))})"
        )


def as_table(where: str, value: object) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: expected a table")
    return cast(dict[str, Any], value)


def as_int(where: str, value: object, *, minimum: int = 1) -> int:
    if isinstance(value, str):
        try:
            value = int(value.strip())
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not an integer") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{where}: must be >= {minimum}, got {value}")
    return value


def as_float(where: str, value: object, *, positive: bool = True) -> float:
    if isinstance(value, str):
        try:
            value = float(value.strip())
        except ValueError:
            raise ConfigError(f"{where}: {value!r} is not a number") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if not math.isfinite(value):  # an inf tier weight makes 0 * inf = nan scores: no order at all
        raise ConfigError(f"{where}: must be a finite number, got {value}")
    if positive and not value > 0:
        raise ConfigError(f"{where}: must be > 0, got {value}")
    if not positive and value < 0:
        raise ConfigError(f"{where}: must be >= 0, got {value}")
    return float(value)


def as_bool(where: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in (
        "1",
        "true",
        "yes",
        "on",
        "0",
        "false",
        "no",
        "off",
    ):
        return value.strip().lower() in ("1", "true", "yes", "on")
    raise ConfigError(f"{where}: expected true or false, got {value!r}")


def as_str(where: str, value: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    return value


def check_hostport(where: str, value: str, *, allow_empty: bool = False) -> str:
    """Validate ``HOST:PORT`` (``[v6]:PORT`` too); port 0 means any free port."""
    if allow_empty and value == "":
        return value
    try:
        host, _ = split_hostport(value)
    except ValueError:
        host = ""
    if not host:
        raise ConfigError(f"{where}: expected HOST:PORT, got {value!r}")
    return value


def learn_seed(where: str, hints: Mapping[str, Any], default_seed: str | None) -> str | None:
    """The seed a model configured without ``algo`` (its profile learned from the events) may be tried with:
    its ``seed``, else ``default_seed``; any other profile key needs ``algo``."""
    others = sorted(set(hints) - {"seed"})
    if others:
        raise ConfigError(f"{where}: {others[0]!r} needs 'algo' and 'block_size' (or give neither, and the "
                          "profile is learned from the events)")
    seed = hints.get("seed", default_seed)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, str | int)):
        raise ConfigError(f"{where}.seed: expected a string, got {seed!r}")
    return None if seed is None else str(seed)
