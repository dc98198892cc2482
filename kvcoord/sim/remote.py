"""The simulator against a running coordinator (``kvcoord simulate --coordinator HOST:PORT``).

Each simulated node streams its pool's KV events through a real
:class:`~kvcoord.agent.reporter.Reporter` (one ``Ingest`` stream per node, as a deployed agent
does), and the router asks the coordinator with
:class:`~kvcoord.router.client.AsyncCoordinatorClient` lookups. The simulation clock is not the wall
clock, so before each routing decision :meth:`CoordinatorBackend.sync` waits until the coordinator has
acknowledged (i.e. applied) every event submitted so far: the lookup then sees exactly what the
in-process index would, and the table is the same as without ``--coordinator``. Only the measured
routing overhead changes: it includes the lookup's network round trip.

Node ids and the model name carry a per-run tag, so several runs (or policies run in parallel) can
share one coordinator without seeing each other's nodes.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from typing import Any

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.pool import BlockPool
from kvcoord.agent.reporter import Reporter
from kvcoord.events import KVEvent, Tier
from kvcoord.hashing import BlockHash64, HashProfile
from kvcoord.index.base import NodeMatch
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.sim.cluster import SimBackend
from kvcoord.transport import ChannelSecurity

log = logging.getLogger(__name__)


def run_tag(policy: str) -> str:
    """A tag unique to this process and policy, for node ids and the model name."""
    return f"sim-{os.getpid()}-{os.urandom(3).hex()}-{policy}"


class CoordinatorBackend(SimBackend):
    """Events through per-node reporters, lookups through the async client, on a private event loop."""

    def __init__(
        self,
        address: str,
        profile: HashProfile,
        *,
        tag: str,
        security: ChannelSecurity | None = None,
        timeout: float = 10.0,
    ) -> None:
        self.address = address
        self.profile = profile
        self.model = f"{tag}-model"
        self.prefix = f"{tag}-"
        self.timeout = timeout
        self.security = security or ChannelSecurity()
        self._loop = asyncio.new_event_loop()
        self._pools: dict[str, BlockPool] = {}
        self._reporters: dict[str, Reporter] = {}
        self._dirty: set[str] = set()
        self._client: AsyncCoordinatorClient | None = None
        self._options = ReporterOptions(flush_interval=0.0, welcome_timeout=timeout)

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def attach(self, node_id: str, pool: BlockPool) -> None:
        self._pools[node_id] = pool

    async def _start(self) -> None:
        self._client = AsyncCoordinatorClient(self.address, security=self.security, timeout=self.timeout)
        await self._client.ping()
        for node_id, pool in self._pools.items():

            def snapshot(rank: int, pool: BlockPool = pool) -> list[tuple[BlockHash64, Tier]]:
                return pool.snapshot().get(rank, [])

            rep = Reporter(
                [self.address],
                node_id=self.prefix + node_id,
                model=self.model,
                snapshot=snapshot,
                hash_profile=self.profile,
                security=self.security,
                options=self._options,
            )
            await rep.start()
            self._reporters[node_id] = rep
        await asyncio.gather(*(r.wait_connected(self.timeout) for r in self._reporters.values()))

    def start(self) -> None:
        """Connect the client and one reporter per attached node (``TimeoutError`` if they cannot)."""
        self._run(self._start())

    def apply(self, node_id: str, events: Sequence[KVEvent]) -> None:
        self._reporters[node_id].submit(0, events)
        self._dirty.add(node_id)

    async def _sync(self) -> None:
        dirty = [self._reporters[n] for n in self._dirty]
        self._dirty.clear()
        await asyncio.gather(*(r.wait_acked(self.timeout) for r in dirty))

    def sync(self) -> None:
        if self._dirty:
            self._run(self._sync())
        else:
            # let the reporters' heartbeats and acks run even when nothing changed
            self._run(asyncio.sleep(0))

    async def _match(self, hashes: Sequence[BlockHash64]) -> list[NodeMatch]:
        assert self._client is not None
        result = await self._client.lookup(self.model, hashes=list(hashes))
        n = len(self.prefix)
        return [
            NodeMatch(m.node_id[n:], m.dp_rank, m.matched_blocks, m.tier_counts())
            for m in result.nodes
            if m.node_id.startswith(self.prefix)
        ]

    def match(self, hashes: Sequence[BlockHash64]) -> list[NodeMatch]:
        if not hashes:
            return []
        result: list[NodeMatch] = self._run(self._match(hashes))
        return result

    async def _close(self) -> None:
        """Close the streams, then remove the run's nodes: left behind, they would expire a lease later
        and show in ``kvcoord stats`` (and fire ``KvcoordLeasesExpiring``) against a real coordinator."""
        await asyncio.gather(*(r.close() for r in self._reporters.values()))
        if self._client is not None:
            client = self._client
            results = await asyncio.gather(*(client.remove(self.prefix + n) for n in self._reporters),
                                           return_exceptions=True)
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                log.warning("simulate: %d of %d simulated nodes were not removed from %s: %s", len(failed),
                            len(results), self.address, failed[0])
        self._reporters.clear()
        if self._client is not None:
            await self._client.close()
            self._client = None

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self._run(self._close())
        finally:
            # grpc.aio leaves status-watcher tasks behind; finish them before the loop goes away
            leftover = asyncio.all_tasks(self._loop)
            for task in leftover:
                task.cancel()
            if leftover:
                self._run(asyncio.gather(*leftover, return_exceptions=True))
            self._run(self._loop.shutdown_asyncgens())
            self._loop.close()
