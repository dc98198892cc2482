"""SGLang's block hashes, as its radix cache publishes them in KV events (SGLang 0.5.23:
``sglang/srt/mem_cache/{utils,events}.py``, ``cpp_utils/hash_binding.cpp``,
``sglang/srt/disaggregation/kv_events.py``; tests/test_hashing_sglang.py proves this bit-identical to them).

A page is ``page_size`` token ids as uint32 little-endian, or a 0xFF byte then uint64 little-endian when one
id exceeds 2**32-1. Page i's digest is SHA-256(digest i-1 || page); the first page has no parent, or, with
a cache salt, SHA-256(b"sglang-cache-salt-v1\\0" || salt). SGLang publishes a digest's first 8 bytes as a
big-endian signed int64, rehashed (SHA-256(namespace || those 8 bytes), first 8 bytes) when the request has a
namespace: its LoRA adapter's id (and, in the ``dynamo`` event format, its cache salt). The index keys the
uint64 reduction, ``int & (2**64-1)``. The native chain is ``native.sglang_chain`` (with OpenSSL).
:mod:`kvcoord.hashing` applies these to its profiles and request keys.
"""

from __future__ import annotations

import hashlib
import struct
import uuid
from array import array
from collections.abc import Sequence
from typing import Final, cast

from kvcoord.native import native

INT64_MAX: Final = (1 << 63) - 1
SALT_TAG: Final = b"sglang-cache-salt-v1\0"
NAMESPACE_TAG: Final = b"sglang-kv-event-namespace-v1"
_UINT32_MAX: Final = 0xFFFFFFFF


def request_seeds(
    dynamo: bool, cache_salt: str | None, lora_name: str | None, lora_path: str | None
) -> tuple[bytes, bytes]:
    """``(parent, namespace)`` of a request: the chain's first parent (b"", or its cache salt's digest) and
    the namespace its published hashes are rehashed into (b"": none). SGLang's own event format namespaces
    LoRA requests only (by the adapter's id); its ``dynamo`` format covers the cache salt too."""
    salt = cache_salt or None  # SGLang: cache_salt or None
    parent = salt_parent(salt) if salt else b""
    extra = None if lora_name is None else lora_id(lora_name, lora_path)
    return parent, namespace_seed(extra, salt if dynamo else None)


def salt_parent(cache_salt: str) -> bytes:
    """The first parent of a salted request's chain (SGLang's legacy salt seed of its event hashes)."""
    return hashlib.sha256(SALT_TAG + cache_salt.encode("utf-8")).digest()


def lora_id(lora_name: str, lora_path: str | None = None) -> str:
    """SGLang's id of a ``--lora-paths`` adapter, the LoRA part of its cache key: ``uuid5(NAMESPACE_URL,
    "NAME\\0PATH").hex``. A bare path there is its own name, hence ``lora_path`` defaults to the name.
    (Adapters loaded at run time get a random uuid4: no name maps to those.)"""
    path = lora_name if lora_path is None else lora_path
    return uuid.uuid5(uuid.NAMESPACE_URL, f"{lora_name}\0{path}").hex


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes:
    """SGLang's event namespace seed (``kv_event_namespace_seed``): b"" when both parts are absent, else
    SHA-256 of a tag and each part as presence byte, uint64 little-endian length and UTF-8 bytes."""
    if extra_key is None and cache_salt is None:
        return b""
    h = hashlib.sha256(NAMESPACE_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            raw = part.encode("utf-8")
            h.update(b"\x01" + len(raw).to_bytes(8, "little") + raw)
    return h.digest()


def page_bytes(tokens: Sequence[int]) -> bytes:
    """One page as SGLang hashes it: uint32 little-endian ids, or 0xFF and uint64 little-endian ids when
    one exceeds 2**32-1 (the odd length keeps the two apart). Ids above 2**63-1 are SGLang's error too."""
    top = max(tokens, default=0)
    if top > INT64_MAX:
        raise ValueError("token id must be a non-negative int64 (SGLang's limit)")
    if top > _UINT32_MAX:
        return b"\xff" + struct.pack(f"<{len(tokens)}Q", *tokens)
    return struct.pack(f"<{len(tokens)}I", *tokens)


def chain_reference(parent: bytes, arr: array[int], block_size: int, count: int) -> list[bytes]:
    """SGLang's chain, straightforwardly: page i's digest is SHA-256(previous digest || page bytes), the
    first page's previous digest being ``parent`` (b"": none)."""
    tokens = arr[: count * block_size].tolist()
    out: list[bytes] = []
    prev = parent
    for i in range(count):
        prev = hashlib.sha256(prev + page_bytes(tokens[i * block_size : (i + 1) * block_size])).digest()
        out.append(prev)
    return out


def key_reference(digest: bytes, namespace: bytes) -> int:
    """The uint64 form of SGLang's published hash: the digest's first 8 bytes (its signed int64), rehashed
    as the first 8 bytes of SHA-256(namespace || those bytes) when a namespace applies."""
    head = digest[:8]
    if namespace:
        head = hashlib.sha256(namespace + head).digest()[:8]
    return int.from_bytes(head, "big")


def native_ok() -> bool:
    """True where the native chain runs (a build with OpenSSL, native code on)."""
    return native is not None and "sha256" in native.C_DIGESTS


def chain(
    parent: bytes, arr: array[int], block_size: int, count: int, fast: bool = True
) -> list[bytes]:
    """The digests of ``count`` pages chained from ``parent``: natively where it runs, else (and always
    when not ``fast``) by the reference."""
    if count and block_size and fast and native_ok():
        assert native is not None
        return cast(list[bytes], native.sglang_chain(parent, arr, block_size, count, b""))
    return chain_reference(parent, arr, block_size, count)


def keys(
    parent: bytes, namespace: bytes, arr: array[int], block_size: int, count: int, fast: bool = True
) -> list[int]:
    """The uint64 keys of ``count`` pages chained from ``parent``, in ``namespace`` (b"": none)."""
    if count and fast and native_ok():
        assert native is not None
        packed = native.sglang_chain(parent, arr, block_size, count, namespace, True)
        return memoryview(cast(bytes, packed)).cast("Q").tolist()
    return [key_reference(d, namespace) for d in chain_reference(parent, arr, block_size, count)]


def to_signed64(key: int) -> int:
    """A uint64 key as the signed int64 SGLang publishes (the inverse of ``int & (2**64-1)``)."""
    return key - (1 << 64) if key > INT64_MAX else key


__all__ = ["INT64_MAX", "chain", "chain_reference", "key_reference", "keys", "lora_id", "namespace_seed",
           "page_bytes", "request_seeds", "salt_parent", "to_signed64"]
