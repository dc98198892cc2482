"""The relay's gRPC transport: an engine's ``SubscribeKvEvents`` stream (``smg.grpc.common.KvEventBatch``).

SGLang serves it natively, vLLM through ``smg-grpc-servicer``, SMG's Rust relay for any engine; the messages
and services are PyPI's ``smg-grpc-proto`` (its generated modules, never a copy of the .proto files).
The semantics follow the servicers and SMG's own subscriber (``model_gateway/src/worker/kv_event_monitor.rs``
and ``kv_event_recovery.rs`` in smg-project/smg):

- a subscription asks for ``start_sequence_number`` = the last sequence applied (0 before any: "from the
  current state"); servers resume strictly after it, so a repeat of it is a duplicate;
- a sequence past the next one is a gap: the relay subscribes again from its position, once; if the stream
  still starts past it the server kept no history there, and the batches are lost (:meth:`RelayCore._lost`:
  the ranks are cleared and marked ``degraded``, as for a ZMQ gap replay could not fill);
- a sequence that goes back (on the open stream, or below the last applied on a new one) is a restarted
  engine (:meth:`RelayCore._restart`), and so is a ``DATA_LOSS`` status; ``OUT_OF_RANGE`` (the server cannot
  resume from the position asked) loses the history: cleared, marked, subscribed again from 0;
- batches marked ``snapshot`` (``KvSnapshotChunk {index, count, blocks, unknown_before}``) are a state
  resync in band: chunk 0 replaces the node's blocks (the ranks are cleared first; the chunk begins with the
  engine's clear), its sequence becomes the relay's position wherever it stands, and the chunks that follow
  are consecutive; a snapshot with ``unknown_before`` > 0 or a missing chunk is partial: marked ``degraded``;
- every batch's ``load`` (``EngineLoad``) is the engine's load for that DP rank: a gRPC engine needs no
  metrics page. A ``load_only`` heartbeat (no events, the last sequence again) only updates it;
- a batch that cannot be decoded (a protobuf that does not parse, an event of no kind) is malformed:
  counted, logged once per kind, and lost history (:meth:`RelayCore._bad_batch`);
- an engine that does not answer is retried with backoff (``backoff_initial`` doubling to ``backoff_max``),
  the stream being what says it is there (:attr:`RelayCore.answered_at`: every message, and every
  ``idle_probe`` while the channel is connected and the stream open).

Which service the engine serves (SGLang's, vLLM's, TRT-LLM's, TokenSpeed's ``SubscribeKvEvents``) is found by
asking each in turn: a server answers ``UNIMPLEMENTED`` for a service it does not have.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import time
from typing import Any

import grpc
import grpc.aio
from google.protobuf.message import DecodeError

from kvcoord.engine.mirror import BlockMirror, EventSink
from kvcoord.engine.relay import RelayCore
from kvcoord.engine.zmq_wire import check_endpoint
from kvcoord.events import decode_smg_batch
from kvcoord.load import NodeLoad
from kvcoord.validate import shown

log = logging.getLogger(__name__)

__all__ = ["SERVICES", "GrpcRelay", "check_grpc_endpoint", "subscribe_paths"]

SERVICES = (("sglang_scheduler_pb2", "SglangScheduler"), ("vllm_engine_pb2", "VllmEngine"),
            ("trtllm_service_pb2", "TrtllmService"), ("tokenspeed_scheduler_pb2", "TokenSpeedScheduler"))
"""The ``smg-grpc-proto`` services that carry ``SubscribeKvEvents``, in the order they are tried."""


def subscribe_paths() -> list[str]:
    """Each service's ``SubscribeKvEvents`` method path, from the generated modules' descriptors."""
    out = []
    for module, service in SERVICES:
        pb2 = importlib.import_module(f"smg_grpc_proto.generated.{module}")
        method = pb2.DESCRIPTOR.services_by_name[service].methods_by_name["SubscribeKvEvents"]
        out.append(f"/{method.containing_service.full_name}/{method.name}")
    return out


def check_grpc_endpoint(text: str) -> str:
    """``text`` if it is a ``HOST:PORT`` to dial (the ZMQ endpoints' host and port rules), else ``ValueError``
    in one line."""
    try:
        check_endpoint(f"tcp://{text}", connect=True)
    except ValueError as exc:
        why = str(exc).rpartition("`: ")[2]
        raise ValueError(f"invalid gRPC endpoint `{shown(text, 256, quote=False)}`: {why} "
                         "(expected HOST:PORT)") from None
    return text


def _common() -> Any:
    return importlib.import_module("smg_grpc_proto.generated.common_pb2")


_RESUBSCRIBE = True


class GrpcRelay(RelayCore):
    """One engine's ``SubscribeKvEvents`` stream -> mirror + sink. A stream has one sequence, so it carries
    one DP rank's batches (SGLang's servicer streams rank 0's publisher): ``allowed_ranks``."""

    def __init__(self, endpoint: str, sink: EventSink, *, mirror: BlockMirror | None = None,
                 default_dp_rank: int = 0, allowed_ranks: set[int] | None = None,
                 on_malformed: Any = None, idle_probe: float = 1.0, backoff_initial: float = 0.1,
                 backoff_max: float = 5.0) -> None:
        super().__init__(check_grpc_endpoint(endpoint), sink, mirror=mirror, default_dp_rank=default_dp_rank,
                         allowed_ranks=allowed_ranks, on_malformed=on_malformed)
        self.replay_endpoint: str | None = None
        self._idle_probe = idle_probe
        self._backoff = (backoff_initial, backoff_max)
        self._pb = _common()
        self._paths = subscribe_paths()
        self._path_at = 0
        self._path: str | None = None
        """The method path the engine answered on (None: not found yet)."""
        self._call: Any = None
        self._resumed = False
        """The stream was opened again to fill a gap (once per gap)."""
        self._chunk_next: int | None = None
        """The next chunk index of the snapshot being read."""
        self._delivered = False
        """The current subscription delivered a message."""
        self._outage = False
        """A failure was logged and nothing was delivered since (one warning per outage)."""
        self.loads: dict[int, NodeLoad] = {}
        """The engine's last load per DP rank (``KvEventBatch.load``), while the stream is up."""
        self.ready = asyncio.Event()

    def load(self) -> NodeLoad:
        """The node's load: its ranks' requests summed, their KV usage averaged (zeros: unknown)."""
        loads = list(self.loads.values())
        if not loads:
            return NodeLoad()
        return NodeLoad(running_requests=sum(x.running_requests for x in loads),
                        waiting_requests=sum(x.waiting_requests for x in loads),
                        kv_usage=sum(x.kv_usage for x in loads) / len(loads))

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set (or the task is cancelled), subscribing again after every failure."""
        channel = grpc.aio.insecure_channel(self.endpoint)
        watcher = asyncio.create_task(self._watch(channel))
        stopping = asyncio.create_task(stop.wait())
        backoff = self._backoff[0]
        self.ready.set()
        try:
            while not stop.is_set():
                self._delivered = False
                sub = asyncio.create_task(self._subscribe(channel))
                await asyncio.wait((sub, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not sub.done():  # stopped: a cancelled stream raises CancelledError, not a status
                    sub.cancel()
                    with contextlib.suppress(asyncio.CancelledError, grpc.aio.AioRpcError):
                        await sub
                    break
                self._call = None
                self.loads.clear()
                try:
                    again = sub.result()
                except grpc.aio.AioRpcError as exc:
                    again = self._failed(exc)
                if self._delivered:
                    backoff = self._backoff[0]
                if again:
                    continue
                await asyncio.wait((stopping,), timeout=backoff)
                backoff = min(backoff * 2, self._backoff[1])
        finally:
            self._call = None
            self.loads.clear()
            for task in (stopping, watcher):
                task.cancel()
            await asyncio.wait((stopping, watcher))
            await channel.close(None)

    async def _watch(self, channel: grpc.aio.Channel) -> None:
        """Keeps :attr:`answered_at` while the stream is open and the channel connected (an idle engine)."""
        while True:
            await asyncio.sleep(self._idle_probe)
            call = self._call
            if call is not None and not call.done() and \
                    channel.get_state() == grpc.ChannelConnectivity.READY:
                self.answered_at = time.monotonic()

    async def _subscribe(self, channel: grpc.aio.Channel) -> bool:
        """One subscription, read to its end; True to subscribe again at once (a gap, a restart)."""
        path = self._path or self._paths[self._path_at]
        start = self._expected - 1 if self._expected > 0 else 0
        request = self._pb.SubscribeKvEventsRequest
        method = channel.unary_stream(path, request_serializer=request.SerializeToString)
        call = self._call = method(request(start_sequence_number=start))
        async for raw in call:
            if self._path is None:
                self._path = path
                log.info("%s: subscribed to %s from seq %d", self.endpoint, path, start)
            self.answered_at = time.monotonic()
            if self._outage:
                self._outage = False
                log.info("%s: the KV event stream is back", self.endpoint)
            self._delivered = True
            if self._message(raw) is _RESUBSCRIBE:
                call.cancel()
                return True
        if self._path is None:
            self._path = path
        log.info("%s: the KV event stream ended; subscribing again from seq %d", self.endpoint,
                 max(self._expected - 1, 0))
        return False

    def _failed(self, exc: grpc.aio.AioRpcError) -> bool:
        """A failed stream: what its status says. True to subscribe again at once."""
        code, details = exc.code(), exc.details() or ""
        if code == grpc.StatusCode.CANCELLED:
            return False
        if code == grpc.StatusCode.UNIMPLEMENTED and self._path is None:
            self._path_at = (self._path_at + 1) % len(self._paths)
            if self._path_at:
                return True  # try the next service
            if not self._outage:
                self._outage = True
                log.warning("%s: the engine serves no SubscribeKvEvents (tried %s): %s; retrying",
                            self.endpoint, ", ".join(self._paths), details)
            return False
        if code == grpc.StatusCode.DATA_LOSS:
            self._restart(f"the server said DATA_LOSS: {details}")
            return True
        if code == grpc.StatusCode.OUT_OF_RANGE:
            self._history_gone(f"the server cannot resume after seq {max(self._expected - 1, 0)}: {details}")
            return True
        log.log(logging.DEBUG if self._outage else logging.WARNING,
                "%s: KV event stream failed (%s: %s); retrying with backoff (logged once per outage)",
                self.endpoint, code.name, details)
        self._outage = True
        return False

    def _history_gone(self, why: str) -> None:
        """The server has no history after our position: what we hold may be stale, so it goes (marked)."""
        ranks = sorted(self._ranks_seen) if self._started else self._marked_ranks()
        self.stats.unrecoverable_gaps += 1
        self._clear_ranks()
        self._expected, self._started, self._chunk_next = 0, False, None
        log.warning("%s: %s; cleared the blocks of DP rank(s) %s and subscribing from the current state",
                    self.endpoint, why, ranks)
        for dp in ranks:
            self.sink.history_lost(dp, f"history lost: {why}")

    def _message(self, raw: bytes) -> bool:
        """Handle one streamed message; ``_RESUBSCRIBE`` to open the stream again from our position."""
        self.stats.frames += 1
        try:
            msg = self._pb.KvEventBatch.FromString(raw)
        except DecodeError as exc:
            self._bad_batch(self._expected, "protobuf", f"not a KvEventBatch ({exc})")
            return False
        if msg.HasField("load"):
            self._take_load(msg)
            if msg.load.load_only and not msg.events and not msg.HasField("snapshot"):
                return False
        seq = msg.sequence_number
        if msg.HasField("snapshot"):
            self._chunk(seq, msg)
            return False
        self._chunk_next = None
        if seq < self._expected:
            cleared = bool(msg.events) and msg.events[0].WhichOneof("data") == "cleared"
            if seq == self._expected - 1 and not cleared:
                # Servers resume strictly after the position asked (some at it); a heartbeat repeats it.
                self.stats.duplicates += 1
                return False
            self._restart(f"sequence went back to {seq} after {self._expected - 1}")
        if seq > self._expected:
            if self._expected > 0 and not self._resumed:
                self.stats.gaps += 1
                self._resumed = True
                return _RESUBSCRIBE
            self._lost(seq - self._expected, f"the engine's stream went on at {seq}")
        elif self._resumed:
            self.stats.healed_gaps += 1
            log.info("%s: gap before %d healed by resuming the stream", self.endpoint, seq)
        self._resumed = False
        self.take(seq, lambda: decode_smg_batch(msg))
        return False

    def _chunk(self, seq: int, msg: Any) -> None:
        """One snapshot chunk: a resync outside the sequence rules (see the module's docstring)."""
        snap = msg.snapshot
        self._resumed = False
        whole = snap.index == self._chunk_next and seq == self._expected
        self.stats.snapshot_chunks += 1
        if snap.index == 0:
            self._clear_ranks()  # the snapshot replaces every rank's blocks
            whole = True
        self._chunk_next = snap.index + 1
        self._expected = seq
        self.take(seq, lambda: decode_smg_batch(msg))
        dp = msg.dp_rank if msg.HasField("dp_rank") else self._default_dp
        if not whole:
            self._mark(dp, f"snapshot chunk {snap.index} of {snap.count} came without the chunks before it")
        elif snap.unknown_before and snap.index == 0:
            self._mark(dp, f"the engine's snapshot lacks its first {snap.unknown_before} batch(es)")
        if snap.index + 1 >= snap.count:
            self._chunk_next = None
            log.info("%s: snapshot of %d chunk(s) applied at seq %d", self.endpoint, snap.count, seq)

    def _mark(self, dp: int, why: str) -> None:
        self.stats.lost_batches += 1
        log.warning("%s: %s; DP rank %d marked degraded (history lost)", self.endpoint, why, dp)
        self.sink.history_lost(dp, f"history lost: {why}")

    def _take_load(self, msg: Any) -> None:
        dp = msg.dp_rank if msg.HasField("dp_rank") else self._default_dp
        if self._allowed is not None and dp not in self._allowed:
            return
        x = msg.load
        usage = x.token_usage if x.token_usage == x.token_usage else 0.0  # NaN: unknown
        self.loads[dp] = NodeLoad(running_requests=x.running_requests, waiting_requests=x.waiting_requests,
                                  kv_usage=min(1.0, max(0.0, usage)))
