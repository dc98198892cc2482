"""Per-node trust states (exact, resyncing, degraded, approximate) over a real in-process coordinator.

Each node is driven by a hand-written ingest stream (``tests.coordinator.test_coordinator_ingest.Agent``),
and the
trust is read back through every surface: gRPC Lookup, ListNodes and Stats, HTTP ``/query``, the
client's JSON (``kvcoord nodes``, a real subprocess), the ``kvcoord_nodes_by_trust`` gauge, and another
replica's answers (the shared node directory in Redis).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc

from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.registry import NO_KV_EVENTS
from kvcoord.coordinator.server import CoordinatorServer
from kvcoord.events import BlockStored
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.index.memory import MemoryIndex
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.router.policy import place
from tests.coordinator.test_coordinator_ingest import MODEL, Agent, Coord, ack_seq, stored, until, wire_event
from tests.procs import kvcoord_cmd
from tests.redis_servers import RedisServer

BS = 4
PROFILE = HashProfile("sha256_cbor", BS, seed="42")
SPEC = f"{MODEL},algo=sha256_cbor,block_size={BS},seed=42"
TOKENS = list(range(100, 116))  # 4 blocks
HASHES = [int(h) for h in block_hashes64(PROFILE, TOKENS)]
WRONG_ALGO = pb.HashProfile(algo="xxhash", block_size=BS, style="untagged")
"""What an agent whose engine hashes with another algorithm announces: degraded from its Hello on."""


def chain(hashes: list[int], *, sampled: bool) -> pb.KVEvent:
    """The 4-block chain as a wire BlockStored; ``sampled`` carries its tokens for verification."""
    ev = BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=tuple(TOKENS),
                     block_size=BS, medium="GPU", lora_name=None, extra_keys=(None,) * len(hashes))
    return wire_event(ev) if sampled else stored(hashes, medium="GPU", block_size=BS)


@contextlib.asynccontextmanager
async def coordinator(**overrides: Any) -> AsyncIterator[Coord]:
    ov: dict[str, Any] = {"listen": "127.0.0.1:0", "metrics_listen": "", "http_listen": "127.0.0.1:0",
                          "models": [SPEC], **overrides}
    index = MemoryIndex() if "index" not in ov else None
    server = CoordinatorServer(load_config(None, env={}, overrides=ov), index=index)
    await server.start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield Coord(server, channel, pbg.CoordinatorStub(channel), index)  # type: ignore[arg-type]
    finally:
        await channel.close()
        await server.stop()


async def degraded_by_verification(c: Coord, node: str) -> str:
    """A node whose sampled chain does not hash to what it published: the notice's reason."""
    a = Agent(c, node)
    await a.start()
    wrong = [h ^ 1 for h in HASHES]
    await a.send(batch=pb.EventBatch(seq=1, events=[chain(wrong, sampled=True)], sampled=True))
    notice = await a.recv()
    assert notice.WhichOneof("msg") == "notice" and notice.notice.state == "hash_mismatch", notice
    assert ack_seq(await a.recv()) == 1
    return str(notice.notice.message)


async def fleet(c: Coord) -> dict[str, Agent]:
    """exact: in sync; degraded: announced a profile that cannot match (its hashes are the right ones,
    so lookups find it); verify: its sampled chain failed; resync: said Hello, no snapshot yet."""
    ok, bad, waiting = Agent(c, "exact"), Agent(c, "degraded"), Agent(c, "resync")
    await ok.start()
    welcome = await bad.hello(profile=WRONG_ALGO)
    assert "algorithm" in welcome.hash_mismatch and welcome.snapshot_required
    await bad.snapshot(0)
    for a in (ok, bad):
        assert ack_seq(await a.batch(1, [chain(HASHES, sampled=False)])) == 1
    await degraded_by_verification(c, "verify")
    assert (await waiting.hello()).snapshot_required
    return {"exact": ok, "degraded": bad, "resync": waiting}


def gauge(c: Coord, trust: str) -> float | None:
    assert c.server.state is not None
    return c.server.state.metrics.registry.get_sample_value("kvcoord_nodes_by_trust", {"trust": trust})


