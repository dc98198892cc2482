"""``kvcoord nodes``, ``kvcoord drain NODE`` and ``kvcoord remove NODE``: the admin RPCs.

``nodes`` needs a router or admin token (ListNodes); ``drain`` and ``remove`` an admin token.
"""

from __future__ import annotations

import argparse

from kvcoord.cli.common import Subparsers, add_connection, print_json, rpc_failed, security


def add(sub: Subparsers) -> None:
    p = sub.add_parser("nodes", help="list the fleet's nodes (state, epoch, load, hash profile) as JSON")
    add_connection(p)
    p.add_argument("--model", default="", help="only this model's nodes")
    p.set_defaults(func=run_nodes)
    p = sub.add_parser("drain", help="leave a node out of lookups (--undrain serves it again)")
    p.add_argument("node_id", metavar="NODE", help="the node id to drain (as its agent's --node-id)")
    add_connection(p)
    p.add_argument("--undrain", action="store_true", help="end the drain")
    p.set_defaults(func=run_drain)
    p = sub.add_parser("remove", help="forget a node and reclaim its index entries")
    p.add_argument("node_id", metavar="NODE", help="the node id to forget (as its agent's --node-id)")
    add_connection(p)
    p.set_defaults(func=run_remove)


def run_nodes(args: argparse.Namespace) -> int:
    from kvcoord.router.client import CoordinatorClient, CoordinatorError

    with CoordinatorClient(args.coordinator, security=security(args), timeout=args.timeout) as client:
        try:
            nodes = client.list_nodes(args.model)
        except CoordinatorError as exc:
            return rpc_failed("nodes", exc)
    print_json({"nodes": [n.to_json() for n in nodes]})
    return 0


def run_drain(args: argparse.Namespace) -> int:
    from kvcoord.router.client import CoordinatorClient, CoordinatorError

    with CoordinatorClient(args.coordinator, security=security(args), timeout=args.timeout) as client:
        try:
            client.drain(args.node_id, undrain=args.undrain)
        except CoordinatorError as exc:
            return rpc_failed("drain", exc)
    print_json({"node_id": args.node_id, "draining": not args.undrain})
    return 0


def run_remove(args: argparse.Namespace) -> int:
    from kvcoord.router.client import CoordinatorClient, CoordinatorError

    with CoordinatorClient(args.coordinator, security=security(args), timeout=args.timeout) as client:
        try:
            client.remove(args.node_id)
        except CoordinatorError as exc:
            return rpc_failed("remove", exc)
    print_json({"node_id": args.node_id, "removed": True})
    return 0
