"""Requests over a block pool, as vLLM's ``vllm/v1/core/kv_cache_manager.py`` drives its ``BlockPool``.

:class:`~kvcoord.agent.pool.BlockPool` owns the blocks, the hash -> block map and the KV events;
:class:`KVCacheManager` owns the running requests: it admits a prompt (reusing its cached prefix,
allocating the rest), extends it with generated tokens and finishes it, caching each block as it fills.
Together they work as a whole engine's cache (the stand-in ``sim-engine``, benchmarks, tests).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvcoord.agent.blocks import PoolExhausted
from kvcoord.agent.pool import BlockPool
from kvcoord.agent.requests import Admission, RunningRequest, checked_tokens
from kvcoord.events import ExtraKeys
from kvcoord.extra_keys import RequestKeys, published_extra_keys
from kvcoord.hashing import RequestBlockHasher, to_block_hash64


class KVCacheManager:
    """The running requests of one :class:`BlockPool` (``pool``), with vLLM's per-request rules.

    Events come from the pool (its ``take_events`` or listener). Not thread-safe: drive it, and its
    pool, from one thread or event loop.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._requests: dict[str, RunningRequest] = {}

    @property
    def num_running(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._requests

    def admit(
        self,
        request_id: str,
        token_ids: Sequence[int],
        keys: RequestKeys | None = None,
        *,
        lora_id: int | None = None,
    ) -> Admission | None:
        """Start a request: reuse its cached prefix, allocate the rest, cache its full blocks.

        Emits the ``BlockRemoved`` of any evicted block and one ``BlockStored`` for the newly
        cached blocks, as vLLM does when it schedules the prefill. Returns None, changing
        nothing, when the pool cannot hold the prompt now (vLLM would keep it waiting). Raises
        ``ValueError`` for a duplicate request id or bad tokens, also changing nothing.
        """
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already running")
        tokens = checked_tokens(token_ids)
        if not tokens:
            raise ValueError("a request needs at least one token")
        pool = self.pool
        hasher = RequestBlockHasher(pool.profile, keys)
        digests = list(hasher.append(tokens))
        bs = pool.block_size
        num_tokens = len(tokens)
        # A full hit still recomputes the last token: vLLM caps the hit at num_tokens - 1.
        hits = pool.find_longest_cache_hit(digests, (num_tokens - 1) // bs)
        num_blocks = -(-num_tokens // bs)
        num_new = num_blocks - len(hits)
        num_evictable_hits = sum(1 for b in hits if b.ref_cnt == 0 and not b.is_null)
        if num_new + num_evictable_hits > pool.num_free_blocks:
            return None
        pool.touch(hits)
        new_blocks = pool.get_new_blocks(num_new)
        req = RunningRequest(request_id, tokens, hasher, keys, lora_id)
        req.blocks = hits + new_blocks
        req.digests = digests
        req.num_cached_blocks = len(hits)
        self._requests[request_id] = req
        self._cache_request(req)
        return Admission(
            request_id=request_id,
            num_tokens=num_tokens,
            num_cached_tokens=len(hits) * bs,
            block_ids=tuple(b.block_id for b in req.blocks),
            num_new_blocks=num_new,
            block_hashes=tuple(map(to_block_hash64, digests)),
        )

    def extend(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Append generated tokens to a running request; cache the blocks they fill.

        Returns the number of blocks allocated. Raises :class:`PoolExhausted` (nothing changed)
        when the pool has too few free blocks, ``KeyError`` for an unknown request.
        """
        req = self._requests.get(request_id)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running")
        tokens = checked_tokens(token_ids)
        if not tokens:
            return 0
        pool = self.pool
        total = len(req.token_ids) + len(tokens)
        num_new = -(-total // pool.block_size) - len(req.blocks)
        if num_new > pool.num_free_blocks:
            raise PoolExhausted(
                f"request {request_id!r} needs {num_new} more blocks, {pool.num_free_blocks} free"
            )
        new_digests = req.hasher.append(tokens)  # validates and may refuse; nothing changed yet
        req.token_ids.extend(tokens)
        req.digests.extend(new_digests)
        if num_new > 0:
            req.blocks.extend(pool.get_new_blocks(num_new))
        self._cache_request(req)
        return max(num_new, 0)

    def _cache_request(self, req: RunningRequest) -> None:
        pool = self.pool
        bs = pool.block_size
        num_full = len(req.token_ids) // bs
        start = req.num_cached_blocks
        if num_full <= start:
            return
        keys = req.keys
        extra: list[ExtraKeys] | None = None
        if keys is not None and not keys.empty and pool.enable_events:
            extra = published_extra_keys(keys, bs, num_full * bs)[start:]
        pool.cache_full_blocks(
            req.blocks,
            req.digests,
            start,
            num_full,
            req.token_ids,
            lora_id=req.lora_id,
            lora_name=keys.lora_name if keys is not None else None,
            extra_keys=extra,
        )
        req.num_cached_blocks = num_full

    def finish(self, request_id: str) -> None:
        """End a request: free its blocks tail-first, so a chain's tail is evicted before its head.

        Raises ``KeyError`` for an unknown request.
        """
        req = self._requests.pop(request_id, None)
        if req is None:
            raise KeyError(f"request {request_id!r} is not running")
        self.pool.free_blocks(reversed(req.blocks))

    def request_ids(self) -> list[str]:
        """The running requests, in admission order."""
        return list(self._requests)

    def request_block_ids(self, request_id: str) -> list[int]:
        """A running request's block table."""
        return [b.block_id for b in self._requests[request_id].blocks]
