"""The agent, run by the coordinator for the engines registered with it (``POST /register``).

Each registered instance gets what ``kvcoord agent`` gives an engine: one :class:`~kvcoord.engine.relay.Relay`
per listener (DP rank), a shared :class:`~kvcoord.engine.relay.BlockMirror`, and, where an agent has its
reporter, a :class:`~kvcoord.agent.local.LocalFeed` into this process's ingest session (no protobuf, no
gRPC). A registered engine and an agent's engine are indexed by the same session code, down to the acks
and snapshots.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import zmq.asyncio

from kvcoord.agent.local import LocalFeed
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.engines import Engine
from kvcoord.engine.relay import BlockMirror, Relay

log = logging.getLogger("kvcoord.agent.fleet")

__all__ = ["Fleet"]


@dataclass(slots=True)
class _Running:
    engine: Engine
    reporter: LocalFeed
    relays: dict[int, Relay]
    tasks: dict[int, asyncio.Task[None]]
    stop: asyncio.Event = field(default_factory=asyncio.Event)


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
        rep = LocalFeed(self.state, node_id=engine.node_id, model=engine.model,
                        snapshot=mirror.rank_entries, dp_ranks=ranks, serving_url=engine.serving_url)
        relays = {x.dp_rank: Relay(x.endpoint, rep, replay_endpoint=x.replay_endpoint, mirror=mirror,
                                   ctx=self._ctx, default_dp_rank=x.dp_rank, allowed_ranks={x.dp_rank})
                  for x in engine.listeners}
        run = _Running(engine, rep, relays, {})
        await rep.start()
        for rank, relay in relays.items():
            run.tasks[rank] = asyncio.create_task(relay.run(run.stop),
                                                  name=f"kvcoord-relay-{engine.instance_id}-{rank}")
        self._running[engine.instance_id] = run
        log.info("relaying engine %d (%s): %s", engine.instance_id, engine.model,
                 ", ".join(f"dp {x.dp_rank} {x.endpoint}" for x in engine.listeners))

    async def stop(self, instance_id: int) -> None:
        run = self._running.pop(instance_id, None)
        if run is None:
            return
        run.stop.set()
        for task in run.tasks.values():
            task.cancel()
        if run.tasks:
            await asyncio.wait(list(run.tasks.values()), timeout=0.5)
        await run.reporter.close(timeout=0.5)

    def status(self, instance_id: int) -> dict[int, tuple[str, str]]:
        run = self._running.get(instance_id)
        if run is None:
            return {}
        out: dict[int, tuple[str, str]] = {}
        feed = run.reporter
        for rank, task in run.tasks.items():
            if feed.refused:  # its events would go nowhere: say so, not "active"
                out[rank] = ("failed", f"refused: {feed.refused}")
            elif task.done():
                exc = None if task.cancelled() else task.exception()
                out[rank] = ("failed", f"{type(exc).__name__}: {exc}" if exc is not None else "stopped")
            else:
                out[rank] = ("active", "") if run.relays[rank].ready.is_set() else ("pending", "")
        return out

    async def close(self) -> None:
        """Stop every engine at once: each may take its 0.5 s bounds, and SIGTERM has a second or two."""
        await asyncio.gather(*(self.stop(iid) for iid in list(self._running)), return_exceptions=True)
        self._ctx.term()
