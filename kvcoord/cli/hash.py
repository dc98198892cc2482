"""``kvcoord hash``: token ids (JSON list on stdin) to vLLM's or SGLang's block hashes (JSON list on
stdout)."""

from __future__ import annotations

import argparse
import json
import sys

from kvcoord.cli.common import (
    POSITIVE_INT,
    CliError,
    Subparsers,
    add_extra_keys,
    add_hash_seed,
    parse_digests,
    parse_mm,
)


def add(sub: Subparsers) -> None:
    p = sub.add_parser(
        "hash",
        help="hash token ids (JSON list on stdin) into vLLM/SGLang block hashes (JSON list on stdout)",
        description="Reads a JSON list of token ids on stdin and prints the JSON list of full-block hashes "
        "exactly as vLLM (uint64) or SGLang (--algo sglang: its published signed int64) computes them.",
    )
    p.add_argument("--algo", required=True, help="sha256 | sha256_cbor | xxhash | xxhash_cbor | sglang")
    add_hash_seed(p, "--seed")
    p.add_argument("--block-size", type=POSITIVE_INT, required=True,
                   help="tokens per KV block, as the engine's --block-size")
    p.add_argument("--style", choices=["untagged", "tagged", "dynamo"], default=None,
                   help="extra-key style: untagged (vLLM <= 0.30) or tagged (vLLM >= 0.31); "
                   "default: from --engine-release, else untagged. SGLang: untagged (its own event format) "
                   "or dynamo (--kv-events-config format dynamo)")
    p.add_argument("--engine-release", default=None,
                   help="vLLM release (e.g. 0.31): sets the extra-key style and the seed default")
    add_extra_keys(p)
    p.add_argument("--bytes", action="store_true", help="print full digests as hex instead of uint64 ints")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Validate everything, then hash; bad input is a one-line error."""
    from kvcoord import hashing, sglang_hash
    from kvcoord.extra_keys import MultiModalItem, RequestKeys

    algo = hashing.check_algo(args.algo)
    if args.engine_release is not None:
        profile = hashing.HashProfile.for_release(args.engine_release, algo, args.block_size, args.hash_seed)
        if args.style is not None:
            profile = hashing.HashProfile(
                algo, args.block_size, args.hash_seed, args.style, engine_release=args.engine_release
            )
    else:
        profile = hashing.HashProfile(algo, args.block_size, args.hash_seed, args.style or "untagged")
    profile.none_hash()  # a missing seed fails here, before stdin is read
    keys = RequestKeys(
        lora_name=args.lora_name,
        lora_path=args.lora_path,
        cache_salt=args.cache_salt,
        mm_items=tuple(MultiModalItem(*item) for item in parse_mm(args.mm)),
        prompt_embeds_digests=None if (d := parse_digests(args.prompt_embeds_digests)) is None else tuple(d),
    )
    try:
        tokens = json.loads(sys.stdin.read())
    except ValueError as exc:
        raise CliError(f"stdin is not JSON: {exc}") from None
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise CliError("stdin must be a JSON list of non-negative integer token ids")
    out: list[int] | list[str]
    if args.bytes:
        out = [d.hex() for d in hashing.hash_request_tokens(profile, tokens, keys)]
    elif algo == hashing.SGLANG:  # as SGLang publishes them: signed int64, namespaced (LoRA)
        out = [sglang_hash.to_signed64(k) for k in hashing.block_hashes64(profile, tokens, keys)]
    else:
        out = [int(k) for k in hashing.block_hashes64(profile, tokens, keys)]
    sys.stdout.write(json.dumps(out) + "\n")
    return 0
