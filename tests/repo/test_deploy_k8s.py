"""deploy/k8s run as an operator applies it, without a cluster: what ``kubectl kustomize`` renders (the
same manifests read from disk when kubectl is absent) becomes local processes.

Each pod's containers run their own args and env (Secrets given by the test, the downward API's pod name
and IP), the ConfigMap mounted as a file; addresses are rewritten the way the pod network would resolve
them: a pod's own ``0.0.0.0``/``127.0.0.1``/``*``/``$(POD_IP)`` ports become free local ports of that pod,
a Service's ``name:port`` the local port of the first pod its selector picks. Redis runs the manifest's
args on a real ``redis-server``; vLLM is a ``kvcoord sim-engine`` given the vLLM container's model, hash
flags, ``PYTHONHASHSEED``, ``--port`` and ``--kv-events-config``. As in the compose test, the test sends
chats through route and reads the answers' headers and both components' /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import yaml
from grpc_health.v1 import health_pb2

from tests.gateway.test_epp import Envoy, health_of, request_body, request_headers, set_headers
from tests.http_util import get_text, http_request
from tests.procs import free_port, kvcoord_cmd, make_certs, running, until, wait_for_port
from tests.redis_servers import REDIS_SERVER, redis_server
from tests.repo.test_deploy import (
    K8S,
    _is_kvcoord_image,
    _loadgen_chat,
    _poll,
    _post_json,
    components_overlay,
    configmap_toml,
    containers,
    flag,
    flag_all,
    k8s_components_docs,
    k8s_docs,
    kind,
    parse_exposition,
    route_ready,
    total,
)

TOKENS = {"agent-token": "agent-t", "router-token": "router-t", "admin-token": "admin-t"}
"""The kvcoord-tokens Secret docs/deploy.md has the operator create (values made up)."""
REPLICAS = {"vllm-qwen3": 2}
"""Pods run per Deployment (1 when not named): two engines to choose between; one coordinator and one
router are enough for what route's answers show (a Service reaches the first pod its selector picks)."""
_ADDRESS = re.compile(r"(?<![\w.$-])(\$\(POD_IP\)|\*|[A-Za-z0-9][\w.-]*):(\d+)(?![\d])")
_LOCAL_HOSTS = {"0.0.0.0", "127.0.0.1", "localhost", "*", "$(POD_IP)"}


