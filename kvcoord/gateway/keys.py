"""API keys and per-key rate limits for ``kvcoord route`` (``--api-keys FILE``; off without it).

Clients present the key as OpenAI's do (``Authorization: Bearer <key>``) or Anthropic's do
(``x-api-key: <key>``). The file names each key and its limits, in the terms LiteLLM's keys
(``rpm_limit``/``tpm_limit``) and Envoy AI Gateway's token-cost limits use, as token buckets::

    {"keys": [{"name": "team-a", "key": "sk-...", "requests_per_second": 5, "burst": 10,
               "tokens_per_minute": 200000}]}

``requests_per_second`` (bucket size ``burst``, default the rate rounded up) admits a request when a whole
request is left; ``tokens_per_minute`` (bucket size one minute of tokens) admits while the bucket is not
in debt and is charged after the answer with its usage (prompt plus output tokens; the prompt estimate
when no usage came), as Envoy AI Gateway and LiteLLM charge tokens known only after the response. Either
limit omitted: unlimited. A missing or unknown key gets 401, a request over a limit 429 with
``Retry-After`` (whole seconds until the bucket admits again), each in the endpoint's error shape.
Secrets are never logged nor labelled: metrics and logs carry the key's ``name``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter

__all__ = ["ApiKey", "Bucket", "KeyFileError", "Keys", "Refused", "load_keys"]

_FIELDS = frozenset({"name", "key", "requests_per_second", "burst", "tokens_per_minute"})


class KeyFileError(ValueError):
    """A key file that cannot be used (one line, for the CLI)."""


class Bucket:
    """A token bucket: ``rate`` per second up to ``capacity``; its level may go negative (debt)."""

    __slots__ = ("capacity", "level", "rate", "stamp")

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity, self.level, self.stamp = rate, capacity, capacity, now

    def _fill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, need: float, now: float) -> float:
        """Seconds until the level reaches ``need`` (0: it has)."""
        self._fill(now)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self._fill(now)
        self.level -= amount


@dataclass(slots=True)
class ApiKey:
    """One configured key's name and limits (the secret itself is kept only as its digest)."""

    name: str
    requests: Bucket | None = None
    tokens: Bucket | None = None
    used_tokens: int = field(default=0)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def _limit(entry: Mapping[str, Any], name: str, where: str) -> float | None:
    value = entry.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0 or math.isinf(value):
        raise KeyFileError(f"{where}: {name} must be a positive number, got {value!r}")
    return float(value)


def load_keys(path: str, now: float | None = None) -> dict[bytes, ApiKey]:
    """The key file's entries by secret digest; :class:`KeyFileError` (one line) when it is unusable."""
    now = time.monotonic() if now is None else now
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise KeyFileError(f"--api-keys {path}: {exc.strerror or exc}") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise KeyFileError(f"--api-keys {path}: not JSON ({exc})") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise KeyFileError(f"--api-keys {path}: expected "
                           '{"keys": [{"name": ..., "key": ...}, ...]}')
    out: dict[bytes, ApiKey] = {}
    names: set[str] = set()
    for i, entry in enumerate(entries):
        where = f"--api-keys {path}: keys[{i}]"
        if not isinstance(entry, dict):
            raise KeyFileError(f"{where} must be an object")
        unknown = sorted(set(entry) - _FIELDS)
        if unknown:
            raise KeyFileError(f"{where}: unknown field {unknown[0]!r}")
        name, secret = entry.get("name"), entry.get("key")
        if not isinstance(name, str) or not name or not name.isprintable() or len(name) > 64:
            raise KeyFileError(f"{where}: name must be a printable string of 1-64 characters")
        if not isinstance(secret, str) or len(secret) < 8 or not secret.isascii() or not secret.isprintable():
            raise KeyFileError(f"{where} ({name}): key must be printable ASCII, at least 8 characters")
        if name in names or _digest(secret) in out:
            raise KeyFileError(f"{where}: name or key {name!r} given twice")
        rps, tpm = _limit(entry, "requests_per_second", where), _limit(entry, "tokens_per_minute", where)
        burst = _limit(entry, "burst", where)
        if burst is not None and rps is None:
            raise KeyFileError(f"{where}: burst without requests_per_second")
        names.add(name)
        out[_digest(secret)] = ApiKey(
            name, Bucket(rps, max(1.0, burst or math.ceil(rps)), now) if rps else None,
            Bucket(tpm / 60.0, tpm, now) if tpm else None)
    return out


class Refused(Exception):
    """A request refused before placement: its status, message and headers."""

    def __init__(self, status: int, message: str, kind: str, headers: Mapping[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.headers = status, message, kind, dict(headers or {})


class Keys:
    """The configured keys (none: every request is admitted, as without ``--api-keys``)."""

    def __init__(self, keys: Mapping[bytes, ApiKey], registry: CollectorRegistry,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = dict(keys)
        self.clock = clock
        self.requests = Counter("kvcoord_route_key_requests", "Requests per API key name, by outcome "
                                "(admitted, rate_limited).", ["key", "outcome"], registry=registry)
        self.tokens = Counter("kvcoord_route_key_tokens", "Tokens charged per API key name.", ["key"],
                              registry=registry)
        self.refused = Counter("kvcoord_route_auth_failures", "Requests refused 401, by reason (missing, "
                               "unknown key).", ["reason"], registry=registry)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def admit(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The request's key, charged one request; raises :class:`Refused` (401, 429). None when off."""
        if not self.keys:
            return None
        auth = headers.get("Authorization", "")
        scheme, _, value = auth.strip().partition(" ")
        secret = value.strip() if scheme.lower() == "bearer" else ""
        secret = secret or headers.get("x-api-key", "").strip()
        if not secret:
            self.refused.labels("missing").inc()
            raise Refused(401, "no API key: send Authorization: Bearer <key> or x-api-key: <key>",
                          "AuthenticationError")
        key = self.keys.get(_digest(secret))
        if key is None:
            self.refused.labels("unknown").inc()
            raise Refused(401, "invalid API key", "AuthenticationError")
        now = self.clock()
        waits = [b.wait(need, now) for b, need in ((key.requests, 1.0), (key.tokens, 1e-9)) if b is not None]
        wait = max(waits, default=0.0)
        if wait > 0:
            self.requests.labels(key.name, "rate_limited").inc()
            raise Refused(429, f"rate limit of API key {key.name!r} reached; retry in {wait:.1f} s",
                          "RateLimitError", {"Retry-After": str(max(1, math.ceil(wait)))})
        if key.requests is not None:
            key.requests.take(1.0, now)
        self.requests.labels(key.name, "admitted").inc()
        return key

    def charge(self, key: ApiKey | None, usage: Mapping[str, Any] | None, estimate: int) -> None:
        """Charge the answered request's tokens: its usage's total, else ``estimate`` (the prompt's)."""
        if key is None:
            return
        used = _total(usage) if usage is not None else None
        n = estimate if used is None else used
        key.used_tokens += n
        self.tokens.labels(key.name).inc(n)
        if key.tokens is not None:
            key.tokens.take(float(n), self.clock())


def _total(usage: Mapping[str, Any]) -> int | None:
    """Prompt plus output tokens in any API's usage (chat's, Responses', Anthropic's)."""
    total = usage.get("total_tokens")
    if isinstance(total, int) and not isinstance(total, bool):
        return total
    parts = [usage.get(k) for k in ("prompt_tokens", "completion_tokens", "input_tokens", "output_tokens",
                                    "cache_read_input_tokens", "cache_creation_input_tokens")]
    ints = [p for p in parts if isinstance(p, int) and not isinstance(p, bool)]
    return sum(ints) if ints else None
