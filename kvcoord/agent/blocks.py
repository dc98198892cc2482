"""vLLM v1's KV-cache blocks and their free queue (``vllm/v1/core/kv_cache_utils.py``), and the
hash -> block map's key packing: the allocation path's data structures, with no per-block objects
beyond the blocks themselves (the queue links live in them)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TypeAlias

from kvcoord.hashing import BlockDigest

__all__ = [
    "GROUP_ID_BYTES",
    "BlockHashWithGroupId",
    "FreeKVCacheBlockQueue",
    "KVCacheBlock",
    "PoolExhausted",
    "get_block_digest",
    "get_group_id",
    "make_block_hash_with_group_id",
]

BlockHashWithGroupId: TypeAlias = bytes
"""A map key: the block digest followed by the group id as 4 big-endian bytes (vLLM's packing,
which avoids a tuple per cached block)."""

GROUP_ID_BYTES = 4


def make_block_hash_with_group_id(digest: BlockDigest, group_id: int) -> BlockHashWithGroupId:
    """Pack a digest and a KV-cache group id into one map key."""
    return digest + group_id.to_bytes(GROUP_ID_BYTES, "big", signed=False)


def get_block_digest(key: BlockHashWithGroupId) -> BlockDigest:
    """The digest part of a map key."""
    return BlockDigest(key[:-GROUP_ID_BYTES])


def get_group_id(key: BlockHashWithGroupId) -> int:
    """The group id part of a map key."""
    return int.from_bytes(key[-GROUP_ID_BYTES:], "big", signed=False)


class PoolExhausted(RuntimeError):
    """The pool has too few free blocks for the request; nothing was changed."""


class KVCacheBlock:
    """Metadata of one KV-cache block. Many exist, so slots and no per-operation allocation."""

    __slots__ = ("block_hash", "block_id", "is_null", "next_free_block", "prev_free_block", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHashWithGroupId | None = None
        """Set while the block is full and in the cache map."""
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None
        self.is_null = False

    def __repr__(self) -> str:
        prev_id = self.prev_free_block.block_id if self.prev_free_block is not None else None
        next_id = self.next_free_block.block_id if self.next_free_block is not None else None
        digest = get_block_digest(self.block_hash).hex()[:12] if self.block_hash is not None else None
        return (
            f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={digest}, "
            f"prev={prev_id}, next={next_id}{', null' if self.is_null else ''})"
        )


class FreeKVCacheBlockQueue:
    """Free blocks in eviction order (front = evicted first), as a doubly linked list.

    A Python deque cannot remove from the middle in O(1), which every prefix hit on a free
    block needs. The links are the blocks' own ``prev_free_block``/``next_free_block`` fields,
    and two sentinel blocks (id -1) bound the list so no operation branches on emptiness. A
    block is in the queue exactly when both its links are set.
    """

    __slots__ = ("fake_free_list_head", "fake_free_list_tail", "num_free_blocks")

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        head = self.fake_free_list_head = KVCacheBlock(-1)
        tail = self.fake_free_list_tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._splice(head, blocks, tail)

    def _splice(self, prev: KVCacheBlock, blocks: Sequence[KVCacheBlock], nxt: KVCacheBlock) -> None:
        """Link ``blocks``, in order, between the adjacent ``prev`` and ``nxt``: the one relinking loop
        behind the constructor, :meth:`append_n` and :meth:`prepend_n`."""
        for block in blocks:
            prev.next_free_block = block
            block.prev_free_block = prev
            prev = block
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        self.num_free_blocks += len(blocks)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Take the front block (the next eviction victim). Raises ``ValueError`` when empty."""
        first = self.fake_free_list_head.next_free_block
        if first is None or first is self.fake_free_list_tail:
            raise ValueError("no free blocks")
        nxt = first.next_free_block
        if nxt is None:
            raise RuntimeError(f"free queue corrupted at {first!r}")
        self.fake_free_list_head.next_free_block = nxt
        nxt.prev_free_block = self.fake_free_list_head
        first.prev_free_block = first.next_free_block = None
        self.num_free_blocks -= 1
        return first

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        """Take the ``n`` front blocks in order; one relink of the head for the whole run."""
        if n < 0 or n > self.num_free_blocks:
            raise ValueError(f"cannot pop {n} of {self.num_free_blocks} free blocks")
        out: list[KVCacheBlock] = []
        if n == 0:
            return out
        curr = self.fake_free_list_head.next_free_block
        for _ in range(n):
            assert curr is not None
            out.append(curr)
            nxt = curr.next_free_block
            curr.prev_free_block = curr.next_free_block = None
            curr = nxt
        assert curr is not None
        self.fake_free_list_head.next_free_block = curr
        curr.prev_free_block = self.fake_free_list_head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from wherever it is. Raises ``RuntimeError`` if it is not queued."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise RuntimeError(f"remove() of a block that is not in the free queue: {block!r}")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Queue ``block`` at the back (evicted last)."""
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None, "tail sentinel lost its link"
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self.fake_free_list_tail
        self.fake_free_list_tail.prev_free_block = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Queue ``blocks`` at the back, keeping their order."""
        if not blocks:
            return
        last = self.fake_free_list_tail.prev_free_block
        assert last is not None, "tail sentinel lost its link"
        self._splice(last, blocks, self.fake_free_list_tail)

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Queue ``blocks`` at the front, keeping their order (``blocks[0]`` is evicted first)."""
        if not blocks:
            return
        first = self.fake_free_list_head.next_free_block
        assert first is not None, "head sentinel lost its link"
        self._splice(self.fake_free_list_head, blocks, first)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Front to back. For tests and invariant checks, not the hot path."""
        curr = self.fake_free_list_head.next_free_block
        while curr is not None and curr is not self.fake_free_list_tail:
            yield curr
            curr = curr.next_free_block

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """All queued blocks, front (next victim) to back."""
        return list(self)
