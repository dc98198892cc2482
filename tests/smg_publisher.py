"""A test engine serving ``SubscribeKvEvents`` over real gRPC, built on ``smg-grpc-proto``'s generated stubs
(SGLang's scheduler service, as SGLang serves it).

It numbers its batches from 0 and keeps the last ``history`` of them, so a subscription resuming after a
sequence (``start_sequence_number``: the last one the subscriber applied) gets what followed it, as a
servicer with a replay buffer answers. What a test can make it do:

- ``drop``: leave a batch out of the live stream once (a gap the subscriber heals by resuming);
- ``forget``: leave it out of the history too (a gap nobody can fill);
- ``publish_raw``: send a batch as it is (a malformed one);
- ``restart``: end every stream (UNAVAILABLE) and count from 0 again, its blocks gone (a subscription from
  a sequence it has not reached gets its whole history);
- ``end_streams(code)``: end every stream with a status (``OUT_OF_RANGE``, ``DATA_LOSS``);
- ``snapshot``: answer a subscription from 0 with its held blocks in ``KvSnapshotChunk`` chunks (chunk 0
  begins with the clear; consecutive sequence numbers ending at its last batch), then go on live;
- every batch carries ``load`` (``EngineLoad``): :attr:`load` as it is then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from smg_grpc_proto.generated import common_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl


class Engine(sgl.SglangSchedulerServicer):  # type: ignore[misc]
    """The engine's KV-event side; :meth:`serve` starts its gRPC server on ``port``."""

    def __init__(self, port: int, *, history: int = 1000, dp_rank: int = 0) -> None:
        self.port = port
        self.history = history
        self.dp_rank = dp_rank
        self.log: list[pb.KvEventBatch] = []
        self.next_seq = 0
        self.drop: set[int] = set()
        self.forgotten: set[int] = set()
        self.held: dict[int, tuple[list[int], int]] = {}
        """Blocks the engine holds: hash -> (token ids, tier)."""
        self.load = pb.EngineLoad(running_requests=0, waiting_requests=0, token_usage=0.0)
        self.snapshot = False
        self.subscriptions: list[int] = []
        """Every subscription's ``start_sequence_number``."""
        self._generation = 0
        self._ending: grpc.StatusCode | None = None
        self._cond = threading.Condition()
        self._server: grpc.Server | None = None

    # --- the server ---
    def serve(self) -> Engine:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        sgl.add_SglangSchedulerServicer_to_server(self, server)
        server.add_insecure_port(f"127.0.0.1:{self.port}")
        server.start()
        self._server = server
        return self

    def close(self) -> None:
        with self._cond:
            self._generation += 1
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(grace=None).wait(5)
            self._server = None

    def SubscribeKvEvents(self, request: Any, context: grpc.ServicerContext) -> Iterator[pb.KvEventBatch]:
        start = request.start_sequence_number
        with self._cond:
            self.subscriptions.append(start)
            generation = self._generation
            if start == 0 and self.snapshot and self.next_seq >= 2:
                queued = self._snapshot_chunks()
            else:
                if start >= self.next_seq:  # a position this engine never reached: it restarted
                    start = 0
                queued = [b for b in self.log if (b.sequence_number > start or not start)
                          and b.sequence_number not in self.forgotten]
            sent = self.next_seq
        yield from queued
        while context.is_active():
            with self._cond:
                if self._generation != generation:
                    code, self._ending = self._ending or grpc.StatusCode.UNAVAILABLE, None
                    context.abort(code, "the engine ended this stream")
                if sent >= self.next_seq:
                    self._cond.wait(0.05)
                    continue
                first = self.next_seq - len(self.log)
                sent = max(sent, first)
                batch = self.log[sent - first]
                sent += 1
                seq = batch.sequence_number
                if seq in self.drop or seq in self.forgotten:
                    self.drop.discard(seq)
                    continue
            yield batch

    # --- what the engine does ---
    def publish(self, *events: pb.KvCacheEvent) -> int:
        """Publish one batch of events (with the load as it is now); its sequence number."""
        with self._cond:
            seq = self.next_seq
            batch = pb.KvEventBatch(sequence_number=seq, timestamp=time.time(), events=events,
                                    dp_rank=self.dp_rank, load=self.load)
            self._append(batch)
            for ev in events:
                self._hold(ev)
            return seq

    def publish_raw(self, batch: pb.KvEventBatch) -> int:
        with self._cond:
            seq = self.next_seq
            batch.sequence_number = seq
            self._append(batch)
            return seq

    def _append(self, batch: pb.KvEventBatch) -> None:
        self.log.append(batch)
        self.next_seq += 1
        del self.log[:-self.history]
        self._cond.notify_all()

    def _hold(self, ev: pb.KvCacheEvent) -> None:
        which = ev.WhichOneof("data")
        if which == "stored":
            for b in ev.stored.blocks:
                self.held[b.block_hash] = (list(b.token_ids), ev.stored.tier)
        elif which == "removed":
            for h in ev.removed.block_hashes:
                self.held.pop(h, None)
        elif which == "cleared":
            self.held.clear()

    def restart(self) -> None:
        """The engine process restarted: streams end, its blocks are gone, it counts from 0 again."""
        with self._cond:
            self.log.clear()
            self.held.clear()
            self.next_seq = 0
            self.drop.clear()
            self.forgotten.clear()
            self._generation += 1
            self._cond.notify_all()

    def end_streams(self, code: grpc.StatusCode) -> None:
        with self._cond:
            self._ending = code
            self._generation += 1
            self._cond.notify_all()

    def _snapshot_chunks(self) -> list[pb.KvEventBatch]:
        """Two chunks of what the engine holds, stamped ``next_seq - 2`` and ``next_seq - 1``."""
        items = sorted(self.held.items())
        half = len(items) // 2
        parts: Sequence[list[tuple[int, tuple[list[int], int]]]] = (items[:half], items[half:])
        out = []
        for index, part in enumerate(parts):
            events = [pb.KvCacheEvent(cleared=pb.KvCacheCleared())] if index == 0 else []
            events += [stored_event([(h, toks)], tier=tier) for h, (toks, tier) in part]
            out.append(pb.KvEventBatch(
                sequence_number=self.next_seq - 2 + index, timestamp=time.time(), events=events,
                dp_rank=self.dp_rank, load=self.load,
                snapshot=pb.KvSnapshotChunk(index=index, count=2, blocks=len(part), unknown_before=0)))
        return out


