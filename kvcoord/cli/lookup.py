"""``kvcoord lookup``: which nodes hold a prompt's prefix, as JSON, best node first."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvcoord.cli.common import (
    CliError,
    Subparsers,
    add_connection,
    add_extra_keys,
    extra_keys_given,
    parse_digests,
    parse_mm,
    parse_uint64_list,
    print_json,
    rpc_failed,
    security,
)


def add(sub: Subparsers) -> None:
    p = sub.add_parser("lookup", help="ask the coordinator which nodes hold a prompt's prefix")
    add_connection(p)
    p.add_argument("--model", required=True, help="the model to look up (its hash profile and tokenizer)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="comma separated token ids")
    g.add_argument("--tokens-file", help="file with a JSON list of token ids ('-' for stdin)")
    g.add_argument("--hashes", help="comma separated block hashes as the engine published them: uint64, or "
                   "SGLang's int64 (write --hashes=-1,2 when the first is negative)")
    g.add_argument("--prompt", help="a completion prompt (tokenized by the coordinator, as the engine would)")
    g.add_argument("--messages-file", metavar="FILE",
                   help="OpenAI chat messages ('-' for stdin): a JSON list of messages, or a chat request "
                        "object with messages and optionally tools and chat_template_kwargs; the coordinator "
                        "applies the model's chat template as vLLM does")
    add_extra_keys(p)
    p.add_argument("--include-unmatched", action="store_true",
                   help="also list the live nodes holding none of it (what a placement policy weighs)")
    p.add_argument("--candidate", action="append", default=[], metavar="NODE_ID[:DP_RANK]",
                   help="only consider these nodes (repeatable; default: every live node)")
    p.set_defaults(func=run)


def read_tokens_file(path: str) -> list[int]:
    """A JSON list of token ids from a file ('-': stdin)."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"--tokens-file: cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"--tokens-file: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, list) or not all(type(t) is int and 0 <= t < 1 << 64 for t in data):
        raise CliError("--tokens-file: expected a JSON list of non-negative integer token ids")
    return data


def read_messages_file(path: str) -> dict[str, Any]:
    """A chat (a list of messages, or a chat request object) from a file ('-': stdin), as lookup keywords."""
    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
    except OSError as exc:
        raise CliError(f"--messages-file: cannot read {path}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CliError(f"--messages-file: not JSON ({exc.msg} at line {exc.lineno})") from None
    if isinstance(data, list):
        data = {"messages": data}
    if not isinstance(data, dict) or not isinstance(data.get("messages"), list):
        raise CliError("--messages-file: expected a JSON list of messages or an object with \"messages\"")
    out: dict[str, Any] = {"messages": data["messages"]}
    for key, kind in (("tools", list), ("chat_template_kwargs", dict), ("add_generation_prompt", bool)):
        if data.get(key) is not None:
            if not isinstance(data[key], kind):
                raise CliError(f"--messages-file: {key} must be a JSON {kind.__name__}")
            out[key] = data[key]
    return out


def _candidates(specs: list[str]) -> list[tuple[str, int]]:
    out = []
    for spec in specs:
        node, _, rank = spec.rpartition(":") if ":" in spec else (spec, "", "0")
        if not node or not rank.isdigit():
            raise CliError(f"--candidate {spec!r}: expected NODE_ID[:DP_RANK]")
        out.append((node, int(rank)))
    return out


def query_of(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as :meth:`~kvcoord.router.client.CoordinatorClient.lookup` keywords, validated whole."""
    query: dict[str, Any] = {}
    if args.prompt is not None or args.messages_file is not None:
        given = [k for k in extra_keys_given(args) if k not in ("--lora-name", "--cache-salt")]
        if given:
            raise CliError(f"{', '.join(given)}: token queries only (a prompt takes --lora-name and "
                           "--cache-salt)")
        text = {"prompt": args.prompt} if args.prompt is not None else read_messages_file(args.messages_file)
        query.update(text)
        query.update(lora_name=args.lora_name, cache_salt=args.cache_salt)
    elif args.hashes is not None:
        given = extra_keys_given(args)
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise CliError(f"{', '.join(given)} {verb} to token queries only (block hashes already include "
                           "the request's extra keys)")
        query["hashes"] = parse_uint64_list(args.hashes, "--hashes", signed_too=True)
    else:
        tokens = (parse_uint64_list(args.tokens, "--tokens") if args.tokens is not None
                  else read_tokens_file(args.tokens_file))
        query.update(tokens=tokens, lora_name=args.lora_name, lora_path=args.lora_path,
                     cache_salt=args.cache_salt, mm_items=parse_mm(args.mm),
                     prompt_embeds_digests=parse_digests(args.prompt_embeds_digests))
    candidates = _candidates(args.candidate)
    if candidates:
        query["candidates"] = candidates
    if args.include_unmatched:
        query["include_unmatched"] = True
    return query


def run(args: argparse.Namespace) -> int:
    from kvcoord.router.client import CoordinatorClient, CoordinatorError, build_lookup_request

    query = query_of(args)
    build_lookup_request(args.model, **query)  # validate before connecting
    with CoordinatorClient(args.coordinator, security=security(args), timeout=args.timeout) as client:
        try:
            result = client.lookup(args.model, **query)
        except CoordinatorError as exc:
            return rpc_failed("lookup", exc)
    print_json(result.to_json())
    return 0
