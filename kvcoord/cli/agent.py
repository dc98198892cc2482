"""``kvcoord agent``: relay one engine's KV events (ZMQ or its gRPC stream) to the coordinator(s)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import sys
from typing import TYPE_CHECKING

from kvcoord.cli.common import (
    GRPC_ENDPOINT,
    NONNEG_FLOAT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    TOKEN_ENV,
    ZMQ_ENDPOINT,
    CliError,
    Subparsers,
    add_hash_seed,
    add_tls_client,
    parse_hostport,
    security,
)

if TYPE_CHECKING:
    from kvcoord.events import Tier
    from kvcoord.hashing import HashProfile


def add(sub: Subparsers) -> None:
    p = sub.add_parser("agent", help="relay one engine's KV events (ZMQ or gRPC) to the coordinator")
    p.add_argument("--coordinator", required=True, action="append", metavar="HOST:PORT",
                   help="the coordinator (repeat or comma-separate for several)")
    p.add_argument("--node-id", required=True, help="this engine's node id, unique in the fleet")
    p.add_argument("--model", required=True, help="the model the engine serves, as the coordinator names it")
    p.add_argument("--zmq-endpoint", default=None, type=ZMQ_ENDPOINT,
                   help="the engine's PUB endpoint, e.g. tcp://127.0.0.1:5557 (or --no-kv-events)")
    p.add_argument("--grpc-endpoint", default=None, type=GRPC_ENDPOINT, metavar="HOST:PORT",
                   help="the engine's gRPC server, whose SubscribeKvEvents stream (SGLang, vLLM's "
                        "smg-grpc-servicer, TRT-LLM) carries its KV events and its load (instead of "
                        "--zmq-endpoint; no --engine-metrics-url needed)")
    p.add_argument("--no-kv-events", action="store_true",
                   help="the engine publishes no KV events (vLLM without --kv-events-config): report its "
                        "load and URL only; lookups show the node with trust 'approximate'")
    p.add_argument("--replay-endpoint", default=None, type=ZMQ_ENDPOINT,
                   help="the engine's ROUTER replay endpoint")
    p.add_argument("--topic", default="", help="ZMQ topic of the engine's KV events (default: all)")
    p.add_argument("--dp-ranks", default="0",
                   help="engine DP ranks to relay, comma separated: rank r publishes on the (rank-0) "
                        "endpoints' port + r, as vLLM offsets them (default 0)")
    p.add_argument("--token", default=None, help=f"agent token for the coordinator (default: ${TOKEN_ENV})")
    p.add_argument("--tls", action="store_true", help="use TLS with the system roots")
    add_tls_client(p)
    g = p.add_argument_group(
        "hash profile",
        "The engine's block-hash settings, announced in the Hello so the coordinator can refuse an agent "
        "whose hashes cannot match its routers' (a fingerprint, never the seed). Omit --algo to announce "
        "nothing.")
    g.add_argument("--algo", default=None, help="sha256 | sha256_cbor | xxhash | xxhash_cbor | sglang")
    g.add_argument("--block-size", type=POSITIVE_INT, default=None,
                   help="the engine's block size (with --algo)")
    add_hash_seed(g)
    g.add_argument("--engine-release", default=None,
                   help="vLLM release (e.g. 0.31): sets the extra-key style and the seed default")
    g.add_argument("--style", choices=["untagged", "tagged"], default=None,
                   help="extra-key style (default: from --engine-release, else untagged)")
    p.add_argument("--pool", action="append", default=[], metavar="NAME",
                   help="a shared pool (lmcache-remote, mooncake-store) this engine loads blocks from: its "
                        "blocks count for this node in lookups (repeatable)")
    p.add_argument("--pool-publisher", default="", metavar="NAME",
                   help="this publisher is pool NAME's storage daemon, not a routable engine: its events "
                        "feed the pool; --node-id must be pool:NAME")
    p.add_argument("--role", default="", metavar="ROLE",
                   help="the engine's role in disaggregated serving, as llm-d's llm-d.ai/role label: "
                        "prefill, decode or both (prefill-decode); route and epp without "
                        "--prefill-node/--decode-node take their pools from these roles")
    p.add_argument("--media", action="append", default=None, metavar="NAME=TIER",
                   help="map a medium name the engine publishes to GPU, CPU or STORAGE, over the defaults "
                        "(repeatable; docs/semantics.md lists them); events of a name no map knows are "
                        "skipped and counted (the coordinator's kvcoord_unknown_medium_events_total)")
    p.add_argument("--signed-hashes", action="store_true",
                   help="accept SGLang's signed int64 block hashes (reinterpreted as uint64)")
    p.add_argument("--linger", type=NONNEG_FLOAT, default=0.0, metavar="SECONDS",
                   help="how long a batch waits for more events before it is sent (default 0: at once); "
                        "e.g. 0.05 sends several engine steps per message, for less CPU here and on the "
                        "coordinator and up to that much more index lag")
    p.add_argument("--replay-timeout", type=POSITIVE_FLOAT, default=2.0,
                   help="seconds to wait for a replay answer")
    p.add_argument("--stats-file", default=None,
                   help="write JSON {state, relays: [{expected_seq, gaps, lost_batches, ..}], "
                        "reporter: {..}} here")
    p.add_argument("--stats-interval", type=POSITIVE_FLOAT, default=0.2,
                   help="seconds between stats-file writes")
    e = p.add_argument_group(
        "engine load and URL",
        "The engine's own load (vLLM's vllm:num_requests_running, vllm:num_requests_waiting, "
        "vllm:kv_cache_usage_perc) rides in heartbeats, so lookups return it; its serving URL is announced "
        "to routers. A failed scrape is logged once per outage; after a few seconds without a good one the "
        "load is reported as unknown (zeros). --stats-file shows engine_metrics {url, ok, last_error, "
        "age_seconds}.")
    e.add_argument("--engine-metrics-url", default=None, type=HTTP_URL, metavar="URL",
                   help="the engine's Prometheus page, e.g. http://127.0.0.1:8000/metrics")
    e.add_argument("--engine-metrics-interval", type=POSITIVE_FLOAT, default=1.0,
                   help="seconds between scrapes (default 1)")
    e.add_argument("--serving-url", default=None, type=HTTP_URL, metavar="URL",
                   help="the engine's OpenAI-compatible base URL, announced in the Hello (default: "
                        "--engine-metrics-url without its /metrics, if it ends so; else none)")
    p.set_defaults(func=run)


def HTTP_URL(text: str) -> str:
    """An ``http://`` or ``https://`` URL with a host."""
    from urllib.parse import urlsplit

    url = text.strip()
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError for a bad port)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"{text!r} is not an http:// or https:// URL with a host")
    return url


