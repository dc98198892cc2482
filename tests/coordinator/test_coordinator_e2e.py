"""End to end (issue 4's "Done when"): ``kvcoord serve`` as a subprocess, agents streaming through the
real reporter, ``kvcoord lookup``/``kvcoord stats`` as subprocesses. The expected answers come from the
real vLLM engine fixture (Qwen3-0.6B, sha256_cbor, seed "42", 16-token blocks)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from kvcoord.agent.link import ReporterOptions
from kvcoord.agent.reporter import Reporter
from kvcoord.events import BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.router.client import AsyncCoordinatorClient, CoordinatorError
from kvcoord.transport import ChannelSecurity
from kvcoord.validate import pack_u64
from kvcoord.wire import events_to_proto
from tests.procs import FIXTURES, free_port, kvcoord_cmd, make_certs, running, wait_for_port

pytestmark = pytest.mark.slow

FX = json.loads((FIXTURES / "vllm-engine" / "kv_event_base.json").read_text())
MODEL: str = FX["model_name"]
HASHES: list[int] = FX["block_hashes"]
TOKENS: list[int] = FX["token_ids"]
BS: int = FX["block_size"]
N = len(HASHES)
FAST = ReporterOptions(flush_interval=0.005, backoff_initial=0.05, backoff_max=0.3)


def stored(lo: int, hi: int) -> BlockStored:
    """The fixture's BlockStored, cut to blocks [lo, hi) with the right parent and token ids."""
    return BlockStored(block_hashes=tuple(HASHES[lo:hi]), parent_block_hash=HASHES[lo - 1] if lo else None,
                       token_ids=tuple(TOKENS[lo * BS:hi * BS]), block_size=BS, medium=FX["medium"])


