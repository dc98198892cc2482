"""Ingest: a batch validated and packed into write-script ops in Python, then queued on its bucket,
where one write call at a time takes every batch queued meanwhile. Why: Redis's per-call cost (and the
client's) is paid once for many nodes' batches, and per-node order still holds."""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import TypeAlias

from kvcoord.events import REMOVE, STORE
from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import IndexUnavailable, RedisConnection
from kvcoord.index.redis.epochs import BucketEpochs
from kvcoord.index.redis.keys import _pack
from kvcoord.validate import Op

_WRITE_COALESCE_BLOCKS = 2048
"""A coalesced write call takes queued batches up to this many blocks (one batch always goes, however
big): it bounds how long one script holds Redis, and so how long a lookup can wait behind it."""


def compile_ops(batch: Sequence[Op]) -> tuple[list[tuple[str, bytes]], int]:
    """A batch of validated ops as write-script ops; returns ``(ops, skipped_store_blocks)``.

    Group rules are the memory backend's: a non-full-attention store is counted and skipped, and its
    ``group_idx`` is remembered for the location so that the group's later removals are skipped too.
    """
    ops: list[tuple[str, list[bytes]]] = []
    skipped = 0

    def add(op: str, blob: bytes) -> None:
        # consecutive store (or removal) events of one tier become one op: the script then pays its
        # per-command costs once for the run (an op handles a hash repeated within it like two ops)
        if ops and ops[-1][0] == op and op[0] in "SR":
            ops[-1][1].append(blob)
        else:
            ops.append((op, [blob]))

    for kind, tier, hashes, group, indexable in batch:
        if kind == STORE:
            if not indexable:
                skipped += len(hashes)
                if group is not None:
                    add(f"G{group}", b"")
            elif hashes:
                add(f"S{tier}", _pack(hashes))
        elif kind == REMOVE:
            if hashes:
                add(f"R{tier}" if group is None else f"R{tier}:{group}", _pack(hashes))
        else:
            add("C", b"")
    return [(op, blobs[0] if len(blobs) == 1 else b"".join(blobs)) for op, blobs in ops], skipped


_Queued: TypeAlias = tuple[list[object], int, asyncio.Future[list[int]]]
"""One batch waiting: its write-script arguments, its block count, and its caller's future."""


class WriteQueue:
    """Per bucket, the batches waiting for the bucket's next write call (see :meth:`submit`)."""

    def __init__(self, conn: RedisConnection, tags: Sequence[str], epochs: BucketEpochs) -> None:
        self._conn = conn
        self._tags = list(tags)
        self._epochs = epochs
        """The index's accepted epoch per bucket: every call carries it."""
        self._queues: list[deque[_Queued]] = [deque() for _ in self._tags]
        self._tasks: list[asyncio.Task[None] | None] = [None] * len(self._tags)

    async def submit(self, bucket: int, batch: list[object], blocks: int) -> list[int]:
        """Queue one batch's write-script arguments for ``bucket``; returns its 6 counts once applied,
        and the change feed's sequence number of the call (0 when the feed is off).

        Batches that arrive while the bucket's previous write call is in flight are coalesced into
        the next call (one EVALSHA for many nodes' batches): Redis's per-call cost is paid once, and
        the client's too. The bucket's calls run one at a time, in queue order, so a node's batches
        (a node lives in one bucket) apply in the order ``apply`` was called. Each batch was validated
        before it was queued, and one script call is atomic, so a batch is applied whole or not at all.
        Raises ``IndexReset`` (nothing of the call applied) when the bucket's epoch is not the one the
        index accepted: Redis lost the bucket's data since.
        """
        fut: asyncio.Future[list[int]] = asyncio.get_running_loop().create_future()
        self._queues[bucket].append((batch, blocks, fut))
        task = self._tasks[bucket]
        if task is None or task.done():
            self._tasks[bucket] = asyncio.get_running_loop().create_task(
                self._drain(bucket), name=f"redis-write-{bucket}"
            )
        return await fut

    async def _drain(self, bucket: int) -> None:
        queue, tag = self._queues[bucket], self._tags[bucket]
        while queue:
            args: list[object] = []
            taken: list[asyncio.Future[list[int]]] = []
            size = 0
            while queue and (not taken or size + queue[0][1] <= _WRITE_COALESCE_BLOCKS):
                batch, blocks, fut = queue.popleft()
                if fut.done():  # the caller was cancelled before the batch was sent: not applied
                    continue
                args.extend(batch)
                taken.append(fut)
                size += blocks
            if not taken:
                break
            try:
                flat = await self._epochs.eval(lua.WRITE, tag, "write", *args, durable=True)  # WAITs too
            except BaseException as e:
                err = IndexUnavailable("redis index closed") if isinstance(e, asyncio.CancelledError) else e
                for fut in taken:
                    if not fut.done():
                        fut.set_exception(err)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            seq = int(flat[6 * len(taken)]) if len(flat) > 6 * len(taken) else 0  # the feed's, if on
            for k, fut in enumerate(taken):
                if not fut.done():
                    fut.set_result([int(x) for x in flat[6 * k : 6 * k + 6]] + [seq])

    async def close(self) -> None:
        """Let each bucket's call in flight finish (1 s at most), then fail every batch still queued."""
        for wtask in self._tasks:
            if wtask is not None and not wtask.done():
                with contextlib.suppress(TimeoutError, asyncio.CancelledError, Exception):
                    async with asyncio.timeout(1.0):
                        await asyncio.shield(wtask)
                wtask.cancel()
        for q in self._queues:
            while q:
                _, _, fut = q.popleft()
                if not fut.done():
                    fut.set_exception(IndexUnavailable("redis index closed"))