def serving_url(args: argparse.Namespace) -> str:
    """``--serving-url``, else the metrics URL's base when it ends in ``/metrics``, else ""."""
    if args.serving_url:
        return str(args.serving_url).rstrip("/")
    metrics = args.engine_metrics_url
    if metrics and metrics.rstrip("/").endswith("/metrics"):
        return str(metrics.rstrip("/")[: -len("/metrics")])
    return ""


def coordinators(values: list[str]) -> tuple[str, ...]:
    out = tuple(c.strip() for v in values for c in v.split(",") if c.strip())
    if not out:
        raise CliError("--coordinator needs at least one HOST:PORT")
    for c in out:
        try:
            parse_hostport(c)
        except ValueError as exc:
            raise CliError(f"--coordinator: {exc}") from None
    return out


def dp_ranks(text: str) -> tuple[int, ...]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise CliError(f"--dp-ranks {text!r} is not a comma-separated list of ints") from None
    if not ranks or any(r < 0 for r in ranks) or len(set(ranks)) != len(ranks):
        raise CliError(f"--dp-ranks {text!r} must be distinct non-negative ints")
    return tuple(ranks)


def media_flags(values: list[str]) -> dict[str, Tier]:
    """``--media NAME=TIER`` flags as a map (one-line ``CliError`` for a bad one)."""
    from kvcoord.media import parse_media

    table: dict[str, object] = {}
    for v in values:
        name, eq, tier = v.partition("=")
        if not eq or not name.strip():
            raise CliError(f"--media {v!r}: expected NAME=TIER (TIER: GPU, CPU or STORAGE)")
        table[name.strip()] = tier
    try:
        return parse_media(table, "--media")
    except ValueError as exc:
        raise CliError(str(exc)) from None


