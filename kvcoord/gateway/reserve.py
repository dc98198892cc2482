"""A front door's side of the shared view: its picks and releases on one long-lived ``Reserve`` stream to
the coordinator (:mod:`kvcoord.coordinator.reservations`), which lookup answers of other routers carry.

Nothing on the request path waits for it: :meth:`ReserveStream.reserve` and :meth:`ReserveStream.release`
add an operation in place to the batch one writer task sends next, so a reservation costs a protobuf
operation per request, no round trip. Completions ride with the next reservation (or go after
``RELEASE_LINGER``); a completion within ``FIRST_BYTE_LINGER`` of its first byte replaces it (and goes
when the first byte would have); what queues during a write goes in one message. So a short request
costs two stream messages at most (its reservation, its release), and under load fewer.

While the stream is down (coordinator down or restarting), the router works on its own memory (its
in-flight counts and placement memory), says so once in its log, in ``kvcoord_route_shared_view`` /
``kvcoord_epp_shared_view`` (0) and in route's ``/health`` ``shared_view``, and reopens the stream every
``retry_seconds``. Lookups ask for a hold on their new prefix only while the stream is up.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

import grpc

from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.router.client import AsyncCoordinatorClient
from kvcoord.validate import pack_u64

__all__ = ["DEFAULT_TTL", "ReserveStream", "new_router_id"]

DEFAULT_TTL = 600.0
"""Seconds a reservation lives at most when its release never comes (a request longer than this stops
counting as in flight for other routers; its own router still counts it)."""
_MAX_OPS = 65_536
"""Operations one batch holds at most (the stream is stuck past that: more are dropped, counted)."""
RELEASE_LINGER = 0.02
"""Seconds a completion may wait for a reservation to travel with (a late one only keeps the view
conservative a little longer); a reservation never waits."""
FIRST_BYTE_LINGER = 0.002
"""Seconds a first byte may wait: a completion within them replaces it (it releases the prefill too), so
a short answer costs one stream message, not two."""


def new_router_id() -> str:
    """Unique per process: host, pid and a random tail (a restarted router is a new one)."""
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


class ReserveStream:
    """One router's ``Reserve`` stream. :meth:`run` keeps it open until cancelled."""

    def __init__(self, client: AsyncCoordinatorClient, log: logging.Logger, *, ttl: float = DEFAULT_TTL,
                 router_id: str | None = None, retry_seconds: float = 1.0,
                 on_change: Callable[[bool], None] | None = None) -> None:
        if ttl <= 0:
            raise ValueError("the reservation ttl must be > 0")
        self.client = client
        self.log = log
        self.ttl = ttl
        self.router_id = router_id or new_router_id()
        self.retry_seconds = retry_seconds
        self.on_change = on_change
        self.up = False
        self.reason = "not connected yet"
        """Why the stream is down (for ``/health``); "" while up."""
        self.dropped = 0
        """Operations not sent: the stream was down, or the batch full."""
        self._batch = pb.ReserveBatch(router_id=self.router_id)
        """What the next write sends: reservations and releases since the last one, built in place (no
        copies of operations)."""
        self._first_bytes: dict[str, pb.ReserveOp] = {}
        """The batch's first-byte releases by request id: a completion turns its own into itself."""
        self._ready = asyncio.Event()
        """Set when the batch is due: the writer takes it at once, or after the write in progress."""
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        self._completion_due = 0.0
        """When the batch's oldest completion must go (0: it has none)."""
        self._ids = itertools.count(1)
        self._announced = False
        self._streams = 0
        """Calls opened so far: a writer of an earlier one stops (grpc leaves it waiting)."""

    def next_id(self) -> str:
        """A request id for a lookup's hold and its reservation; "" while the stream is down (no hold)."""
        return str(next(self._ids)) if self.up else ""

    # ------------------------------------------------------------------ the request path
    def reserve(self, request_id: str, model: str, key: NodeKey, first_block: int,
                hashes: Sequence[BlockHash64], prefill_tokens: int) -> None:
        """Sent at once (other lookups may wait for it), with the releases pending."""
        if not self.up or len(self._batch.ops) >= _MAX_OPS:
            self.dropped += 1
            return
        op = self._batch.ops.add(request_id=request_id)
        r = op.reserve
        r.model, r.node_id, r.dp_rank, r.first_block = model, key[0], key[1], first_block
        r.block_hashes = pack_u64(hashes[first_block:])
        r.prefill_tokens, r.ttl_seconds = max(0, prefill_tokens), self.ttl
        self._flush()

    def release(self, request_id: str, *, first_byte: bool) -> None:
        """A first byte goes within ``FIRST_BYTE_LINGER`` s (the node's queued prefill is load every router
        weighs), unless the completion comes first and replaces it; a completion goes with the next
        reservation, or ``RELEASE_LINGER`` s after the oldest one pending."""
        if not self.up:
            return
        now = asyncio.get_running_loop().time()
        if first_byte:
            if len(self._batch.ops) >= _MAX_OPS:
                self.dropped += 1
                return
            op = self._batch.ops.add(request_id=request_id)
            op.release.first_byte = True
            self._first_bytes[request_id] = op
            self._arm(now + FIRST_BYTE_LINGER)
            return
        pending = self._first_bytes.pop(request_id, None)
        if pending is not None:  # it releases the prefill too: one operation, due as the first byte was
            pending.release.first_byte = False
            return
        if not self._completion_due:
            self._completion_due = now + RELEASE_LINGER
        if len(self._batch.ops) >= _MAX_OPS:
            self.dropped += 1
            return
        self._batch.ops.add(request_id=request_id).release.first_byte = False
        self._arm(self._completion_due)

    def _arm(self, due: float) -> None:
        """Flush at ``due`` at the latest."""
        if self._timer is not None:
            if self._due <= due:
                return
            self._timer.cancel()
        loop = asyncio.get_running_loop()
        self._timer, self._due = loop.call_at(due, self._flush), due  # uvloop's handles have no when()

    def _flush(self) -> None:
        """The batch is due: the writer sends it (what queues before the write goes along)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._batch.ops:
            self._ready.set()

    def _take(self) -> pb.ReserveBatch:
        batch, self._batch = self._batch, pb.ReserveBatch(router_id=self.router_id)
        self._first_bytes.clear()
        self._completion_due = 0.0
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._ready.clear()
        return batch

    # ------------------------------------------------------------------ the stream
    async def _batches(self, stream: int) -> AsyncIterator[pb.ReserveBatch]:
        yield pb.ReserveBatch(router_id=self.router_id)  # names the router at once
        while True:
            await self._ready.wait()
            if stream != self._streams:  # a failed call's writer: the batch is the next stream's
                return
            if self._batch.ops:
                yield self._take()  # what queued during the last write goes in this one message
            else:
                self._ready.clear()

    def _set(self, up: bool, reason: str) -> None:
        changed = up != self.up or not self._announced
        self.up, self.reason = up, reason
        if not changed:
            return
        self._announced = True
        if up:
            self.log.warning("reservations: stream to the coordinator open (router id %s); routers share "
                             "one view", self.router_id)
        else:
            self.log.warning("reservations: stream to the coordinator down (%s); placing on this router's "
                             "own memory until it is back", reason)
            self._take()  # the coordinator dropped them with the stream
        if self.on_change is not None:
            self.on_change(up)

    async def run(self) -> None:
        """Open the stream, keep it open, reopen it after a failure; a coordinator without ``Reserve``
        (UNIMPLEMENTED) is logged once and never asked again."""
        while True:
            self._streams += 1
            call = self.client.reserve_stream(self._batches(self._streams))
            try:
                await call.wait_for_connection()
                self._set(True, "")
                await call
                self._set(False, "the coordinator ended the stream")
            except grpc.aio.AioRpcError as exc:
                self._set(False, f"{exc.code().name}: {exc.details()}")
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    self.log.warning("reservations: the coordinator has no Reserve call; not shared")
                    self.reason = "the coordinator has no Reserve call"
                    return
            except asyncio.CancelledError:
                call.cancel()
                raise
            await asyncio.sleep(self.retry_seconds)