def removed(*idx: int, medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved(block_hashes=tuple(HASHES[i] for i in idx), medium=medium)


class Agent:
    """A test engine: a mirror of its blocks (the snapshot source) and a reporter streaming its events."""

    def __init__(self, address: str, node_id: str, *, epoch: int, security: ChannelSecurity | None = None,
                 options: ReporterOptions = FAST) -> None:
        self.blocks: dict[int, Tier] = {}
        self.reporter = Reporter([address], node_id=node_id, model=MODEL, epoch=epoch,
                                 snapshot=lambda rank: sorted(self.blocks.items()), security=security,
                                 options=options)

    def submit(self, events: list[KVEvent]) -> None:
        for ev in events:
            if isinstance(ev, BlockStored):
                self.blocks.update(dict.fromkeys((int(h) for h in ev.block_hashes), Tier.GPU))
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self.blocks.pop(int(h), None)
        self.reporter.submit(0, events)


@contextlib.asynccontextmanager
async def agent(address: str, node_id: str, epoch: int, **kw: Any) -> AsyncIterator[Agent]:
    a = Agent(address, node_id, epoch=epoch, **kw)
    await a.reporter.start()
    try:
        yield a
    finally:
        await a.reporter.close()


@dataclass
class Coordinator:
    address: str
    proc: subprocess.Popen[bytes]
    log: Path


def write_config(path: Path, port: int, metrics: int, extra: str = "", lease: float = 10.0) -> None:
    path.write_text(f"""
listen = "127.0.0.1:{port}"
metrics_listen = "127.0.0.1:{metrics}"
lease_seconds = {lease}
{extra}
[models."{MODEL}"]
algo = "sha256_cbor"
block_size = {BS}
seed = "42"
""")


@contextlib.contextmanager
def serve(tmp: Path, extra: str = "", lease: float = 10.0, port: int | None = None) -> Iterator[Coordinator]:
    port = port or free_port()
    cfg = tmp / f"kvcoord-{port}.toml"
    write_config(cfg, port, free_port(), extra, lease)
    log = tmp / f"serve-{port}.log"
    with running(kvcoord_cmd("serve", "--config", str(cfg)), log=log) as proc:
        try:
            wait_for_port(port, timeout=20)
        except TimeoutError:
            raise AssertionError(f"kvcoord serve did not start:\n{log.read_text()}") from None
        yield Coordinator(f"127.0.0.1:{port}", proc, log)


async def cli(*args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(*kvcoord_cmd(*args), stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def lookup_cli(address: str, tokens: list[int], *extra: str) -> dict[str, Any]:
    rc, out, err = await cli("lookup", "--coordinator", address, "--model", MODEL,
                             "--tokens", ",".join(map(str, tokens)), *extra)
    assert rc == 0, err
    result: dict[str, Any] = json.loads(out)
    return result


def matches(result: dict[str, Any]) -> dict[str, int]:
    return {n["node_id"]: n["matched_blocks"] for n in result["nodes"]}


async def until(cond: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if asyncio.iscoroutine(v):
            v = await v
        if v:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


async def current(client: AsyncCoordinatorClient, tokens: list[int] = TOKENS) -> dict[str, int]:
    r = await client.lookup(MODEL, tokens=tokens)
    return {n.node_id: n.matched_blocks for n in r.nodes}


def test_fixture_hashes_match_the_profile() -> None:
    """The expectation below is sound: the coordinator's profile reproduces the engine's hashes."""
    from kvcoord.hashing import HashProfile, block_hashes64

    profile = HashProfile(algo="sha256_cbor", block_size=BS, seed="42")
    assert block_hashes64(profile, TOKENS) == HASHES


async def test_two_agents_store_remove_and_lookup_by_tokens(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        async with agent(co.address, "node-a", 1) as a, agent(co.address, "node-b", 1) as b, \
                AsyncCoordinatorClient(co.address) as client:
            a.submit([stored(0, 10)])
            a.submit([stored(10, N)])
            b.submit([stored(0, 10)])
            await a.reporter.wait_acked(10)
            await b.reporter.wait_acked(10)

            full = await lookup_cli(co.address, TOKENS)
            assert full["model"] == MODEL and full["block_size"] == BS and full["num_blocks"] == N
            assert [n["node_id"] for n in full["nodes"]] == ["node-a", "node-b"]  # best first
            a_entry = full["nodes"][0]
            assert a_entry["dp_rank"] == 0 and a_entry["matched_blocks"] == N
            assert a_entry["tiers"]["GPU"] == N and a_entry["tiers"].get("CPU", 0) == 0
            assert full["nodes"][1]["matched_blocks"] == 10

            # 200 tokens: 12 full blocks (the partial 13th is not part of any query)
            part = await lookup_cli(co.address, TOKENS[:200])
            assert part["num_blocks"] == 12 and matches(part) == {"node-a": 12, "node-b": 10}

            a.submit([removed(*range(20, N))])
            b.submit([removed(3)])
            await a.reporter.wait_acked(10)
            await b.reporter.wait_acked(10)
            assert matches(await lookup_cli(co.address, TOKENS)) == {"node-a": 20, "node-b": 3}
            # a different LoRA is a different keyspace: nothing matches
            assert matches(await lookup_cli(co.address, TOKENS, "--lora-name", "Alice")) == {}

            rc, out, err = await cli("stats", "--coordinator", co.address)
            assert rc == 0, err
            stats = json.loads(out)
            assert stats["entries"] == 20 + 9
            states = {n["node_id"]: n["state"] for n in stats["nodes"]}
            assert states == {"node-a": "active", "node-b": "active"}
            assert stats["hash_mismatches"] == 0

            # bad input: one-line error, non-zero exit, and the index is unchanged
            rc, out, err = await cli("lookup", "--coordinator", co.address, "--model", MODEL,
                                     "--tokens", "1,x")
            assert rc == 2 and out == "" and "item 1 'x' is not an integer" in err
            assert len(err.splitlines()) == 1
            big = tmp_path / "big.json"
            big.write_text(json.dumps([1] * BS * 9000))  # more blocks than max_query_blocks (8192)
            rc, out, err = await cli("lookup", "--coordinator", co.address, "--model", MODEL,
                                     "--tokens-file", str(big))
            assert rc == 1 and "INVALID_ARGUMENT" in err and len(err.strip().splitlines()) == 1
            assert await current(client) == {"node-a": 20, "node-b": 3}


async def test_lease_expiry_and_return(tmp_path: Path) -> None:
    with serve(tmp_path, lease=1.0) as co:
        async with AsyncCoordinatorClient(co.address) as client, agent(co.address, "node-b", 1) as b:
            b.submit([stored(0, 5)])
            async with agent(co.address, "node-a", 1) as a:
                a.submit([stored(0, N)])
                await a.reporter.wait_acked(10)
                await b.reporter.wait_acked(10)
                assert await current(client) == {"node-a": N, "node-b": 5}
            # node-a stopped heart-beating; node-b keeps its lease alive with heartbeats (lease / 3)
            # Lease 1 s; the deadline is generous for a loaded CI machine (the check is that it expires).
            await until(lambda: _without(client, "node-a"), timeout=10, what="node-a to expire")
            assert await current(client) == {"node-b": 5}
            stats = await client.stats()
            states = {n.node_id: n.state for n in stats.nodes}
            assert states["node-b"] == "active" and states.get("node-a", "expired") == "expired"

            async def counted() -> bool:
                return (await client.stats()).leases_expired >= 1

            await until(counted, timeout=5, what="leases_expired to count node-a")
            # it comes back only through a new Hello and snapshot
            async with agent(co.address, "node-a", 2) as a2:
                a2.submit([stored(0, 7)])
                await a2.reporter.wait_acked(10)
                assert await current(client) == {"node-a": 7, "node-b": 5}


async def _without(client: AsyncCoordinatorClient, node: str) -> bool:
    return node not in await current(client)


async def test_gap_leads_to_snapshot(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        async with AsyncCoordinatorClient(co.address) as client:
            channel = grpc.aio.insecure_channel(co.address)
            try:
                call = pbg.CoordinatorStub(channel).Ingest()

                def batch(seq: int, *events: KVEvent) -> pb.AgentMessage:
                    return pb.AgentMessage(batch=pb.EventBatch(seq=seq, ts=time.time(), dp_rank=0,
                                                               events=events_to_proto(events)))

                await call.write(pb.AgentMessage(hello=pb.Hello(node_id="node-g", model=MODEL, dp_ranks=[0],
                                                                epoch=5, next_seq=1)))
                welcome = (await call.read()).welcome
                assert welcome.snapshot_required and welcome.lease_seconds == 10
                await call.write(pb.AgentMessage(snapshot=pb.Snapshot(epoch=5, seq=0, dp_rank=0, final=True)))
                assert (await call.read()).ack.seq == 0
                await call.write(batch(1, stored(0, 5)))
                assert (await call.read()).ack.seq == 1
                await call.write(batch(3, stored(5, 10)))  # seq 2 never arrives
                req = await call.read()
                assert req.WhichOneof("msg") == "snapshot_request" and "gap" in req.snapshot_request.reason
                await call.write(batch(4, stored(10, 12)))  # discarded until the snapshot
                # a resyncing node's entries are stale: it is out of answers until its snapshot lands
                assert await current(client) == {}
                assert [(n.node_id, n.state) for n in await client.list_nodes()] == [("node-g", "resyncing")]
                for lo, hi, final in ((0, 6, False), (6, 12, True)):
                    await call.write(pb.AgentMessage(snapshot=pb.Snapshot(
                        epoch=5, seq=4, dp_rank=0, block_hashes=pack_u64(HASHES[lo:hi]),
                        tiers=bytes([pb.TIER_CPU] * (hi - lo)), final=final)))
                ack = await call.read()
                assert ack.WhichOneof("msg") == "ack" and ack.ack.seq == 4
                r = await client.lookup(MODEL, tokens=TOKENS)
                got = [(n.node_id, n.matched_blocks, n.tiers_by_name()["CPU"]) for n in r.nodes]
                assert got == [("node-g", 12, 12)]
                await call.write(batch(5, removed(11)))  # held on CPU: a GPU removal is a no-op
                assert (await call.read()).ack.seq == 5
                assert await current(client) == {"node-g": 12}
                await call.write(batch(6, removed(11, medium="CPU")))
                assert (await call.read()).ack.seq == 6
                assert await current(client) == {"node-g": 11}
                call.cancel()
            finally:
                await channel.close()


async def test_agent_restart_with_new_epoch_replaces_entries(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        async with AsyncCoordinatorClient(co.address) as client:
            async with agent(co.address, "node-a", 100) as a:
                a.submit([stored(0, N)])
                await a.reporter.wait_acked(10)
            assert await current(client) == {"node-a": N}
            # the engine restarted with an empty cache and has stored 4 blocks since
            async with agent(co.address, "node-a", 200) as a2:
                a2.submit([stored(0, 4)])
                await a2.reporter.wait_acked(10)
                assert a2.reporter.stats().links[0].snapshots_sent >= 1
                assert await current(client) == {"node-a": 4}
                nodes = await client.list_nodes()
                assert [(n.node_id, n.epoch) for n in nodes] == [("node-a", 200)]


async def test_reporter_refills_a_restarted_coordinator(tmp_path: Path) -> None:
    port = free_port()
    with serve(tmp_path, port=port) as co:
        async with agent(co.address, "node-a", 1) as a:
            a.submit([stored(0, 10)])
            await a.reporter.wait_acked(10)
            co.proc.send_signal(signal.SIGTERM)
            co.proc.wait(5)
            a.submit([stored(10, N)])  # while the coordinator is down
            with serve(tmp_path, port=port) as co2:
                await a.reporter.wait_acked(15)
                async with AsyncCoordinatorClient(co2.address) as client:
                    assert await current(client) == {"node-a": N}
                st = a.reporter.stats().links[0]
                assert st.reconnects >= 1 and st.snapshots_sent >= 2


async def test_tls(tmp_path: Path) -> None:
    pki = make_certs(tmp_path / "pki")
    cert, key, ca = pki["server_crt"], pki["server_key"], pki["ca_crt"]
    with serve(tmp_path, extra=f'[tls]\ncert = "{cert}"\nkey = "{key}"\n') as co:
        sec = ChannelSecurity(root_ca=str(ca))
        async with agent(co.address, "node-a", 1, security=sec) as a:
            a.submit([stored(0, 8)])
            await a.reporter.wait_acked(10)
        assert matches(await lookup_cli(co.address, TOKENS, "--tls-ca", str(ca))) == {"node-a": 8}
        rc, _, err = await cli("lookup", "--coordinator", co.address, "--model", MODEL, "--tokens", "1,2",
                               "--timeout", "3")
        assert rc == 1 and "UNAVAILABLE" in err


async def test_token_bound_to_another_node(tmp_path: Path) -> None:
    extra = ('[[auth.agent_tokens]]\ntoken = "tok-a"\nnodes = ["node-a"]\n'
             '[[auth.router_tokens]]\ntoken = "tok-r"\n')
    with serve(tmp_path, extra=extra) as co:
        router = ChannelSecurity(token="tok-r")
        async with AsyncCoordinatorClient(co.address, security=router) as client:
            async with agent(co.address, "node-a", 1, security=ChannelSecurity(token="tok-a")) as a:
                a.submit([stored(0, 6)])
                await a.reporter.wait_acked(10)
            # node-b publishing with node-a's token: PERMISSION_DENIED on the raw stream...
            channel = grpc.aio.insecure_channel(co.address)
            try:
                call = pbg.CoordinatorStub(channel).Ingest(metadata=(("authorization", "Bearer tok-a"),))
                await call.write(pb.AgentMessage(hello=pb.Hello(node_id="node-b", model=MODEL, dp_ranks=[0],
                                                                epoch=1, next_seq=1)))
                # (nothing more is written: a write racing the server's refusal ends the call locally
                # with INTERNAL instead of the server's status)
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    while True:
                        msg = await call.read()
                        assert msg is not grpc.aio.EOF, "stream ended without an error status"
                assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
                assert "node-b" in (err.value.details() or "")
            finally:
                await channel.close()
            # ...and through the reporter, which keeps retrying without ever applying anything
            async with agent(co.address, "node-b", 1, security=ChannelSecurity(token="tok-a")) as b:
                b.submit([stored(0, N)])
                await until(lambda: "PERMISSION_DENIED" in b.reporter.stats().links[0].last_error,
                            what="the reporter to see PERMISSION_DENIED")
            assert await current(client) == {"node-a": 6}
            stats = await client.stats()
            assert stats.entries == 6 and [n.node_id for n in stats.nodes] == ["node-a"]
            # the router token may only query
            with pytest.raises(CoordinatorError) as cerr:
                await client.remove("node-a")
            assert cerr.value.code == grpc.StatusCode.PERMISSION_DENIED
            assert await current(client) == {"node-a": 6}
        rc, _, err_text = await cli("stats", "--coordinator", co.address)
        assert rc == 1 and "UNAUTHENTICATED" in err_text
        rc, out, _ = await cli("stats", "--coordinator", co.address, "--token", "tok-r")
        assert rc == 0 and json.loads(out)["entries"] == 6


async def test_sigterm_stops_server_promptly(tmp_path: Path) -> None:
    with serve(tmp_path) as co:
        async with agent(co.address, "node-a", 1) as a:
            a.submit([stored(0, 3)])
            await a.reporter.wait_acked(10)
            os.killpg(co.proc.pid, signal.SIGTERM)
            # Generous bound for a loaded CI machine (about 0.1 s measured); the checks are the clean
            # exit and that nothing of the process group remains.
            await asyncio.to_thread(co.proc.wait, 5)
            assert co.proc.returncode == 0
            with pytest.raises(ProcessLookupError):
                os.killpg(co.proc.pid, 0)  # nothing of its process group remains
