"""Issue 15 item 2: snapshots that never finish cannot hold unbounded memory.

Before: every stream could stage up to ``max_snapshot_blocks`` (16.7M blocks) of an unfinished snapshot,
two such streams took the coordinator to 5 GB, and an aborted stream's staged blocks stayed referenced
through the abort's traceback. Now one budget, ``max_staged_snapshot_blocks``, caps the blocks staged
over all streams: the stream that would pass it is refused (RESOURCE_EXHAUSTED, counted), a stream that
ends or is aborted releases its share at once (and, past one 512 KB chunk, asks for a reclaim: the ended
streams' garbage collected, then ``malloc_trim``).

A real ``kvcoord serve`` with its flags; agents are raw gRPC streams. Waits poll for their condition.
"""

from __future__ import annotations

import asyncio
import gc
import random
import weakref
from pathlib import Path

import grpc

from kvcoord.coordinator.reclaim import release_memory
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.wire import snapshot_to_proto
from tests.coordinator.test_hardening import DEADLINE, eventually, hello, scrape, status
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port

MODEL = "budget-model"
CHUNK = 50_000


def _chunk(rng: random.Random, final: bool = False, n: int = CHUNK) -> pb.AgentMessage:
    hashes = [rng.getrandbits(64) for _ in range(n)]
    return pb.AgentMessage(snapshot=snapshot_to_proto(1, 0, 0, hashes, (), final))


async def _open(stub: pbg.CoordinatorStub, node: str) -> grpc.aio.StreamStreamCall:
    call = stub.Ingest()
    await call.write(hello(node, MODEL))
    msg = await asyncio.wait_for(call.read(), DEADLINE)
    assert msg.WhichOneof("msg") == "welcome" and msg.welcome.snapshot_required, msg
    return call


def _refused(text: str) -> float:
    line = next(x for x in text.splitlines()
                if x.startswith('kvcoord_ingest_streams_refused_total{reason="snapshot_budget"}'))
    return float(line.split()[1])


async def test_one_budget_over_all_streams_and_released_when_a_stream_ends(tmp_path: Path) -> None:
    port, mport = free_port(), free_port()
    budget = 4 * CHUNK + CHUNK // 2  # four and a half chunks over all streams
    cmd = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}",
                      "--http-listen", "", "--max-staged-snapshot-blocks", str(budget))
    rng = random.Random(5)
    with running(cmd, log=tmp_path / "serve.log"):
        wait_for_port(port)
        wait_for_port(mport)
        assert _refused(scrape(mport)) == 0  # the series exists before any refusal
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                             options=[("grpc.max_send_message_length", 64 << 20)]) as ch:
            stub = pbg.CoordinatorStub(ch)
            a, b = await _open(stub, "node-a"), await _open(stub, "node-b")
            for _ in range(2):  # 2 + 2 chunks staged: under the budget
                await a.write(_chunk(rng))
                await b.write(_chunk(rng))
            c = await _open(stub, "node-c")
            await c.write(_chunk(rng))  # the fifth chunk passes it: this stream is refused
            code, details = await status(c)
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, (code, details)
            assert "snapshot staging is full" in details and "max_staged_snapshot_blocks" in details, details
            assert _refused(scrape(mport)) == 1
            # The others are still staging: one of them finishes, and its snapshot is applied.
            await a.write(_chunk(rng, final=True, n=10))
            msg = await asyncio.wait_for(a.read(), DEADLINE)
            assert msg.WhichOneof("msg") == "ack", msg
            # b goes away mid-snapshot: its share is released, so a new stream may stage again.
            b.cancel()

            async def admitted() -> bool:
                d = await _open(stub, "node-d")
                try:
                    for _ in range(4):
                        await d.write(_chunk(rng))
                    await d.write(_chunk(rng, final=True, n=10))
                    msg = await asyncio.wait_for(d.read(), DEADLINE)
                except grpc.aio.AioRpcError:
                    return False
                finally:
                    d.cancel()
                return msg.WhichOneof("msg") == "ack"

            await eventually(admitted, "a snapshot staged once the budget is released")
            a.cancel()
            # Only the finished snapshots reached the index: node-a's and node-d's, none of b's or c's.
            stats = await stub.Stats(pb.StatsRequest(), timeout=DEADLINE)
            assert stats.entries == (2 * CHUNK + 10) + (4 * CHUNK + 10), stats.entries


async def test_an_ended_snapshot_soon_collects_the_garbage_of_ended_streams() -> None:
    """An ended ingest RPC is a reference cycle inside grpc (its state, the abort's traceback, the frames
    holding its last message): ``release_memory``, asked for when a staged snapshot ends, collects such
    cycles soon instead of leaving them to the rare full collections (each wave of a flood stayed in
    the RSS)."""

    class Cycle:
        me: object = None

    gc.disable()  # only the reclaim may collect it
    try:
        garbage = Cycle()
        garbage.me = garbage
        gone = weakref.ref(garbage)
        del garbage
        release_memory()
        release_memory()  # coalesced with the first

        async def collected() -> bool:
            return gone() is None

        await eventually(collected, "the cycle collected by the reclaim")
    finally:
        gc.enable()
