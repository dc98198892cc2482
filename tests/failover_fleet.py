"""A small fleet on a shared Redis index, for failover tests: two ``kvcoord serve`` replicas (B answers
lookups from its mirror, ``?mirror=1``), one agent per replica under steady load, and a lookup loop that
judges every answer.

The agents are the real :class:`~kvcoord.agent.reporter.Reporter` over gRPC, fed by a writer that stores a
new chain of blocks every few milliseconds and never evicts them, so the truth is known exactly: once a
replica has answered a block as held by a node, every later answer that calls the node ``exact`` must hold it
too. A churn set (stored, then removed) proves that nothing removed comes back. The lookup loop records, per
replica, every failure and every violation; :meth:`Fleet.settle` then checks, at quiet, that both replicas
hold every block each node holds and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvcoord.agent.reporter import Reporter
from kvcoord.events import BlockRemoved, BlockStored, Tier
from kvcoord.hashing import BlockHash64, HashProfile
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

MODEL = "failover-model"
BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="3")
CHAIN = 8
"""Blocks per stored chain (one BlockStored event)."""
SAMPLE = 48
"""Confirmed blocks per judged lookup."""


@dataclass
class Outcomes:
    """What one replica answered, as the lookup loop judged it."""

    lookups: int = 0
    failed: int = 0
    violations: list[str] = field(default_factory=list)
    slowest: float = 0.0
    """Longest lookup (seconds), failed or not."""
    outage: float = 0.0
    """Longest run of failed lookups, first failure to next success (seconds)."""
    unsure: float = 0.0
    """Longest time a node was out of answers or not ``exact`` (seconds)."""


class Agent:
    """One node: a Reporter streaming to one replica, and the blocks it holds (the truth)."""

    def __init__(self, node_id: str, addr: str, seed: int) -> None:
        self.node_id = node_id
        self.held: dict[int, Tier] = {}
        self.order: list[int] = []
        """Held blocks in the order they were stored (never evicted)."""
        self.removed: set[int] = set()
        self._rng = random.Random(seed)
        self.reporter = Reporter([addr], node_id=node_id, model=MODEL, epoch=seed,
                                 hash_profile=PROFILE, snapshot=lambda rank: sorted(self.held.items()))

    def _chain(self) -> tuple[int, ...]:
        return tuple(self._rng.getrandbits(63) for _ in range(CHAIN))

    def store(self) -> None:
        hashes = self._chain()
        self.held.update(dict.fromkeys(hashes, Tier.GPU))
        self.order.extend(hashes)
        self.reporter.submit(0, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(),
                                             block_size=BS)])

    def churn(self) -> None:
        """Store a chain and remove it in the same batch: it must never be reported afterwards."""
        hashes = self._chain()
        self.removed.update(hashes)
        self.reporter.submit(0, [BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=(),
                                             block_size=BS),
                                 BlockRemoved(block_hashes=hashes)])


class Fleet:
    """Two replicas on ``index_uri`` (B with ``mirror=1``), two agents, a writer and a judging lookup loop."""

    def __init__(self, tmp: Path, stack: contextlib.ExitStack, index_uri: str, *, lease: float = 3.0) -> None:
        sep = "&" if "?" in index_uri else "?"
        self.addrs: list[str] = []
        for name, options in (("a", ""), ("b", "mirror=1")):
            port = free_port()
            uri = index_uri + (sep + options if options else "")
            stack.enter_context(running(kvcoord_cmd(
                "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", "--index", uri,
                "--lease-seconds", str(lease),
                "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=3",
            ), log=tmp / f"serve-{name}.log"))
            wait_for_port(port)
            self.addrs.append(f"127.0.0.1:{port}")
        self.tmp = tmp
        self.agents = [Agent("node-a", self.addrs[0], 11), Agent("node-b", self.addrs[1], 12)]
        self.outcomes = {addr: Outcomes() for addr in self.addrs}
        self.confirmed: dict[tuple[str, str], int] = {}
        """Per (replica, node): how many of the node's blocks (in store order) the replica has answered
        as held; every later ``exact`` answer must hold them all."""
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        for agent in self.agents:
            await agent.reporter.start()
            await agent.reporter.wait_connected(20)
            agent.store()
        self._tasks = [asyncio.create_task(self._write()),
                       *(asyncio.create_task(self._judge(addr)) for addr in self.addrs)]

    async def _write(self) -> None:
        n = 0
        while not self._stop.is_set():
            for agent in self.agents:
                if n % 5 == 4:
                    agent.churn()
                else:
                    agent.store()
            n += 1
            await asyncio.sleep(0.05)

    async def _judge(self, addr: str) -> None:
        out = self.outcomes[addr]
        failing_since: float | None = None
        unsure_since: dict[str, float] = {}
        rng = random.Random(addr)
        async with AsyncCoordinatorClient(addr, timeout=10.0) as client:
            while not self._stop.is_set():
                for agent in self.agents:
                    key = (addr, agent.node_id)
                    known = self.confirmed.get(key, 0)
                    sample = rng.sample(agent.order[:known], min(SAMPLE, known)) if known else []
                    fresh = agent.order[known:known + 2 * CHAIN]
                    t0 = time.monotonic()
                    try:
                        res = await client.lookup(MODEL, hashes=sample + fresh, include_unmatched=True)
                    except CoordinatorError:
                        res = None
                    now = time.monotonic()
                    out.lookups += 1
                    out.slowest = max(out.slowest, now - t0)
                    if res is None:
                        out.failed += 1
                        failing_since = failing_since if failing_since is not None else t0
                        continue
                    if failing_since is not None:
                        out.outage = max(out.outage, now - failing_since)
                        failing_since = None
                    node = next((n for n in res.nodes if n.node_id == agent.node_id), None)
                    if node is None or node.trust != "exact":
                        unsure_since.setdefault(agent.node_id, t0)
                        continue
                    if agent.node_id in unsure_since:
                        out.unsure = max(out.unsure, now - unsure_since.pop(agent.node_id))
                    if node.matched_blocks < len(sample):
                        out.violations.append(
                            f"{addr} answered {agent.node_id} exact with {node.matched_blocks} blocks of "
                            f"{len(sample)} it had answered held before")
                    else:
                        self.confirmed[key] = known + node.matched_blocks - len(sample)
                await asyncio.sleep(0.01)

    async def stop_load(self) -> None:
        self._stop.set()
        for task in self._tasks:
            await task

    async def settle(self, timeout: float = 60.0) -> None:
        """At quiet: both replicas hold every block of every node, exactly, and no removed block."""
        for agent in self.agents:
            await agent.reporter.wait_acked(timeout)
        deadline = time.monotonic() + timeout
        while True:
            problems = await self._differences()
            if not problems:
                return
            if time.monotonic() > deadline:
                raise AssertionError(f"at quiet: {problems[:6]}")
            await asyncio.sleep(0.2)

    async def _differences(self) -> list[str]:
        problems: list[str] = []
        total = sum(len(a.held) for a in self.agents)
        for addr in self.addrs:
            async with AsyncCoordinatorClient(addr, timeout=10.0) as client:
                try:
                    stats = await client.stats()
                except CoordinatorError as exc:
                    return [f"{addr}: stats failed: {exc}"]
                if stats.entries != total:
                    problems.append(f"{addr}: {stats.entries} entries, the agents hold {total}")
                for agent in self.agents:
                    order = agent.order
                    for i in range(0, len(order), 512):
                        chunk = [BlockHash64(h) for h in order[i:i + 512]]
                        res = await client.lookup(MODEL, hashes=chunk, include_unmatched=True)
                        node = next((n for n in res.nodes if n.node_id == agent.node_id), None)
                        if node is None or node.trust != "exact" or node.matched_blocks != len(chunk):
                            problems.append(f"{addr}: {agent.node_id} answered "
                                            f"{None if node is None else (node.trust, node.matched_blocks)}"
                                            f" for {len(chunk)} held blocks at {i}")
                            break
                    # (exact entry counts already rule out leftovers; a sample says which)
                    for h in random.Random(1).sample(sorted(agent.removed), min(64, len(agent.removed))):
                        res = await client.lookup(MODEL, hashes=[h])
                        if any(n.matched_blocks for n in res.nodes):
                            problems.append(f"{addr}: removed block {h} still reported")
                            break
        return problems

    async def close(self) -> None:
        self._stop.set()
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for agent in self.agents:
            await agent.reporter.close()

    def report(self) -> str:
        return "; ".join(
            f"{addr}: {o.lookups} lookups, {o.failed} failed, longest outage {o.outage:.2f}s, longest "
            f"not-exact {o.unsure:.2f}s, slowest lookup {o.slowest:.2f}s, {len(o.violations)} violations"
            for addr, o in self.outcomes.items())

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2500:]}"
                         for p in sorted(self.tmp.glob("serve-*.log")))
