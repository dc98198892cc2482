"""Block hashing: kvcoord's native path vs the straightforward reference, same run, same prompt.

The reference is what vLLM does per block: ``H(cbor2.dumps((parent, tuple(block), None),
canonical=True))`` (or ``pickle.dumps`` for the pickle algorithms) with ``hashlib`` / ``xxhash``; for
``sglang``, SGLang's page chain: ``hashlib.sha256(parent + struct.pack("<16I", *page))``.
All run on a 32k-token prompt (block size 16) and must produce identical digests.

Token ids come from a 151,936-entry vocabulary (Qwen's), drawn two ways: Zipf-like, as text is,
and uniform. Every algorithm is timed through ``hash_request_tokens`` on each of kvcoord's two
paths, interleaved with the reference on the same prompts: ``native`` (the C chains of
``kvcoord._native``; absent when not built or under ``KVCOORD_NATIVE=0``) and ``python`` (the
pure-Python fallback, ``fast=False``: kvcoord's own copy of the reference, so about 1x). Run:

    .venv/bin/python benchmarks/bench_hashing.py [--quick] [--tokens N] [--block-size B] [--algos A,B]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import pickle
import random
import statistics
import struct
import time
from collections.abc import Callable

import cbor2
import xxhash

from kvcoord import native
from kvcoord.hashing import PROFILE_ALGOS, SGLANG, HashProfile, check_algo, hash_request_tokens

VOCAB = 151_936


def reference(algo: str, none_hash: bytes, tokens: list[int], block_size: int) -> list[bytes]:
    """The straightforward chain, written out here so the baseline owes nothing to kvcoord."""
    if algo == SGLANG:  # ids of a Qwen vocabulary: uint32 pages
        parent, out = none_hash, []
        for start in range(0, len(tokens) - block_size + 1, block_size):
            page = struct.pack(f"<{block_size}I", *tokens[start : start + block_size])
            parent = hashlib.sha256(parent + page).digest()
            out.append(parent)
        return out
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
    ap.add_argument("--repeat", type=int, default=31, help="prompts per row, each timed once per variant")
    ap.add_argument("--quick", action="store_true", help="3 runs, for a smoke test")
    ap.add_argument("--algos", default=",".join(PROFILE_ALGOS))
    args = ap.parse_args()
    repeat = 3 if args.quick else args.repeat
    # kvcoord's two paths: native (when built and not switched off by KVCOORD_NATIVE=0) and the Python one
    impls = {"native": True} if native.native is not None else {}
    impls["python"] = False  # hash_request_tokens(fast=...)
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{args.tokens} tokens, block size {args.block_size}, {repeat} prompts/row, load average {load}")
    state = "on" if native.native is not None else "NOT built" if native.enabled else "off (KVCOORD_NATIVE=0)"
    print(f"native code: {state}; native paths: {', '.join(native.native_paths()) or 'none'}")
    print("times in ms: median (min); ratio = reference / kvcoord, of medians (of minimums)")
    print(f"{'tokens':8} {'algo':12} {'impl':7} {'kvcoord':>15} {'reference':>15} {'ratio':>15}")
    for kind in ("zipf", "uniform"):
        batch = prompts(kind, args.tokens, repeat, seed=1)
        for algo in args.algos.split(","):
            algo_ = check_algo(algo)
            profile = HashProfile(algo_, args.block_size, seed=None if algo_ == SGLANG else "0")
            none = profile.none_hash()
            runs = list(impls)
            times: dict[str, list[float]] = {impl: [] for impl in [*runs, "reference"]}
            for impl in runs:  # warm each path
                hash_request_tokens(profile, batch[0], fast=impls[impl])
            for i, tokens in enumerate(batch):
                # interleave the variants and rotate their order, so load spikes hit all of them alike
                order = [*runs, "reference"]
                order = order[i % len(order) :] + order[: i % len(order)]
                results = []
                for variant in order:
                    if variant == "reference":
                        t0 = time.perf_counter()
                        out = reference(algo, none, tokens, args.block_size)
                    else:
                        fast = impls[variant]
                        t0 = time.perf_counter()
                        out = list(hash_request_tokens(profile, tokens, fast=fast))
                    times[variant].append(time.perf_counter() - t0)
                    results.append(out)
                if any(r != results[0] for r in results):
                    raise SystemExit(f"MISMATCH: {algo}: kvcoord's digests differ from the reference")
            ref = times.pop("reference")
            r_med, r_min = statistics.median(ref) * 1e3, min(ref) * 1e3
            for impl, ts in times.items():
                f_med, f_min = statistics.median(ts) * 1e3, min(ts) * 1e3
                fast_s, ref_s = f"{f_med:7.2f} ({f_min:5.2f})", f"{r_med:7.2f} ({r_min:5.2f})"
                ratios = f"{r_med / f_med:5.2f}x ({r_min / f_min:5.2f}x)"
                print(f"{kind:8} {algo:12} {impl:7} {fast_s} {ref_s} {ratios}")
    print("outputs identical: yes")


if __name__ == "__main__":
    main()
