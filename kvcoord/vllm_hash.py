"""vLLM's four reference block-hash functions (vllm/utils/hashing.py), which :mod:`kvcoord.hashing`'s
profiles pick by name: each serialises an object (pickle protocol 5 or canonical CBOR) and hashes it
(SHA-256 or XXH3-128)."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable
from typing import Final

import cbor2
import xxhash as _xxhash


def hash_sha256(obj: object) -> bytes:
    """vLLM ``sha256``: SHA-256 of ``pickle.dumps(obj, protocol=5)`` (CPython-specific)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def hash_sha256_cbor(obj: object) -> bytes:
    """vLLM ``sha256_cbor``: SHA-256 of canonical CBOR (reproducible in any language)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def hash_xxhash(obj: object) -> bytes:
    """vLLM ``xxhash``: XXH3-128 digest of pickle protocol 5."""
    return _xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=5))


def hash_xxhash_cbor(obj: object) -> bytes:
    """vLLM ``xxhash_cbor``: XXH3-128 digest of canonical CBOR."""
    return _xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: Final[dict[str, Callable[[object], bytes]]] = {
    "sha256": hash_sha256,
    "sha256_cbor": hash_sha256_cbor,
    "xxhash": hash_xxhash,
    "xxhash_cbor": hash_xxhash_cbor,
}


__all__ = ["HASH_FUNCTIONS", "hash_sha256", "hash_sha256_cbor", "hash_xxhash", "hash_xxhash_cbor"]