async def test_every_surface_says_each_nodes_trust() -> None:
    async with coordinator() as c:
        assert {t: gauge(c, t) for t in ("exact", "resyncing", "degraded", "approximate")} == dict.fromkeys(
            ("exact", "resyncing", "degraded", "approximate"), 0.0)
        agents = await fleet(c)
        # gRPC Lookup: the degraded node is still answered (live), and says so.
        resp = await c.lookup_hashes(HASHES)
        assert sorted((n.node_id, n.matched_blocks, n.trust, n.trust_cause) for n in resp.nodes) == [
            ("degraded", 4, "degraded", "hash_mismatch"), ("exact", 4, "exact", "")]
        resp = await c.lookup_hashes(HASHES, include_unmatched=True)
        assert {n.node_id: (n.trust, n.trust_cause) for n in resp.nodes} == {
            "degraded": ("degraded", "hash_mismatch"), "exact": ("exact", ""),
            "verify": ("degraded", "hash_mismatch")}
        # ListNodes and Stats.
        for nodes in ((await c.stub.ListNodes(pb.ListNodesRequest())).nodes, (await c.stats()).nodes):
            got = {n.node_id: (n.state, n.trust) for n in nodes}
            assert got == {"exact": ("active", "exact"), "degraded": ("hash_mismatch", "degraded"),
                           "verify": ("hash_mismatch", "degraded"), "resync": ("resyncing", "resyncing")}
            why = {n.node_id: n.trust_reason for n in nodes}
            assert {n.node_id: n.trust_cause for n in nodes} == {
                "exact": "", "degraded": "hash_mismatch", "verify": "hash_mismatch", "resync": ""}
            assert why["exact"] == "" and why["resync"] == "waiting for the node's snapshot"
            assert why["degraded"].startswith("algorithm: the engine hashes with xxhash")
            assert why["verify"] == next(n.hash_mismatch_reason for n in nodes if n.node_id == "verify")
            assert why["verify"]
        # HTTP /query (by tokens) and /query_by_hash.
        async with aiohttp.ClientSession() as s:
            base = f"http://127.0.0.1:{c.server.http_port}"
            for path, body in (("/query", {"token_ids": TOKENS, "model_name": MODEL}),
                               ("/query_by_hash", {"block_hashes": HASHES, "model_name": MODEL})):
                async with s.post(base + path, json=body) as r:
                    assert r.status == 200, await r.text()
                    nodes = (await r.json())["nodes"]
                got = {n["node_id"]: (n["trust"], n.get("trust_cause")) for n in nodes}
                assert got == {"exact": ("exact", None), "degraded": ("degraded", "hash_mismatch")}, path
        # The gauge: expired nodes aside, every node once.
        assert {t: gauge(c, t) for t in ("exact", "resyncing", "degraded", "approximate")} == {
            "exact": 1.0, "resyncing": 1.0, "degraded": 2.0, "approximate": 0.0}
        # The client's types, the policies on them, and `kvcoord nodes` (a real process).
        async with AsyncCoordinatorClient(c.server.address) as client:
            stats = await client.stats()
            assert {n.node_id: n.to_json()["trust"] for n in stats.nodes}["degraded"] == "degraded"
            answer = await client.lookup(MODEL, tokens=TOKENS)
            assert {n.node_id: (n.trust, n.trust_cause) for n in answer.nodes} == {
                "exact": ("exact", ""), "degraded": ("degraded", "hash_mismatch")}
            assert place(answer, degraded="trust").node_id in {"exact", "degraded"}
            assert place(answer).node_id == "exact"  # discounted: the exact node holds more
        proc = await asyncio.create_subprocess_exec(*kvcoord_cmd("nodes", "--coordinator", c.server.address),
                                                    stdout=asyncio.subprocess.PIPE)
        out, _ = await proc.communicate()
        assert proc.returncode == 0
        listed = {n["node_id"]: (n["trust"], n["trust_reason"]) for n in json.loads(out)["nodes"]}
        assert {n["node_id"]: n["trust_cause"] for n in json.loads(out)["nodes"]}["verify"] == "hash_mismatch"
        assert listed["resync"] == ("resyncing", "waiting for the node's snapshot")
        assert listed["degraded"][0] == "degraded" and listed["exact"] == ("exact", "")
        for a in agents.values():
            await a.close()


async def test_degraded_ends_with_a_new_epoch_not_with_a_reconnect() -> None:
    async with coordinator() as c:
        reason = await degraded_by_verification(c, "n1")
        assert (await c.node("n1")).trust_reason == reason
        # The same engine process (same epoch) reconnecting: its hashes have not changed, it stays degraded.
        again = Agent(c, "n1")
        welcome = await again.hello(next_seq=2)
        assert not welcome.snapshot_required and welcome.hash_mismatch == reason
        assert ((await c.node("n1")).trust, gauge(c, "degraded")) == ("degraded", 1.0)
        # A new epoch (the engine restarted, perhaps with the right seed): verified afresh, resyncing until
        # its snapshot, then exact.
        fresh = Agent(c, "n1", epoch=2)
        welcome = await fresh.hello()
        assert welcome.snapshot_required and not welcome.hash_mismatch
        info = await c.node("n1")
        assert (info.trust, info.trust_reason, info.hash_mismatch) == (
            "resyncing", "waiting for the node's snapshot", False)
        assert (gauge(c, "degraded"), gauge(c, "resyncing")) == (0.0, 1.0)
        await fresh.snapshot(0)
        assert ack_seq(await fresh.batch(1, [chain(HASHES, sampled=True)])) == 1  # verifies this time
        info = await c.node("n1")
        assert (info.state, info.trust, info.trust_reason) == ("active", "exact", "")
        assert (gauge(c, "exact"), gauge(c, "resyncing")) == (1.0, 0.0)
        assert [n.trust for n in (await c.lookup_hashes(HASHES)).nodes] == ["exact"]
        for a in (again, fresh):
            await a.close()


