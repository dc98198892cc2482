"""``kvcoord stats``: the coordinator's state (nodes, blocks, events applied and rejected) as JSON."""

from __future__ import annotations

import argparse

from kvcoord.cli.common import Subparsers, add_connection, print_json, rpc_failed, security


def add(sub: Subparsers) -> None:
    p = sub.add_parser("stats", help="print the coordinator's state as JSON")
    add_connection(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvcoord.router.client import CoordinatorClient, CoordinatorError

    with CoordinatorClient(args.coordinator, security=security(args), timeout=args.timeout) as client:
        try:
            stats = client.stats()
        except CoordinatorError as exc:
            return rpc_failed("stats", exc)
    print_json(stats.to_json())
    return 0
