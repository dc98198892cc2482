"""What every ``kvcoord`` command shares: the one-line error contract, argument types, and the flags
that connect to a coordinator.

Contract (DESIGN.md): data goes to stdout as JSON, human text to stderr, and any mistake ends in one
line on stderr and a non-zero exit. Argument types here reject bad values while parsing, so a command
body only ever sees well-formed input. Nothing heavy is imported at module level: ``kvcoord hash``
must not pay for gRPC.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn, TypeAlias

if TYPE_CHECKING:
    import asyncio

    from kvcoord.gateway.disagg import PdConfig
    from kvcoord.router.placement import LatencyModel
    from kvcoord.transport import ChannelSecurity

TOKEN_ENV = "KVCOORD_TOKEN"
"""Environment variable every client command reads its bearer token from (``--token`` wins)."""

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


class CliError(Exception):
    """Bad input from the command line: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse with the one-line error contract: ``kvcoord CMD: what is wrong (see --help)``."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: {message} (see {self.prog} --help)\n")
        sys.exit(2)

    def parse_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                   namespace: argparse.Namespace | None = None) -> argparse.Namespace:
        """As argparse's, but flags a subcommand does not know are reported by that subcommand, so the
        line names its help (``kvcoord serve --help``), not the top level's."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            self._command_parser(parsed).error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the subcommand ``parsed`` ran (``self`` when none)."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest or "", None) or "")
                if chosen is not None:
                    return chosen._command_parser(parsed) if isinstance(chosen, Parser) else chosen
        return self


def _type(name: str, check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type=`` whose ValueError message becomes the one-line error."""

    def convert(text: str) -> Any:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def parse_hostport(text: str) -> tuple[str, int]:
    """An address to dial: ``HOST:PORT`` (``[v6]:PORT`` too) with a host and a port in 1..65535; no
    default port is ever guessed."""
    from kvcoord.transport import split_hostport

    host, port = split_hostport(text)
    if not host or port == 0:
        raise ValueError(f"{text!r} is not HOST:PORT (a port is required, e.g. 127.0.0.1:50051)")
    return host, port


def _hostport(text: str) -> str:
    parse_hostport(text)
    return text.strip()


