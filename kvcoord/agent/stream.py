"""A reporter's streams, one per coordinator: connect, Hello, resend or snapshot, then write batches and
heartbeats and read acks until the stream ends; reconnect with backoff unless the coordinator refused the
node for good. See :mod:`kvcoord.agent.reporter` for the stream semantics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from typing import TYPE_CHECKING

import grpc
import grpc.aio

from kvcoord.agent.link import Link, batch_message, batches_message
from kvcoord.media import MISFIT_STORES, UNKNOWN_MEDIA
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.transport import open_aio_channel
from kvcoord.wire import load_to_proto

if TYPE_CHECKING:
    from kvcoord.agent.reporter import Reporter

log = logging.getLogger("kvcoord.agent.reporter")

AGENT_VERSION = "kvcoord-reporter/1"
INGEST_METHOD = "/kvcoord.v2.Coordinator/Ingest"


def _raw(data: bytes) -> bytes:
    return data


class _StreamClosed(Exception):
    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


PERMANENT = frozenset({
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.UNIMPLEMENTED,
})
"""Statuses that refuse a stream before its Welcome for a reason a retry cannot change: the link stops."""


class Streams:
    """The streams of one :class:`~kvcoord.agent.reporter.Reporter`, whose queues and state they read."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter

    async def _send_snapshot(self, link: Link, call: grpc.aio.StreamStreamCall) -> int:
        r = self.reporter
        link.force_snapshot = True  # until the final chunk is written
        chunks = r._take_snapshot()
        seq = chunks[0].seq
        link.drop_through(seq)
        # Before the writes: the coordinator's Ack can be read while the last write is still being
        # awaited, and an Ack seen before snap_wait was set would leave the link unsettled for ever.
        link.snap_wait = seq
        for c in chunks:
            await call.write(pb.AgentMessage(snapshot=c).SerializeToString())
        link.force_snapshot = False
        link.stats.snapshots_sent += 1
        return seq

    def _hello(self, link: Link) -> bytes:
        r = self.reporter
        next_seq = link.unacked[0].seq if link.unacked else r._last_seq + 1
        hello = pb.Hello(node_id=r.node_id, model=r.model, dp_ranks=r.dp_ranks, epoch=r.epoch,
                         agent_version=AGENT_VERSION, next_seq=next_seq, serving_url=r.serving_url,
                         no_kv_events=not r.kv_events, pools=r.pools, pool_publisher=r.pool_publisher,
                         role=r.role)
        if r._profile is not None:
            hello.hash_profile.CopyFrom(r._profile)
        return pb.AgentMessage(hello=hello).SerializeToString()

    async def run(self, link: Link) -> None:
        r = self.reporter
        opts = r.options
        backoff = opts.backoff_initial
        last_logged = ""
        while not r._closing:
            welcomed = False
            code: grpc.StatusCode | None = None
            try:
                welcomed = await self._session(link)
            except asyncio.CancelledError:
                link.stats.connected = False
                raise
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
                link.stats.last_error = f"{code.name}: {exc.details()}"
            except _StreamClosed as exc:
                code = exc.code
                link.stats.last_error = str(exc)
            except (TimeoutError, OSError, ValueError) as exc:
                link.stats.last_error = str(exc) or type(exc).__name__
            except Exception as exc:  # a bug or a snapshot provider failure: keep the engine running
                link.stats.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("coordinator %s: stream failed", link.endpoint.address)
            link.stats.connected = False
            if r._closing:
                return
            if not welcomed and code in PERMANENT:
                self._refuse(link)
                return
            if link.stats.last_error != last_logged:
                last_logged = link.stats.last_error
                log.warning("coordinator %s: %s; reconnecting", link.endpoint.address, last_logged)
            if welcomed:
                backoff = opts.backoff_initial
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, opts.backoff_max)
            link.stats.reconnects += 1

    def _refuse(self, link: Link) -> None:
        r = self.reporter
        link.stats.refused = link.stats.last_error
        log.error("coordinator %s refused node %s for good (%s); not retrying", link.endpoint.address,
                  r.node_id, link.stats.refused)
        if all(lk.stats.refused for lk in r._links):
            r.refused.set()

    def _mismatch(self, link: Link, message: str) -> None:
        if message and message != link.stats.hash_mismatch:
            log.error("coordinator %s: this node's block hashes do not match its profile, so its cache "
                      "will not be found by token lookups: %s", link.endpoint.address, message)
        link.stats.hash_mismatch = message

    async def _session(self, link: Link) -> bool:
        """One stream's life. Returns True if it got as far as a Welcome."""
        r = self.reporter
        opts = r.options
        channel = open_aio_channel(link.endpoint.address, link.security, opts.max_message_bytes)
        call: grpc.aio.StreamStreamCall | None = None
        reader: asyncio.Task[None] | None = None
        try:
            ingest = channel.stream_stream(INGEST_METHOD, request_serializer=_raw,
                                           response_deserializer=pb.CoordinatorMessage.FromString)
            call = ingest(metadata=link.security.metadata() or None)
            await call.write(self._hello(link))
            async with asyncio.timeout(opts.welcome_timeout):  # not wait_for: see kvcoord.waits
                first = await call.read()
            if first is grpc.aio.EOF:
                await self._raise_status(call)
                raise _StreamClosed("stream closed before Welcome")
            if first.WhichOneof("msg") != "welcome":
                raise _StreamClosed(f"expected Welcome, got {first.WhichOneof('msg')}")
            w = first.welcome
            lease = w.lease_seconds if w.lease_seconds > 0 else opts.default_lease_seconds
            cursor = self._on_welcome(link, w)
            link.stats.connected = True
            link.stats.last_error = ""
            reader = asyncio.create_task(self._read_loop(link, call))
            await self._write_loop(link, call, reader, cursor, lease / 3.0)
            return True
        finally:
            link.stats.connected = False
            if reader is not None:
                reader.cancel()
                with contextlib.suppress(BaseException):
                    await reader
            if call is not None:
                call.cancel()
            with contextlib.suppress(BaseException):
                await channel.close(grace=None)

    async def _raise_status(self, call: grpc.aio.StreamStreamCall) -> None:
        code = await call.code()
        if code is not None and code != grpc.StatusCode.OK:
            raise _StreamClosed(f"{code.name}: {await call.details()}", code)

    def _on_welcome(self, link: Link, w: pb.Welcome) -> int:
        """Apply the coordinator's view; returns the cursor (last seq it has) for the writer."""
        r = self.reporter
        if w.HasField("verify"):
            r.sampler.configure(w.verify)
        self._mismatch(link, w.hash_mismatch)
        acked = w.acked_seq if w.epoch in (0, r.epoch) else 0
        if w.epoch not in (0, r.epoch):
            log.warning("coordinator %s welcomed epoch %d, ours is %d",
                        link.endpoint.address, w.epoch, r.epoch)
        if w.snapshot_required:
            link.snap_wait = -1  # it is lost with the old stream; a fresh one follows
        else:
            link.on_ack(acked)
        need = w.snapshot_required or link.force_snapshot
        if not need and acked < r._last_seq:
            first = link.unacked[0].seq if link.unacked else None
            if first is None or first > acked + 1:
                need = True  # batches it never saw are gone from our queue
        if acked > r._last_seq:
            log.warning("coordinator %s acked seq %d beyond ours (%d); resyncing",
                        link.endpoint.address, acked, r._last_seq)
            need = True
        link.snapshot_requested = need
        return acked

    async def _write_loop(self, link: Link, call: grpc.aio.StreamStreamCall, reader: asyncio.Task[None],
                          cursor: int, hb_interval: float) -> None:
        r = self.reporter
        next_hb = time.monotonic() + hb_interval
        stats = link.stats
        max_group_bytes = r.options.max_message_bytes // 4
        while True:
            link.wakeup.clear()
            if reader.done():
                reader.result()  # raises the stream's error
                await self._raise_status(call)
                raise _StreamClosed("coordinator closed the stream")
            if link.snapshot_requested or (link.force_snapshot and not link.unacked):
                link.snapshot_requested = False
                cursor = await self._send_snapshot(link, call)
                continue
            if link.force_snapshot:
                link.snapshot_requested = True  # overflowed while connected: resync now
                continue
            b = link.next_after(cursor)
            if b is not None:
                group = link.group_after(cursor, max_group_bytes)
                if len(group) == 1:
                    await call.write(batch_message(b.body))
                else:
                    await call.write(batches_message([g.body for g in group]))
                cursor = group[-1].seq
                stats.batches_sent += len(group)
                if group[0].seq <= link.high_sent:
                    stats.batches_resent += min(len(group), link.high_sent - group[0].seq + 1)
                link.high_sent = max(link.high_sent, cursor)
                continue
            now = time.monotonic()
            if now >= next_hb:
                load = r._load() if r._load is not None else None
                hb = pb.AgentHeartbeat(load=load_to_proto(load) if load is not None else None,
                                       unknown_media=UNKNOWN_MEDIA.take(), misfit_stores=MISFIT_STORES.take())
                await call.write(pb.AgentMessage(heartbeat=hb).SerializeToString())
                stats.heartbeats_sent += 1
                next_hb = now + hb_interval
                continue
            if r._pending and not r.options.linger:
                r._seal_all()  # what arrived while this stream was writing: its next message
                continue
            link.idle = True
            try:
                await link.wakeup.wait(next_hb - now)
            finally:
                link.idle = False

    async def _read_loop(self, link: Link, call: grpc.aio.StreamStreamCall) -> None:
        r = self.reporter
        assert r._ack_event is not None
        try:
            while True:
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    return
                kind = msg.WhichOneof("msg")
                if kind == "ack":
                    if msg.ack.epoch in (0, r.epoch):
                        link.on_ack(msg.ack.seq)
                        r._ack_event.set()
                elif kind == "snapshot_request":
                    link.stats.snapshot_requests += 1
                    log.info("coordinator %s asks for a snapshot: %s", link.endpoint.address,
                             msg.snapshot_request.reason)
                    link.snapshot_requested = True
                elif kind == "notice":
                    if msg.notice.state == "hash_mismatch":
                        self._mismatch(link, msg.notice.message)
                    else:
                        log.info("coordinator %s: node %s is %s: %s", link.endpoint.address, r.node_id,
                                 msg.notice.state, msg.notice.message)
                else:
                    log.debug("coordinator %s: ignoring %s", link.endpoint.address, kind)
        finally:
            link.wakeup.set()
