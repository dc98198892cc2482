"""BlockPool and KVCacheManager: vLLM v1 prefix-caching semantics and the exact KV events, block by block.

The scenarios follow vLLM's tests/v1/core/test_prefix_caching.py (prefill hit/miss, eviction
order, partial blocks, LoRA / cache_salt separation, reset, events), rewritten for this pool.
Small block sizes keep the expected block tables readable.
"""

from __future__ import annotations

import contextlib
import json
import random
from collections.abc import Sequence

import pytest

from kvcoord.agent.blocks import (
    FreeKVCacheBlockQueue,
    KVCacheBlock,
    PoolExhausted,
    get_block_digest,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvcoord.agent.kv_cache_manager import KVCacheManager
from kvcoord.agent.pool import BlockPool
from kvcoord.agent.requests import Admission
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier
from kvcoord.extra_keys import MultiModalItem, RequestKeys
from kvcoord.hashing import (
    BlockDigest,
    BlockHash64,
    HashProfile,
    block_hashes64,
    hash_request_tokens,
    to_block_hash64,
)
from tests.procs import FIXTURES

BS = 4
PROFILE = HashProfile(algo="sha256_cbor", block_size=BS, seed="kvcoord-test")


def toks(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def h64s(token_ids: Sequence[int], keys: RequestKeys | None = None) -> list[BlockHash64]:
    return block_hashes64(PROFILE, token_ids, keys)


def make_pool(num_blocks: int = 10, **kwargs: object) -> BlockPool:
    return BlockPool(num_blocks, PROFILE, **kwargs)  # type: ignore[arg-type]


def make_cache(num_blocks: int = 10, **kwargs: object) -> KVCacheManager:
    return KVCacheManager(make_pool(num_blocks, **kwargs))


def queue_ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def check_queue_links(queue: FreeKVCacheBlockQueue) -> None:
    """Forward and backward walks agree, and the count matches."""
    forward: list[KVCacheBlock] = []
    node = queue.fake_free_list_head.next_free_block
    while node is not queue.fake_free_list_tail:
        assert node is not None
        forward.append(node)
        node = node.next_free_block
    backward: list[KVCacheBlock] = []
    node = queue.fake_free_list_tail.prev_free_block
    while node is not queue.fake_free_list_head:
        assert node is not None
        backward.append(node)
        node = node.prev_free_block
    assert forward == backward[::-1]
    assert len(forward) == queue.num_free_blocks == len(queue)


def check_invariants(pool: BlockPool) -> None:
    """ref_cnt == 0 exactly for queued blocks; the map and the blocks' hashes agree."""
    check_queue_links(pool.free_block_queue)
    queued = {b.block_id for b in pool.free_block_queue}
    assert 0 not in queued and pool.null_block.is_null and pool.null_block.block_id == 0
    for block in pool.blocks[1:]:
        assert (block.ref_cnt == 0) == (block.block_id in queued), block
        assert block.ref_cnt >= 0
    in_map: set[int] = set()
    for key, entry in pool.cached_block_hash_to_block.items():
        blocks = [entry] if isinstance(entry, KVCacheBlock) else list(entry.values())
        assert blocks
        for block in blocks:
            assert block.block_hash == key
            in_map.add(block.block_id)
    assert in_map == {b.block_id for b in pool.blocks if b.block_hash is not None}
    assert pool.null_block.block_hash is None


def state(kv: KVCacheManager) -> object:
    """Everything observable, to prove a refused operation changed nothing."""
    pool = kv.pool
    return (
        queue_ids(pool.free_block_queue),
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        {
            k: (v.block_id if isinstance(v, KVCacheBlock) else sorted(v))
            for k, v in pool.cached_block_hash_to_block.items()
        },
        [(rid, tuple(kv.request_block_ids(rid))) for rid in kv.request_ids()],
        pool.take_events(),
    )


def stored(events: Sequence[KVEvent]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


def removed_hashes(events: Sequence[KVEvent]) -> list[object]:
    out: list[object] = []
    for e in events:
        if isinstance(e, BlockRemoved):
            assert len(e.block_hashes) == 1
            out.extend(e.block_hashes)
    return out


def admit(
    kv: KVCacheManager, rid: str, token_ids: Sequence[int], keys: RequestKeys | None = None, **kw: int
) -> Admission:
    adm = kv.admit(rid, token_ids, keys, **kw)
    assert adm is not None
    check_invariants(kv.pool)
    return adm


# ------------------------------------------------------------------ free queue


def blocks_of(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def test_queue_starts_in_id_order_and_pops_from_the_front() -> None:
    blocks = blocks_of(5)
    q = FreeKVCacheBlockQueue(blocks)
    check_queue_links(q)
    assert queue_ids(q) == [0, 1, 2, 3, 4]
    first = q.popleft()
    assert first is blocks[0]
    assert first.prev_free_block is None and first.next_free_block is None
    assert queue_ids(q) == [1, 2, 3, 4]
    check_queue_links(q)
    for expected in (1, 2, 3, 4):
        assert q.popleft().block_id == expected
    assert q.num_free_blocks == 0
    check_queue_links(q)
    with pytest.raises(ValueError, match="no free blocks"):
        q.popleft()
    assert q.num_free_blocks == 0
    check_queue_links(q)


def test_queue_empty_at_start() -> None:
    q = FreeKVCacheBlockQueue([])
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.get_all_free_blocks() == []
    b = KVCacheBlock(7)
    q.append(b)
    assert queue_ids(q) == [7]
    check_queue_links(q)


def test_queue_popleft_n() -> None:
    blocks = blocks_of(6)
    q = FreeKVCacheBlockQueue(blocks)
    assert q.popleft_n(0) == []
    assert queue_ids(q) == [0, 1, 2, 3, 4, 5]
    got = q.popleft_n(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3]
    assert all(b.prev_free_block is None and b.next_free_block is None for b in got)
    assert queue_ids(q) == [4, 5]
    assert blocks[4].prev_free_block is q.fake_free_list_head
    check_queue_links(q)
    with pytest.raises(ValueError, match="cannot pop 3 of 2"):
        q.popleft_n(3)
    assert queue_ids(q) == [4, 5]
    check_queue_links(q)
    assert [b.block_id for b in q.popleft_n(2)] == [4, 5]
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    check_queue_links(q)


def test_queue_remove_anywhere() -> None:
    blocks = blocks_of(5)
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])  # middle
    assert queue_ids(q) == [0, 1, 3, 4]
    q.remove(blocks[0])  # head
    q.remove(blocks[4])  # tail
    assert queue_ids(q) == [1, 3]
    check_queue_links(q)
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    with pytest.raises(RuntimeError, match="not in the free queue"):
        q.remove(blocks[2])
    assert queue_ids(q) == [1, 3]
    check_queue_links(q)


def test_queue_append_append_n_prepend_n_keep_order() -> None:
    blocks = blocks_of(8)
    q = FreeKVCacheBlockQueue(blocks[:2])
    q.append(blocks[2])
    assert queue_ids(q) == [0, 1, 2]
    q.append_n([blocks[5], blocks[3]])
    assert queue_ids(q) == [0, 1, 2, 5, 3]
    q.prepend_n([blocks[7], blocks[6]])
    assert queue_ids(q) == [7, 6, 0, 1, 2, 5, 3]
    q.append_n([])
    q.prepend_n([])
    assert queue_ids(q) == [7, 6, 0, 1, 2, 5, 3]
    check_queue_links(q)
    # Take from the middle and put back at both ends: links stay consistent.
    q.remove(blocks[1])
    q.remove(blocks[5])
    q.prepend_n([blocks[5]])
    q.append(blocks[1])
    assert queue_ids(q) == [5, 7, 6, 0, 2, 3, 1]
    check_queue_links(q)
    assert [b.block_id for b in q.popleft_n(7)] == [5, 7, 6, 0, 2, 3, 1]
    check_queue_links(q)
    q.prepend_n([blocks[4]])
    q.append_n([blocks[0]])
    assert queue_ids(q) == [4, 0]
    check_queue_links(q)


def test_block_key_packing() -> None:
    digest = BlockDigest(bytes(range(32)))
    key = make_block_hash_with_group_id(digest, 7)
    assert len(key) == 36
    assert get_block_digest(key) == digest
    assert get_group_id(key) == 7


# ------------------------------------------------------------------ pool basics


def test_null_block_is_never_free_or_cached() -> None:
    kv = make_cache(5)
    pool = kv.pool
    null = pool.null_block
    assert null.block_id == 0 and null.is_null
    assert pool.num_free_blocks == 4
    assert 0 not in queue_ids(pool.free_block_queue)
    assert pool.usage == 0.0
    # Freeing, touching and caching the null block do nothing to it.
    pool.free_blocks([null])
    pool.touch([null])
    pool.free_blocks([null])
    digests = hash_request_tokens(PROFILE, toks(4))
    pool.cache_full_blocks([null], digests, 0, 1, toks(4))
    assert null.block_hash is None and pool.num_cached_blocks == 0
    assert pool.num_free_blocks == 4
    check_invariants(pool)
    # Admitting everything uses blocks 1..4 only.
    adm = admit(kv, "r", toks(16))
    assert adm.block_ids == (1, 2, 3, 4)
    assert pool.usage == 1.0 and pool.num_free_blocks == 0
    kv.finish("r")
    assert pool.usage == 0.0
    check_invariants(pool)


def test_pool_rejects_bad_construction() -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, PROFILE)
    with pytest.raises(ValueError, match="hash_form"):
        BlockPool(4, PROFILE, hash_form="hex")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="removal_events"):
        BlockPool(4, PROFILE, removal_events="some")  # type: ignore[arg-type]
    tape = BlockPool(4, PROFILE, medium="TAPE")  # a medium no map knows: an index holds none of its blocks
    assert tape.tier is None and tape.snapshot() == {0: []}


