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
    p.add_argument("--style", choices=["untagged", "tagged"], default="untagged",
                   help="extra-key style: untagged (vLLM <= 0.30) or tagged (vLLM >= 0.31)")
    p.add_argument("--engine-release", default=None,
                   help="vLLM release whose seed default applies when no seed is given (e.g. 0.31)")
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
    """Body of ``kvcoord hash`` (filled in by the hashing issue)."""
    raise CliError("not implemented yet")


# --- kvcoord serve / lookup / stats ------------------------------------------------------------
def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the coordinator (gRPC + Prometheus metrics)")
    p.add_argument("--listen", default=None, help="gRPC HOST:PORT (default 127.0.0.1:50051)")
    p.add_argument("--metrics-listen", default=None, help="metrics HOST:PORT (default 127.0.0.1:9400)")
    p.add_argument("--index", default=None, help="memory | redis://host:port/db | redis+cluster://h:p,...")
    p.add_argument("--config", default=None, help="TOML configuration file")
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
    p.set_defaults(func=_lazy("kvcoord.router.client", "run_lookup"))


def _add_stats(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("stats", help="print the coordinator's state as JSON")
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    p.set_defaults(func=_lazy("kvcoord.router.client", "run_stats"))


# --- kvcoord agent / sim-engine ----------------------------------------------------------------
def _add_agent(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("agent", help="relay one engine's ZMQ KV events to the coordinator")
    p.add_argument("--coordinator", required=True, help="HOST:PORT (repeat or comma-separate for several)")
    p.add_argument("--node-id", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--zmq-endpoint", required=True, help="the engine's PUB endpoint, e.g. tcp://127.0.0.1:5557")
    p.add_argument("--replay-endpoint", default=None, help="the engine's ROUTER replay endpoint")
    p.add_argument("--topic", default="")
    p.set_defaults(func=_lazy("kvcoord.agent.relay", "run_agent"))


def _add_sim_engine(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("sim-engine", help="a stand-in engine publishing vLLM-exact KV events")
    p.add_argument("--zmq-bind", default="tcp://*:5557")
    p.add_argument("--replay-bind", default=None)
    p.add_argument("--topic", default="")
    p.set_defaults(func=_lazy("kvcoord.agent.sim_engine", "run_sim_engine"))


# --- kvcoord simulate --------------------------------------------------------------------------
def _add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="compare routing policies on a simulated cluster")
    p.add_argument("--trace", default=None, help="Mooncake JSONL trace")
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=_lazy("kvcoord.sim.cli", "run_simulate"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcoord", description="Distributed prefix-cache coordination.")
    parser.add_argument("--version", action="version", version=f"kvcoord {__version__}")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING, ERROR")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_hash, _add_serve, _add_lookup, _add_stats, _add_agent, _add_sim_engine, _add_simulate):
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
