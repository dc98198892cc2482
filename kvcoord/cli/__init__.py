"""The ``kvcoord`` command: one module per subcommand, each with ``add(subparsers)`` and ``run(args)``.

Only this package parses arguments. A command module turns its flags into the typed configuration of
the module that owns the work and imports that module only when the command runs, so ``kvcoord hash``
does not pay for gRPC. Every failure ends in one line on stderr and a non-zero exit: 2 for bad input,
1 for a refused or failed operation; a traceback only with ``--log-level DEBUG``.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from importlib import import_module

from kvcoord import __version__
from kvcoord.cli.common import LOG_LEVELS, CliError, Parser

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = ("hash", "serve", "lookup", "stats", "admin", "health", "agent", "sim_engine", "simulate", "route",
            "epp")
"""Modules of this package that add subcommands, in ``--help`` order (``admin`` adds nodes, drain, remove)."""


def build_parser() -> Parser:
    parser = Parser(prog="kvcoord", description="Distributed prefix-cache coordination for LLM serving.")
    parser.add_argument("--version", action="version", version=f"kvcoord {__version__}")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="log verbosity on stderr (default INFO)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in COMMANDS:
        import_module(f"kvcoord.cli.{name}").add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, args.log_level), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    handler: Callable[..., int] = args.func
    try:
        return handler(args)
    except (CliError, ValueError) as exc:
        print(f"kvcoord {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except OSError as exc:  # a port in use, an unreadable file, an endpoint that cannot be bound
        print(f"kvcoord {args.command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # an operation failed (port in use, unreachable host, ...): still one line
        logging.getLogger("kvcoord").debug("kvcoord %s failed", args.command, exc_info=True)
        print(f"kvcoord {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