def stored_event(blocks: Sequence[tuple[int, list[int]]], *, tier: int = 0, medium: str | None = None,
                 parent: int | None = None) -> pb.KvCacheEvent:
    """A ``KvBlocksStored`` of ``(int64 hash, token ids)`` blocks."""
    stored = pb.KvBlocksStored(blocks=[pb.KvBlock(block_hash=h, token_ids=t, block_size=len(t))
                                       for h, t in blocks])
    if tier:
        stored.tier = tier  # type: ignore[assignment]
    if medium is not None:
        stored.medium = medium
    if parent is not None:
        stored.parent_block_hash = parent
    return pb.KvCacheEvent(stored=stored)


def removed_event(hashes: Sequence[int], *, tier: int = 0) -> pb.KvCacheEvent:
    removed = pb.KvBlocksRemoved(block_hashes=list(hashes))
    if tier:
        removed.tier = tier  # type: ignore[assignment]
    return pb.KvCacheEvent(removed=removed)


def cleared_event() -> pb.KvCacheEvent:
    return pb.KvCacheEvent(cleared=pb.KvCacheCleared())


def int64(h: int) -> int:
    """A uint64 block hash as SMG's servicers publish it: the same 64 bits, signed."""
    return h - (1 << 64) if h >= 1 << 63 else h
