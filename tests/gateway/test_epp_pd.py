"""``kvcoord epp`` with disaggregated pools, as a real process behind the test playing Envoy (the harness
and fleet of tests/gateway/test_epp.py: node-a holds PROMPT_A, node-b PROMPT_B): the pick is a decode node,
and
llm-d's ``x-prefiller-host-port`` names the prefill endpoint when the decode node lacks more of the prompt
than ``--max-local-prefill-tokens``."""

from __future__ import annotations

import asyncio
import subprocess
import time

import pytest

from tests.gateway.test_epp import MODEL, PROFILE, PROMPT_A, PROMPT_B, Fleet, buffered, chat, epp, set_headers
from tests.gateway.test_epp import fleet as fleet  # its module-scoped fixture, by name
from tests.procs import free_port, free_port_pair, kvcoord_cmd, running, wait_for_port


async def test_decode_pick_and_prefiller_header(fleet: Fleet) -> None:
    a, b = fleet.endpoints["node-a"], fleet.endpoints["node-b"]
    pools = ("--prefill-node", "node-a", "--decode-node", "node-b", "--max-local-prefill-tokens", "40")
    with epp(fleet, *pools, name="epp-pd") as address:
        # node-b (decode) lacks PROMPT_A, which node-a (prefill) holds: prefill there first
        _, second = await buffered(address, chat(PROMPT_A))
        headers = set_headers(second.request_body.response)
        assert headers["x-gateway-destination-endpoint"] == b
        assert headers["x-prefiller-host-port"] == a
        # node-b holds PROMPT_B: it prefills the rest alone, no prefill endpoint
        _, second = await buffered(address, chat(PROMPT_B))
        headers = set_headers(second.request_body.response)
        assert headers["x-gateway-destination-endpoint"] == b
        assert "x-prefiller-host-port" not in headers, headers


@pytest.mark.parametrize(("flags", "words"), [
    (("--prefill-node", "a"), "--prefill-node needs --decode-node"),
    (("--prefill-node", "a", "--decode-node", "a"), "node a is in both"),
])
def test_pd_flag_mistakes_are_one_line(flags: tuple[str, ...], words: str) -> None:
    out = subprocess.run(kvcoord_cmd("epp", "--coordinator", "127.0.0.1:1", *flags), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], out.stderr


async def test_pools_from_the_roles_the_agents_declare(fleet: Fleet) -> None:
    """Last (it adds a node): without pool flags, a third engine whose agent says ``--role prefill`` is
    the prefill pool and node-a and node-b (no role) the decode pool, as llm-d's filters read them."""
    http, pub = free_port(), free_port_pair()
    with running(kvcoord_cmd("sim-engine", "--zmq-bind", f"tcp://127.0.0.1:{pub}", "--replay-bind",
                             f"tcp://127.0.0.1:{pub + 1}", "--model", MODEL, *PROFILE, "--http-listen",
                             f"127.0.0.1:{http}", "--rate", "0", "--requests", "0"),
                 log=fleet.tmp / "node-p-engine.log"):
        wait_for_port(http, timeout=30)
        agent = kvcoord_cmd("agent", "--coordinator", fleet.coordinator, "--node-id", "node-p",
                            "--model", MODEL,
                            "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint",
                            f"tcp://127.0.0.1:{pub + 1}", "--role", "prefill", "--serving-url",
                            f"http://127.0.0.1:{http}")
        with running(agent, log=fleet.tmp / "node-p-agent.log"), \
                epp(fleet, "--max-local-prefill-tokens", "40", "--refresh-interval", "0.2",
                    name="epp-roles") as address:
            deadline = time.monotonic() + 120
            while True:  # until the node list names node-p's role
                _, second = await buffered(address, chat(PROMPT_A + " and a long new question " * 20))
                headers = set_headers(second.request_body.response)
                if headers.get("x-prefiller-host-port") == f"127.0.0.1:{http}":
                    break
                assert time.monotonic() < deadline, headers
                await asyncio.sleep(0.2)
            assert headers["x-gateway-destination-endpoint"] in fleet.endpoints.values()
            _, second = await buffered(address, chat(PROMPT_B))  # node-b holds it: no remote prefill
            headers = set_headers(second.request_body.response)
            assert headers["x-gateway-destination-endpoint"] == fleet.endpoints["node-b"]
            assert "x-prefiller-host-port" not in headers, headers
