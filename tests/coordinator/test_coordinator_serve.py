"""``kvcoord serve`` as a real subprocess: health, reflection, metrics, TLS/mTLS, config, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.config_values import ConfigError
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.validate import pack_u64
from kvcoord.wire import pack_tokens
from tests.http_util import get_text, http_request
from tests.procs import free_port, kvcoord_cmd, make_certs, running, stop, until, wait_for_port

TIMEOUT = 5.0
STOP_BOUND = 5.0
"""Seconds SIGTERM may take in a test (generous for a loaded CI machine; about 0.1-0.3 s measured)."""


def _serve(
    tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[list[str], int, int, Path]:
    port, mport = free_port(), free_port()
    cmd = kvcoord_cmd(
        "serve", "--listen", f"127.0.0.1:{port}", "--metrics-listen", f"127.0.0.1:{mport}", *extra
    )
    return cmd, port, mport, tmp_path / "serve.log"


def _metrics(mport: int) -> str:
    return get_text(f"http://127.0.0.1:{mport}/metrics", timeout=TIMEOUT)


def _ingest_one(stub: pbg.CoordinatorStub, node: str = "n1") -> list[pb.CoordinatorMessage]:
    msgs = [
        pb.AgentMessage(hello=pb.Hello(node_id=node, model="m", epoch=1, next_seq=1)),
        pb.AgentMessage(snapshot=pb.Snapshot(epoch=1, seq=0, final=True)),
        pb.AgentMessage(
            batch=pb.EventBatch(
                seq=1,
                ts=time.time(),
                events=[pb.KVEvent(stored=pb.BlockStored(block_hashes=pack_u64([1, 2]), block_size=4))],
            )
        ),
    ]
    return list(stub.Ingest(iter(msgs), timeout=TIMEOUT))


def test_serve_health_reflection_metrics_and_sigterm(tmp_path: Path) -> None:
    cmd, port, mport, log = _serve(tmp_path, "--model", "m,algo=sha256_cbor,block_size=4,seed=1")
    with running(cmd, log=log) as proc:
        wait_for_port(port)
        wait_for_port(mport)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ("", "kvcoord.v2.Coordinator"):
                resp = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            answer = next(
                iter(
                    refl.ServerReflectionInfo(
                        iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=TIMEOUT
                    )
                )
            )
            names = {s.name for s in answer.list_services_response.service}
            assert {"kvcoord.v2.Coordinator", "grpc.health.v1.Health"} <= names
            stub = pbg.CoordinatorStub(ch)
            replies = _ingest_one(stub)
            # Acks are cumulative and may be coalesced: the snapshot's Ack(0) can merge into Ack(1).
            assert replies[0].WhichOneof("msg") == "welcome"
            assert {r.WhichOneof("msg") for r in replies[1:]} == {"ack"} and replies[-1].ack.seq == 1
            resp = stub.Lookup(
                pb.LookupRequest(model="m", hashes=pb.HashQuery(block_hashes=pack_u64([1, 2, 3]))),
                timeout=TIMEOUT,
            )
            assert [(n.node_id, n.matched_blocks) for n in resp.nodes] == [("n1", 2)]
        text = _metrics(mport)
        for line in (
            'kvcoord_events_applied_total{type="block_stored"} 1.0',
            'kvcoord_lookup_latency_seconds_count{query="hashes"} 1.0',
            "kvcoord_lookup_matched_fraction_count 1.0",
            "kvcoord_ingest_lag_seconds_count 1.0",
            'kvcoord_index_up{backend="memory"} 1.0',
            # The index's metrics wrapper (InstrumentedIndex): one match, none failed, nothing fenced.
            'kvcoord_index_call_seconds_count{backend="memory",op="match"} 1.0',
            'kvcoord_index_call_errors_total{backend="memory",op="match"} 0.0',
            'kvcoord_index_fenced_writes_total{backend="memory"} 0.0',
        ):
            assert line in text, line
        for name in (
            "hash_mismatches",
            "snapshots_requested",
            "leases_expired",
            "nodes",
            "index_entries",
            "index_blocks",
            "events_rejected",
            "index_bytes",
        ):
            assert f"# HELP kvcoord_{name}" in text, name
        os.killpg(proc.pid, signal.SIGTERM)
        # Bound generous for a loaded CI machine: the functional check is the clean exit (status 0).
        assert proc.wait(timeout=STOP_BOUND) == 0
    out = log.read_text()
    assert f"grpc 127.0.0.1:{port}" in out and f"http://127.0.0.1:{mport}/metrics" in out
    assert "Traceback" not in out


def test_sigterm_ends_open_streams_with_unavailable_and_exits(tmp_path: Path) -> None:
    cmd, port, _, log = _serve(tmp_path, "--metrics-listen", "")
    with running(cmd, log=log) as proc:
        wait_for_port(port)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.CoordinatorStub(ch)
            # An agent stream that stays open (a generator that blocks until the server goes away).
            stop_flag: list[bool] = []

            def messages() -> Iterator[pb.AgentMessage]:
                yield pb.AgentMessage(hello=pb.Hello(node_id="n1", model="m", epoch=1))
                while not stop_flag:
                    time.sleep(0.05)

            call = stub.Ingest(messages())
            assert next(call).WhichOneof("msg") == "welcome"
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                # The open stream is ended at once with UNAVAILABLE (agents fail over on it), not left
                # to the server's grace period.
                with pytest.raises(grpc.RpcError) as err:
                    for _ in call:
                        pass
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "shutting down" in (err.value.details() or "")
                assert proc.wait(timeout=STOP_BOUND) == 0
            finally:
                stop_flag.append(True)
                call.cancel()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A CA, a server cert for 127.0.0.1/localhost and a client cert (see tests.procs.make_certs)."""
    return make_certs(tmp_path_factory.mktemp("certs"))