def rendered_k8s(root: Path = K8S) -> list[dict[str, Any]]:
    """``kubectl kustomize ROOT`` when kubectl is installed, else the manifests read directly (the base,
    plus an overlay's own files)."""
    if shutil.which("kubectl") is None:
        if "components" in yaml.safe_load((root / "kustomization.yaml").read_text()):
            return k8s_components_docs()  # components_overlay()'s
        return k8s_docs() + (k8s_docs(root) if root != K8S else [])
    out = subprocess.run(["kubectl", "kustomize", str(root)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


@dataclass
class Pod:
    name: str
    deployment: dict[str, Any]
    ports: dict[int, int] = field(default_factory=dict)
    """container port -> local port, allocated on first use."""

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.deployment["spec"]["template"]["metadata"]["labels"])

    def local(self, port: int) -> int:
        if port not in self.ports:
            self.ports[port] = free_port()
        return self.ports[port]


@dataclass
class Cluster:
    """The rendered manifests' pods and Services, resolved to local ports."""

    docs: list[dict[str, Any]]
    tmp: Path
    secrets: dict[str, dict[str, str]]
    """Secret name -> key -> content: what the operator creates before applying (docs/deploy.md)."""
    pods: list[Pod] = field(default_factory=list)
    redis_port: int = 0

    def __post_init__(self) -> None:
        for d in self.docs:
            if d["kind"] == "Deployment":
                name = d["metadata"]["name"]
                self.pods += [Pod(f"{name}-{i}", d) for i in range(REPLICAS.get(name, 1))]

    def pods_of(self, deployment: str) -> list[Pod]:
        return [p for p in self.pods if p.deployment["metadata"]["name"] == deployment]

    def service_port(self, name: str, port: int) -> int | None:
        """The local port behind Service ``name``'s ``port`` (None: no such Service or port)."""
        svcs = [d for d in self.docs if d["kind"] == "Service" and d["metadata"]["name"] == name]
        if not svcs:
            return None
        (svc,) = svcs
        sp = next((p for p in svc["spec"]["ports"] if p["port"] == port), None)
        assert sp is not None, f"Service {name} has no port {port}"
        selector = svc["spec"]["selector"]
        pods = [p for p in self.pods if selector.items() <= p.labels.items()]
        assert pods, f"Service {name} selects no pod"
        pod = pods[0]
        target = sp.get("targetPort", sp["port"])
        if isinstance(target, str):  # a named container port
            named = [cp["containerPort"] for c in containers(pod.deployment) for cp in c.get("ports", [])
                     if cp.get("name") == target]  # fmt: skip
            assert len(named) == 1, f"Service {name}: port name {target} in {pod.name}"
            target = named[0]
        if pod.deployment["metadata"]["name"] == "kvcoord-redis":
            return self.redis_port
        return pod.local(int(target))

    def rewrite(self, pod: Pod, text: str) -> str:
        """Every ``host:port`` the pod would reach, as the local address it is at here."""

        def repl(m: re.Match[str]) -> str:
            host, port = m.group(1), int(m.group(2))
            if host in _LOCAL_HOSTS:
                return f"127.0.0.1:{pod.local(port)}"
            local = self.service_port(host, port)
            return m.group(0) if local is None else f"127.0.0.1:{local}"

        return _ADDRESS.sub(repl, text)


def _env(cluster: Cluster, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
    """A container's env: literal values, the test's Secrets, the downward API's pod name and IP."""
    out: dict[str, str] = {}
    for e in c.get("env", []):
        if "value" in e:
            out[e["name"]] = str(e["value"])
            continue
        src = e["valueFrom"]
        if "secretKeyRef" in src:
            ref = src["secretKeyRef"]
            out[e["name"]] = cluster.secrets[ref["name"]][ref["key"]]
        else:
            path = src["fieldRef"]["fieldPath"]
            out[e["name"]] = {"metadata.name": pod.name, "status.podIP": "127.0.0.1"}[path]
    return out


def _expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion in args; ``$(POD_IP)`` stays for :meth:`Cluster.rewrite`."""
    return re.sub(r"\$\(([A-Z_][A-Z0-9_]*)\)",
                  lambda m: m.group(0) if m.group(1) == "POD_IP" else env.get(m.group(1), m.group(0)), arg)


def _mounts(cluster: Cluster, pod: Pod, c: dict[str, Any]) -> dict[str, str]:
    """configMap, Secret and claim volumes mounted by ``c``: mount path -> a local directory holding the keys
    as files; a ConfigMap's with the addresses rewritten (the coordinator's TOML names its listen ports,
    Redis and the engines); a PersistentVolumeClaim's, one directory all its pods share."""
    volumes = {v["name"]: v for v in pod.deployment["spec"]["template"]["spec"].get("volumes", [])}
    out = {}
    for m in c.get("volumeMounts", []):
        vol = volumes[m["name"]]
        if "persistentVolumeClaim" in vol:  # one directory per claim, shared by the pods mounting it
            shared = cluster.tmp / "claims" / vol["persistentVolumeClaim"]["claimName"]
            shared.mkdir(parents=True, exist_ok=True)
            out[m["mountPath"]] = str(shared)
            continue
        if "configMap" in vol:
            data = {k: cluster.rewrite(pod, t)
                    for k, t in kind(cluster.docs, "ConfigMap", vol["configMap"]["name"])["data"].items()}
        elif "secret" in vol:
            data = cluster.secrets[vol["secret"]["secretName"]]
        else:
            continue
        local = cluster.tmp / pod.name / c["name"] / m["name"]
        local.mkdir(parents=True)
        for key, text in data.items():
            (local / key).write_text(text)
        out[m["mountPath"]] = str(local)
    return out


def _sim_engine_args(pod: Pod, c: dict[str, Any], seed: int) -> list[str]:
    """``kvcoord sim-engine`` standing in for the vLLM container: its model, hash profile, HTTP port and
    KV events publisher (vLLM's ``--kv-events-config``)."""
    args = list(c["args"])
    assert c["command"] == ["vllm", "serve"] and not args[0].startswith("-"), c["command"]
    events = json.loads(flag(args, "--kv-events-config"))
    assert events["publisher"] == "zmq" and events["enable_kv_cache_events"] is True
    return ["sim-engine", "--model", args[0], "--algo", flag(args, "--prefix-caching-hash-algo"),
            "--block-size", flag(args, "--block-size"), "--zmq-bind", events["endpoint"],
            "--replay-bind", events["replay_endpoint"], "--topic", events["topic"],
            "--buffer-steps", str(events["buffer_steps"]), "--hwm", str(events["hwm"]),
            "--http-listen", f"0.0.0.0:{flag(args, '--port')}", "--seed", str(seed),
            "--rate", "0", "--requests", "0"]  # fmt: skip


@dataclass
class Proc:
    name: str
    cmd: list[str]
    env: dict[str, str]


def local_processes(cluster: Cluster) -> list[Proc]:
    """Every container of every pod, as a local command, Redis first, then in the manifests' order."""
    out: list[Proc] = []
    for i, pod in enumerate(cluster.pods):
        for c in containers(pod.deployment):
            env = _env(cluster, pod, c)
            mounts = _mounts(cluster, pod, c)
            if _is_kvcoord_image(c["image"]):
                argv = [_expand(a, env) for a in c["args"]]
            elif c["image"].startswith("vllm/"):
                argv = _sim_engine_args(pod, c, seed=i)
            elif c["image"].startswith("redis:"):
                continue  # the test's redis-server runs these args
            else:
                raise AssertionError(f"{pod.name}/{c['name']}: no local stand-in for {c['image']}")
            for path, local in mounts.items():
                argv = [a.replace(path + "/", local + "/") for a in argv]
            cmd = kvcoord_cmd(*[cluster.rewrite(pod, a) for a in argv])
            out.append(Proc(f"{pod.name}-{c['name']}", cmd, env))
    return out


def _redis_args(docs: list[dict[str, Any]]) -> list[str]:
    (dep,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "kvcoord-redis"]
    args = list(containers(dep)[0]["args"])
    assert args[0] == "redis-server", args
    return args[1:]


def test_k8s_tokenizer_is_the_engines_service_not_one_pod() -> None:
    """The coordinator tokenizes route's text with the engines' /tokenize through a Service selecting every
    engine pod on their OpenAI port: one engine down does not turn lookups off fleet-wide."""
    docs = rendered_k8s()
    _, cfg = configmap_toml(docs)
    vllm = kind(docs, "Deployment", "vllm-qwen3")
    (engine,) = [c for c in containers(vllm) if c["name"] == "vllm"]
    model = engine["args"][0]
    m = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", cfg["models"][model]["tokenizer"])
    assert m, cfg["models"][model]
    svc = kind(docs, "Service", m.group(1))
    assert svc["spec"]["selector"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == int(m.group(2))]
    (http,) = [p for p in engine["ports"] if p["name"] == "http"]
    assert sp["targetPort"] in (http["name"], http["containerPort"])
    assert int(flag(engine["args"], "--port")) == http["containerPort"]


_POOL_SPEC = {"selector", "targetPorts", "endpointPickerRef", "appProtocol"}
_PICKER_REF = {"group", "kind", "name", "port", "failureMode"}
"""InferencePool's v1 fields (api/v1/inferencepool_types.go of gateway-api-inference-extension): no
schema for it in kubernetes-validate, so unknown fields are caught here."""


def test_k8s_epp_overlay_agrees_with_the_pool_engines_and_coordinator() -> None:
    """deploy/k8s/epp: the InferencePool (v1 fields only) selects the engine pods on the port their agents
    announce; its endpointPickerRef names the epp Service's port, which reaches the picker's --listen; the
    picker asks the coordinator Service with the router token, is probed on its plaintext health port and
    scraped on --metrics-listen; the HTTPRoute sends to the pool."""
    docs = rendered_k8s(K8S / "epp")
    pool = kind(docs, "InferencePool")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert set(spec) <= _POOL_SPEC and {"selector", "targetPorts", "endpointPickerRef"} <= set(spec), spec
    assert set(spec["selector"]) == {"matchLabels"}
    vllm = kind(docs, "Deployment", "vllm-qwen3")
    assert spec["selector"]["matchLabels"].items() <= vllm["spec"]["template"]["metadata"]["labels"].items()
    (engine,) = [c for c in containers(vllm) if c["name"] == "vllm"]
    (agent,) = [c for c in containers(vllm) if c["name"] == "kvcoord-agent"]
    (http,) = [p["containerPort"] for p in engine["ports"] if p["name"] == "http"]
    assert spec["targetPorts"] == [{"number": http}]
    for d in [*docs, *k8s_components_docs()]:  # the conformance hooks let clients steer their own picks
        if d["kind"] == "Deployment":
            assert all("--conformance" not in c.get("args", []) for c in containers(d)), d["metadata"]
    assert flag(agent["args"], "--serving-url") == f"http://$(POD_IP):{http}"  # the picker's endpoints
    ref = spec["endpointPickerRef"]
    assert set(ref) <= _PICKER_REF and ref.get("kind", "Service") == "Service" and ref.get("group", "") == ""
    assert ref["failureMode"] in ("FailOpen", "FailClose")
    svc = kind(docs, "Service", ref["name"])
    (sp,) = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    epp = kind(docs, "Deployment", "kvcoord-epp")
    assert svc["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    (c,) = containers(epp)
    args = c["args"]
    assert args[0] == "epp" and _is_kvcoord_image(c["image"])
    # a data-parallel pool's targetPorts are the picker's --target-ports, in rank order; else one port
    target_ports = flag_all(args, "--target-ports")
    want = [int(p) for p in target_ports[0].split(",")] if target_ports else [http]
    assert [p["number"] for p in spec["targetPorts"]] == want
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports[sp["targetPort"]] == int(flag(args, "--listen").rsplit(":", 1)[1])
    health = int(flag(args, "--health-listen").rsplit(":", 1)[1])
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["grpc"]["port"] == health, probe
    assert c["readinessProbe"]["grpc"]["service"] == "readiness"
    coord_svc = kind(docs, "Service", "kvcoord")
    (grpc_port,) = [p["port"] for p in coord_svc["spec"]["ports"] if p["name"] == "grpc"]
    assert flag(args, "--coordinator") == f"kvcoord:{grpc_port}"
    token = next(e for e in c["env"] if e["name"] == "KVCOORD_TOKEN")["valueFrom"]["secretKeyRef"]
    assert (token["name"], token["key"]) == ("kvcoord-tokens", "router-token")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for key in ("--listen-tls-cert", "--listen-tls-key"):
        assert flag(args, key).startswith(mounts["tls"] + "/"), key
    sm = kind(docs, "ServiceMonitor", "kvcoord-epp")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (metrics,) = [p for p in svc["spec"]["ports"] if p["name"] == sm["spec"]["endpoints"][0]["port"]]
    assert ports[metrics["targetPort"]] == int(flag(args, "--metrics-listen").rsplit(":", 1)[1])
    route = kind(docs, "HTTPRoute")
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]
    if shutil.which("kubectl") is not None:  # the overlay's own resources land in the base's namespace
        assert all(d["metadata"].get("namespace") == "kvcoord" for d in docs if d["kind"] != "Namespace")


@contextlib.contextmanager
def k8s_stack(root: Path, tmp: Path, secrets: dict[str, dict[str, str]] | None = None) -> Iterator[Cluster]:
    """Every pod of ``kubectl kustomize ROOT`` as local processes on a real redis-server; yields once the
    coordinator has both engines' nodes active. Prints every log when the body fails."""
    if shutil.which(REDIS_SERVER) is None:
        pytest.skip("redis-server is not installed")
    docs = rendered_k8s(root)
    with redis_server(*_redis_args(docs)) as redis, contextlib.ExitStack() as stack:
        cluster = Cluster(docs, tmp, {"kvcoord-tokens": TOKENS, **(secrets or {})}, redis_port=redis.port)
        procs = local_processes(cluster)
        started = {}
        try:
            for p in procs:
                started[p.name] = stack.enter_context(running(p.cmd, env=p.env, log=tmp / f"{p.name}.log"))
            (coord,) = cluster.pods_of("kvcoord")
            wait_for_port(coord.local(9400), timeout=30)
            _poll(coord.local(9400), lambda sc: total(sc, "kvcoord_nodes", state="active") == 2, "both nodes",
                  timeout=60)
            yield cluster
            for name, proc in started.items():
                assert proc.poll() is None, f"{name} exited"
        except BaseException:
            for name in started:
                print(f"--- {name}\n" + (tmp / f"{name}.log").read_text()[-3000:])
            raise


@pytest.mark.slow
def test_k8s_route_is_prefix_aware_out_of_the_box(tmp_path: Path) -> None:
    """What ``kubectl apply -k deploy/k8s`` runs, run locally with its own args, env and ConfigMap: route
    must place chats by prefix (not ``lookup_error; least-loaded``: the coordinator needs a tokenizer for
    the model), the coordinator show lookups with hits, and the engines serve what the index predicted."""
    with k8s_stack(K8S, tmp_path) as cluster:
        (coord,) = cluster.pods_of("kvcoord")
        (route,) = cluster.pods_of("kvcoord-route")
        mport = coord.local(9400)
        route_url = f"http://127.0.0.1:{route.local(8000)}"
        wait_for_port(route.local(8000), timeout=30)
        until(lambda: route_ready(route_url, 2), "route ready with both engines' URLs", timeout=60,
              interval=0.1)
        headers = []
        for i in range(40):
            status, h = _post_json(f"{route_url}/v1/chat/completions", _loadgen_chat(i))
            assert status == 200, h
            headers.append(h)
        reasons = [h["x-kvcoord-reason"] for h in headers]
        assert not any("lookup_error" in r for r in reasons), reasons
        # (the first lookups may miss route's --deadline-ms while the tokenizer connection warms up)
        assert sum(h["x-kvcoord-prefix-aware"] == "true" for h in headers) >= len(headers) / 2, reasons
        sc = _poll(mport, lambda sc: (
            total(sc, "kvcoord_lookup_latency_seconds_count") >= 20
            and total(sc, "kvcoord_lookup_matched_fraction_sum") > 0
        ), "lookups with hits", timeout=60)  # fmt: skip
        assert total(sc, "kvcoord_hash_mismatches_total") == 0
        assert total(sc, "kvcoord_events_rejected_total") == 0
        routed = parse_exposition(get_text(f"{route_url}/metrics", timeout=5))
        assert total(routed, "kvcoord_route_hit_outcomes_total", outcome="below") == 0
        achieved = total(routed, "kvcoord_route_achieved_tokens_total")
        assert achieved >= 0.5 * total(routed, "kvcoord_route_prompt_tokens_total"), achieved


def _pool_endpoints(cluster: Cluster) -> set[str]:
    """The InferencePool's members as a gateway sees them, podIP:targetPort, in local addresses."""
    pool = kind(cluster.docs, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    (port,) = [p["number"] for p in pool["spec"]["targetPorts"]]
    members = [p for p in cluster.pods if selector.items() <= p.labels.items()]
    return {cluster.rewrite(p, f"$(POD_IP):{port}") for p in members}


async def _gateway_pick(address: str, ca: bytes, body: bytes) -> tuple[str, str]:
    """One request as the gateway's Envoy sends it to the picker (TLS, buffered body): the destination
    endpoint and ``x-kvcoord-pick``."""
    async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(root_certificates=ca),
                                       options=[("grpc.ssl_target_name_override", "localhost")]) as ch:
        envoy = Envoy(ch)
        await envoy.send(request_headers())
        [resp] = await envoy.send(request_body(body))
        await envoy.close()
    assert resp.WhichOneof("response") == "request_body", resp
    headers = set_headers(resp.request_body.response)
    return headers["x-gateway-destination-endpoint"], headers["x-kvcoord-pick"]


@pytest.mark.slow
def test_k8s_epp_picks_the_pool_members_by_prefix(tmp_path: Path) -> None:
    """``kubectl apply -k deploy/k8s/epp`` run locally: the epp Deployment's own args, its TLS Secret and
    the router token. Once its health port says ready, the picker (reached through the Service the
    InferencePool's endpointPickerRef names) answers every request with a member of the pool, podIP and
    targetPort, prefix-aware: its endpoints are the coordinator's nodes, whose agents announce the same
    address. Chats sharing a system prompt go to one engine."""
    certs = make_certs(tmp_path / "pki")
    tls = {"tls.crt": certs["server_crt"].read_text(), "tls.key": certs["server_key"].read_text()}
    with k8s_stack(K8S / "epp", tmp_path, {"kvcoord-epp-tls": tls}) as cluster:
        pool = kind(cluster.docs, "InferencePool")
        ref = pool["spec"]["endpointPickerRef"]
        assert ref.get("kind", "Service") == "Service"
        address = cluster.rewrite(cluster.pods[0], f"{ref['name']}:{ref['port']['number']}")
        (epp,) = cluster.pods_of("kvcoord-epp")
        (probe,) = [c["readinessProbe"]["grpc"] for c in containers(epp.deployment)]
        health = f"127.0.0.1:{epp.local(probe['port'])}"
        wait_for_port(epp.local(probe["port"]), timeout=30)
        until(lambda: health_of(health, probe["service"]) == health_pb2.HealthCheckResponse.SERVING,
              "the picker ready", timeout=60, interval=0.1)
        members = _pool_endpoints(cluster)
        assert len(members) == 2, members
        ca = certs["ca_crt"].read_bytes()
        vllm = kind(cluster.docs, "Deployment", "vllm-qwen3")
        model = next(c for c in containers(vllm) if c["name"] == "vllm")["args"][0]

        def pick(prompt: int) -> tuple[str, str]:
            body = json.dumps({**_loadgen_chat(prompt), "model": model}).encode()
            endpoint, why = asyncio.run(_gateway_pick(address, ca, body))
            assert endpoint in members, (endpoint, members)
            assert why.startswith("prefix-aware: "), why  # the index was consulted (a tokenizer is set)
            return endpoint, why

        def holder(prompt: int, endpoint: str) -> bool:
            got, why = pick(prompt)
            m = re.search(r"\((\d+) blocks\)", why)
            return got == endpoint and m is not None and int(m.group(1)) > 0

        for prompt in (0, 1):
            first, _ = pick(prompt)
            # the gateway forwards the chat there; the engine's KV events then reach the index
            chat = {**_loadgen_chat(prompt), "model": model}
            assert _post_json(f"http://{first}/v1/chat/completions", chat)[0] == 200
            until(lambda p=prompt, e=first: holder(p, e), f"picks of prompt {prompt} following its prefix to "
                  f"{first}", timeout=60, interval=0.1)
            assert all(holder(prompt, first) for _ in range(4))


KEYS = {"keys": [{"name": "team-a", "key": "sk-team-a-0123", "requests_per_second": 100}]}
"""The kvcoord-route-keys Secret's keys.json, as docs/deploy.md has the operator create it."""


def _chat_status(url: str, body: dict[str, Any], key: str | None) -> int:
    return http_request("POST", url, body, headers={"Authorization": f"Bearer {key}"} if key else None).status


@pytest.mark.slow
def test_k8s_components_keys_on_route_leader_and_flow_control_on_epp(tmp_path: Path) -> None:
    """The epp overlay with every Component of deploy/k8s/components, run locally with the Secrets the
    components name: route asks for the API key from its Secret (401 without, 200 with), the picker holds
    the leader lock on the claim and reports ready, with flow control's limits in force."""
    certs = make_certs(tmp_path / "pki")
    secrets = {"kvcoord-epp-tls": {"tls.crt": certs["server_crt"].read_text(),
                                   "tls.key": certs["server_key"].read_text()},
               "kvcoord-route-keys": {"keys.json": json.dumps(KEYS)}}
    root = components_overlay(tmp_path / "overlay")
    with k8s_stack(root, tmp_path, secrets) as cluster:
        (route,) = cluster.pods_of("kvcoord-route")
        route_url = f"http://127.0.0.1:{route.local(8000)}"
        wait_for_port(route.local(8000), timeout=30)
        until(lambda: route_ready(route_url, 2), "route ready with both engines' URLs", timeout=60,
              interval=0.1)
        chat = f"{route_url}/v1/chat/completions"
        assert _chat_status(chat, _loadgen_chat(0), None) == 401
        assert _chat_status(chat, _loadgen_chat(0), KEYS["keys"][0]["key"]) == 200
        (epp,) = cluster.pods_of("kvcoord-epp")
        (c,) = containers(epp.deployment)
        assert flag(c["args"], "--max-in-flight") == "64" and flag(c["args"], "--leader-lock")
        probe = c["readinessProbe"]["grpc"]
        health = f"127.0.0.1:{epp.local(probe['port'])}"
        wait_for_port(epp.local(probe["port"]), timeout=30)
        until(lambda: health_of(health, probe["service"]) == health_pb2.HealthCheckResponse.SERVING,
              "the picker ready (the leader)", timeout=60, interval=0.1)
        assert any((tmp_path / "claims" / "kvcoord-epp-leader").iterdir()), "no lock file on the claim"
