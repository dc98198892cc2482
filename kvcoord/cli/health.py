"""``kvcoord health``: one ``grpc.health.v1`` Check, exit 0 when SERVING (the container healthcheck)."""

from __future__ import annotations

import argparse
import json
import sys

from kvcoord.cli.common import Subparsers, add_connection, security


def add(sub: Subparsers) -> None:
    p = sub.add_parser(
        "health",
        help="check a coordinator's grpc.health.v1 status (exit 0 when SERVING)",
        description="Asks grpc.health.v1 Check and prints {\"status\": ...}. Exit 0 when SERVING, 1 "
        "otherwise (NOT_SERVING, unknown service, unreachable). For container HEALTHCHECKs; "
        "Kubernetes can use its native grpc probe instead.",
    )
    add_connection(p, token=False, timeout=3.0, replicas=False)
    p.add_argument("--service", default="", help="service name to check (default: '' = the whole server)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """One Check RPC, so a HEALTHCHECK costs one short connection; anything but SERVING also says why in
    one line on stderr (a probe's log shows it, stdout stays JSON)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvcoord.transport import open_channel

    channel = open_channel(args.coordinator, security(args))
    result: dict[str, str] = {"coordinator": args.coordinator, "service": args.service}
    try:
        stub = health_pb2_grpc.HealthStub(channel)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        result["status"] = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    except grpc.RpcError as exc:
        code = exc.code()
        # NOT_FOUND is how grpc.health.v1 says "no such service" (grpc_health_probe reports it the same way).
        result["status"] = "SERVICE_UNKNOWN" if code == grpc.StatusCode.NOT_FOUND else "UNREACHABLE"
        result["error"] = f"{code.name if code is not None else 'UNKNOWN'}: {exc.details()}"
    finally:
        channel.close()
    print(json.dumps(result))
    if result["status"] == "SERVING":
        return 0
    why = f" ({result['error']})" if "error" in result else ""
    print(f"kvcoord health: {args.coordinator} is {result['status']}{why}", file=sys.stderr)
    return 1