def _ping(target: str, creds: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    ch = grpc.secure_channel(target, creds) if creds is not None else grpc.insecure_channel(target)
    with ch:
        try:
            pbg.CoordinatorStub(ch).Ping(pb.PingRequest(), timeout=3.0)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def test_tls_and_mutual_tls(tmp_path: Path, certs: dict[str, Path]) -> None:
    ca = certs["ca_crt"].read_bytes()
    client = (certs["client_key"].read_bytes(), certs["client_crt"].read_bytes())
    cmd, port, _, log = _serve(
        tmp_path,
        "--metrics-listen",
        "",
        "--tls-cert",
        str(certs["server_crt"]),
        "--tls-key",
        str(certs["server_key"]),
    )
    with running(cmd, log=log):
        wait_for_port(port)
        target = f"127.0.0.1:{port}"
        assert _ping(target, grpc.ssl_channel_credentials(root_certificates=ca)) == grpc.StatusCode.OK
        assert _ping(target, None) == grpc.StatusCode.UNAVAILABLE
    # Mutual TLS from the config file: a client without a certificate is refused.
    toml = tmp_path / "mtls.toml"
    toml.write_text(
        f'[tls]\ncert = "{certs["server_crt"]}"\nkey = "{certs["server_key"]}"\n'
        f'client_ca = "{certs["ca_crt"]}"\n'
    )
    cmd, port, _, log = _serve(tmp_path, "--metrics-listen", "", "--config", str(toml))
    with running(cmd, log=log):
        wait_for_port(port)
        target = f"127.0.0.1:{port}"
        with_cert = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=client[0], certificate_chain=client[1]
        )
        assert _ping(target, with_cert) == grpc.StatusCode.OK
        assert (
            _ping(target, grpc.ssl_channel_credentials(root_certificates=ca)) == grpc.StatusCode.UNAVAILABLE
        )