async def test_another_replica_reports_the_owners_trust(redis_server: RedisServer) -> None:
    """Replica b holds no stream of the node: its ListNodes and lookups say what the owner published."""
    ov = {"index": redis_server.url, "index_key_prefix": f"trust-{uuid.uuid4().hex[:8]}"}
    async with coordinator(**ov) as a, coordinator(**ov) as b:
        await degraded_by_verification(a, "n1")
        ok = Agent(a, "n2")
        await ok.start()
        assert ack_seq(await ok.batch(1, [chain(HASHES, sampled=False)])) == 1
        blind = Agent(a, "n3")
        await blind.hello(no_kv_events=True)
        await blind.snapshot(0)

        async def seen() -> bool:
            nodes = (await b.stub.ListNodes(pb.ListNodesRequest())).nodes
            return {n.node_id: n.trust for n in nodes} == {
                "n1": "degraded", "n2": "exact", "n3": "approximate"}

        await until(seen, timeout=15.0)
        info = await b.node("n1")
        assert info.replica and info.trust_reason == (await a.node("n1")).trust_reason
        resp = await b.lookup_hashes(HASHES, include_unmatched=True)
        assert {n.node_id: (n.trust, n.trust_cause) for n in resp.nodes} == {
            "n1": ("degraded", "hash_mismatch"), "n2": ("exact", ""), "n3": ("approximate", "")}
        assert (await b.node("n3")).trust_reason == NO_KV_EVENTS
        await ok.close()
        await blind.close()



async def test_a_node_without_kv_events_is_approximate_and_holds_nothing() -> None:
    """An agent whose engine publishes no KV events says so in its Hello: after its (empty) snapshot the
    node is live and ``approximate`` everywhere; a batch or a snapshot block from it is refused with the
    index unchanged; a Hello with events (a new epoch) makes it an ordinary node again."""
    async with coordinator() as c:
        ok = Agent(c, "exact")
        await ok.start()
        assert ack_seq(await ok.batch(1, [chain(HASHES, sampled=False)])) == 1
        blind = Agent(c, "blind")
        assert (await blind.hello(no_kv_events=True)).snapshot_required
        assert (await c.node("blind")).trust == "resyncing"
        await blind.snapshot(0)
        info = await c.node("blind")
        assert (info.state, info.trust, info.trust_cause) == ("active", "approximate", "")
        assert info.trust_reason == NO_KV_EVENTS and "no KV events" in NO_KV_EVENTS
        assert (gauge(c, "approximate"), gauge(c, "exact")) == (1.0, 1.0)
        resp = await c.lookup_hashes(HASHES, include_unmatched=True)
        assert {n.node_id: (n.matched_blocks, n.trust) for n in resp.nodes} == {
            "exact": (4, "exact"), "blind": (0, "approximate")}
        assert {n.node_id: n.trust for n in (await c.stats()).nodes}["blind"] == "approximate"
        async with AsyncCoordinatorClient(c.server.address) as client:
            answer = await client.lookup(MODEL, hashes=HASHES, include_unmatched=True)
            assert {n.node_id: n.trust for n in answer.nodes} == {"exact": "exact", "blind": "approximate"}
        before = await c.stats()
        # A batch: refused, nothing applied.
        await blind.send(batch=pb.EventBatch(seq=1, events=[chain(HASHES, sampled=False)], ts=1.0))
        err = await blind.aborted()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "no_kv_events" in (err.details() or "")
        # A snapshot with blocks: refused too, on a new stream of the same process.
        again = Agent(c, "blind")
        await again.hello(no_kv_events=True)
        block = pb.Snapshot(epoch=1, seq=0, dp_rank=0, block_hashes=b"\x01" * 8, final=True)
        await again.send(snapshot=block)
        err = await again.aborted()
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "heartbeats and empty snapshots" in (
            err.details() or "")
        # An empty snapshot with a lost-history mark (it would make the node degraded): refused too.
        marked = Agent(c, "blind")
        await marked.hello(no_kv_events=True)
        mark = pb.Snapshot(epoch=1, seq=0, dp_rank=0, final=True, history_lost="gone")
        await marked.send(snapshot=mark)
        assert (await marked.aborted()).code() == grpc.StatusCode.INVALID_ARGUMENT
        after = await c.stats()
        assert (after.entries, after.blocks) == (before.entries, before.blocks)
        assert [n.node_id for n in (await c.lookup_hashes(HASHES)).nodes] == ["exact"]
        # The engine restarted with KV events: an ordinary node once its snapshot is in.
        fresh = Agent(c, "blind", epoch=2)
        await fresh.start()
        assert ack_seq(await fresh.batch(1, [chain(HASHES, sampled=False)])) == 1
        info = await c.node("blind")
        assert (info.trust, info.trust_reason) == ("exact", "")
        assert gauge(c, "approximate") == 0.0
        for a in (ok, blind, again, marked, fresh):
            await a.close()