# ------------------------------------------------------------------ prefill


def test_prefill_miss_then_hit_with_exact_events() -> None:
    kv = make_cache(10)
    pool = kv.pool
    common = toks(3 * BS)  # three full blocks
    prompt0 = [*common, 900, 901]  # plus a partial block
    adm0 = admit(kv, "r0", prompt0)
    assert adm0.num_cached_tokens == 0 and adm0.num_cached_blocks == 0
    assert adm0.block_ids == (1, 2, 3, 4) and adm0.num_new_blocks == 4
    hashes = h64s(common)
    assert list(adm0.block_hashes) == hashes
    assert pool.take_events() == [
        BlockStored(
            block_hashes=tuple(hashes),
            parent_block_hash=None,
            token_ids=tuple(common),
            block_size=BS,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            extra_keys=(None, None, None),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    assert pool.take_events() == []

    # Same three blocks, a different tail that fills a fourth block and starts a fifth.
    tail = [700, 701, 702, 703, 704]
    adm1 = admit(kv, "r1", common + tail)
    assert adm1.num_cached_tokens == 3 * BS
    assert adm1.block_ids == (1, 2, 3, 5, 6)
    assert [pool.blocks[i].ref_cnt for i in (1, 2, 3, 4, 5, 6)] == [2, 2, 2, 1, 1, 1]
    full1 = h64s(common + tail)
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(full1[3],),
            parent_block_hash=hashes[2],
            token_ids=(700, 701, 702, 703),
            block_size=BS,
            medium="GPU",
            extra_keys=(None,),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    # A prompt that diverges inside block 2 hits block 1 only.
    prompt2 = toks(BS) + [555] * (2 * BS)
    adm2 = admit(kv, "r2", prompt2)
    assert adm2.num_cached_tokens == BS and adm2.block_ids[0] == 1
    for rid in ("r0", "r1", "r2"):
        kv.finish(rid)
    check_invariants(pool)
    assert pool.num_free_blocks == 9


def test_partial_blocks_are_not_cached() -> None:
    kv = make_cache(10)
    pool = kv.pool
    admit(kv, "a", toks(BS + 3))  # one full block, one partial
    events = pool.take_events()
    assert len(events) == 1 and len(stored(events)[0].block_hashes) == 1
    assert pool.num_cached_blocks == 1
    kv.finish("a")
    # The partial block went to the front of the free queue (no hash: reuse it first).
    assert queue_ids(pool.free_block_queue)[0] == 2
    assert queue_ids(pool.free_block_queue)[-1] == 1
    # Same first 6 tokens: only the full block hits.
    adm = admit(kv, "b", [*toks(BS + 2), 99, 98])
    assert adm.num_cached_tokens == BS
    assert adm.block_ids == (1, 2)  # block 2 (fresh, at the front) is reused first
    # A prompt shorter than one block caches nothing and emits nothing.
    admit(kv, "c", toks(BS - 1))
    assert stored(pool.take_events())[-1].block_hashes == (h64s([*toks(BS + 2), 99, 98])[1],)
    assert pool.take_events() == []


def test_full_prompt_hit_recomputes_last_block() -> None:
    """vLLM caps the hit at num_tokens - 1: a fully cached prompt recomputes its last block."""
    kv = make_cache(10)
    pool = kv.pool
    prompt = toks(3 * BS)
    admit(kv, "a", prompt)
    hashes = h64s(prompt)
    pool.take_events()
    adm = admit(kv, "b", prompt)
    assert adm.num_cached_tokens == 2 * BS
    assert adm.block_ids[:2] == (1, 2) and adm.block_ids[2] == 4
    # The recomputed block is stored again (vLLM does not de-duplicate) under the same hash.
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(hashes[2],),
            parent_block_hash=hashes[1],
            token_ids=tuple(prompt[2 * BS :]),
            block_size=BS,
            medium="GPU",
            extra_keys=(None,),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    assert pool.num_cached_blocks == 3
    entry = pool.cached_block_hash_to_block[pool.blocks[3].block_hash or b""]
    assert isinstance(entry, dict) and sorted(entry) == [3, 4]
    # One more token and the whole prompt is a hit.
    adm = admit(kv, "c", [*prompt, 1])
    assert adm.num_cached_tokens == 3 * BS
    check_invariants(pool)


@pytest.mark.parametrize("mode", ["vllm", "last_copy"])
def test_duplicate_block_eviction_events(mode: str) -> None:
    """``vllm`` reports each evicted copy; ``last_copy`` only when the hash leaves the pool."""
    kv = make_cache(6, removal_events=mode)
    pool = kv.pool
    prompt = toks(2 * BS)
    admit(kv, "a", prompt)
    admit(kv, "b", prompt)  # recomputes block 2 into block 3: two copies of hash[1]
    kv.finish("a")
    kv.finish("b")
    # Queue: b's tail (3), then b's head (1, shared), a's tail (2) first... check the order:
    # finish(a) frees 2 (cached), 1 stays with b; finish(b) frees 3 then 1.
    assert queue_ids(pool.free_block_queue) == [4, 5, 2, 3, 1]
    pool.take_events()
    hashes = h64s(prompt)
    admit(kv, "c", toks(3 * BS, start=1000))  # pops 4, 5, 2: evicts one copy of hash[1]
    evicted = removed_hashes(pool.take_events())
    assert evicted == ([hashes[1]] if mode == "vllm" else [])
    assert hashes[1] in pool.cached_hashes()
    admit(kv, "d", toks(BS, start=2000))  # pops 3: the last copy goes
    assert removed_hashes(pool.take_events()) == [hashes[1]]
    assert hashes[1] not in pool.cached_hashes()
    check_invariants(pool)


def test_not_enough_blocks_changes_nothing() -> None:
    kv = make_cache(6)  # 5 usable blocks
    pool = kv.pool
    admit(kv, "a", toks(3 * BS))  # blocks 1..3
    kv.finish("a")
    pool.take_events()
    admit(kv, "hold", toks(BS, start=500))  # takes block 4 (fresh, front of the queue)
    pool.take_events()
    before = state(kv)
    # Needs its 3 cached blocks (free, so they count against the free pool) + 2 new = 5 > 4.
    assert kv.admit("b", toks(3 * BS) + toks(2 * BS, start=100)) is None
    assert state(kv) == before
    assert pool.take_events() == []
    assert "b" not in kv
    # One block less fits exactly.
    adm = admit(kv, "b", toks(3 * BS) + toks(BS, start=100))
    assert adm.num_cached_tokens == 3 * BS and pool.num_free_blocks == 0


# ------------------------------------------------------------------ eviction


def test_eviction_is_lru_and_tail_before_head() -> None:
    kv = make_cache(10)  # usable blocks 1..9
    pool = kv.pool
    a = toks(3 * BS + 2)  # blocks 1,2,3 full + 4 partial
    b = toks(3 * BS, start=100)  # blocks 5,6,7
    admit(kv, "a", a)
    admit(kv, "b", b)
    assert queue_ids(pool.free_block_queue) == [8, 9]
    kv.finish("a")
    # a's partial block to the front; its cached blocks to the back, tail first.
    assert queue_ids(pool.free_block_queue) == [4, 8, 9, 3, 2, 1]
    kv.finish("b")
    assert queue_ids(pool.free_block_queue) == [4, 8, 9, 3, 2, 1, 7, 6, 5]
    check_invariants(pool)
    pool.take_events()
    ha, hb = h64s(a), h64s(b)

    # Five new blocks: the three never-cached ones, then a's tail (3), then a's middle (2).
    adm = admit(kv, "c", toks(5 * BS - 1, start=300))
    assert adm.block_ids == (4, 8, 9, 3, 2)
    events = pool.take_events()
    assert events[:2] == [
        BlockRemoved(block_hashes=(ha[2],), medium="GPU", group_idx=0),
        BlockRemoved(block_hashes=(ha[1],), medium="GPU", group_idx=0),
    ]
    assert isinstance(events[2], BlockStored) and len(events) == 3
    # a's head survives, so a's prompt now hits one block; b is intact.
    assert pool.count_cached_blocks(hash_request_tokens(PROFILE, a)) == 1
    assert pool.count_cached_blocks(hash_request_tokens(PROFILE, b)) == 3
    assert pool.cached_hashes() == {ha[0], *hb, *h64s(toks(5 * BS - 1, start=300))}

    # b's blocks are touched (off the queue); the one new block is the last free one, a's head.
    adm = admit(kv, "b2", [*b, 7])
    assert adm.block_ids == (5, 6, 7, 1) and adm.num_cached_tokens == 3 * BS
    assert removed_hashes(pool.take_events()) == [ha[0]]
    assert pool.num_free_blocks == 0
    assert kv.admit("y", toks(BS, start=950)) is None
    check_invariants(pool)


def test_recently_hit_blocks_move_to_the_back() -> None:
    kv = make_cache(8)  # usable 1..7
    pool = kv.pool
    admit(kv, "a", toks(2 * BS))  # 1,2
    admit(kv, "b", toks(2 * BS, start=50))  # 3,4
    kv.finish("a")
    kv.finish("b")
    assert queue_ids(pool.free_block_queue) == [5, 6, 7, 2, 1, 4, 3]
    # Re-use a: its blocks leave the queue and come back behind b's; the fresh block goes first.
    adm = admit(kv, "a2", [*toks(2 * BS), 1])
    assert adm.block_ids == (1, 2, 5)
    assert queue_ids(pool.free_block_queue) == [6, 7, 4, 3]
    kv.finish("a2")
    assert queue_ids(pool.free_block_queue) == [5, 6, 7, 4, 3, 2, 1]
    check_invariants(pool)


def test_evict_blocks_by_id() -> None:
    kv = make_cache(8)
    pool = kv.pool
    prompt = toks(2 * BS)
    admit(kv, "a", prompt)
    pool.take_events()
    before = state(kv)
    with pytest.raises(ValueError, match="invalid block id 99"):
        pool.evict_blocks([1, 99])
    assert state(kv) == before
    pool.evict_blocks([2, 5])  # 5 is not cached: nothing to report
    assert removed_hashes(pool.take_events()) == [h64s(prompt)[1]]
    assert pool.blocks[2].ref_cnt == 1  # still allocated to "a"
    kv.finish("a")
    assert queue_ids(pool.free_block_queue)[0] == 2  # no hash any more: front of the queue
    check_invariants(pool)


# ------------------------------------------------------------------ decode


def test_extend_caches_blocks_as_they_fill() -> None:
    kv = make_cache(6)
    pool = kv.pool
    prompt = toks(BS + 2)
    admit(kv, "a", prompt)
    pool.take_events()
    assert kv.extend("a", [100]) == 0  # 7 tokens: still two blocks
    assert pool.take_events() == []
    assert kv.extend("a", [101, 102]) == 1  # 9 tokens: block 2 full, block 3 started
    full = h64s([*prompt, 100, 101, 102])
    assert pool.take_events() == [
        BlockStored(
            block_hashes=(full[1],),
            parent_block_hash=full[0],
            token_ids=(4, 5, 100, 101),
            block_size=BS,
            medium="GPU",
            extra_keys=(None,),
            group_idx=0,
            kv_cache_spec_kind="full_attention",
        )
    ]
    assert kv.request_block_ids("a") == [1, 2, 3]
    check_invariants(pool)
    # Two free blocks left (4, 5); asking for three more is refused whole.
    before = state(kv)
    with pytest.raises(PoolExhausted, match="needs 3 more blocks, 2 free"):
        kv.extend("a", [*toks(3 * BS - 1, start=200), 1])
    assert state(kv) == before
    # A generated sequence is a prefix hit for the next turn.
    assert kv.extend("a", [103, 104, 105]) == 0
    kv.finish("a")
    adm = admit(kv, "b", [*prompt, 100, 101, 102, 103, 104, 105, 106])
    assert adm.num_cached_tokens == 3 * BS
    with pytest.raises(KeyError):
        kv.extend("nope", [1])


# ------------------------------------------------------------------ extra keys


def test_lora_requests_do_not_share_blocks() -> None:
    kv = make_cache(20)
    pool = kv.pool
    prompt = toks(2 * BS)
    alice, bob = RequestKeys(lora_name="alice"), RequestKeys(lora_name="bob")
    admit(kv, "base", prompt)
    a1 = admit(kv, "a1", prompt, alice, lora_id=1)
    b1 = admit(kv, "b1", prompt, bob, lora_id=2)
    assert a1.num_cached_tokens == 0 and b1.num_cached_tokens == 0
    base_h, alice_h, bob_h = h64s(prompt), h64s(prompt, alice), h64s(prompt, bob)
    assert len({*base_h, *alice_h, *bob_h}) == 6
    events = stored(pool.take_events())
    assert [e.lora_name for e in events] == [None, "alice", "bob"]
    assert [e.lora_id for e in events] == [None, 1, 2]
    assert events[1] == BlockStored(
        block_hashes=tuple(alice_h),
        parent_block_hash=None,
        token_ids=tuple(prompt),
        block_size=BS,
        lora_id=1,
        medium="GPU",
        lora_name="alice",
        extra_keys=(("alice",), ("alice",)),
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )
    # The same adapter hits its own blocks.
    a2 = admit(kv, "a2", [*prompt, 1], alice, lora_id=1)
    assert a2.num_cached_tokens == 2 * BS


def test_cache_salt_separates_tenants() -> None:
    kv = make_cache(20)
    pool = kv.pool
    prompt = toks(3 * BS)
    t1, t2 = RequestKeys(cache_salt="tenant-1"), RequestKeys(cache_salt="tenant-2")
    admit(kv, "plain", prompt)
    admit(kv, "t1", prompt, t1)
    adm = admit(kv, "t2", prompt, t2)
    assert adm.num_cached_tokens == 0
    plain_h, t1_h, t2_h = h64s(prompt), h64s(prompt, t1), h64s(prompt, t2)
    # The salt is in the first block only, but the chain carries it into every later hash.
    assert not set(plain_h) & set(t1_h) and not set(t1_h) & set(t2_h)
    events = stored(pool.take_events())
    assert events[1].extra_keys == (("tenant-1",), None, None)
    assert events[1].lora_name is None
    adm = admit(kv, "t1b", [*prompt, 5], t1)
    assert adm.num_cached_tokens == 3 * BS


def test_multimodal_identifier_is_part_of_the_hash() -> None:
    kv = make_cache(20)
    pool = kv.pool
    prompt = toks(3 * BS)
    img1 = RequestKeys(mm_items=(MultiModalItem("img-1", BS, BS),))
    img2 = RequestKeys(mm_items=(MultiModalItem("img-2", BS, BS),))
    admit(kv, "i1", prompt, img1)
    adm = admit(kv, "i2", prompt, img2)
    # The first block holds no image: shared. The image's block and everything after differ.
    assert adm.num_cached_tokens == BS
    events = stored(pool.take_events())
    assert events[0].extra_keys == (None, (("img-1", 0),), None)
    assert events[1].parent_block_hash == h64s(prompt, img1)[0]
    assert events[1].extra_keys == ((("img-2", 0),), None)


def test_tagged_profile_hashes_tagged_but_publishes_untagged() -> None:
    """vLLM >= 0.31 hashes ("lora", name, path) but still publishes the bare LoRA name."""
    profile = HashProfile.for_release("0.31", "sha256_cbor", BS, seed="kvcoord-test")
    keys = RequestKeys(lora_name="alice", lora_path="/adapters/alice")
    kv = KVCacheManager(BlockPool(10, profile))
    pool = kv.pool
    adm = kv.admit("a", toks(2 * BS), keys, lora_id=4)
    assert adm is not None
    ev = stored(pool.take_events())[0]
    assert list(ev.block_hashes) == block_hashes64(profile, toks(2 * BS), keys)
    assert ev.block_hashes != tuple(h64s(toks(2 * BS), keys))
    assert ev.extra_keys == (("alice",), ("alice",))
    assert ev.lora_name == "alice" and ev.lora_id == 4
    # Without the path the tagged hash cannot be computed: refused, nothing changed.
    before = state(kv)
    with pytest.raises(ValueError, match="lora_path"):
        kv.admit("b", toks(2 * BS), RequestKeys(lora_name="alice"))
    assert state(kv) == before


def test_extend_refused_by_the_hasher_changes_nothing() -> None:
    """Prompt-embeds keys need one digest per block; a block without one is refused whole."""
    kv = make_cache(10)
    pool = kv.pool
    keys = RequestKeys(prompt_embeds_digests=(b"\x01" * 32,))
    admit(kv, "a", toks(BS + 1), keys)
    assert stored(pool.take_events())[0].extra_keys == ((b"\x01" * 32,),)
    before = state(kv)
    with pytest.raises(ValueError, match="prompt-embeds digests"):
        kv.extend("a", toks(BS, start=50))
    assert state(kv) == before
    assert kv.extend("a", [1, 2]) == 0  # still inside block 2: nothing to hash


# ------------------------------------------------------------------ reset


def test_reset_prefix_cache() -> None:
    kv = make_cache(10)
    pool = kv.pool
    prompt = toks(2 * BS + 1)
    admit(kv, "a", prompt)
    pool.take_events()
    before = state(kv)
    assert pool.reset_prefix_cache() is False  # "a" still holds blocks
    assert state(kv) == before
    assert pool.take_events() == []
    kv.finish("a")
    order = queue_ids(pool.free_block_queue)
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.num_cached_blocks == 0 and pool.cached_hashes() == set()
    assert all(b.block_hash is None for b in pool.blocks)
    assert queue_ids(pool.free_block_queue) == order
    check_invariants(pool)
    adm = admit(kv, "b", prompt)
    assert adm.num_cached_tokens == 0
    # Evicting a block whose hash was reset reports nothing.
    assert [type(e) for e in pool.take_events()] == [BlockStored]


# ------------------------------------------------------------------ event delivery and forms


def test_listener_gets_events_instead_of_the_queue() -> None:
    seen: list[KVEvent] = []
    kv = make_cache(10, listener=seen.append)
    pool = kv.pool
    admit(kv, "a", toks(2 * BS))
    kv.finish("a")
    assert pool.reset_prefix_cache()
    assert [type(e) for e in seen] == [BlockStored, AllBlocksCleared]
    assert pool.take_events() == []


def test_events_disabled_still_caches() -> None:
    kv = make_cache(10, enable_events=False)
    pool = kv.pool
    admit(kv, "a", toks(2 * BS), RequestKeys(lora_name="x"))
    adm = admit(kv, "b", [*toks(2 * BS), 1], RequestKeys(lora_name="x"))
    assert adm.num_cached_tokens == 2 * BS
    assert pool.take_events() == []


def test_bytes_hash_form_and_group_fields() -> None:
    kv = make_cache(10, hash_form="bytes", group_idx=None, kv_cache_spec_kind=None, medium="cpu")
    pool = kv.pool
    prompt = toks(2 * BS)
    admit(kv, "a", prompt)
    digests = hash_request_tokens(PROFILE, prompt)
    ev = stored(pool.take_events())[0]
    assert ev.block_hashes == tuple(digests)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in ev.block_hashes)
    assert ev.group_idx is None and ev.kv_cache_spec_kind is None and ev.medium == "cpu"
    admit(kv, "b", [*prompt, 1, 2, 3, 4, 5])
    ev = stored(pool.take_events())[0]
    assert ev.parent_block_hash == digests[1]
    assert pool.snapshot() == {
        0: [(to_block_hash64(d), Tier.CPU) for d in hash_request_tokens(PROFILE, [*prompt, 1, 2, 3, 4, 5])]
    }


def test_group_id_is_part_of_the_key() -> None:
    kv = make_cache(10, group_idx=3, dp_rank=2)
    pool = kv.pool
    admit(kv, "a", toks(BS))
    [key] = pool.cached_block_hash_to_block
    assert get_group_id(key) == 3
    assert get_block_digest(key) == hash_request_tokens(PROFILE, toks(BS))[0]
    assert stored(pool.take_events())[0].group_idx == 3
    assert pool.snapshot() == {2: [(h64s(toks(BS))[0], Tier.GPU)]}


# ------------------------------------------------------------------ bad input


def test_bad_requests_are_refused_whole() -> None:
    kv = make_cache(10)
    pool = kv.pool
    admit(kv, "a", toks(2 * BS))
    pool.take_events()
    before = state(kv)
    with pytest.raises(ValueError, match="already running"):
        kv.admit("a", toks(BS, start=40))
    with pytest.raises(ValueError, match="at least one token"):
        kv.admit("b", [])
    with pytest.raises(ValueError, match="non-negative ints"):
        kv.admit("b", [*toks(2 * BS, start=40), -1])
    with pytest.raises(ValueError, match="non-negative ints"):
        kv.admit("b", [1, 2, "3"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="non-negative ints"):
        kv.admit("b", [1, True])
    with pytest.raises(ValueError, match="not a string"):
        kv.admit("b", "1234")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="non-negative ints"):
        kv.extend("a", [3, None])  # type: ignore[list-item]
    with pytest.raises(KeyError):
        kv.finish("b")
    assert state(kv) == before
    kv.finish("a")
    before = state(kv)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([pool.blocks[1]])
    assert state(kv) == before
    with pytest.raises(RuntimeError, match="not in the free queue"):
        pool.free_block_queue.remove(pool.null_block)
    assert state(kv) == before


# ------------------------------------------------------------------ agreement with hashing and real engines


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_emitted_hashes_equal_the_hashing_module(algo: str) -> None:
    profile = HashProfile(algo=algo, block_size=16, seed="7")  # type: ignore[arg-type]
    rng = random.Random(algo)
    prompt = [rng.randrange(150_000) for _ in range(16 * 9 + 5)]
    keys = RequestKeys(lora_name="ad", cache_salt="s")
    for k in (None, keys):
        kv = KVCacheManager(BlockPool(64, profile))
        pool = kv.pool
        adm = kv.admit("r", prompt, k)
        assert adm is not None
        ev = stored(pool.take_events())[0]
        expected = block_hashes64(profile, prompt, k)
        assert list(ev.block_hashes) == expected == list(adm.block_hashes)
        assert {h for h, _ in pool.snapshot()[0]} == set(expected)


def _fixture(name: str) -> dict[str, object]:
    path = FIXTURES / "vllm-engine" / name
    data: dict[str, object] = json.loads(path.read_text())
    return data


@pytest.mark.parametrize("name", ["kv_event_base.json", "kv_event_lora.json"])
def test_real_engine_events(name: str) -> None:
    """Admitting the captured prompt emits exactly the BlockStored the real vLLM engine published."""
    fx = _fixture(name)
    seed, block_size = fx["hash_seed"], fx["block_size"]
    assert isinstance(seed, str) and isinstance(block_size, int)
    profile = HashProfile(algo="sha256_cbor", block_size=block_size, seed=seed)
    lora_name = fx["lora_name"]
    keys = RequestKeys(lora_name=lora_name) if isinstance(lora_name, str) else None
    token_ids = fx["token_ids"]
    assert isinstance(token_ids, list)
    kv = KVCacheManager(BlockPool(64, profile))
    pool = kv.pool
    adm = kv.admit("fx", token_ids, keys, lora_id=1 if keys else None)
    assert adm is not None
    [ev] = pool.take_events()
    assert isinstance(ev, BlockStored)
    assert list(ev.block_hashes) == fx["block_hashes"]
    assert ev.parent_block_hash == fx["parent_block_hash"]
    assert list(ev.token_ids) == token_ids
    assert ev.block_size == block_size and ev.medium == fx["medium"]
    assert ev.lora_name == lora_name
    if keys is not None:
        assert ev.extra_keys == ((lora_name,),) * len(ev.block_hashes)
    # A second request for the same prompt hits all but the last block.
    adm2 = kv.admit("fx2", token_ids, keys)
    assert adm2 is not None and adm2.num_cached_tokens == (len(token_ids) - 1) // block_size * block_size


# ------------------------------------------------------------------ random workloads


def _replay(events: Sequence[KVEvent], index: set[int]) -> None:
    """A minimal index: what a coordinator would hold after these events."""
    for e in events:
        if isinstance(e, BlockStored):
            index.update(to_block_hash64(h) for h in e.block_hashes)
        elif isinstance(e, BlockRemoved):
            index.difference_update(to_block_hash64(h) for h in e.block_hashes)
        else:
            index.clear()


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("mode", ["vllm", "last_copy"])
def test_random_workload_keeps_invariants_and_index_agreement(seed: int, mode: str) -> None:
    rng = random.Random(seed)
    kv = make_cache(40, removal_events=mode)
    pool = kv.pool
    prefixes = [toks(rng.randrange(1, 6) * BS, start=1000 * i) for i in range(5)]
    index: set[int] = set()
    running: list[str] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not running:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 3 * BS))]
            keys = rng.choice([None, None, RequestKeys(lora_name="l"), RequestKeys(cache_salt="s")])
            if kv.admit(f"r{step}", prompt, keys) is not None:
                running.append(f"r{step}")
        elif op < 0.7:
            rid = rng.choice(running)
            with contextlib.suppress(PoolExhausted):
                kv.extend(rid, [rng.randrange(50) for _ in range(rng.randrange(1, 2 * BS))])
        elif op < 0.98:
            rid = running.pop(rng.randrange(len(running)))
            kv.finish(rid)
        else:
            ok = pool.reset_prefix_cache()
            assert ok == (not running)
        _replay(pool.take_events(), index)
        check_invariants(pool)
        held = pool.cached_hashes()
        if mode == "last_copy":
            assert index == held
        else:
            assert index <= held  # vLLM may report a duplicate's eviction while a copy remains
    for rid in running:
        kv.finish(rid)
    check_invariants(pool)
    assert pool.num_free_blocks == 39 and pool.usage == 0.0