def check_event_source(args: argparse.Namespace) -> None:
    """Exactly one of ``--zmq-endpoint``, ``--grpc-endpoint`` and ``--no-kv-events``; no ZMQ flag with a gRPC
    stream, and no relay or hash flag without events (an announced profile could only mark the node
    mismatched)."""
    flags: tuple[tuple[str, object], ...]
    if args.grpc_endpoint is not None:
        flags = (("--zmq-endpoint", args.zmq_endpoint), ("--no-kv-events", args.no_kv_events),
                 ("--replay-endpoint", args.replay_endpoint), ("--topic", args.topic),
                 ("--signed-hashes", args.signed_hashes))
        given = [f for f, v in flags if v]
        if given:
            raise CliError(f"--grpc-endpoint is the engine's whole stream (hashes are int64 on it): drop "
                           f"{given[0]}")
        if "," in args.dp_ranks.strip(" ,"):
            raise CliError("--grpc-endpoint: a SubscribeKvEvents stream carries one DP rank's sequence; give "
                           "one rank in --dp-ranks (one agent per rank's server)")
    elif args.no_kv_events:
        flags = (("--zmq-endpoint", args.zmq_endpoint), ("--replay-endpoint", args.replay_endpoint),
                 ("--topic", args.topic), ("--signed-hashes", args.signed_hashes), ("--algo", args.algo),
                 ("--block-size", args.block_size), ("--hash-seed", args.hash_seed),
                 ("--engine-release", args.engine_release), ("--style", args.style))
        given = [f for f, v in flags if v]
        if given:
            raise CliError(f"--no-kv-events relays no events: drop {given[0]}")
    elif args.zmq_endpoint is None:
        raise CliError("--zmq-endpoint is required (or --grpc-endpoint for an engine's gRPC stream, or "
                       "--no-kv-events for an engine without KV events)")


def hash_profile(args: argparse.Namespace) -> HashProfile | None:
    """``--algo`` and friends as the profile the Hello announces (None: announce nothing).

    The seed defaults to ``$PYTHONHASHSEED`` (then the release's default); a seed that cannot be
    resolved is an error now, not a mismatch the coordinator discovers later.
    """
    from kvcoord.hashing import HashProfile, check_algo

    names = ("block_size", "hash_seed", "engine_release", "style")
    given = [f for f in names if getattr(args, f) is not None]
    if args.algo is None:
        if given:
            raise CliError(f"--{given[0].replace('_', '-')} needs --algo")
        return None
    if args.block_size is None:
        raise CliError("--algo needs --block-size")
    algo = check_algo(args.algo)
    seed = args.hash_seed if args.hash_seed is not None else (
        None if algo == "sglang" else os.environ.get("PYTHONHASHSEED"))  # SGLang's chain has no seed
    if args.engine_release is not None:
        profile = HashProfile.for_release(args.engine_release, algo, args.block_size, seed=seed)
        if args.style is not None:
            profile = dataclasses.replace(profile, style=args.style)
    else:
        profile = HashProfile(algo, args.block_size, seed=seed, style=args.style or "untagged")
    profile.fingerprint()  # ValueError (with the fix) when the seed cannot be resolved
    return profile


def run(args: argparse.Namespace) -> int:
    from kvcoord.agent.service import AgentConfig, AgentRefused, run_agent
    from kvcoord.coordinator.pools import check_pool_hello
    from kvcoord.media import configure_media
    from kvcoord.roles import check_role
    from kvcoord.validate import check_model, check_node_id

    try:  # the coordinator would refuse the Hello: say so before connecting
        check_node_id(args.node_id, "--node-id")
        check_model(args.model, "--model")
        check_pool_hello(args.node_id, args.pool_publisher, args.pool)
        if args.pool_publisher and args.node_id != f"pool:{args.pool_publisher}":
            raise ValueError(f"--pool-publisher {args.pool_publisher}: --node-id must be "
                             f"pool:{args.pool_publisher}")
        role = check_role(args.role, "--role", publisher=args.pool_publisher)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    check_event_source(args)
    configure_media(media_flags(args.media or []))
    config = AgentConfig(
        coordinators=coordinators(args.coordinator), node_id=args.node_id, model=args.model,
        zmq_endpoint=args.zmq_endpoint, replay_endpoint=args.replay_endpoint, topic=args.topic,
        dp_ranks=dp_ranks(args.dp_ranks), security=security(args), hash_profile=hash_profile(args),
        signed_hashes=args.signed_hashes, replay_timeout=args.replay_timeout, stats_file=args.stats_file,
        stats_interval=args.stats_interval, engine_metrics_url=args.engine_metrics_url,
        engine_metrics_interval=args.engine_metrics_interval, serving_url=serving_url(args),
        linger=args.linger, grpc_endpoint=args.grpc_endpoint, pools=tuple(args.pool),
        pool_publisher=args.pool_publisher, role=role,
    )
    try:
        asyncio.run(run_agent(config))
    except AgentRefused as exc:
        print(f"kvcoord agent: {exc}", file=sys.stderr)
        return 1
    return 0
