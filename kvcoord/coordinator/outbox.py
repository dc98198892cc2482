"""The replies of one ingest stream, written by their own task, with Acks coalesced."""

from __future__ import annotations

import asyncio
from collections import deque

import grpc

from kvcoord.engine.zmq_wire import Wakeup
from kvcoord.proto.v2 import kvcoord_pb2 as pb

ACK_INTERVAL = 0.05
"""Seconds an Ack waits for the ones after it on one stream: acks are cumulative, so they coalesce
(agents never block on acks: they only bound the agent's resend queue). Each Ack costs both sides a
gRPC message, three thread wakeups or so; an engine publishing one batch per scheduler step would
otherwise cost an Ack per batch."""

class Outbox:
    """Replies of one ingest stream, written by their own task so reading never waits for a write.

    Acks are cumulative: an Ack queued right behind another unsent Ack replaces it, and an Ack waits
    ``ack_interval`` before it is written, so a stream gets at most one Ack write per interval instead of
    one per batch (each write costs both sides about as much as applying a small batch). Order with
    other messages is kept, and those are never delayed behind the interval unless an Ack is ahead;
    :meth:`drain` writes what is queued at once.
    """

    __slots__ = ("_context", "_empty", "_flush", "_queue", "_task", "_wake", "ack_interval")
    # _flush: a Wakeup, so that drain() also cuts short an Ack already waiting out its interval

    def __init__(self, context: grpc.aio.ServicerContext, ack_interval: float = ACK_INTERVAL) -> None:
        self._context = context
        self.ack_interval = ack_interval
        self._flush = Wakeup()
        self._queue: deque[pb.CoordinatorMessage | tuple[int, int]] = deque()
        self._wake = asyncio.Event()
        self._empty = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def put(self, msg: pb.CoordinatorMessage) -> None:
        q = self._queue
        if msg.HasField("ack"):
            self.ack(msg.ack.epoch, msg.ack.seq)
            return
        q.append(msg)
        self._wakeup()

    def ack(self, epoch: int, seq: int) -> None:
        """Queue Ack(epoch, seq), replacing an unsent Ack of the same epoch right before it. Kept as a
        plain tuple until written: a busy stream builds one Ack message per write, not per batch."""
        q = self._queue
        if q:
            last = q[-1]
            if type(last) is tuple and last[0] == epoch:
                q[-1] = (epoch, seq)
                return  # the writer already knows about the queued Ack
        q.append((epoch, seq))
        self._wakeup()

    def _wakeup(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="kvcoord-ingest-writer")
        self._empty.clear()
        self._wake.set()

    async def _run(self) -> None:
        q = self._queue
        try:
            while True:
                while q:
                    msg = q[0]
                    if len(q) == 1 and type(msg) is tuple:
                        # Let the acks of the batches arriving meanwhile collapse into this one.
                        await self._flush.wait(self.ack_interval)
                    out = q.popleft()
                    if type(out) is tuple:
                        out = pb.CoordinatorMessage(ack=pb.Ack(epoch=out[0], seq=out[1]))
                    await self._context.write(out)
                self._empty.set()
                self._wake.clear()
                await self._wake.wait()
        finally:
            self._empty.set()  # a dead writer never empties the queue: release drain()

    async def drain(self) -> None:
        """Until everything queued is written (or the writer died with the stream)."""
        if self._task is not None:
            self._flush.set()
            await self._empty.wait()
            self._flush.clear()

    def close(self) -> None:
        task = self._task
        if task is not None:
            if task.done():
                if not task.cancelled():
                    task.exception()  # retrieved: a write to a closed stream is not worth a log line
            else:
                task.cancel()
