"""Blocking HTTP for tests: one request on a fresh connection, its answer whatever the status. An error
status is an answer a test checks, not an exception; only a failure to connect (OSError) raises. Also the
one reader of a Prometheus ``/metrics`` page (:func:`metrics`, :func:`parse_samples`, :func:`sample`)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from email.message import Message
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

Labels = tuple[tuple[str, str], ...]
"""A sample's labels, sorted by name: one stable form whatever order the exposition wrote them in."""
Samples = dict[tuple[str, Labels], float]
"""Every sample of a ``/metrics`` page: ``(sample name, sorted labels)`` → value."""


@dataclass(frozen=True)
class Reply:
    """One HTTP answer: its status, headers (case-insensitive ``get``) and body bytes."""

    status: int
    headers: Message
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode()

    def json(self) -> Any:
        """The body as JSON; None when empty."""
        return json.loads(self.body) if self.body else None


def http_request(method: str, url: str, body: Any = None, *, data: bytes | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float = 30.0) -> Reply:
    """``method url`` with ``body`` sent as JSON (``content-type: application/json``), or ``data`` as
    it is, or nothing when both are None."""
    if body is not None:
        data = json.dumps(body).encode()
        headers = {"content-type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, data=data, method=method, headers=dict(headers or {}))
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(int(resp.status), resp.headers, resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return Reply(exc.code, exc.headers, exc.read())


def http_json(method: str, url: str, body: Any = None, *, headers: Mapping[str, str] | None = None,
              timeout: float = 30.0) -> tuple[int, Any]:
    """``(status, JSON answer or None when empty)`` of ``method url`` with ``body`` sent as JSON."""
    reply = http_request(method, url, body, headers=headers, timeout=timeout)
    return reply.status, reply.json()


def get_text(url: str, timeout: float = 30.0) -> str:
    """The body of ``GET url`` (a ``/metrics`` page), which must answer 200."""
    reply = http_request("GET", url, timeout=timeout)
    assert reply.status == 200, f"GET {url}: HTTP {reply.status}: {reply.text[:500]}"
    return reply.text


def parse_samples(text: str) -> Samples:
    """The samples of a Prometheus text exposition (prometheus_client's parser, so escaping, ``+Inf`` and
    ``_total``/``_bucket`` names read as a scraper reads them)."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def metrics(url: str, timeout: float = 30.0) -> Samples:
    """The samples of the ``/metrics`` page at ``url`` (which must answer 200)."""
    return parse_samples(get_text(url, timeout))


def sample(page: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples carrying ``labels`` (others may carry more labels); 0.0 when none
    does, as Prometheus's ``sum()`` of an absent series reads in a test."""
    return sum(v for (n, ls), v in page.items() if n == name and labels.items() <= dict(ls).items())


def flat(page: Samples, *prefixes: str) -> dict[str, float]:
    """The samples keyed as exposition lines write them, labels sorted: ``name{a="x",b="y"}``, or ``name``
    without labels; only the keys starting with one of ``prefixes`` (all when none)."""
    keys = ((_line_key(n, ls), v) for (n, ls), v in page.items())
    return {k: v for k, v in keys if not prefixes or k.startswith(prefixes)}


def _line_key(name: str, labels: Labels) -> str:
    if not labels:
        return name
    def escape(v: str) -> str:
        return v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return name + "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels) + "}"


def by_label(page: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s samples by the value of ``label`` (summed over its other labels)."""
    out: dict[str, float] = {}
    for (n, ls), v in page.items():
        value = dict(ls).get(label)
        if n == name and value is not None:
            out[value] = out.get(value, 0.0) + v
    return out
