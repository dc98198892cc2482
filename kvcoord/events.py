"""The typed KV-event model shared by every layer, and its codecs.

The model mirrors vLLM's ``vllm/distributed/kv_events.py`` field for field, so that nothing an
engine publishes is lost between the wire and the index. Hashes keep the form the engine
published (``int`` or raw digest ``bytes``); the index reduces them with
:func:`kvcoord.hashing.to_block_hash64`.

(Skeleton: codecs are added by the events issue; the model below is the stable API.)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeAlias

EngineHash: TypeAlias = int | bytes
"""A block hash as an engine publishes it: uint64 int, or the raw digest."""

ExtraKeys: TypeAlias = tuple[object, ...] | None
"""One block's published extra keys (LoRA name, ``(mm_id, offset)`` pairs, cache salt, digest)."""


class Tier(enum.IntEnum):
    """Where a node keeps a block. Small ints so the index can pack them into bitmasks."""

    GPU = 0
    CPU = 1
    STORAGE = 2


_MEDIUM_ALIASES: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "DEVICE": Tier.GPU,
    "HBM": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "HOST": Tier.CPU,
    "DRAM": Tier.CPU,
    "STORAGE": Tier.STORAGE,
    "DISK": Tier.STORAGE,
    "SSD": Tier.STORAGE,
    "LOCAL_FILE": Tier.STORAGE,
    "FILE": Tier.STORAGE,
    "REMOTE": Tier.STORAGE,
}


def normalize_medium(medium: str | None) -> Tier:
    """Map an engine's ``medium`` string to a tier; a missing medium means GPU.

    Raises ``ValueError`` for a medium nobody has published, rather than guessing a tier.
    """
    if medium is None:
        return Tier.GPU
    tier = _MEDIUM_ALIASES.get(medium.strip().upper())
    if tier is None:
        raise ValueError(f"unknown medium {medium!r} (known: {', '.join(sorted(_MEDIUM_ALIASES))})")
    return tier


FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention"})
"""Group kinds whose blocks are prefix-matchable. Events of other groups (sliding window,
Mamba, …) describe caches that cannot serve a prefix hit on their own, so the index skips them."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became cached (and reusable) on one node, in chain order."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None

    def is_prefix_indexable(self) -> bool:
        """True for full-attention groups (kind absent, ``full_attention`` or ``mla_attention``)."""
        return self.kv_cache_spec_kind is None or self.kv_cache_spec_kind in FULL_ATTENTION_KINDS


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from one medium of one node."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The node dropped its whole prefix cache (reset, or restart)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published batch: a timestamp (seconds since the epoch), events, and the DP rank."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
