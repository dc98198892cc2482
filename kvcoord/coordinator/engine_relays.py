"""The agent, run by the coordinator for the engines registered with it (``POST /register``).

Each registered instance gets what ``kvcoord agent`` gives an engine: one :class:`~kvcoord.engine.relay.Relay`
per listener (DP rank), a shared :class:`~kvcoord.engine.mirror.BlockMirror`, and, where an agent has its
reporter, a :class:`~kvcoord.coordinator.engine_feed.LocalFeed` into this process's ingest session (no
protobuf, no gRPC). A registered engine and an agent's engine are indexed by the same session code, down
to the acks and snapshots.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import zmq.asyncio

from kvcoord.agent.engine_metrics import EngineMetrics
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.engine_feed import LocalFeed
from kvcoord.coordinator.engines import ACTIVE, CONNECTING, FAILED, UNREACHABLE, Engine
from kvcoord.engine.grpc_relay import GrpcRelay
from kvcoord.engine.mirror import BlockMirror
from kvcoord.engine.relay import Relay, RelayCore
from kvcoord.hashing import SGLANG
from kvcoord.load import NodeLoad

log = logging.getLogger("kvcoord.coordinator.engine_relays")

__all__ = ["Fleet"]


@dataclass(slots=True)
class _Running:
    engine: Engine
    reporter: LocalFeed
    relays: dict[int, RelayCore]
    tasks: dict[int, asyncio.Task[None]]
    started: float
    scraper: EngineMetrics | None = None
    scraping: asyncio.Task[None] | None = None
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    def answered_at(self) -> float | None:
        """When every rank had last answered: the node is there only while all of its ranks are."""
        times = [r.answered_at for r in self.relays.values()]
        return None if any(t is None for t in times) else min(t for t in times if t is not None)

    def streamed_load(self) -> NodeLoad:
        """The engine's load as its gRPC streams carry it (every rank's): no metrics page needed."""
        loads = [r.load() for r in self.relays.values() if isinstance(r, GrpcRelay)]
        return NodeLoad(sum(x.running_requests for x in loads), sum(x.waiting_requests for x in loads),
                        sum(x.kv_usage for x in loads) / max(1, len(loads)))


class Fleet:
    """Relays registered engines into the coordinator whose ``state`` it is given (an ``EngineRunner``)."""

    def __init__(self, state: CoordinatorState) -> None:
        self.state = state
        self._ctx = zmq.asyncio.Context()
        self._running: dict[int, _Running] = {}

    async def start(self, engine: Engine) -> None:
        await self.stop(engine.instance_id)
        mirror = BlockMirror()
        ranks = [x.dp_rank for x in engine.listeners]
        lease = self.state.config.lease_seconds
        scraper = EngineMetrics(engine.metrics_url, engine.model_name) if engine.metrics_url else None
        streamed = scraper is None and engine.source == "grpc"
        rep = LocalFeed(self.state, node_id=engine.node_id, model=engine.model,
                        snapshot=mirror.rank_entries, dp_ranks=ranks, serving_url=engine.serving_url,
                        pools=engine.pools, pool_publisher=engine.pool_publisher, role=engine.role,
                        answered=lambda: run.answered_at(),
                        load=scraper.load if scraper is not None else
                        (lambda: run.streamed_load()) if streamed else None)
        # Probed several times a lease, so an idle engine that is there keeps its lease.
        relays: dict[int, RelayCore] = {}
        for x in engine.listeners:
            grpc_endpoint = x.grpc_endpoint
            if grpc_endpoint is not None:
                relays[x.dp_rank] = GrpcRelay(grpc_endpoint, rep, mirror=mirror, default_dp_rank=x.dp_rank,
                                              allowed_ranks={x.dp_rank}, idle_probe=min(1.0, lease / 4),
                                              on_malformed=self.state.metrics.relay_malformed_seen)
                continue
            relays[x.dp_rank] = Relay(x.endpoint, rep, replay_endpoint=x.replay_endpoint, mirror=mirror,
                                      ctx=self._ctx, default_dp_rank=x.dp_rank, allowed_ranks={x.dp_rank},
                                      signed_hashes=engine.kind == SGLANG,
                                      on_malformed=self.state.metrics.relay_malformed_seen,
                                      idle_probe=min(1.0, lease / 4), replay_timeout=min(2.0, lease / 3))
        run = _Running(engine, rep, relays, {}, time.monotonic(), scraper)
        await rep.start()
        for rank, relay in relays.items():
            run.tasks[rank] = asyncio.create_task(relay.run(run.stop),
                                                  name=f"kvcoord-relay-{engine.instance_id}-{rank}")
        if scraper is not None:  # its own task: a slow engine page never delays a relay
            run.scraping = asyncio.create_task(scraper.run(run.stop),
                                               name=f"kvcoord-engine-metrics-{engine.instance_id}")
        self._running[engine.instance_id] = run
        log.info("relaying engine %d (%s): %s", engine.instance_id, engine.model,
                 ", ".join(f"dp {x.dp_rank} {x.endpoint}" for x in engine.listeners))

    async def stop(self, instance_id: int) -> None:
        run = self._running.pop(instance_id, None)
        if run is None:
            return
        run.stop.set()
        tasks = [*run.tasks.values(), *([run.scraping] if run.scraping is not None else [])]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=0.5)
        await run.reporter.close(timeout=0.5)

    def status(self, instance_id: int) -> dict[int, tuple[str, str]]:
        run = self._running.get(instance_id)
        if run is None:
            return {}
        out: dict[int, tuple[str, str]] = {}
        feed = run.reporter
        for rank, task in run.tasks.items():
            if feed.refused:  # its events would go nowhere: say so, not "active"
                out[rank] = (FAILED, f"refused: {feed.refused}")
            elif task.done():
                exc = None if task.cancelled() else task.exception()
                out[rank] = (FAILED, f"{type(exc).__name__}: {exc}" if exc is not None else "stopped")
            else:
                out[rank] = self._liveness(run, run.relays[rank])
        return out

    def _liveness(self, run: _Running, relay: RelayCore) -> tuple[str, str]:
        """A running relay's status by its engine's last answer, and why when it is not ``active``."""
        lease, now = self.state.config.lease_seconds, time.monotonic()
        at = relay.answered_at
        if at is not None and now - at <= lease:
            return ACTIVE, ""
        replay = getattr(relay, "replay_endpoint", None)
        asked = (f"replay {replay}" if replay else "its SubscribeKvEvents stream"
                 if isinstance(relay, GrpcRelay) else "its PUB connection")
        if at is None:
            if now - run.started <= lease:
                return CONNECTING, f"waiting for a first answer from {relay.endpoint} ({asked})"
            return UNREACHABLE, (f"nothing answered at {relay.endpoint} ({asked}) in "
                                 f"{now - run.started:.0f} s of relaying")
        return UNREACHABLE, (f"no events and no answer from {relay.endpoint} ({asked}) for {now - at:.0f} s "
                             f"(lease {lease:g} s)")

    async def close(self) -> None:
        """Stop every engine at once: each may take its 0.5 s bounds, and SIGTERM has a second or two."""
        await asyncio.gather(*(self.stop(iid) for iid in list(self._running)), return_exceptions=True)
        self._ctx.term()
