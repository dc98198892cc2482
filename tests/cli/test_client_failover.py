"""Issue 15 item 4: a client given several replicas keeps answering reads when one dies.

Two real ``kvcoord serve`` replicas on one real Redis. The client is told both; the one it uses is
SIGKILLed. Its reads (lookups, stats, ping) move to the other within the call's deadline; a write
(DrainNode) is never repeated elsewhere; with no replica left, a read fails UNAVAILABLE.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.router.client import (
    AsyncCoordinatorClient,
    CoordinatorClient,
    CoordinatorError,
    replica_addresses,
)
from tests.procs import free_port, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import redis_server

MODEL = "failover-model"
PROFILE = HashProfile(algo="sha256_cbor", block_size=4, seed="7")
TOKENS = list(range(100, 132))


@contextlib.contextmanager
def two_replicas(tmp_path: Path) -> Iterator[list[tuple[str, subprocess.Popen[bytes]]]]:
    with redis_server() as redis, contextlib.ExitStack() as stack:
        out = []
        for name in ("a", "b"):
            port = free_port()
            proc = stack.enter_context(running(kvcoord_cmd(
                "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", "", "--http-listen", "",
                "--index", f"{redis.url}?timeout=2",
                "--model", f"{MODEL},algo=sha256_cbor,block_size=4,seed=7",
            ), log=tmp_path / f"serve-{name}.log"))
            wait_for_port(port)
            out.append((f"127.0.0.1:{port}", proc))
        yield out


def test_addresses_are_a_list_or_commas() -> None:
    assert replica_addresses("h1:1, h2:2,") == ["h1:1", "h2:2"]
    assert replica_addresses(["h1:1"]) == ["h1:1"]
    with pytest.raises(ValueError, match="no coordinator address"):
        replica_addresses(" , ")


def test_reads_move_to_the_live_replica_and_writes_do_not(tmp_path: Path) -> None:
    with two_replicas(tmp_path) as [(a, proc_a), (b, _)]:
        with CoordinatorClient(f"{a},{b}", timeout=15) as client, \
                CoordinatorClient(b, timeout=15) as only_b:
            first = client.stats().replica_id
            assert first and first != only_b.stats().replica_id  # it asks a first
            proc_a.send_signal(signal.SIGKILL)
            proc_a.wait()

            answer = client.lookup(MODEL, tokens=TOKENS)  # no error: answered by b
            assert answer.num_blocks == len(block_hashes64(PROFILE, TOKENS)) and answer.nodes == []
            assert client.stats().replica_id == only_b.stats().replica_id
            client.ping()
            assert client.list_nodes() == []

        with CoordinatorClient(f"{a},{b}", timeout=15) as writer, pytest.raises(CoordinatorError) as exc:
            writer.drain("some-node")  # a is dead; b would say NOT_FOUND, but a write is not repeated
        assert exc.value.code == grpc.StatusCode.UNAVAILABLE

        with CoordinatorClient(f"{a},127.0.0.1:{free_port()}", timeout=1) as none, \
                pytest.raises(CoordinatorError) as exc:
            none.ping()
        assert exc.value.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


async def test_the_async_client_moves_too(tmp_path: Path) -> None:
    with two_replicas(tmp_path) as [(a, proc_a), (b, _)]:
        async with AsyncCoordinatorClient([a, b], timeout=15) as client:
            before = (await client.stats()).replica_id
            proc_a.send_signal(signal.SIGKILL)
            proc_a.wait()
            answer = await client.lookup(MODEL, tokens=TOKENS)
            assert answer.nodes == []
            assert (await client.stats()).replica_id not in ("", before)
