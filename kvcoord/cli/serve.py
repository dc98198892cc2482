"""``kvcoord serve``: the coordinator (gRPC, HTTP API, Prometheus metrics), until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
from typing import TYPE_CHECKING

from kvcoord.cli.common import NONNEG_INT, POSITIVE_FLOAT, POSITIVE_INT, Subparsers
from kvcoord.eventloop import use_uvloop

if TYPE_CHECKING:
    from kvcoord.coordinator.config import CoordinatorConfig


def add(sub: Subparsers) -> None:
    p = sub.add_parser("serve", help="run the coordinator (gRPC, HTTP API, Prometheus metrics)")
    p.add_argument("--listen", default=None, help="gRPC HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--metrics-listen", default=None,
                   help="metrics HOST:PORT (default 127.0.0.1:9400; '' disables)")
    p.add_argument("--http-listen", default=None,
                   help="HTTP API HOST:PORT, Dynamo's indexer API (default 127.0.0.1:8090; '' disables)")
    p.add_argument("--index", default=None, help="memory | redis://host:port/db | redis+cluster://h:p,...")
    p.add_argument("--config", default=None, help="TOML configuration file (default: $KVCOORD_CONFIG)")
    p.add_argument("--lease-seconds", type=POSITIVE_FLOAT, default=None, help="node lease (default 10)")
    p.add_argument("--lookup-deadline", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
                   help="a lookup waits this long for a remote index, then answers UNAVAILABLE / 503 "
                        "(default 0.5)")
    p.add_argument("--state-dir", default=None, metavar="DIR",
                   help="with the memory index, keep engines registered over HTTP (POST /register) in "
                        "DIR/engines.json across restarts (default: not kept; Redis keeps them itself)")
    p.add_argument("--replica-silent-seconds", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
                   help="Redis index: a coordinator replica silent this long has its routers' reservations "
                        "dropped on the others (default 3, at least 2)")
    p.add_argument("--reservation-hold-seconds", type=POSITIVE_FLOAT, default=None, metavar="SECONDS",
                   help="a router's lookup holds its new prefix this long for its pick; another router's "
                        "lookup of it, on any replica, waits at most that to see the pick (default 0.25)")
    p.add_argument("--lookup-workers", type=NONNEG_INT, default=None, metavar="N",
                   help="memory index: N worker processes answer HTTP lookups on --http-listen "
                        "(SO_REUSEPORT), fed by this one, which keeps ingest (default 0: it answers them)")
    p.add_argument("--strict-models", action="store_const", const=True, default=None,
                   help="refuse models that are not configured")
    p.add_argument("--model", action="append", default=None,
                   metavar="NAME,algo=A,block_size=N[,seed=S][,style=S][,engine_release=R]",
                   help="a model's hash profile (repeatable; adds to the config file's [models]); NAME alone "
                        "(or NAME,seed=S): its profile is learned from the engines' events")
    p.add_argument("--max-message-bytes", type=POSITIVE_INT, default=None,
                   help="largest gRPC message accepted (default 16777216)")
    p.add_argument("--max-events-per-batch", type=POSITIVE_INT, default=None,
                   help="events in one ingest batch; more are refused (default 4096)")
    p.add_argument("--max-query-blocks", type=POSITIVE_INT, default=None,
                   help="blocks one lookup may ask about; more are refused (default 8192)")
    p.add_argument("--max-hashes-per-batch", type=POSITIVE_INT, default=None,
                   help="block hashes over all events of one batch (default 262144)")
    p.add_argument("--max-entries-per-node", type=POSITIVE_INT, default=None,
                   help="entries one node may hold over its ranks (default 16777216)")
    p.add_argument("--max-staged-snapshot-blocks", type=POSITIVE_INT, default=None,
                   help="blocks of unfinished snapshots held over all streams (default 33554432)")
    p.add_argument("--max-streams", type=POSITIVE_INT, default=None,
                   help="concurrent ingest streams; more get RESOURCE_EXHAUSTED (default 10000)")
    p.add_argument("--hello-timeout-s", type=POSITIVE_FLOAT, default=None,
                   help="close an ingest stream that sends no Hello within this (default 5)")
    p.add_argument("--http-header-timeout-s", type=POSITIVE_FLOAT, default=None,
                   help="HTTP API: a request head must arrive within this; else 408, closed (default 10)")
    p.add_argument("--http-max-header-bytes", type=POSITIVE_INT, default=None,
                   help="HTTP API: request line and headers at most; else 431 (default 65536)")
    p.add_argument("--http-max-connections", type=POSITIVE_INT, default=None,
                   help="HTTP API: open connections at most; one more gets 503, closed (default 1024)")
    p.add_argument("--http-idle-timeout-s", type=POSITIVE_FLOAT, default=None,
                   help="HTTP API: close a kept-alive connection idle this long (default 75)")
    p.add_argument("--tls-cert", default=None, help="PEM server certificate")
    p.add_argument("--tls-key", default=None, help="PEM server key")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA for client certificates (mutual TLS)")
    p.add_argument("--agent-token", action="append", default=None, metavar="TOKEN=NODE[,NODE...]",
                   help="agent token bound to node ids (repeatable; prefer the config file)")
    p.add_argument("--router-token", action="append", default=None, metavar="TOKEN",
                   help="query-only token (repeatable; prefer the config file)")
    p.add_argument("--admin-token", action="append", default=None, metavar="TOKEN",
                   help="token for every RPC, drain and remove included (repeatable; prefer the config file)")
    p.set_defaults(func=run)


CONFIG_FLAGS = (
    "listen",
    "metrics_listen",
    "http_listen",
    "index",
    "lease_seconds",
    "lookup_deadline",
    "state_dir",
    "strict_models",
    "lookup_workers",
    "replica_silent_seconds",
    "reservation_hold_seconds",
    "max_message_bytes",
    "max_events_per_batch",
    "max_query_blocks",
    "max_hashes_per_batch",
    "max_entries_per_node",
    "max_streams",
    "max_staged_snapshot_blocks",
    "hello_timeout_s",
    "http_header_timeout_s",
    "http_max_header_bytes",
    "http_max_connections",
    "http_idle_timeout_s",
    "tls_cert",
    "tls_key",
    "tls_client_ca",
)
"""Flags that override the configuration key of the same name."""


def config_from_args(args: argparse.Namespace) -> CoordinatorConfig:
    """Flags win over env vars, which win over the config file."""
    from kvcoord.coordinator.config import load_config

    overrides: dict[str, object] = {k: getattr(args, k, None) for k in CONFIG_FLAGS}
    if getattr(args, "model", None):
        overrides["models"] = args.model
    for k in ("agent_token", "router_token", "admin_token"):
        if getattr(args, k, None):
            overrides[k + "s"] = getattr(args, k)
    return load_config(getattr(args, "config", None), overrides=overrides)


def run(args: argparse.Namespace) -> int:
    from kvcoord.coordinator.server import serve

    config = config_from_args(args)
    use_uvloop()
    asyncio.run(serve(config, relay_engines=True))
    return 0