def _number(kind: type[int] | type[float], minimum: float, strict: bool) -> Callable[[str], Any]:
    def check(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise ValueError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None
        if value < minimum or (strict and value == minimum) or value != value:
            raise ValueError(f"{text} must be {'>' if strict else '>='} {minimum:g}")
        return value

    return check


def _hostports(text: str) -> str:
    """Coordinator replicas, comma-separated (a client reads from the next one while one is down)."""
    parts = [part.strip() for part in text.split(",")]
    for part in parts:
        parse_hostport(part)
    return ",".join(parts)


def _listen(text: str) -> str:
    """A listen address, ``HOST:PORT`` (port 0: any free port)."""
    from kvcoord.transport import split_hostport

    split_hostport(text)
    return text.strip()


HOSTPORT = _type("HOST:PORT", _hostport)
LISTEN = _type("HOST:PORT", _listen)
HOSTPORTS = _type("HOST:PORT[,HOST:PORT...]", _hostports)
POSITIVE_FLOAT = _type("number", _number(float, 0.0, strict=True))
NONNEG_FLOAT = _type("number", _number(float, 0.0, strict=False))
POSITIVE_INT = _type("integer", _number(int, 0, strict=True))
NONNEG_INT = _type("integer", _number(int, 0, strict=False))
AT_LEAST_ONE = _type("number", _number(float, 1.0, strict=False))


def _fraction(text: str) -> float:
    value: float = _number(float, 0.0, strict=False)(text)
    if value > 1.0:
        raise ValueError(f"{text} must be <= 1")
    return value


FRACTION = _type("number in [0, 1]", _fraction)


def _zmq_endpoint(text: str) -> str:
    """A ZMQ endpoint vLLM would accept: ``tcp://HOST:PORT`` (``*`` binds every interface), ``ipc://PATH``
    or ``inproc://NAME``."""
    from kvcoord.engine.zmq_wire import check_endpoint  # zmq loads only for commands that use it

    try:
        return check_endpoint(text)
    except ValueError as exc:
        raise ValueError(f"{exc} (expected tcp://HOST:PORT, ipc://PATH or inproc://NAME)") from None


ZMQ_ENDPOINT = _type("endpoint", _zmq_endpoint)


def _grpc_endpoint(text: str) -> str:
    """An engine's gRPC server to dial, ``HOST:PORT``."""
    from kvcoord.engine.grpc_relay import check_grpc_endpoint  # grpc's stubs load only for commands using it

    return check_grpc_endpoint(text)


GRPC_ENDPOINT = _type("HOST:PORT", _grpc_endpoint)


def add_connection(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, token: bool = True,
                   required: bool = True, timeout: float | None = 10.0, replicas: bool = True) -> None:
    """``--coordinator`` and the flags every client command connects with, named alike everywhere.
    ``replicas``: the command's client takes several addresses (reads move on while one is down)."""
    if replicas:
        p.add_argument("--coordinator", required=required, default=None, type=HOSTPORTS,
                       metavar="HOST:PORT[,HOST:PORT...]",
                       help="the coordinator's gRPC address; several replicas comma-separated")
    else:
        p.add_argument("--coordinator", required=required, default=None, type=HOSTPORT, metavar="HOST:PORT",
                       help="the coordinator's gRPC address")
    if token:
        p.add_argument("--token", default=None,
                       help=f"bearer token (router, agent or admin; default: ${TOKEN_ENV})")
    p.add_argument("--tls", action="store_true", help="use TLS with the system roots")
    add_tls_client(p)
    if timeout is not None:
        p.add_argument("--timeout", type=POSITIVE_FLOAT, default=timeout,
                       help=f"seconds per RPC (default {timeout:g})")


def add_cost_model(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, mean_output: bool,
                   pull: bool = False) -> None:
    """The latency model's flags (:class:`kvcoord.router.placement.LatencyModel`, whose defaults they show):
    the simulator's hardware and the cost the prefix-aware policy weighs load with, named alike in
    ``simulate``, ``route`` and ``epp`` so that a router can be run with the model a simulation assumed.
    ``mean_output``: the command takes the mean output length as a flag (the simulator reads it off its
    workload). ``pull``: the peer-pull transfer cost too (``route`` and ``epp`` pass hints on)."""
    from kvcoord.router.placement import LatencyModel

    d = LatencyModel().flags()
    p.add_argument("--max-running", type=POSITIVE_INT, default=int(d["max_running"]),
                   help=f"concurrent requests per node (default {d['max_running']:g})")
    p.add_argument("--prefill-us-per-token", type=POSITIVE_FLOAT, default=d["prefill_us_per_token"],
                   help=f"prefill time per uncached prompt token, in microseconds (default "
                        f"{d['prefill_us_per_token']:g})")
    p.add_argument("--decode-ms-per-token", type=POSITIVE_FLOAT, default=d["decode_ms_per_token"],
                   help=f"decode time per output token, in milliseconds (default "
                        f"{d['decode_ms_per_token']:g})")
    p.add_argument("--work-weight", type=AT_LEAST_ONE, default=d["work_weight"], metavar="K",
                   help="times a placement counts the prefill it causes against a shorter queue elsewhere "
                        "(>= 1; higher keeps prompts on the node holding their prefix longer; default "
                        f"{d['work_weight']:g})")
    p.add_argument("--cache-threshold", type=FRACTION, default=d["cache_threshold"], metavar="SHARE",
                   help="share of the prompt some node must hold for --work-weight to apply; below it a "
                        "request is a miss, placed for its own TTFT, so new conversations spread on load "
                        f"(0-1; default {d['cache_threshold']:g})")
    if mean_output:
        p.add_argument("--mean-output-tokens", type=NONNEG_FLOAT, default=d["mean_output_tokens"],
                       help="expected output length of a running request, for the wait-for-a-slot "
                            f"estimate (default {d['mean_output_tokens']:g})")
    if pull:
        p.add_argument("--pull-us-per-block", type=NONNEG_FLOAT, default=None, metavar="US",
                       help="transfer time of one KV block pulled from a peer, in microseconds: when a peer "
                            "holds a longer prefix and pulling it costs less than its prefill, the request "
                            "names the peer in x-kv-cache-source-host-port (default: no pull hints)")


def cost_model(args: argparse.Namespace, mean_output_tokens: float | None = None) -> LatencyModel:
    """The :class:`LatencyModel` of :func:`add_cost_model`'s flags (``mean_output_tokens`` wins over the
    flag)."""
    from kvcoord.router.placement import LatencyModel

    mean = mean_output_tokens if mean_output_tokens is not None else args.mean_output_tokens
    return LatencyModel.from_flags(prefill_us_per_token=args.prefill_us_per_token,
                                   decode_ms_per_token=args.decode_ms_per_token,
                                   max_running=args.max_running, mean_output_tokens=mean,
                                   pull_us_per_block=getattr(args, "pull_us_per_block", None),
                                   work_weight=args.work_weight, cache_threshold=args.cache_threshold)


def add_degraded(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """How the prefix-aware policy counts a node whose hashes failed verification (``route`` and ``epp``)."""
    from kvcoord.router.policy import DEGRADED_MODES, DEGRADED_WEIGHT

    p.add_argument("--degraded", choices=DEGRADED_MODES, default="discount",
                   help="how prefix-aware counts the blocks of a node degraded by a hash mismatch (its "
                        f"hashes failed verification): discount (default, at {DEGRADED_WEIGHT:g}), ignore "
                        "(as holding nothing), or trust (in full); a node degraded by lost history (missing "
                        "blocks, real matches) always counts in full")


def add_reserve(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--no-reserve`` and ``--reserve-ttl``, as ``route`` and ``epp`` take them."""
    p.add_argument("--no-reserve", dest="reserve", action="store_false",
                   help="do not share picks with the coordinator's other routers (by default each pick is "
                        "reserved on one stream, and every router's reservations count in placement)")
    p.add_argument("--reserve-ttl", type=POSITIVE_FLOAT, default=600.0, metavar="S",
                   help="a reservation whose release never comes expires after this (default 600)")


def add_pd(p: argparse.ArgumentParser, local: str) -> None:
    """The disaggregated prefill/decode pools, as ``route`` and ``epp`` take them (``local``: what
    happens when the decode node prefills alone)."""
    pd = p.add_argument_group(
        "disaggregated prefill and decode", "Two pools of nodes speaking vLLM's disaggregated protocol "
        "(kv_transfer_params, e.g. the NIXL connector): the decode node is picked by load and its own "
        "prefix; a prefill node, by prefix and load, prefills first unless the decode node lacks at most "
        f"--max-local-prefill-tokens of the prompt (then {local}). With the flags, nodes in neither pool "
        "are not used. Without them, the pools come from the roles the nodes declared (agent --role, "
        "/register role): prefill nodes prefill, the model's other nodes decode; a model without a prefill "
        "node is served one engine per request.")
    pd.add_argument("--prefill-node", action="append", default=[], metavar="NODE",
                    help="a node of the prefill pool (repeatable; needs --decode-node)")
    pd.add_argument("--decode-node", action="append", default=[], metavar="NODE",
                    help="a node of the decode pool (repeatable; needs --prefill-node)")
    pd.add_argument("--max-local-prefill-tokens", type=NONNEG_INT, default=None, metavar="N",
                    help="the decode node prefills alone when it lacks at most N prompt tokens (Dynamo's "
                         "conditional disaggregation, max_local_prefill_length; default 1000; 0: always "
                         "a remote prefill)")


def pd_config(args: argparse.Namespace) -> PdConfig:
    """The P/D pools from the flags (none given: the nodes' roles decide) and the threshold; CliError for
    pools that cannot run."""
    from kvcoord.gateway.disagg import DEFAULT_MAX_LOCAL_PREFILL, PdConfig

    prefill, decode = frozenset(args.prefill_node), frozenset(args.decode_node)
    limit = args.max_local_prefill_tokens
    if not prefill and not decode:
        return PdConfig(max_local_prefill_tokens=DEFAULT_MAX_LOCAL_PREFILL if limit is None else limit)
    if not prefill or not decode:
        given, missing = ("--prefill-node", "--decode-node")[::1 if prefill else -1]
        raise CliError(f"{given} needs {missing} too (a disaggregated fleet has both pools)")
    if not all(n.strip() for n in prefill | decode):
        raise CliError("--prefill-node/--decode-node: empty node id")
    both = sorted(prefill & decode)
    if both:
        raise CliError(f"node {both[0]} is in both --prefill-node and --decode-node")
    return PdConfig(prefill, decode, DEFAULT_MAX_LOCAL_PREFILL if limit is None else limit)


def add_tls_client(p: argparse.ArgumentParser | argparse._ArgumentGroup, prefix: str = "") -> None:
    """The TLS flags of a coordinator client (``prefix`` e.g. ``lookup-`` names them for a side job)."""
    p.add_argument(f"--{prefix}tls-ca", default=None,
                   help="PEM root CA of the coordinator certificate (turns TLS on)")
    p.add_argument(f"--{prefix}tls-cert", default=None,
                   help="PEM client certificate for mutual TLS (with --tls-key)")
    p.add_argument(f"--{prefix}tls-key", default=None, help="PEM client key for mutual TLS (with --tls-cert)")
    p.add_argument(f"--{prefix}tls-server-name", default=None,
                   help="name to check in the coordinator's certificate (turns TLS on)")


def security(args: argparse.Namespace, prefix: str = "") -> ChannelSecurity:
    """The connection flags as :class:`~kvcoord.transport.ChannelSecurity`; PEM files are read now, so a
    bad path is a one-line error before anything connects."""
    from kvcoord.transport import ChannelSecurity

    attr = prefix.replace("-", "_")

    def get(name: str) -> Any:
        return getattr(args, attr + name, None)

    if (get("tls_cert") is None) != (get("tls_key") is None):
        raise CliError(f"--{prefix}tls-cert and --{prefix}tls-key must be given together (mutual TLS)")
    token = get("token") or os.environ.get(TOKEN_ENV) or None
    sec = ChannelSecurity(token=token, tls=bool(get("tls")) or get("tls_server_name") is not None,
                          root_ca=get("tls_ca"), client_cert=get("tls_cert"), client_key=get("tls_key"),
                          server_name=get("tls_server_name"))
    if sec.uses_tls:
        sec.credentials()  # ValueError naming the unreadable file
    return sec


def add_hash_seed(p: argparse.ArgumentParser | argparse._ArgumentGroup, *aliases: str,
                  default: str | None = None) -> None:
    """``--hash-seed``: the engines' NONE_HASH seed, one name in every command."""
    p.add_argument("--hash-seed", *aliases, dest="hash_seed", default=default, metavar="SEED",
                   help="the engines' NONE_HASH seed, i.e. their PYTHONHASHSEED "
                        + ("(default: $PYTHONHASHSEED)" if default is None else f"(default {default!r})"))


def add_block_hashing(p: argparse.ArgumentParser | argparse._ArgumentGroup, *, algo_flag: str,
                      algo_default: str, seed_default: str | None) -> None:
    """How simulated engines hash their blocks: ``--block-size``, the algorithm (``algo_flag``:
    ``sim-engine``'s ``--algo``, ``simulate``'s ``--hash-algo``) and ``--hash-seed``, taken alike by both."""
    p.add_argument("--block-size", type=POSITIVE_INT, default=16, help="tokens per KV block")
    p.add_argument(algo_flag, default=algo_default, help="sha256 | sha256_cbor | xxhash | xxhash_cbor")
    add_hash_seed(p, default=seed_default)


def parse_uint64_list(text: str, what: str, *, signed_too: bool = False) -> list[int]:
    """Comma separated uint64s (decimal, or 0x hex); with ``signed_too``, int64s as well (SGLang publishes
    its block hashes signed), each taken as its uint64 form, ``v & (2**64-1)``."""
    out = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            v = int(part, 0)
        except ValueError:
            raise CliError(f"{what}: item {i} {part!r} is not an integer") from None
        if signed_too and -(1 << 63) <= v < 0:
            v &= (1 << 64) - 1
        if not 0 <= v < 1 << 64:
            raise CliError(f"{what}: item {i} {v} is not a {'uint64 or int64' if signed_too else 'uint64'}")
        out.append(v)
    if not out:
        raise CliError(f"{what}: empty list")
    return out


def parse_mm(specs: Sequence[str]) -> list[tuple[str, int, int]]:
    """``--mm ID:OFFSET:LENGTH`` items (the identifier may itself contain ':')."""
    items = []
    for spec in specs:
        parts = spec.rsplit(":", 2)
        try:
            if len(parts) != 3 or not parts[0]:
                raise ValueError(spec)
            offset, length = int(parts[1]), int(parts[2])
            if offset < 0 or length < 1:
                raise ValueError(spec)
        except ValueError:
            raise CliError(f"bad --mm {spec!r}: expected ID:OFFSET:LENGTH, OFFSET>=0, LENGTH>=1") from None
        items.append((parts[0], offset, length))
    return items


def parse_digests(text: str | None) -> list[bytes] | None:
    """``--prompt-embeds-digests HEX,...``."""
    if text is None:
        return None
    try:
        return [bytes.fromhex(h.strip()) for h in text.split(",") if h.strip()]
    except ValueError:
        raise CliError("bad --prompt-embeds-digests: expected comma separated hex digests") from None


def add_extra_keys(p: argparse.ArgumentParser) -> None:
    """The request's extra keys, which vLLM folds into its block hashes."""
    p.add_argument("--lora-name", default=None, help="the LoRA adapter's name")
    p.add_argument("--lora-path", default=None, help="the LoRA adapter's path (tagged style, vLLM >= 0.31)")
    p.add_argument("--cache-salt", default=None, help="the request's cache_salt")
    p.add_argument("--mm", action="append", default=[], metavar="ID:OFFSET:LENGTH",
                   help="a multimodal item placeholder (repeatable)")
    p.add_argument("--prompt-embeds-digests", default=None, metavar="HEX,...",
                   help="per-block prompt-embeds digests, comma separated hex")


def extra_keys_given(args: argparse.Namespace) -> list[str]:
    """The extra-key flags given on the command line (they only mean something with token ids)."""
    names = ("lora_name", "lora_path", "cache_salt", "mm", "prompt_embeds_digests")
    return ["--" + n.replace("_", "-") for n in names if getattr(args, n, None)]


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def rpc_failed(command: str, exc: Exception) -> int:
    """A coordinator refused or could not be reached: one line, exit 1."""
    print(f"kvcoord {command}: {exc}", file=sys.stderr)
    return 1


def run_until_signalled(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """``asyncio.run(main(stop))`` with ``stop`` set on SIGTERM or SIGINT: a server's graceful stop."""
    import asyncio
    import signal

    async def run() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(run())
