"""vLLM-exact prefix-cache block hashing.

(Skeleton: the types below are the stable API other modules build on.)
"""

from __future__ import annotations

from typing import NewType

BlockDigest = NewType("BlockDigest", bytes)
"""A full block digest as the engine computes it: 32 bytes (sha256*) or 16 bytes (xxh3-128)."""

BlockHash64 = NewType("BlockHash64", int)
"""vLLM's ``ExternalBlockHash`` in int form: the digest's last 8 bytes, big-endian, unsigned."""

UINT64_MASK = (1 << 64) - 1


def to_block_hash64(value: int | bytes) -> BlockHash64:
    """Reduce an engine-published hash (int or raw digest) to the uint64 key, exactly as vLLM does.

    Raises ``ValueError`` for a negative int or an int wider than 64 bits, which no engine emits.
    """
    if isinstance(value, bytes | bytearray | memoryview):
        return BlockHash64(int.from_bytes(value, "big") & UINT64_MASK)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"block hash must be int or bytes, not {type(value).__name__}")
    if value < 0 or value > UINT64_MASK:
        raise ValueError(f"block hash {value} is outside uint64")
    return BlockHash64(value)
