"""``kvcoord agent``: relay one engine's KV events to one or more coordinators, until SIGTERM.

One :class:`~kvcoord.engine.relay.Relay` per engine DP rank (vLLM offsets each rank's ports by the rank),
or one :class:`~kvcoord.engine.grpc_relay.GrpcRelay` for an engine's gRPC stream (its one rank), feeds
a shared :class:`~kvcoord.engine.mirror.BlockMirror` and a :class:`~kvcoord.agent.reporter.Reporter`.
The agent exits 1 when every coordinator refused the node for good (a token not allowed for it, an
unknown model in strict mode): retrying could not change the answer, so it says why once and stops.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvcoord.agent.engine_metrics import EngineMetrics
from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.reporter import Reporter
from kvcoord.engine.mirror import BlockMirror, EventSink
from kvcoord.engine.relay import Relay, RelayCore
from kvcoord.engine.zmq_wire import offset_endpoint_port
from kvcoord.hashing import HashProfile
from kvcoord.load import NodeLoad
from kvcoord.transport import ChannelSecurity
from kvcoord.waits import wait_event

log = logging.getLogger("kvcoord.agent")


class AgentRefused(RuntimeError):
    """Every coordinator refused the node for good; the message names each one's reason."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """What one agent relays, and to where."""

    coordinators: tuple[str, ...]
    node_id: str
    model: str
    zmq_endpoint: str | None
    """The engine's rank-0 PUB endpoint; rank r is on its port + r. None: the engine publishes no KV
    events, so nothing is relayed and the Hello says so (load and URL only; trust ``approximate``)."""
    replay_endpoint: str | None = None
    topic: str = ""
    dp_ranks: tuple[int, ...] = (0,)
    security: ChannelSecurity = field(default_factory=ChannelSecurity)
    hash_profile: HashProfile | None = None
    """Announced in the Hello (a fingerprint, never the seed), so a mismatch is found at once."""
    signed_hashes: bool = False
    replay_timeout: float = 2.0
    stats_file: str | None = None
    stats_interval: float = 0.2
    engine_metrics_url: str | None = None
    """The engine's Prometheus page (vLLM's ``/metrics``): its load goes into heartbeats."""
    engine_metrics_interval: float = 1.0
    serving_url: str = ""
    pools: tuple[str, ...] = ()
    """``--pool``: shared pools the engine loads blocks from."""
    pool_publisher: str = ""
    """``--pool-publisher``: this publisher feeds that pool (its node id is ``pool:NAME``)."""
    role: str = ""
    """``--role``: the engine's P/D role (``prefill``, ``decode``, ``both``; "" none)."""
    """The engine's OpenAI-compatible base URL, announced in the Hello for routers ("" : none)."""
    linger: float = 0.0
    """Seconds a batch waits for more events before it goes (``ReporterOptions.linger``)."""
    grpc_endpoint: str | None = None
    """The engine's ``SubscribeKvEvents`` server (``HOST:PORT``), instead of ``zmq_endpoint``: its batches
    carry the engine's load, which heartbeats report unless ``engine_metrics_url`` is given."""

    @property
    def kv_events(self) -> bool:
        return self.zmq_endpoint is not None or self.grpc_endpoint is not None


def build_relays(config: AgentConfig, sink: EventSink, mirror: BlockMirror) -> list[RelayCore]:
    """One relay per DP rank, on vLLM's per-rank port offsets of the rank-0 endpoints; one for a gRPC stream,
    which carries one rank (none without KV events)."""
    relays: list[RelayCore] = []
    if config.grpc_endpoint is not None:
        from kvcoord.engine.grpc_relay import GrpcRelay

        return [GrpcRelay(config.grpc_endpoint, sink, mirror=mirror, default_dp_rank=config.dp_ranks[0],
                          allowed_ranks=set(config.dp_ranks))]
    if config.zmq_endpoint is None:
        return relays
    for rank in config.dp_ranks:
        endpoint = offset_endpoint_port(config.zmq_endpoint, rank)
        assert endpoint is not None
        relays.append(Relay(
            endpoint, sink,
            replay_endpoint=offset_endpoint_port(config.replay_endpoint, rank),
            topic=config.topic, mirror=mirror, signed_hashes=config.signed_hashes, default_dp_rank=rank,
            replay_timeout=config.replay_timeout, allowed_ranks={rank},
        ))
    return relays


