"""The router client: local validation of queries, and both clients against an in-process server."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from kvcoord.agent.reporter import Reporter
from kvcoord.coordinator.config import CoordinatorConfig
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.events import BlockStored, Tier
from kvcoord.load import NodeLoad
from kvcoord.router.answer import LookupResult
from kvcoord.router.client import (
    AsyncCoordinatorClient,
    CoordinatorClient,
    CoordinatorError,
    HeartbeatResult,
    NodeStatus,
    build_lookup_request,
)
from kvcoord.router.policy import LeastLoadedPolicy, place
from kvcoord.wire import unpack_tokens
from tests.procs import free_port


@pytest.mark.parametrize(
    ("kw", "reason"),
    [
        ({}, "exactly one of tokens, hashes, prompt or messages"),
        ({"tokens": [1], "hashes": [2]}, "exactly one of tokens, hashes, prompt or messages"),
        ({"hashes": [-1]}, r"block hashes must be integers in 0..2\*\*64-1"),
        ({"tokens": [1, 2**32]}, r"token ids must be integers in 0..2\*\*32-1"),
        ({"hashes": [1], "lora_name": "x"}, "token queries only"),
        ({"tokens": [1], "mm_items": [("img", -1, 4)]}, "offset and length"),
    ],
)
def test_bad_queries_fail_before_any_rpc(kw: dict[str, object], reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        build_lookup_request("m", **kw)  # type: ignore[arg-type]


def test_request_carries_every_key() -> None:
    req = build_lookup_request("m", tokens=[1, 2], lora_name="A", lora_path="/p", cache_salt="s",
                               mm_items=[("img", 0, 2)], prompt_embeds_digests=[b"\x01"],
                               candidates=[("n1", 1)])
    q = req.tokens
    got = (list(unpack_tokens(q.token_ids)), q.lora_name, q.lora_path, q.cache_salt)
    assert got == ([1, 2], "A", "/p", "s")
    assert [(m.identifier, m.offset, m.length) for m in q.mm_items] == [("img", 0, 2)]
    assert list(q.prompt_embeds_digests) == [b"\x01"]
    assert [(c.node_id, c.dp_rank) for c in req.candidates] == [("n1", 1)]
    assert build_lookup_request("m", hashes=[]).WhichOneof("query") == "hashes"


async def test_sync_client_against_a_server() -> None:
    cfg = CoordinatorConfig(listen=f"127.0.0.1:{free_port()}", metrics_listen="", http_listen="")
    async with CoordinatorServer(cfg) as server:
        held: dict[int, Tier] = {7: Tier.CPU}  # the engine's state, as its snapshot reports it
        rep = Reporter([server.address], node_id="n1", model="m", epoch=3,
                       snapshot=lambda rank: sorted(held.items()))
        await rep.start()
        try:
            await rep.wait_connected(10)
            rep.submit(0, [BlockStored(block_hashes=(8, 9), parent_block_hash=7, token_ids=(), block_size=4)])
            held.update({8: Tier.GPU, 9: Tier.GPU})
            await rep.wait_acked(10)

            def sync_part() -> None:
                with CoordinatorClient(server.address) as c:
                    c.ping()
                    r = c.lookup("m", hashes=[7, 8, 9, 10])
                    assert (r.num_blocks, len(r.nodes)) == (4, 1)
                    n = r.nodes[0]
                    assert (n.node_id, n.dp_rank, n.matched_blocks, n.tiers_by_name()) == (
                        "n1", 0, 3, {"GPU": 2, "CPU": 1, "STORAGE": 0})
                    assert c.lookup("m", hashes=[7], candidates=[("other", 0)]).nodes == []
                    assert [x.node_id for x in c.list_nodes()] == ["n1"]
                    assert c.heartbeat("n1", 3).known
                    with pytest.raises(CoordinatorError) as err:
                        c.lookup("m", tokens=[1] * 4)  # no hash profile configured for "m"
                    assert err.value.code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND,
                                              grpc.StatusCode.INVALID_ARGUMENT)
                    c.drain("n1")
                    assert c.lookup("m", hashes=[7]).nodes == []
                    c.remove("n1")
                    assert c.stats().nodes == []

            await asyncio.to_thread(sync_part)
        finally:
            await rep.close()


async def test_place_takes_the_clients_answer() -> None:
    """``place(client.lookup(...))``: the client's answer is the policies' input, loads and tiers included."""
    cfg = CoordinatorConfig(listen=f"127.0.0.1:{free_port()}", metrics_listen="", http_listen="")
    async with CoordinatorServer(cfg) as server:
        loads = {"busy": NodeLoad(running_requests=40, waiting_requests=30), "idle": NodeLoad()}
        reps = [Reporter([server.address], node_id=n, model="m", snapshot=lambda rank: [],
                         load=lambda n=n: loads[n])  # type: ignore[misc]
                for n in loads]
        for rep in reps:
            await rep.start()
        try:
            for rep in reps:
                await rep.wait_connected(10)
            reps[0].submit(0, [BlockStored(block_hashes=(1, 2, 3), parent_block_hash=None, token_ids=(),
                                           block_size=4, medium="CPU")])
            await reps[0].wait_acked(10)

            def sync_part() -> None:
                with CoordinatorClient(server.address) as c:
                    for n, load in loads.items():  # what the reporters' heartbeats also say
                        c.heartbeat(n, next(r.epoch for r in reps if r.node_id == n), load)
                    answer = c.lookup("m", hashes=[1, 2, 3], include_unmatched=True)
                    assert [(n.node_id, n.matched_blocks, n.tier_counts()) for n in answer.nodes] == [
                        ("busy", 3, (0, 3, 0)), ("idle", 0, (0, 0, 0))]
                    assert answer.nodes[0].load.in_flight == 70
                    # A 3-block CPU hit does not outweigh 70 requests queued ahead: the idle node wins.
                    assert place(answer).node_id == "idle"
                    assert place(c.lookup("m", hashes=[1, 2, 3])).node_id == "busy"  # matched nodes only
                    assert place(answer, LeastLoadedPolicy()).node_id == "idle"

            await asyncio.to_thread(sync_part)
        finally:
            for rep in reps:
                await rep.close()


async def test_both_clients_answer_alike_and_pass_a_dead_replica() -> None:
    """Both clients run the same calls under the same retry policy. Told a dead address first: a write
    fails there UNAVAILABLE and is not repeated; a read moves to the live replica, and every later call
    goes there."""
    cfg = CoordinatorConfig(listen=f"127.0.0.1:{free_port()}", metrics_listen="", http_listen="")
    async with CoordinatorServer(cfg) as server:
        rep = Reporter([server.address], node_id="n1", model="m", epoch=2, snapshot=lambda rank: [])
        await rep.start()
        try:
            await rep.wait_connected(10)
            rep.submit(0, [BlockStored(block_hashes=(7, 8), parent_block_hash=None, token_ids=(),
                                       block_size=4)])
            await rep.wait_acked(10)
            addresses = [f"127.0.0.1:{free_port()}", server.address]

            def summary(answer: LookupResult, nodes: list[NodeStatus], beat: HeartbeatResult) -> object:
                return ([(n.node_id, n.matched_blocks, n.tier_counts()) for n in answer.nodes],
                        [(n.node_id, n.epoch, n.state) for n in nodes], beat.known)

            def sync_part() -> object:
                with CoordinatorClient(addresses, timeout=10) as c:
                    with pytest.raises(CoordinatorError) as err:
                        c.drain("n1")
                    assert err.value.code == grpc.StatusCode.UNAVAILABLE
                    answer = c.lookup("m", hashes=[7, 8, 9])
                    c.ping()
                    return summary(answer, c.list_nodes(), c.heartbeat("n1", 2))

            got_sync = await asyncio.to_thread(sync_part)
            async with AsyncCoordinatorClient(addresses, timeout=10) as ac:
                with pytest.raises(CoordinatorError) as err:
                    await ac.remove("n1")
                assert err.value.code == grpc.StatusCode.UNAVAILABLE
                answer = await ac.lookup("m", hashes=[7, 8, 9], timeout=10)
                await ac.ping(timeout=10)
                raw = await ac.lookup_raw(build_lookup_request("m", hashes=[7, 8, 9]))
                got_async = summary(answer, await ac.list_nodes(), await ac.heartbeat("n1", 2))
            assert got_sync == got_async == ([("n1", 2, (2, 0, 0))], [("n1", 2, "active")], True)
            assert [(n.node_id, n.matched_blocks) for n in raw.nodes] == [("n1", 2)]
        finally:
            await rep.close()
