"""Issue 6 item 2: two ``kvcoord serve`` replicas on one Redis answer lookups identically.

An agent streams to replica A only; lookups (by tokens and by hashes) from A and B must agree, and
when the agent goes silent the node vanishes from both once its (short) lease expires, never answered
with its entries half removed. Real
``redis-server`` and real ``kvcoord serve`` subprocesses; the agent is the real Reporter over gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvcoord.agent.reporter import Reporter
from kvcoord.events import BlockRemoved, BlockStored, Tier
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.load import NodeLoad
from kvcoord.router.client import AsyncCoordinatorClient, NodeStatus
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import RedisServer, redis_server

MODEL = "rep-model"
BS = 4
LEASE = 1.5
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="7")
TOKENS = list(range(100, 100 + 12 * BS))
OTHER = list(range(900, 900 + 6 * BS))


@pytest.fixture(params=["", "&mirror=1"], ids=["redis", "redis-mirror"])
def replicas(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    """Two replicas on one Redis; with ``mirror=1`` each answers lookups from its copy of the index,
    so B learns A's writes only through Redis's change feed."""
    with redis_server() as redis, contextlib.ExitStack() as stack:
        addrs = [_serve(stack, redis, tmp_path, name, request.param) for name in ("a", "b")]
        yield addrs[0], addrs[1]


def _serve(stack: contextlib.ExitStack, redis: RedisServer, tmp: Path, name: str, options: str) -> str:
    port = free_port()
    stack.enter_context(running(kvcoord_cmd(
        "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", "--index",
        f"{redis.url}?timeout=2{options}",
        "--lease-seconds", str(LEASE), "--model", f"{MODEL},algo=sha256_cbor,block_size={BS},seed=7",
    ), log=tmp / f"serve-{name}.log"))
    wait_for_port(port)
    return f"127.0.0.1:{port}"


def _view(res: Any) -> list[tuple[object, ...]]:
    return [(n.node_id, n.dp_rank, n.matched_blocks, tuple(sorted(n.tiers_by_name().items())),
             (n.load.running_requests, n.load.waiting_requests)) for n in res.nodes]


async def _answers(a: AsyncCoordinatorClient, b: AsyncCoordinatorClient, query: dict[str, Any]) -> tuple[
    list[tuple[object, ...]], list[tuple[object, ...]]
]:
    ra, rb = await asyncio.gather(a.lookup(MODEL, **query), b.lookup(MODEL, **query))
    return _view(ra), _view(rb)


async def _until(cond: Any, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not await cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.05)


async def test_two_replicas_answer_alike_and_expire_alike(replicas: tuple[str, str]) -> None:
    addr_a, addr_b = replicas
    hashes = block_hashes64(PROFILE, TOKENS)
    other = block_hashes64(PROFILE, OTHER)
    held: dict[int, Tier] = {}
    load = NodeLoad(running_requests=3, waiting_requests=1)
    rep = Reporter([addr_a], node_id="node-r", model=MODEL, epoch=5, hash_profile=PROFILE,
                   snapshot=lambda rank: sorted(held.items()), load=lambda: load)
    await rep.start()
    try:
        await rep.wait_connected(10)
        rep.submit(0, [BlockStored(block_hashes=tuple(hashes[:10]), parent_block_hash=None, token_ids=(),
                                   block_size=BS),
                       BlockStored(block_hashes=tuple(hashes[10:]), parent_block_hash=hashes[9], token_ids=(),
                                   block_size=BS, medium="CPU"),
                       BlockStored(block_hashes=tuple(other), parent_block_hash=None, token_ids=(),
                                   block_size=BS),
                       BlockRemoved(block_hashes=(other[3],))])
        held.update({h: Tier.GPU for h in hashes[:10]})
        held.update({h: Tier.CPU for h in hashes[10:]})
        held.update({h: Tier.GPU for h in other if h != other[3]})
        await rep.wait_acked(10)
        async with AsyncCoordinatorClient(addr_a) as a, AsyncCoordinatorClient(addr_b) as b:
            queries: list[dict[str, Any]] = [
                {"tokens": TOKENS}, {"hashes": hashes}, {"tokens": OTHER}, {"hashes": other[:2]},
                {"hashes": hashes[:5] + other[:1]}, {"tokens": TOKENS[: 3 * BS]},
            ]
            expected = [
                [("node-r", 0, 12, (("CPU", 2), ("GPU", 10), ("STORAGE", 0)), (3, 1))],
                [("node-r", 0, 12, (("CPU", 2), ("GPU", 10), ("STORAGE", 0)), (3, 1))],
                [("node-r", 0, 3, (("CPU", 0), ("GPU", 3), ("STORAGE", 0)), (3, 1))],
                [("node-r", 0, 2, (("CPU", 0), ("GPU", 2), ("STORAGE", 0)), (3, 1))],
                [("node-r", 0, 6, (("CPU", 0), ("GPU", 6), ("STORAGE", 0)), (3, 1))],  # any held run
                [("node-r", 0, 3, (("CPU", 0), ("GPU", 3), ("STORAGE", 0)), (3, 1))],
            ]

            async def agree() -> bool:
                for q, want in zip(queries, expected, strict=True):
                    va, vb = await _answers(a, b, q)
                    if va != want or vb != want:
                        return False
                return True

            # B learns of the node through the shared directory (within its refresh interval).
            await _until(agree, "identical answers from both replicas")
            # Both list the node; B names the replica holding its stream (A), A lists it as its own.
            stats_a, stats_b = await a.stats(), await b.stats()
            nodes_a, nodes_b = await a.list_nodes(), await b.list_nodes()
            def rows(nodes: list[NodeStatus]) -> list[tuple[str, str, int, str]]:
                return [(n.node_id, n.state, n.epoch, n.replica) for n in nodes]

            assert rows(nodes_a) == [("node-r", "active", 5, "")]
            assert rows(nodes_b) == [("node-r", "active", 5, stats_a.replica_id)]
            assert nodes_b[0].load == load and nodes_a[0].last_seq >= 1 and nodes_b[0].last_seq == 0
            assert stats_a.replica_id and stats_a.replica_id != stats_b.replica_id
            assert stats_b.nodes_by_state["active"] == 1 and stats_a.nodes_by_state["active"] == 1
            assert [n.node_id for n in stats_b.nodes] == ["node-r"]

            # The agent goes silent: the node leaves both replicas' answers once its lease expired.
            silent = time.monotonic()
            await rep.close()

            # Until it vanishes, every answer naming it holds all 12 blocks: A removes the entries only
            # after B, reading A's record, stopped answering the node (the record's deadline has slack).
            partial: list[tuple[object, ...]] = []

            async def gone() -> bool:
                va, vb = await _answers(a, b, {"hashes": hashes, "include_unmatched": True})
                partial.extend(row for row in va + vb if row[2] != 12)
                return va == [] and vb == []

            await _until(gone, "the node to vanish from both replicas", timeout=LEASE + 8)
            assert not partial, f"answered with blocks missing before the node vanished: {partial[:3]}"
            assert [(n.node_id, n.state) for n in await b.list_nodes()] == [("node-r", "expired")]
            # The lease runs from the last heartbeat, which the agent sends every lease/3: it may have
            # been up to LEASE/3 before the agent went silent, so the node may go LEASE*2/3 after.
            assert time.monotonic() - silent >= LEASE * 2 / 3 * 0.9, "vanished before its lease ran out"
    finally:
        await rep.close()


async def test_pool_reach_and_role_from_a_hello_hold_on_every_replica(tmp_path: Path) -> None:
    """A node's Hello reaches replica A only, the pool's storage daemon's (not a ``pool:`` id, as an engine
    registered over HTTP has) B only. Each replica learns the other's through the node records: both
    credit the node with the pool's blocks, neither lists the daemon, and B lists the node's role."""
    hashes = block_hashes64(PROFILE, TOKENS)
    with redis_server() as redis, contextlib.ExitStack() as stack:
        addr_a, addr_b = (_serve(stack, redis, tmp_path, name, "") for name in ("a", "b"))
        pub = Reporter([addr_b], node_id="store-1", model=MODEL, epoch=1, hash_profile=PROFILE,
                       snapshot=lambda rank: [], pool_publisher="lmc")
        node = Reporter([addr_a], node_id="node-p", model=MODEL, epoch=2, hash_profile=PROFILE,
                        snapshot=lambda rank: [], pools=["lmc"], role="decode")
        for rep in (pub, node):
            await rep.start()
        try:
            await pub.wait_connected(10)
            await node.wait_connected(10)
            pub.submit(0, [BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(),
                                       block_size=BS)])
            await pub.wait_acked(10)
            async with AsyncCoordinatorClient(addr_a) as a, AsyncCoordinatorClient(addr_b) as b:
                async def credited() -> bool:
                    ra, rb = await asyncio.gather(*(c.lookup(MODEL, hashes=hashes) for c in (a, b)))
                    return all([(n.node_id, n.matched_blocks, n.pool) for n in r.nodes]
                               == [("node-p", len(hashes), "lmc")] for r in (ra, rb))

                await _until(credited, "both replicas to credit node-p with the pool's blocks")
                listed = {n.node_id: n for n in await b.list_nodes()}
                assert listed["node-p"].role == "decode" and listed["node-p"].replica
                assert not (await a.lookup(MODEL, hashes=hashes, include_unmatched=True)).nodes[1:]
        finally:
            for rep in (node, pub):
                await rep.close()
