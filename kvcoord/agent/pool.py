"""The engine-side prefix cache: vLLM v1's block pool, with the KV events vLLM publishes.

Engines that embed kvcoord, the stand-in ``sim-engine`` and the cluster simulator all keep their
KV-cache bookkeeping here, so what they report to the coordinator is exactly what a vLLM engine
with the same blocks would report. The semantics follow ``vllm/v1/core/block_pool.py`` and
``kv_cache_utils.py``:

- block 0 is the *null block*: never free, never cached, never evicted;
- free blocks sit in one doubly linked queue in eviction order. Allocation pops the front; a
  popped block that still carries a hash is evicted from the cache (``BlockRemoved``). Freed
  blocks without a hash go to the front (reused first), cached ones to the back (LRU). A
  request's blocks are freed tail-first (``kv_cache_manager.py``), so the tail of a chain is
  evicted before its head;
- the hash -> block map is keyed by (block digest, KV-cache group id), packed into bytes as
  vLLM's ``BlockHashWithGroupId`` is. Identical full blocks are not de-duplicated (block ids of
  a running request never change), so one key may map to several blocks;
- a prompt that is cached in full still recomputes its last token, so at most
  ``num_tokens - 1`` tokens count as a hit (``max_cache_hit_length`` in vLLM).

The allocate/free path creates no per-block objects: the queue links live in the blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Literal, TypeAlias

from kvcoord.agent.blocks import (
    GROUP_ID_BYTES,
    BlockHashWithGroupId,
    FreeKVCacheBlockQueue,
    KVCacheBlock,
)
from kvcoord.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    ExtraKeys,
    KVEvent,
    Tier,
)
from kvcoord.extra_keys import RequestKeys
from kvcoord.hashing import (
    UINT64_MASK,
    BlockDigest,
    BlockHash64,
    HashProfile,
    RequestBlockHasher,
    to_block_hash64,
)
from kvcoord.media import normalize_medium

__all__ = ["BlockPool", "HashForm", "RemovalEvents"]

HashForm: TypeAlias = Literal["int", "bytes"]
"""How events carry hashes: uint64 ints (vLLM's default, ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``)
or the raw digests."""

RemovalEvents: TypeAlias = Literal["vllm", "last_copy"]
"""``vllm``: one ``BlockRemoved`` per evicted block, as vLLM emits, even when another block still
holds the same hash (a duplicate). ``last_copy``: only when the last block holding it goes, so an
index fed by the events always equals :meth:`BlockPool.snapshot`."""


class BlockPool:
    """vLLM v1's prefix-caching block pool for one KV-cache group, with its KV events.

    The low-level operations mirror vLLM's ``BlockPool`` (``get_cached_block``, ``touch``,
    ``get_new_blocks``, ``cache_full_blocks``, ``free_blocks``, ``reset_prefix_cache``,
    ``take_events``); :class:`~kvcoord.agent.kv_cache_manager.KVCacheManager` drives them per
    request the way vLLM's ``KVCacheManager`` does.

    Events are queued for :meth:`take_events`, or, when ``listener`` is given, handed to it as
    they happen instead (it must not raise). ``enable_events=False`` skips building them at all.
    ``hash_form`` defaults to the profile's ``external`` form. Not thread-safe: drive a pool from
    one thread or event loop.
    """

    def __init__(
        self,
        num_blocks: int,
        profile: HashProfile,
        *,
        hash_form: HashForm | None = None,
        medium: str = "GPU",
        group_idx: int | None = 0,
        kv_cache_spec_kind: str | None = "full_attention",
        dp_rank: int = 0,
        enable_events: bool = True,
        listener: Callable[[KVEvent], None] | None = None,
        removal_events: RemovalEvents = "vllm",
    ) -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}"
            )
        if hash_form is None:
            hash_form = profile.external
        if hash_form not in ("int", "bytes"):
            raise ValueError(f"hash_form must be 'int' or 'bytes', got {hash_form!r}")
        if removal_events not in ("vllm", "last_copy"):
            raise ValueError(f"removal_events must be 'vllm' or 'last_copy', got {removal_events!r}")
        if group_idx is not None and not 0 <= group_idx < 2**32:
            raise ValueError(f"group_idx must be a uint32, got {group_idx!r}")
        self.tier: Tier | None = normalize_medium(medium)
        """None: a medium the map does not know, whose blocks no index holds."""
        self.profile = profile
        self.block_size: int = profile.block_size
        self.num_blocks = num_blocks
        self.hash_form: HashForm = hash_form
        self.medium = medium
        self.group_idx = group_idx
        self.kv_cache_spec_kind = kv_cache_spec_kind
        self.dp_rank = dp_rank
        self.enable_events = enable_events
        self.listener = listener
        self.removal_events: RemovalEvents = removal_events
        self._group_suffix = (group_idx or 0).to_bytes(GROUP_ID_BYTES, "big", signed=False)

        self.blocks: list[KVCacheBlock] = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[
            BlockHashWithGroupId, KVCacheBlock | dict[int, KVCacheBlock]
        ] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self._events: list[KVEvent] = []

    # ----------------------------------------------------------------- events

    def _emit(self, event: KVEvent) -> None:
        if self.listener is not None:
            self.listener(event)
        else:
            self._events.append(event)

    def _external(self, digest: bytes) -> EngineHash:
        if self.hash_form == "int":  # to_block_hash64 of a digest, inlined: this runs per block
            return int.from_bytes(digest, "big") & UINT64_MASK
        return bytes(digest)

    def take_events(self) -> list[KVEvent]:
        """All queued events, oldest first; the queue is left empty."""
        events = self._events
        self._events = []
        return events

    # --------------------------------------------------------------- the map

    def get_cached_block(self, digest: BlockDigest) -> KVCacheBlock | None:
        """A block holding ``digest`` in this pool's group, or None. The first cached wins."""
        entry = self.cached_block_hash_to_block.get(digest + self._group_suffix)
        if entry is None or isinstance(entry, KVCacheBlock):
            return entry
        return next(iter(entry.values()))

    def _map_insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        cache = self.cached_block_hash_to_block
        entry = cache.get(key)
        if entry is None:
            cache[key] = block
        elif isinstance(entry, KVCacheBlock):
            cache[key] = {entry.block_id: entry, block.block_id: block}
        else:
            entry[block.block_id] = block

    def _map_pop(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> bool:
        """Drop ``block`` from ``key``'s entry; True if it was there."""
        cache = self.cached_block_hash_to_block
        entry = cache.get(key)
        if entry is None:
            return False
        if isinstance(entry, KVCacheBlock):
            if entry is not block:
                return False
            del cache[key]
            return True
        if entry.pop(block.block_id, None) is None:
            return False
        if len(entry) == 1:
            cache[key] = next(iter(entry.values()))
        return True

    def find_longest_cache_hit(
        self, digests: Sequence[BlockDigest], max_blocks: int | None = None
    ) -> list[KVCacheBlock]:
        """The cached blocks of the longest leading run of ``digests``, stopping at the first miss."""
        limit = len(digests) if max_blocks is None else min(max_blocks, len(digests))
        hits: list[KVCacheBlock] = []
        cache = self.cached_block_hash_to_block
        suffix = self._group_suffix
        for i in range(limit):
            entry = cache.get(digests[i] + suffix)
            if entry is None:
                break
            hits.append(entry if isinstance(entry, KVCacheBlock) else next(iter(entry.values())))
        return hits

    # ------------------------------------------------------- block operations

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be allocated now (free, cached or not); the null block is never free."""
        return self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks (all but the null block) held by requests."""
        return 1.0 - self.free_block_queue.num_free_blocks / (self.num_blocks - 1)

    @property
    def num_cached_blocks(self) -> int:
        """Distinct (hash, group) keys in the cache map."""
        return len(self.cached_block_hash_to_block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks hit by another request; free ones leave the free queue."""
        queue = self.free_block_queue
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                queue.remove(block)
            block.ref_cnt += 1

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Allocate ``num_blocks`` from the front of the free queue, evicting cached ones.

        Raises ``ValueError`` (nothing changed) when fewer blocks are free.
        """
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: {self.free_block_queue.num_free_blocks} free"
            )
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt += 1
        return blocks

    def _evict(self, block: KVCacheBlock) -> bool:
        """Drop a block's hash from the cache, with its ``BlockRemoved``. True if it was cached."""
        key = block.block_hash
        if key is None:
            return False
        block.block_hash = None
        if not self._map_pop(key, block):
            return False
        if self.enable_events and (
            self.removal_events == "vllm" or key not in self.cached_block_hash_to_block
        ):
            self._emit(
                BlockRemoved(
                    block_hashes=(self._external(key[:-GROUP_ID_BYTES]),),
                    medium=self.medium,
                    group_idx=self.group_idx,
                )
            )
        return True

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the given blocks from the prefix cache (a connector found them invalid).

        Blocks in use stay allocated; only their hash goes. Validated whole before any change.
        """
        ids = list(block_ids)
        for block_id in ids:
            if (
                isinstance(block_id, bool)
                or not isinstance(block_id, int)
                or not 0 <= block_id < self.num_blocks
            ):
                raise ValueError(f"invalid block id {block_id!r} (pool has {self.num_blocks} blocks)")
        for block_id in ids:
            self._evict(self.blocks[block_id])

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock],
        digests: Sequence[BlockDigest],
        num_cached_blocks: int,
        num_full_blocks: int,
        token_ids: Sequence[int],
        *,
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[ExtraKeys] | None = None,
    ) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the cache, with one BlockStored.

        ``digests`` and ``token_ids`` cover the whole request from its first block; ``extra_keys``
        (published, untagged form), when given, has one entry per *new* block. Blocks that already
        carry a hash (prefix hits) and the null block are skipped, as vLLM does.
        """
        if num_cached_blocks >= num_full_blocks:
            return
        if len(digests) < num_full_blocks or len(blocks) < num_full_blocks:
            raise ValueError(
                f"need {num_full_blocks} blocks and digests, got {len(blocks)} and {len(digests)}"
            )
        bs = self.block_size
        if len(token_ids) < num_full_blocks * bs:
            raise ValueError(f"{len(token_ids)} tokens cannot fill {num_full_blocks} blocks of {bs}")
        if extra_keys is not None and len(extra_keys) != num_full_blocks - num_cached_blocks:
            raise ValueError(
                f"{len(extra_keys)} extra-key entries for {num_full_blocks - num_cached_blocks} blocks"
            )
        suffix = self._group_suffix
        events = self.enable_events
        new_hashes: list[EngineHash] = []
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.is_null:
                continue
            key = digests[i] + suffix
            if block.block_hash is not None:
                if block.block_hash != key:
                    raise AssertionError(f"block {block.block_id} is cached under another hash")
                continue
            block.block_hash = key
            self._map_insert(key, block)
            if events:
                new_hashes.append(self._external(digests[i]))
        if not events:
            return
        parent = self._external(digests[num_cached_blocks - 1]) if num_cached_blocks > 0 else None
        self._emit(
            BlockStored(
                block_hashes=tuple(new_hashes),
                parent_block_hash=parent,
                token_ids=tuple(token_ids[num_cached_blocks * bs : num_full_blocks * bs]),
                block_size=bs,
                lora_id=lora_id,
                medium=self.medium,
                lora_name=lora_name,
                extra_keys=(
                    tuple(extra_keys)
                    if extra_keys is not None
                    else (None,) * (num_full_blocks - num_cached_blocks)
                ),
                group_idx=self.group_idx,
                kv_cache_spec_kind=self.kv_cache_spec_kind,
            )
        )

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; ``ordered_blocks`` is in eviction priority order.

        Blocks that reach zero references return to the queue: unhashed ones to the front (their
        content can never hit, so reuse them first), cached ones to the back (LRU).
        """
        blocks = list(ordered_blocks)
        for block in blocks:
            if block.ref_cnt <= 0 and not block.is_null:
                raise RuntimeError(f"double free of {block!r}")
        fresh: list[KVCacheBlock] = []
        cached: list[KVCacheBlock] = []
        for block in blocks:
            if block.is_null:
                continue
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                (fresh if block.block_hash is None else cached).append(block)
        self.free_block_queue.prepend_n(fresh)
        self.free_block_queue.append_n(cached)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, if no request holds a block; emits ``AllBlocksCleared``.

        Returns False (and changes nothing) while any block other than the null block is in use.
        """
        if self.free_block_queue.num_free_blocks != self.num_blocks - 1:
            return False
        self.cached_block_hash_to_block = {}
        for block in self.blocks:
            block.block_hash = None
        if self.enable_events:
            self._emit(AllBlocksCleared())
        return True

    def snapshot(self) -> dict[int, list[tuple[BlockHash64, Tier]]]:
        """The cached blocks, as ``{dp_rank: [(uint64 hash, tier), ...]}``: what an index should hold."""
        entries: list[tuple[BlockHash64, Tier]] = []
        tier = self.tier
        if tier is None:  # an unknown medium: its events are skipped, so an index holds none of them
            return {self.dp_rank: entries}
        for key in self.cached_block_hash_to_block:
            entries.append((to_block_hash64(key[:-GROUP_ID_BYTES]), tier))
        return {self.dp_rank: entries}

    def cached_hashes(self) -> set[BlockHash64]:
        """The uint64 hashes of all cached blocks."""
        return {h for h, _ in self.snapshot()[self.dp_rank]}

    # ---------------------------------------------------------- lookups

    def hash_prompt(self, token_ids: Sequence[int], keys: RequestKeys | None = None) -> list[BlockDigest]:
        """The digests of the prompt's full blocks under this pool's profile."""
        hasher = RequestBlockHasher(self.profile, keys)
        return list(hasher.append(list(token_ids)))

    def count_cached_blocks(self, digests: Sequence[BlockDigest]) -> int:
        """Length of the cached leading run of ``digests`` (no side effects)."""
        cache = self.cached_block_hash_to_block
        suffix = self._group_suffix
        n = 0
        for digest in digests:
            if digest + suffix not in cache:
                break
            n += 1
        return n