def test_config_file_env_and_flags(tmp_path: Path) -> None:
    port_file, port_env, port_flag = free_port(), free_port(), free_port()
    toml = tmp_path / "c.toml"
    toml.write_text(
        f'listen = "127.0.0.1:{port_file}"\nmetrics_listen = ""\nstrict_models = true\n'
        '[models.m]\nalgo = "xxhash"\nblock_size = 8\nseed = "7"\n'
        "[limits]\nmax_query_blocks = 2\n"
    )
    env = {"KVCOORD_LISTEN": f"127.0.0.1:{port_env}", "KVCOORD_CONFIG": str(toml)}
    with running(kvcoord_cmd("serve"), env=env, log=tmp_path / "a.log"):
        wait_for_port(port_env)  # env beats the file
        with grpc.insecure_channel(f"127.0.0.1:{port_env}") as ch:
            stub = pbg.CoordinatorStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                stub.Lookup(
                    pb.LookupRequest(model="x", hashes=pb.HashQuery(block_hashes=pack_u64([1]))),
                    timeout=TIMEOUT,
                )
            assert info.value.code() == grpc.StatusCode.NOT_FOUND  # strict_models from the file
            with pytest.raises(grpc.RpcError) as info:
                stub.Lookup(
                    pb.LookupRequest(model="m", tokens=pb.TokenQuery(token_ids=pack_tokens(range(24)))),
                    timeout=TIMEOUT,
                )
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            resp = stub.Lookup(
                pb.LookupRequest(model="m", tokens=pb.TokenQuery(token_ids=pack_tokens(range(16)))),
                timeout=TIMEOUT,
            )
            assert resp.block_size == 8 and resp.num_blocks == 2
    with running(kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port_flag}"), env=env, log=tmp_path / "b.log"):
        wait_for_port(port_flag)  # the flag beats env and file


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ("bogus = 1\n", "unknown key(s) 'bogus'"),
        ("[limits]\nmax_events_per_batch = 0\n", "limits.max_events_per_batch: must be >= 1"),
        ('[models.m]\nalgo = "md5"\nblock_size = 16\n', "algo: 'md5' is not one of"),
        ('[tls]\ncert = "a.pem"\n', "cert and key must be given together"),
        ('[[auth.agent_tokens]]\ntoken = "t"\n', "nodes: expected a non-empty list"),
        ('listen = "nope"\n', "expected HOST:PORT"),
        ("strict_models = true\n", "no [models]"),
        ("replica_silent_seconds = 1.5\n", "replica_silent_seconds: must be >= 2"),
        ("reservation_hold_seconds = 61\n", "reservation_hold_seconds: must be in (0, 60]"),
        ("lease = [\n", "config"),
    ],
)
def test_bad_config_is_a_one_line_error(tmp_path: Path, body: str, words: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(body)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert words in str(info.value)


def test_bad_config_exits_2_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("bogus = 1\n")
    out = subprocess.run(
        kvcoord_cmd("serve", "--config", str(path)), capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown key(s) 'bogus'" in lines[0]


def test_config_tokens_models_and_precedence(tmp_path: Path) -> None:
    (tmp_path / "admin.token").write_text("adm\n")
    path = tmp_path / "c.toml"
    path.write_text(
        'lease_seconds = 3\n[models."Qwen/Qwen3-0.6B"]\nalgo = "sha256_cbor"\nblock_size = 16\n'
        'engine_release = "0.31"\n'
        '[[auth.agent_tokens]]\ntoken_env = "MY_AGENT_TOKEN"\nnodes = ["a", "b"]\n'
        '[[auth.admin_tokens]]\ntoken_file = "admin.token"\n[tier_weights]\nCPU = 0.25\n'
    )
    env = {"MY_AGENT_TOKEN": "sekrit", "KVCOORD_LEASE_SECONDS": "4"}
    cfg = load_config(path, env=env, overrides={"lease_seconds": None})
    assert cfg.lease_seconds == 4.0  # env beats the file (a None flag is unset)
    profile = cfg.profile("Qwen/Qwen3-0.6B")
    assert profile is not None and profile.style == "tagged" and profile.block_size == 16
    assert cfg.tier_weights == (1.0, 0.25, 0.5)
    assert cfg.auth.admin_tokens == frozenset({"adm"})
    assert cfg.auth.agent_tokens == {"sekrit": frozenset({"a", "b"})}
    cfg = load_config(path, env=env, overrides={"lease_seconds": 5.0})
    assert cfg.lease_seconds == 5.0  # the flag beats env


def test_serve_stops_on_sigint_and_frees_port(tmp_path: Path) -> None:
    cmd, port, _, log = _serve(tmp_path, "--metrics-listen", "")
    with running(cmd, log=log) as proc:
        wait_for_port(port)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=STOP_BOUND) == 0
        assert stop(proc) == 0
    # The port is free again: a second server binds it.
    with running(cmd, log=tmp_path / "again.log"):
        wait_for_port(port)


@pytest.mark.parametrize("uvloop_env", ["1", "0", ""])
def test_serve_runs_on_uvloop_unless_told_not_to(uvloop_env: str, tmp_path: Path) -> None:
    """uvloop is an optional extra: with it installed serve's loop runs on it unless KVCOORD_UVLOOP=0, and
    otherwise asyncio's runs it (the start-up line names it); serve answers either way."""
    try:
        import uvloop  # noqa: F401
        installed = True
    except ImportError:
        installed = False
    port, http = free_port(), free_port()
    log = tmp_path / "serve.log"
    with running(kvcoord_cmd("serve", "--listen", f"127.0.0.1:{port}", "--http-listen", f"127.0.0.1:{http}",
                             "--metrics-listen", ""), env={"KVCOORD_UVLOOP": uvloop_env}, log=log):
        wait_for_port(http, timeout=30)
        assert http_request("GET", f"http://127.0.0.1:{http}/health").status == 200
        until(lambda: "event loop:" in log.read_text(), "the start-up line")
    expected = "uvloop" if installed and uvloop_env != "0" else "asyncio"
    assert f"event loop: {expected}" in log.read_text()
