"""``kvcoord epp``: a Gateway API Inference Extension endpoint picker (Envoy ``ext_proc`` v3) that places
each request on the node holding the most of its prefix."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from kvcoord.cli.common import (
    HOSTPORT,
    NONNEG_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    CliError,
    Subparsers,
    add_connection,
    add_cost_model,
    add_degraded,
    add_pd,
    add_reserve,
    cost_model,
    parse_hostport,
    pd_config,
    run_until_signalled,
    security,
)
from kvcoord.gateway import POLICIES

if TYPE_CHECKING:
    from kvcoord.gateway.epp import EppConfig


def add(sub: Subparsers) -> None:
    p = sub.add_parser("epp", help="Gateway API endpoint picker: Envoy ext_proc, prefix-aware picks",
                       description="Serve Envoy's ext_proc v3 as a Gateway API Inference Extension endpoint "
                                   "picker: read each request's body, look its prompt up on the coordinator, "
                                   "pick a node, answer x-gateway-destination-endpoint (header and envoy.lb "
                                   "metadata; one ip:port by default, per DP rank with --target-ports).")
    add_connection(p, timeout=0.5)
    p.add_argument("--listen", default="0.0.0.0:9002", type=HOSTPORT, metavar="HOST:PORT",
                   help="ext_proc and grpc.health.v1 address (default 0.0.0.0:9002, the EPP's port)")
    p.add_argument("--backend", action="append", default=[], metavar="NODE=ADDR:PORT",
                   help="a node's endpoint (repeatable; wins over the serving URL its agent announced)")
    p.add_argument("--policy", default="prefix-aware", choices=POLICIES,
                   help="placement (default prefix-aware)")
    add_degraded(p)
    add_reserve(p)
    add_cost_model(p.add_argument_group(
        "policy cost model", "How prefix-aware weighs a node's queue against its cached prefix (as "
        "kvcoord route and kvcoord simulate take it)"), mean_output=True, pull=True)
    p.add_argument("--fallbacks", type=NONNEG_INT, default=0,
                   help="endpoints listed after the pick, for a data plane that walks the list on retry "
                        "(default 0: one ip:port, what every gateway reads; see docs/epp.md)")
    p.add_argument("--target-ports", type=target_ports, default=(), metavar="PORT,PORT,...",
                   help="the InferencePool's targetPorts: data-parallel rank r is picked at the node's IP "
                        "and the r-th port (default: one endpoint per node, its serving URL's port)")
    p.add_argument("--conformance", action="store_true",
                   help="the Inference Extension conformance suite's hooks: the test-epp-endpoint-selection "
                        "header restricts the pick, x-conformance-test-served-endpoint echoes the served "
                        "endpoint (test gateways only: clients could steer their own picks)")
    p.add_argument("--max-in-flight", type=NONNEG_INT, default=0, metavar="N",
                   help="a node with N requests in flight takes no more; when all are, the request "
                        "waits (--max-queued) or gets 429 (default 0: no limit)")
    p.add_argument("--max-waiting", type=NONNEG_INT, default=0, metavar="N",
                   help="a node with N queued requests takes no more; when all are, the request "
                        "waits (--max-queued) or gets 429 (default 0: no limit)")
    flow = p.add_argument_group("flow control", "What saturated pools do with requests (as llm-d's flow "
                                "control: priority bands, fairness ids, a queue TTL; see docs/epp.md)")
    flow.add_argument("--max-queued", type=NONNEG_INT, default=0, metavar="N",
                      help="requests that may wait while every eligible endpoint is saturated, highest "
                           "priority first, fairness ids in turn (default 0: 429 at once)")
    flow.add_argument("--queue-ttl", type=POSITIVE_FLOAT, default=30.0, metavar="SECONDS",
                      help="longest wait in the queue, then 429 rejected-ttl-expired; a request's "
                           "x-llm-d-inference-ttl header wins (default 30)")
    flow.add_argument("--objective", action="append", default=[], metavar="NAME=PRIORITY",
                      help="the priority of requests whose x-llm-d-inference-objective names NAME "
                           "(repeatable; an InferenceObjective's priority; others: 0)")
    p.add_argument("--leader-lock", default=None, metavar="FILE",
                   help="replicas naming the same FILE elect one leader (an exclusive lock on it); only "
                        "the leader reports ready (default: every replica is ready, active-active)")
    p.add_argument("--emit-endpoint-scores", action="store_true",
                   help="add x-gateway-destination-endpoint-scores (every scored ip:port to its score) to "
                        "the envoy.lb metadata, as llm-d's --emit-endpoint-scores")
    p.add_argument("--grpc-model", default=None, metavar="MODEL",
                   help="the model of gRPC Generate requests (they name none) without an "
                        "x-gateway-model-name header (default: the one model the coordinator lists)")
    p.add_argument("--request-body-mode", default="buffered", choices=("buffered", "full-duplex"),
                   help="Envoy's request_body_mode when its first message does not say (default buffered)")
    p.add_argument("--refresh-interval", type=POSITIVE_FLOAT, default=2.0, metavar="SECONDS",
                   help="how often the node list is reloaded from ListNodes (default 2)")
    p.add_argument("--max-body-bytes", type=POSITIVE_INT, default=16 << 20,
                   help="larger request bodies get 413 (default 16 MiB)")
    p.add_argument("--metrics-listen", default=None, type=HOSTPORT, metavar="HOST:PORT",
                   help="Prometheus /metrics address (default: none)")
    p.add_argument("--health-listen", default=None, type=HOSTPORT, metavar="HOST:PORT",
                   help="also serve grpc.health.v1 alone, in plaintext, here (for kubelet probes under TLS)")
    p.add_argument("--listen-tls-cert", default=None, help="PEM certificate: serve ext_proc over TLS")
    p.add_argument("--listen-tls-key", default=None, help="PEM key of --listen-tls-cert")
    add_pd(p, "no x-prefiller-host-port is set: the decode pod prefills itself")
    p.set_defaults(func=run)


def target_ports(text: str) -> tuple[int, ...]:
    """``--target-ports 8000,8001``: distinct ports, rank order (as an InferencePool lists them)."""
    try:
        ports = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ports") from None
    if not all(0 < p < 65536 for p in ports) or len(set(ports)) != len(ports):
        raise argparse.ArgumentTypeError(f"{text!r}: ports must be distinct, 1 to 65535")
    return ports


def objectives(specs: list[str]) -> dict[str, int]:
    """``NAME=PRIORITY`` flags as a mapping (an integer priority, higher served first)."""
    out: dict[str, int] = {}
    for spec in specs:
        name, sep, prio = spec.partition("=")
        try:
            priority = int(prio)
        except ValueError:
            priority = None
        if not sep or not name.strip() or priority is None:
            raise CliError(f"--objective {spec!r}: expected NAME=PRIORITY, an integer priority")
        if name.strip() in out:
            raise CliError(f"--objective: {name.strip()!r} given twice")
        out[name.strip()] = priority
    return out


def backends(specs: list[str]) -> dict[str, str]:
    """``NODE=ADDR:PORT`` flags as a mapping; the address must be an IP (Envoy's original_dst needs one)."""
    import ipaddress

    out: dict[str, str] = {}
    for spec in specs:
        node, sep, addr = spec.partition("=")
        if not sep or not node or not addr:
            raise CliError(f"--backend {spec!r}: expected NODE=ADDR:PORT")
        try:
            host, port = parse_hostport(addr)
            ipaddress.ip_address(host)
        except ValueError:
            raise CliError(f"--backend {spec!r}: ADDR:PORT must be an IP address and a port, "
                           "e.g. 10.0.0.5:8000") from None
        if node in out:
            raise CliError(f"--backend: node {node!r} given twice")
        out[node] = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    return out


def epp_config(args: argparse.Namespace) -> EppConfig:
    """The parsed flags as the picker's configuration; raises CliError for what cannot run."""
    if (args.listen_tls_cert is None) != (args.listen_tls_key is None):
        raise CliError("--listen-tls-cert and --listen-tls-key must be given together")
    static = backends(args.backend)
    try:
        from kvcoord.gateway.epp import EppConfig
    except ImportError as exc:  # the Envoy protobufs are an extra
        if (exc.name or "").split(".")[0] in ("envoy", "xds", "udpa", "validate"):
            raise CliError("needs Envoy's protobufs: pip install 'kvcoord[epp]' (xds-protos)") from None
        raise
    from kvcoord.gateway.picker import PickerConfig

    picker = PickerConfig(static_backends=static, policy=args.policy, degraded=args.degraded,
                          latency=cost_model(args),
                          fallbacks=args.fallbacks, max_in_flight=args.max_in_flight,
                          max_waiting=args.max_waiting, target_ports=args.target_ports,
                          reserve=args.reserve, reserve_ttl=args.reserve_ttl, pd=pd_config(args))
    return EppConfig(coordinator=args.coordinator, listen=args.listen, security=security(args),
                     timeout=args.timeout, picker=picker, mode=args.request_body_mode,
                     refresh_seconds=args.refresh_interval, max_body_bytes=args.max_body_bytes,
                     metrics_listen=args.metrics_listen, health_listen=args.health_listen,
                     tls_cert=args.listen_tls_cert, tls_key=args.listen_tls_key,
                     conformance=args.conformance, objectives=objectives(args.objective),
                     max_queued=args.max_queued, queue_ttl=args.queue_ttl,
                     emit_scores=args.emit_endpoint_scores, leader_lock=args.leader_lock,
                     grpc_model=args.grpc_model)


def run(args: argparse.Namespace) -> int:
    from kvcoord.gateway.epp import serve_epp

    config = epp_config(args)
    run_until_signalled(lambda stop: serve_epp(config, stop))
    return 0
