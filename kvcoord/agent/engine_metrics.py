"""The engine's own load, scraped from its Prometheus ``/metrics`` (``kvcoord agent --engine-metrics-url``).

Routers weigh cache hits against load, and only the engine knows its load: vLLM exports it as
``vllm:num_requests_running``, ``vllm:num_requests_waiting`` and ``vllm:kv_cache_usage_perc`` (0..1;
``vllm:gpu_cache_usage_perc`` before vLLM 0.10). The scraper polls the page on the agent's event loop
(an aiohttp request with a short timeout: the relays never wait for it) and hands the last good
:class:`~kvcoord.load.NodeLoad` to the reporter's ``load`` provider, so every heartbeat carries it.

Samples are kept when their ``model_name`` label is the agent's model (or when no sample names that
model: a one-model engine served under another name still counts). Requests are summed across the
remaining labels (``engine``: one per DP rank); KV usage is their mean, a fraction of the node's blocks.
A failed scrape is counted and logged once per outage; the last good value stays in use for
``stale_after`` seconds, then the load is reported as unknown (zeros) until a scrape succeeds again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any

from kvcoord.load import NodeLoad
from kvcoord.waits import wait_event

if TYPE_CHECKING:
    import aiohttp

log = logging.getLogger(__name__)

__all__ = ["EngineMetrics", "parse_engine_load"]

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_LOAD_PREFIXES = (RUNNING, WAITING, *KV_USAGE)
_LOAD_NAMES = frozenset(_LOAD_PREFIXES)


def parse_engine_load(text: str, model: str) -> NodeLoad:
    """The node's load from a Prometheus text page; ``ValueError`` when it holds no vLLM load gauge."""
    from prometheus_client.parser import text_string_to_metric_families

    # Only the load gauges' sample lines reach the parser, whose cost is per line: a vLLM page holds
    # hundreds more (histograms), and even the sim-engine's 21 lines took ~1 ms a scrape (~0.5 ms so).
    text = "\n".join(line for line in text.splitlines() if line.startswith(_LOAD_PREFIXES))
    samples: list[tuple[str, dict[str, str], float]] = []
    try:
        for family in text_string_to_metric_families(text):
            samples.extend((s.name, s.labels, s.value) for s in family.samples if s.name in _LOAD_NAMES)
    except Exception as exc:  # the parser raises ValueError mostly, but not only
        raise ValueError(f"not Prometheus text: {exc}") from None
    if not any(name == RUNNING for name, _, _ in samples):
        raise ValueError(f"no {RUNNING} on the page (is this a vLLM /metrics?)")
    if any(labels.get("model_name") == model for _, labels, _ in samples):
        samples = [s for s in samples if s[1].get("model_name", model) == model]
    running = sum(v for name, _, v in samples if name == RUNNING)
    waiting = sum(v for name, _, v in samples if name == WAITING)
    usage_name = next((n for n in KV_USAGE if any(name == n for name, _, _ in samples)), None)
    usages = [v for name, _, v in samples if name == usage_name]
    usage = sum(usages) / len(usages) if usages else 0.0
    return NodeLoad(running_requests=max(0, int(running)), waiting_requests=max(0, int(waiting)),
                    kv_usage=min(1.0, max(0.0, usage)) if usage == usage else 0.0)


class EngineMetrics:
    """Polls one engine's ``/metrics``; :meth:`load` is the reporter's load provider."""

    def __init__(self, url: str, model: str, *, interval: float = 1.0, timeout: float = 0.5,
                 stale_after: float = 5.0) -> None:
        self.url = url
        self.model = model
        self.interval = interval
        self.timeout = timeout
        self.stale_after = stale_after
        self.scrapes = 0
        self.failures = 0
        self.last_error = ""
        self._last: NodeLoad | None = None
        self._last_ok_at: float | None = None
        self._ok = False

    def load(self) -> NodeLoad:
        """The last good load while fresh, else zeros (unknown)."""
        age = self.age_seconds()
        if self._last is None or age is None or age > self.stale_after:
            return NodeLoad()
        return self._last

    def age_seconds(self) -> float | None:
        return None if self._last_ok_at is None else time.monotonic() - self._last_ok_at

    def status(self) -> dict[str, Any]:
        """What the agent's stats file shows under ``engine_metrics``."""
        age = self.age_seconds()
        last = self.load()
        return {"url": self.url, "ok": self._ok, "last_error": self.last_error,
                "age_seconds": round(age, 3) if age is not None else None, "scrapes": self.scrapes,
                "failures": self.failures,
                "stale": self._last is None or age is None or age > self.stale_after, "load": last.to_json()}

    def _failed(self, error: str) -> None:
        self.failures += 1
        self.last_error = error
        if self._ok or self.failures == 1:
            log.warning("engine metrics %s: scrape failing (counted; logged once per outage): %s",
                        self.url, error)
        self._ok = False

    async def scrape_once(self, session: aiohttp.ClientSession) -> None:
        """One scrape; never raises (a failure is counted)."""
        import aiohttp

        self.scrapes += 1
        try:
            async with session.get(self.url, timeout=aiohttp.ClientTimeout(total=self.timeout)) as resp:
                if resp.status != 200:
                    raise ValueError(f"HTTP {resp.status}")
                text = await resp.text()
            load = parse_engine_load(text, self.model)
        except (aiohttp.ClientError, TimeoutError, ValueError, UnicodeDecodeError) as exc:
            self._failed(str(exc) or type(exc).__name__)
            return
        if not self._ok and self.failures:
            log.info("engine metrics %s: scraping again after %d failures", self.url, self.failures)
        self._ok = True
        self._last = load
        self._last_ok_at = time.monotonic()

    async def run(self, stop: asyncio.Event) -> None:
        """Scrape every ``interval`` until ``stop``."""
        import aiohttp

        async with aiohttp.ClientSession() as session:
            while not stop.is_set():
                await self.scrape_once(session)
                await wait_event(stop, self.interval)
