"""The ``kvcoord`` command.

Contract (DESIGN.md): data goes to stdout as JSON, human text to stderr, and bad input exits
non-zero with a one-line reason. Each subcommand's parser lives here; its body lives in the
module that owns the work and is imported only when that subcommand runs, so ``kvcoord hash``
does not pay for gRPC.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from kvcoord import __version__


class CliError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


Handler = Callable[[argparse.Namespace], int]


def _lazy(module: str, func: str) -> Handler:
    def run(args: argparse.Namespace) -> int:
        import importlib

        target: Handler = getattr(importlib.import_module(module), func)
        return target(args)

    return run


# --- kvcoord hash -------------------------------------------------------------------------------
def _add_hash(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "hash",
        help="hash token ids (JSON list on stdin) into vLLM block hashes (JSON list on stdout)",
        description="Reads a JSON list of token ids on stdin and prints the JSON list of full-block hashes "
        "exactly as vLLM computes them.",
    )
    p.add_argument("--algo", required=True, help="sha256 | sha256_cbor | xxhash | xxhash_cbor")
    p.add_argument("--seed", default=None, help="NONE_HASH seed (default: $PYTHONHASHSEED)")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--style", choices=["untagged", "tagged"], default=None,
                   help="extra-key style: untagged (vLLM <= 0.30) or tagged (vLLM >= 0.31); "
                   "default: from --engine-release, else untagged")
    p.add_argument("--engine-release", default=None,
                   help="vLLM release (e.g. 0.31): sets the extra-key style and the seed default")
    p.add_argument("--lora-name", default=None)
    p.add_argument("--lora-path", default=None)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--mm", action="append", default=[], metavar="ID:OFFSET:LENGTH",
                   help="a multimodal item placeholder (repeatable)")
    p.add_argument("--prompt-embeds-digests", default=None, metavar="HEX,...",
                   help="per-block prompt-embeds digests, comma separated hex")
    p.add_argument("--bytes", action="store_true", help="print full digests as hex instead of uint64 ints")
    p.set_defaults(func=run_hash)


def run_hash(args: argparse.Namespace) -> int:
    """Body of ``kvcoord hash``: validate everything, then hash; bad input is a one-line error."""
    import json

    from kvcoord import hashing

    algo = hashing.check_algo(args.algo)
    if args.engine_release is not None:
        profile = hashing.HashProfile.for_release(args.engine_release, algo, args.block_size, args.seed)
        if args.style is not None:
            profile = hashing.HashProfile(
                algo, args.block_size, args.seed, args.style, engine_release=args.engine_release
            )
    else:
        profile = hashing.HashProfile(algo, args.block_size, args.seed, args.style or "untagged")
    profile.none_hash()  # a missing seed fails here, before stdin is read
    items = []
    for spec in args.mm:
        parts = spec.rsplit(":", 2)  # the identifier may itself contain ':'
        try:
            if len(parts) != 3 or not parts[0]:
                raise ValueError(spec)
            items.append(hashing.MultiModalItem(parts[0], int(parts[1]), int(parts[2])))
        except ValueError:
            raise CliError(f"bad --mm {spec!r}: expected ID:OFFSET:LENGTH, OFFSET>=0, LENGTH>=1") from None
    digests = None
    if args.prompt_embeds_digests is not None:
        try:
            digests = tuple(bytes.fromhex(h) for h in args.prompt_embeds_digests.split(",") if h.strip())
        except ValueError:
            raise CliError("bad --prompt-embeds-digests: expected comma separated hex digests") from None
    keys = hashing.RequestKeys(
        lora_name=args.lora_name,
        lora_path=args.lora_path,
        cache_salt=args.cache_salt,
        mm_items=tuple(items),
        prompt_embeds_digests=digests,
    )
    try:
        tokens = json.loads(sys.stdin.read())
    except ValueError as exc:
        raise CliError(f"stdin is not JSON: {exc}") from None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise CliError("stdin must be a JSON list of non-negative integer token ids")
    digest_list = hashing.hash_request_tokens(profile, tokens, keys)
    out: list[int] | list[str] = [int(hashing.to_block_hash64(d)) for d in digest_list]
    if args.bytes:
        out = [d.hex() for d in digest_list]
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


# --- kvcoord serve / lookup / stats ------------------------------------------------------------
def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the coordinator (gRPC + Prometheus metrics)")
    p.add_argument("--listen", default=None, help="gRPC HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--metrics-listen", default=None, help="metrics HOST:PORT (default 127.0.0.1:9400)")
    p.add_argument("--index", default=None, help="memory | redis://host:port/db | redis+cluster://h:p,...")
    p.add_argument("--config", default=None, help="TOML configuration file (default: $KVCOORD_CONFIG)")
    p.add_argument("--lease-seconds", type=float, default=None, help="node lease (default 10)")
    p.add_argument("--strict-models", action="store_const", const=True, default=None,
                   help="refuse models that are not configured")
    p.add_argument("--model", action="append", default=None,
                   metavar="NAME,algo=A,block_size=N[,seed=S][,style=S][,engine_release=R]",
                   help="a model's hash profile (repeatable; adds to the config file's [models])")
    p.add_argument("--max-message-bytes", type=int, default=None)
    p.add_argument("--max-events-per-batch", type=int, default=None)
    p.add_argument("--max-query-blocks", type=int, default=None)
    p.add_argument("--tls-cert", default=None, help="PEM server certificate")
    p.add_argument("--tls-key", default=None, help="PEM server key")
    p.add_argument("--tls-client-ca", default=None, help="PEM CA for client certificates (mutual TLS)")
    p.add_argument("--agent-token", action="append", default=None, metavar="TOKEN=NODE[,NODE...]",
                   help="agent token bound to node ids (repeatable; prefer the config file)")
    p.add_argument("--router-token", action="append", default=None, metavar="TOKEN",
                   help="query-only token (repeatable; prefer the config file)")
    p.add_argument("--admin-token", action="append", default=None, metavar="TOKEN")
    p.set_defaults(func=_lazy("kvcoord.coordinator.server", "run_serve"))


def _add_lookup(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("lookup", help="ask the coordinator which nodes hold a prompt's prefix")
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    p.add_argument("--model", required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="comma separated token ids")
    g.add_argument("--tokens-file", help="file with a JSON list of token ids ('-' for stdin)")
    g.add_argument("--hashes", help="comma separated uint64 block hashes")
    p.add_argument("--lora-name", default=None)
    p.add_argument("--lora-path", default=None)
    p.add_argument("--cache-salt", default=None)
    p.add_argument("--mm", action="append", default=[], metavar="ID:OFFSET:LENGTH",
                   help="a multimodal item placeholder (repeatable)")
    p.add_argument("--prompt-embeds-digests", default=None, metavar="HEX,...",
                   help="per-block prompt-embeds digests, comma separated hex")
    p.add_argument("--candidate", action="append", default=[], metavar="NODE_ID[:DP_RANK]",
                   help="only consider these nodes (repeatable; default: every live node)")
    _client_flags(p)
    p.set_defaults(func=_lazy("kvcoord.router.client", "run_lookup"))


def _tls_client_flags(p: argparse.ArgumentParser) -> None:
    """TLS flags of every command that connects to a coordinator."""
    p.add_argument("--tls-ca", default=None, help="PEM root CA of the coordinator certificate (turns TLS on)")
    p.add_argument("--tls-cert", default=None, help="PEM client certificate for mutual TLS (with --tls-key)")
    p.add_argument("--tls-key", default=None, help="PEM client key for mutual TLS (with --tls-cert)")
    p.add_argument("--tls-server-name", default=None,
                   help="name to check in the coordinator's certificate (turns TLS on)")


def _client_flags(p: argparse.ArgumentParser) -> None:
    """Connection flags of the client subcommands (lookup, stats)."""
    p.add_argument("--token", default=None, help="bearer token (router or admin)")
    p.add_argument("--tls", action="store_true", help="use TLS with the system roots")
    _tls_client_flags(p)
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per RPC (default 10)")


def _add_stats(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stats", help="print the coordinator's state as JSON")
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    _client_flags(p)
    p.set_defaults(func=_lazy("kvcoord.router.client", "run_stats"))


# --- kvcoord agent / sim-engine ----------------------------------------------------------------
def _add_agent(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="relay one engine's ZMQ KV events to the coordinator")
    p.add_argument("--coordinator", required=True, action="append",
                   help="HOST:PORT (repeat or comma-separate for several)")
    p.add_argument("--node-id", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--zmq-endpoint", required=True, help="the engine's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay-endpoint", default=None, help="the engine's ROUTER replay endpoint")
    p.add_argument("--topic", default="")
    p.add_argument("--dp-ranks", default="0",
                   help="engine DP ranks to relay, comma separated: rank r publishes on the (rank-0) "
                        "endpoints' port + r, as vLLM offsets them (default 0)")
    _tls_client_flags(p)
    g = p.add_argument_group(
        "hash profile",
        "The engine's block-hash settings, announced in the Hello so the coordinator can refuse an agent "
        "whose hashes cannot match its routers' (a fingerprint, never the seed). Omit --algo to announce "
        "nothing.")
    g.add_argument("--algo", default=None, help="sha256 | sha256_cbor | xxhash | xxhash_cbor")
    g.add_argument("--block-size", type=int, default=None, help="the engine's block size (with --algo)")
    g.add_argument("--hash-seed", default=None, help="the engine's NONE_HASH seed (default: $PYTHONHASHSEED)")
    g.add_argument("--engine-release", default=None,
                   help="vLLM release (e.g. 0.31): sets the extra-key style and the seed default")
    g.add_argument("--style", choices=["untagged", "tagged"], default=None,
                   help="extra-key style (default: from --engine-release, else untagged)")
    p.add_argument("--signed-hashes", action="store_true",
                   help="accept SGLang's signed int64 block hashes (reinterpreted as uint64)")
    p.add_argument("--replay-timeout", type=float, default=2.0, help="seconds to wait for a replay answer")
    p.add_argument("--token", default=None, help="auth token for the coordinator (default: $KVCOORD_TOKEN)")
    p.add_argument("--stats-file", default=None,
                   help="write JSON {relays: [{expected_seq, gaps, lost_batches, ..}], reporter: {..}} here")
    p.add_argument("--stats-interval", type=float, default=0.2, help="seconds between stats-file writes")
    p.set_defaults(func=_lazy("kvcoord.agent.relay", "run_agent"))


def _add_sim_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim-engine", help="a stand-in engine publishing vLLM-exact KV events")
    p.add_argument("--zmq-bind", default="tcp://*:5557",
                   help="PUB endpoint, always bound (rank 0; rank r uses port + r); agents connect to it")
    p.add_argument("--replay-bind", default=None, help="ROUTER replay endpoint, always bound, e.g. tcp://*:5558")
    p.add_argument("--topic", default="")
    p.add_argument("--model", default="sim-model")
    p.add_argument("--dp-rank", type=int, default=0)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--algo", default="sha256_cbor", help="sha256 | sha256_cbor | xxhash | xxhash_cbor")
    p.add_argument("--hash-seed", default=None, help="NONE_HASH seed (default: $PYTHONHASHSEED)")
    p.add_argument("--hash-form", choices=["int", "bytes"], default="int", help="how events carry hashes")
    p.add_argument("--medium", default="GPU")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--rate", type=float, default=20.0, help="requests per second (0: as fast as possible)")
    p.add_argument("--requests", type=int, default=0,
                   help="stop after N requests (0: run until SIGTERM); SIGUSR1 serves N more")
    p.add_argument("--linger", action="store_true", help="after --requests, serve replay until SIGTERM")
    p.add_argument("--concurrency", type=int, default=8, help="requests kept running (holding blocks)")
    p.add_argument("--prefixes", type=int, default=8, help="distinct shared prompt prefixes")
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--buffer-steps", type=int, default=10_000, help="batches kept for replay")
    p.add_argument("--hwm", type=int, default=100_000, help="PUB high-water mark")
    p.add_argument("--form", choices=["map", "array"], default="map",
                   help="event encoding: map (vLLM >= 0.24) or array (<= 0.23)")
    p.add_argument("--removal-events", choices=["vllm", "last_copy"], default="vllm",
                   help="BlockRemoved per evicted block (vllm) or only when a hash's last copy goes")
    p.add_argument("--state-file", default=None,
                   help="write JSON {blocks: {dp_rank: [[hash, tier]..]}, next_seq, ..} here periodically")
    p.add_argument("--state-interval", type=float, default=0.2, help="seconds between state-file writes")
    p.add_argument("--cache-salt", default=None,
                   help="every request's cache_salt (an extra key of its block hashes)")
    g = p.add_argument_group(
        "router-style lookups",
        "Before admitting each request, ask a coordinator how much of the prompt each node holds, as a "
        "router would (off the engine loop; errors are counted, never fatal). Counters go to --state-file "
        "under 'lookup'; the coordinator's metrics show the lookups and hit rates.")
    g.add_argument("--lookup-coordinator", default=None, metavar="HOST:PORT", help="the coordinator to ask")
    g.add_argument("--lookup-model", default=None, help="model to look up (default: --model)")
    g.add_argument("--lookup-node-id", default=None,
                   help="this engine's node id (its agent's --node-id), to count what the coordinator "
                        "says it holds")
    g.add_argument("--lookup-token", default=None, help="router token for the coordinator")
    g.add_argument("--lookup-tls-ca", default=None,
                   help="PEM root CA of the coordinator certificate (turns TLS on)")
    g.add_argument("--lookup-timeout", type=float, default=0.5, help="seconds per lookup (default 0.5)")
    g.add_argument("--lookup-queue", type=int, default=64,
                   help="lookups waiting to be sent; more are dropped and counted (default 64)")
    p.set_defaults(func=_lazy("kvcoord.agent.sim_engine", "run_sim_engine"))


# --- kvcoord simulate --------------------------------------------------------------------------
def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "simulate",
        help="compare routing policies on a simulated cluster",
        description="Replays a Mooncake trace or a synthetic shared-prefix workload on N simulated "
        "nodes (real block pools feeding a real index) under each routing policy, and prints a "
        "comparison table on stderr (JSON with --json, a PNG with --plot).",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--trace", default=None, help="Mooncake JSONL trace (default: the synthetic workload)")
    w.add_argument("--synthetic", action="store_true", help="use the synthetic generator (the default)")
    w.add_argument("--limit", type=int, default=None, help="only the first N requests")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply inter-arrival times (0.5 = twice the request rate)")
    w.add_argument("--requests", type=int, default=2000, help="synthetic: number of requests")
    w.add_argument("--groups", type=int, default=16, help="synthetic: system prompts")
    w.add_argument("--prompts-per-group", type=int, default=32, help="synthetic: conversations per group")
    w.add_argument("--system-tokens", type=int, default=2048)
    w.add_argument("--question-tokens", type=int, default=128)
    w.add_argument("--output-tokens", type=int, default=256)
    w.add_argument("--turns", type=int, default=4, help="synthetic: turns per conversation")
    w.add_argument("--zipf", type=float, default=1.1, help="synthetic: group popularity exponent")
    w.add_argument("--rate", type=float, default=10.0, help="synthetic: Poisson arrivals per second")
    c = p.add_argument_group("cluster and cost model")
    c.add_argument("--nodes", type=int, default=8)
    c.add_argument("--blocks-per-node", type=int, default=25_000, help="KV blocks per node (default 25000)")
    c.add_argument("--max-running", type=int, default=32, help="concurrent requests per node")
    c.add_argument("--prefill-us-per-token", type=float, default=50.0, help="prefill time per uncached token")
    c.add_argument("--decode-ms-per-token", type=float, default=15.0, help="decode time per output token")
    c.add_argument("--block-size", type=int, default=16)
    c.add_argument("--hash-algo", default="xxhash_cbor", help="sha256 | sha256_cbor | xxhash | xxhash_cbor")
    c.add_argument("--hash-seed", default="kvcoord-sim", help="NONE_HASH seed")
    c.add_argument("--index", default="memory", help="index backend URI (default: in-process memory)")
    c.add_argument("--coordinator", default=None,
                   help="HOST:PORT of a running coordinator: nodes stream events to it through real "
                   "reporters and the router looks prefixes up with the gRPC client (same table, "
                   "routing overhead includes the network)")
    r = p.add_argument_group("routing and output")
    r.add_argument("--policies", default="prefix-aware,approximate,least-loaded,round-robin,random",
                   help="comma separated policies to compare")
    r.add_argument("--ttl", type=float, default=120.0,
                   help="approximate policy: routed-prefix memory TTL (s)")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--seeds", type=int, default=1,
                   help="run each policy with seeds SEED..SEED+N-1 and report means and the hit-rate range")
    r.add_argument("--jobs", type=int, default=1, help="policies simulated in parallel processes")
    r.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON ('-' for stdout)")
    r.add_argument("--plot", default=None, metavar="PNG", help="write a comparison plot (needs matplotlib)")
    p.set_defaults(func=_lazy("kvcoord.sim.cli", "run_simulate"))


# --- kvcoord health ----------------------------------------------------------------------------
def _add_health(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "health",
        help="check a coordinator's grpc.health.v1 status (exit 0 when SERVING)",
        description="Asks grpc.health.v1 Check and prints {\"status\": ...}. Exit 0 when SERVING, 1 "
        "otherwise (NOT_SERVING, unknown service, unreachable). For container HEALTHCHECKs; "
        "Kubernetes can use its native grpc probe instead.",
    )
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    p.add_argument("--service", default="", help="service name to check (default: '' = the whole server)")
    p.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for an answer (default 3)")
    _tls_client_flags(p)
    p.set_defaults(func=run_health)


def run_health(args: argparse.Namespace) -> int:
    """Body of ``kvcoord health``: one Check RPC, so a HEALTHCHECK costs one short connection."""
    import json

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from kvcoord.agent.reporter import ChannelSecurity, open_channel

    if not args.timeout > 0:
        raise CliError("--timeout must be > 0")
    if (args.tls_cert is None) != (args.tls_key is None):
        raise CliError("--tls-cert and --tls-key must be given together")
    security = ChannelSecurity(
        root_ca=args.tls_ca,
        client_cert=args.tls_cert,
        client_key=args.tls_key,
        server_name=args.tls_server_name,
    )
    channel = open_channel(args.coordinator, security)  # a bad PEM path: ValueError, one line
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
    return 0 if result["status"] == "SERVING" else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcoord", description="Distributed prefix-cache coordination.")
    parser.add_argument("--version", action="version", version=f"kvcoord {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_hash, _add_serve, _add_lookup, _add_stats, _add_agent, _add_sim_engine, _add_simulate,
                _add_health):
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    handler: Handler = args.func
    try:
        return handler(args)
    except (CliError, ValueError) as exc:
        print(f"kvcoord {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