def agent_status(relays: Sequence[RelayCore], reporter: Reporter,
                 engine_metrics: EngineMetrics | None = None) -> dict[str, Any]:
    """What ``--stats-file`` holds: each relay's position and counters, the reporter's links, and the
    engine-metrics scraper's health (``engine_metrics``: null without ``--engine-metrics-url``)."""
    rs = reporter.stats()
    return {
        "node_id": rs.node_id,
        "state": "refused" if reporter.refused.is_set() else "running",
        "relays": [{"endpoint": r.endpoint, "expected_seq": r.expected_seq,
                    # not asdict(): it rebuilds a Counter from its (key, count) pairs, counting the pairs
                    **{k: (dict(v) if isinstance(v, Counter) else v) for k, v in vars(r.stats).items()}}
                   for r in relays],
        "mirror_blocks": {str(dp): relays[0].mirror.num_blocks(dp) for dp in relays[0].mirror.ranks()}
        if relays else {},
        "reporter": {"epoch": rs.epoch, "last_seq": rs.last_seq, "events_submitted": rs.events_submitted,
                     "links": [asdict(link) for link in rs.links]},
        "serving_url": reporter.serving_url,
        "engine_metrics": engine_metrics.status() if engine_metrics is not None else None,
    }


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Atomically replace ``path`` (a reader never sees half a file)."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


async def _write_stats(path: Path, interval: float, relays: Sequence[RelayCore], reporter: Reporter,
                       scraper: EngineMetrics | None, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            _write_json(path, agent_status(relays, reporter, scraper))
        except OSError as exc:
            log.warning("cannot write %s: %s", path, exc)
        await wait_event(stop, interval)


async def _cancel_tasks(tasks: Sequence[asyncio.Task[Any]], timeout: float) -> None:
    """Cancel and reap tasks. A relay holds nothing to finish: its ``handle_payload`` is synchronous (the
    mirror never sees half a batch) and its sockets close in ``finally``; one mid-replay must not delay
    the exit, nor submit to a reporter that is closing."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


def _load_source(config: AgentConfig, scraper: EngineMetrics | None,
                 relays: Sequence[RelayCore]) -> Callable[[], NodeLoad] | None:
    """The heartbeats' load: the engine's metrics page when scraped, else what its gRPC stream carries."""
    if scraper is not None or config.grpc_endpoint is None:
        return scraper.load if scraper is not None else None

    def streamed() -> NodeLoad:
        load = getattr(relays[0], "load", None) if relays else None
        return load() if load is not None else NodeLoad()

    return streamed


async def run_agent(config: AgentConfig) -> None:
    """Relay until SIGTERM/SIGINT. Raises :class:`AgentRefused` when every coordinator refused the node."""
    mirror = BlockMirror()
    scraper = (EngineMetrics(config.engine_metrics_url, config.model, interval=config.engine_metrics_interval)
               if config.engine_metrics_url else None)
    relays: list[RelayCore] = []
    rep = Reporter(list(config.coordinators), node_id=config.node_id, model=config.model,
                   snapshot=mirror.rank_entries, dp_ranks=config.dp_ranks, security=config.security,
                   hash_profile=config.hash_profile, load=_load_source(config, scraper, relays),
                   serving_url=config.serving_url, kv_events=config.kv_events,
                   pools=config.pools, pool_publisher=config.pool_publisher, role=config.role,
                   options=ReporterOptions(linger=config.linger))
    relays += build_relays(config, rep, mirror)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await rep.start()
    tasks = [asyncio.create_task(r.run(stop), name=f"relay-{r.endpoint}") for r in relays]
    if scraper is not None:  # its own task: a slow engine page never delays a relay
        tasks.append(asyncio.create_task(scraper.run(stop), name="engine-metrics"))
    if config.stats_file:
        writer = _write_stats(Path(config.stats_file), config.stats_interval, relays, rep, scraper, stop)
        tasks.append(asyncio.create_task(writer, name="stats-file"))
    log.info("agent %s: relaying %s to %s", config.node_id,
             ", ".join(r.endpoint for r in relays) or "no KV events (load and URL only)",
             ", ".join(config.coordinators))
    stopper = asyncio.create_task(stop.wait())
    refused = asyncio.create_task(rep.refused.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper, refused], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t not in (stopper, refused):
                exc = t.exception()
                if exc is not None:
                    raise exc
    finally:
        stop.set()
        stopper.cancel()
        refused.cancel()
        await _cancel_tasks(tasks, 0.5)  # immediate: nothing is left to submit when the reporter closes
        await rep.close(timeout=0.5)
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
        if config.stats_file:  # the final word: streams closed, counters complete
            try:
                _write_json(Path(config.stats_file), agent_status(relays, rep, scraper))
            except OSError as exc:
                log.warning("cannot write %s: %s", config.stats_file, exc)
    if rep.refused.is_set():
        raise AgentRefused("every coordinator refused this node: " + "; ".join(rep.refusals()))
    log.info("agent %s: stopped", config.node_id)
