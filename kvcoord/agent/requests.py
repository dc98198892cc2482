"""A request in the pool: what admitting it did, and its block table and hashing state while it runs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcoord.agent.blocks import KVCacheBlock
from kvcoord.extra_keys import RequestKeys
from kvcoord.hashing import BlockDigest, BlockHash64, RequestBlockHasher


@dataclass(frozen=True, slots=True)
class Admission:
    """What :meth:`BlockPool.admit` did for one request."""

    request_id: str
    num_tokens: int
    num_cached_tokens: int
    """Prompt tokens served from the prefix cache (a multiple of the block size)."""
    block_ids: tuple[int, ...]
    """The request's block table: the cached prefix, then the new blocks."""
    num_new_blocks: int
    block_hashes: tuple[BlockHash64, ...]
    """uint64 hashes of the prompt's full blocks, in order."""

    @property
    def num_cached_blocks(self) -> int:
        return len(self.block_ids) - self.num_new_blocks


class RunningRequest:
    """A running request's block table and hashing state."""

    __slots__ = (
        "blocks",
        "digests",
        "hasher",
        "keys",
        "lora_id",
        "num_cached_blocks",
        "request_id",
        "token_ids",
    )

    def __init__(
        self,
        request_id: str,
        token_ids: list[int],
        hasher: RequestBlockHasher,
        keys: RequestKeys | None,
        lora_id: int | None,
    ) -> None:
        self.request_id = request_id
        self.token_ids = token_ids
        self.hasher = hasher
        self.keys = keys
        self.lora_id = lora_id
        self.blocks: list[KVCacheBlock] = []
        self.digests: list[BlockDigest] = []
        self.num_cached_blocks = 0
        """Leading blocks of ``blocks`` that are in the cache map (hit or stored by us)."""


def checked_tokens(token_ids: Sequence[int]) -> list[int]:
    """A private copy of ``token_ids``, refusing anything but non-negative ints."""
    if isinstance(token_ids, str | bytes):
        raise ValueError("token ids must be a sequence of ints, not a string")
    tokens = list(token_ids)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ValueError(f"token ids must be non-negative ints, got {t!r}")
    return tokens
