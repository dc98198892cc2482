"""``kvcoord route``: an OpenAI-compatible proxy that places each request on the engine holding most of
its prefix (:mod:`kvcoord.gateway.route`)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from kvcoord.cli.common import (
    LISTEN,
    NONNEG_FLOAT,
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
    pd_config,
    run_until_signalled,
    security,
)
from kvcoord.eventloop import use_uvloop
from kvcoord.gateway import POLICIES
from kvcoord.tokenize.media import DEFAULT_IMAGE_PLACEHOLDER, DEFAULT_IMAGE_TOKENS

if TYPE_CHECKING:
    from kvcoord.gateway.route import RouteConfig


def _backend(text: str) -> tuple[str, str]:
    from kvcoord.gateway.route_backends import parse_backend

    try:
        return parse_backend(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


_backend.__name__ = "NODE=URL"


def _http_url(text: str) -> str:
    url = text.strip() if "://" in text else f"http://{text.strip()}"
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    if parts.scheme not in ("http", "https") or not parts.hostname or port is None or parts.path.strip("/"):
        raise argparse.ArgumentTypeError(f"{text!r} is not http(s)://HOST:PORT")
    return url.rstrip("/")


_http_url.__name__ = "URL"


def add(sub: Subparsers) -> None:
    p = sub.add_parser("route", help="OpenAI-compatible router placing requests by prefix",
                       description="An OpenAI-compatible HTTP proxy in front of the engines: "
                       "/v1/completions, /v1/chat/completions (streaming), /v1/models, /health, /metrics. "
                       "Each request is looked up (the coordinator tokenizes it as the engine will) and "
                       "placed by the prefix-aware policy; x-kvcoord-* response headers say where and why.")
    add_connection(p, required=False, timeout=5.0)
    p.add_argument("--listen", default="127.0.0.1:8000", type=LISTEN, metavar="HOST:PORT",
                   help="where to serve the OpenAI API (default 127.0.0.1:8000)")
    p.add_argument("--backend", action="append", default=[], type=_backend, metavar="NODE=URL",
                   help="a node's engine URL, e.g. node-a=http://10.0.0.5:8000 (repeatable; overrides the "
                        "URL its agent announced; a node the coordinator does not list is still a candidate)")
    p.add_argument("--model", default=None,
                   help="model of requests that name none")
    p.add_argument("--coordinator-http", default=None, type=_http_url, metavar="URL",
                   help="the coordinator's HTTP API (its --http-listen, e.g. http://coord:8090): lookups go "
                        "there on a kept-alive connection, cheaper than gRPC per request; reservations, "
                        "ListNodes and queries HTTP cannot say stay on --coordinator (default: all gRPC)")
    p.add_argument("--deadline-ms", type=POSITIVE_FLOAT, default=50.0,
                   help="a lookup slower than this places least-loaded instead (default 50)")
    p.add_argument("--policy", choices=POLICIES, default="prefix-aware",
                   help="placement policy (default prefix-aware; the others ask no lookup)")
    add_degraded(p)
    add_cost_model(p.add_argument_group(
        "policy cost model", "How prefix-aware weighs a node's queue against its cached prefix (the "
        "defaults describe an 8B model on one H100; give a simulation's figures to route as it assumed)"),
        mean_output=True, pull=True)
    p.add_argument("--refresh-interval", type=POSITIVE_FLOAT, default=2.0,
                   help="seconds between ListNodes calls that learn serving URLs and loads (default 2)")
    p.add_argument("--connect-timeout", type=POSITIVE_FLOAT, default=2.0,
                   help="seconds to connect to a backend before trying the next (default 2)")
    p.add_argument("--read-timeout", type=NONNEG_FLOAT, default=300.0, metavar="SECONDS",
                   help="an engine that sends no answer byte for this long (stopped mid-answer, or hung) "
                        "fails the attempt: a stream ends with an error event, an unanswered request gets "
                        "504, not sent elsewhere (default 300, Envoy's stream idle timeout; 0: none)")
    p.add_argument("--max-attempts", type=POSITIVE_INT, default=3,
                   help="backends tried per request before answering 503 (default 3)")
    p.add_argument("--tokenizer", default=None, metavar="DIR|URL",
                   help="tokenize here instead of in the coordinator: a Hugging Face tokenizer directory "
                        "or an engine URL (its /tokenize; sim:toktok: sim-engines' toy tokenizer, for "
                        "simulation and tests); lookups then go by token ids and the policy "
                        "remembers prefixes routed but not yet reported, so a burst sharing a new prefix "
                        "stays together")
    p.add_argument("--image-tokens", type=POSITIVE_INT, default=DEFAULT_IMAGE_TOKENS, metavar="N",
                   help="with --tokenizer: placeholder tokens per image part, as the model's processor "
                        f"expands it (default {DEFAULT_IMAGE_TOKENS}; the coordinator's is image_tokens "
                        "in [models])")
    p.add_argument("--image-placeholder", default=DEFAULT_IMAGE_PLACEHOLDER, metavar="TEXT",
                   help="with --tokenizer: the one token an image renders as before expansion "
                        f"(default {DEFAULT_IMAGE_PLACEHOLDER})")
    add_reserve(p)
    add_pd(p, "the request goes whole to the decode node")
    g = p.add_argument_group("sessions and keys")
    g.add_argument("--session-ttl", type=NONNEG_FLOAT, default=600.0, metavar="S",
                   help="forget a session's node this long after its last request; 0 turns session "
                        "affinity off (default 600)")
    g.add_argument("--max-sessions", type=POSITIVE_INT, default=100_000,
                   help="sessions remembered at most, least recently used forgotten first (default 100000)")
    g.add_argument("--session-bonus-tokens", type=NONNEG_INT, default=512, metavar="N",
                   help="a session stays on its last node while that costs at most N prompt tokens of "
                        "prefill more than the best node (default 512)")
    g.add_argument("--api-keys", default=None, metavar="FILE",
                   help="JSON file of API keys and their rate limits; requests must then carry one "
                        "(Authorization: Bearer or x-api-key). Default: no key asked")
    p.add_argument("--seed", type=NONNEG_INT, default=None, help="tie-break RNG seed (default: random)")
    p.add_argument("--http-header-timeout-s", type=POSITIVE_FLOAT, default=10.0,
                   help="a request head must arrive within this; else 408, closed (default 10)")
    p.add_argument("--http-max-header-bytes", type=POSITIVE_INT, default=64 * 1024,
                   help="request line and headers at most; else 431 (default 65536)")
    p.add_argument("--http-max-connections", type=POSITIVE_INT, default=1024,
                   help="open client connections at most; one more gets 503, closed (default 1024)")
    p.add_argument("--http-idle-timeout-s", type=POSITIVE_FLOAT, default=75.0,
                   help="close a kept-alive client connection idle this long (default 75)")
    p.set_defaults(func=run)


def route_config(args: argparse.Namespace) -> RouteConfig:
    """The parsed flags as the router's configuration; raises CliError for a combination that cannot run."""
    from kvcoord.coordinator.httpd import HttpLimits
    from kvcoord.gateway.route import RouteConfig

    backends = dict(args.backend)
    if len(backends) != len(args.backend):
        dup = next(n for n, _ in args.backend if [b for b, _ in args.backend].count(n) > 1)
        raise CliError(f"--backend {dup}: given twice")
    if args.coordinator_http is not None and args.coordinator is None:
        raise CliError("--coordinator-http needs --coordinator (reservations and ListNodes go over gRPC)")
    if args.coordinator is None and (args.policy == "prefix-aware" or not backends):
        raise CliError("--coordinator is required (only --policy least-loaded|round-robin|random with "
                       "--backend runs without one)")
    from kvcoord.gateway.keys import KeyFileError, load_keys
    from kvcoord.gateway.sessions import SessionConfig

    try:
        keys = load_keys(args.api_keys) if args.api_keys else {}
    except KeyFileError as exc:
        raise CliError(str(exc)) from None
    from kvcoord.tokenize.media import MediaRule

    sessions = SessionConfig(args.session_ttl, args.max_sessions, args.session_bonus_tokens)
    if not args.image_placeholder.strip():
        raise CliError("--image-placeholder: must not be empty")
    return RouteConfig(media=MediaRule(args.image_placeholder, args.image_tokens),
                       sessions=sessions, api_keys=keys, pd=pd_config(args),
                       coordinator=args.coordinator, coordinator_http=args.coordinator_http,
                       security=security(args), listen=args.listen,
                       backends=backends, model=args.model, deadline_ms=args.deadline_ms,
                       policy=args.policy, degraded=args.degraded, latency=cost_model(args),
                       rpc_timeout=args.timeout, refresh_interval=args.refresh_interval,
                       connect_timeout=args.connect_timeout, read_timeout=args.read_timeout or None,
                       max_attempts=args.max_attempts, seed=args.seed,
                       tokenizer=args.tokenizer, reserve=args.reserve, reserve_ttl=args.reserve_ttl,
                       limits=HttpLimits(args.http_header_timeout_s,
                                                                   args.http_max_header_bytes,
                                                                   args.http_max_connections,
                                                                   args.http_idle_timeout_s))


def run(args: argparse.Namespace) -> int:
    from kvcoord.gateway.route import serve_route

    config = route_config(args)
    use_uvloop()
    run_until_signalled(lambda stop: serve_route(config, stop))
    return 0
