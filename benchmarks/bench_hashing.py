"""Block hashing: kvcoord's fast path vs the straightforward reference, same run, same prompt.

The reference is what vLLM does per block: ``H(cbor2.dumps((parent, tuple(block), None),
canonical=True))`` (or ``pickle.dumps`` for the pickle algorithms) with ``hashlib`` / ``xxhash``.
Both run on a 32k-token prompt (block size 16) and must produce identical digests.

Token ids come from a 151,936-entry vocabulary (Qwen's), drawn two ways: Zipf-like, as text is,
and uniform, the worst case for the per-token encoding table. Run:

    .venv/bin/python benchmarks/bench_hashing.py [--quick] [--tokens N] [--block-size B]
"""

from __future__ import annotations

import argparse
import hashlib
import pickle
import random
import statistics
import time
from collections.abc import Callable

import cbor2
import xxhash

from kvcoord.hashing import HASH_ALGOS, HashAlgo, HashProfile, hash_request_tokens

VOCAB = 151_936


def reference(algo: str, none_hash: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The straightforward chain, written out here so the baseline owes nothing to kvcoord."""
    serialise: Callable[[object], bytes] = (
        (lambda x: cbor2.dumps(x, canonical=True)) if algo.endswith("_cbor") else
        (lambda x: pickle.dumps(x, protocol=5))
    )
    digest: Callable[[bytes], bytes] = (
        (lambda b: hashlib.sha256(b).digest()) if algo.startswith("sha256") else xxhash.xxh3_128_digest
    )
    parent, out = none_hash, []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = digest(serialise((parent, tuple(tokens[start : start + block_size]), None)))
        out.append(parent)
    return out


def prompts(kind: str, n: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    if kind == "uniform":
        return [[rng.randrange(VOCAB) for _ in range(n)] for _ in range(count)]
    # Zipf-like: token rank r has weight 1/(r+10); frequent tokens have small ids, as in BPE vocabularies
    weights = [1.0 / (r + 10) for r in range(VOCAB)]
    return [rng.choices(range(VOCAB), weights=weights, k=n) for _ in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32_768)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=15, help="timed runs per variant (median reported)")
    ap.add_argument("--quick", action="store_true", help="3 runs, for a smoke test")
    ap.add_argument("--algos", default=",".join(HASH_ALGOS))
    args = ap.parse_args()
    repeat = 3 if args.quick else args.repeat
    print(f"{args.tokens} tokens, block size {args.block_size}, median of {repeat} runs (ms)")
    print(f"{'tokens':8} {'algo':12} {'fast':>8} {'reference':>10} {'ratio':>7}")
    for kind in ("zipf", "uniform"):
        batch = prompts(kind, args.tokens, repeat, seed=1)
        for algo in args.algos.split(","):
            algo_t: HashAlgo = algo  # type: ignore[assignment]
            profile = HashProfile(algo_t, args.block_size, seed="0")
            none = profile.none_hash()
            hash_request_tokens(profile, batch[0])  # warm the per-token table (steady state of a server)
            fast_t, ref_t = [], []
            for tokens in batch:
                t0 = time.perf_counter()
                got = hash_request_tokens(profile, tokens)
                t1 = time.perf_counter()
                want = reference(algo, none, tokens, args.block_size)
                t2 = time.perf_counter()
                if got != want:
                    raise SystemExit(f"MISMATCH: {algo} fast path differs from the reference")
                fast_t.append(t1 - t0)
                ref_t.append(t2 - t1)
            f, r = statistics.median(fast_t) * 1e3, statistics.median(ref_t) * 1e3
            print(f"{kind:8} {algo:12} {f:8.2f} {r:10.2f} {r / f:6.2f}x")
    print("outputs identical: yes")


if __name__ == "__main__":
    main()
