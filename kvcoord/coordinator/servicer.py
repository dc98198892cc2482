"""The ``kvcoord.v2.Coordinator`` gRPC service.

Requests are deserialised by the handlers here rather than by gRPC, so that a malformed message
gets ``INVALID_ARGUMENT`` with the parser's reason instead of a generic internal error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import traceback
from array import array
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from kvcoord.coordinator.auth import ROUTER, Authenticator, AuthError, Principal
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.engines import ACTIVE
from kvcoord.coordinator.ingest import IngestSession
from kvcoord.coordinator.lookup import (
    INTERNAL,
    INVALID,
    NO_PROFILE,
    NOT_FOUND,
    TOKENIZER_DOWN,
    UNAVAILABLE,
    UNIMPLEMENTED,
    LookupFailed,
    Lookups,
    prompt_keys,
)
from kvcoord.coordinator.nodeinfo import node_info, remote_node_info, with_model_profile
from kvcoord.coordinator.outbox import Outbox
from kvcoord.coordinator.registry import NodeRecord
from kvcoord.coordinator.reservations import lookup_view, take_stream
from kvcoord.coordinator.snapshots import IngestAbort
from kvcoord.extra_keys import MultiModalItem, RequestKeys
from kvcoord.hashing import BlockHash64
from kvcoord.load import RESYNCING
from kvcoord.native import native_paths
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.transport import CAUSE_METADATA, TOKENIZER_CAUSE
from kvcoord.validate import InvalidEvent, pack_u64, shown, unpack_u64
from kvcoord.wire import load_from_proto, load_to_proto, unpack_tokens

log = logging.getLogger("kvcoord.coordinator")

SERVICE = "kvcoord.v2.Coordinator"
_LOOKUP_STATUS = {
    INVALID: grpc.StatusCode.INVALID_ARGUMENT,
    NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    NO_PROFILE: grpc.StatusCode.FAILED_PRECONDITION,
    UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    INTERNAL: grpc.StatusCode.INTERNAL,
    TOKENIZER_DOWN: grpc.StatusCode.UNAVAILABLE,
}
SHUTTING_DOWN = "coordinator shutting down: reconnect to another replica, or retry shortly"
M = TypeVar("M", bound=Message)


def _prompt_query(q: pb.PromptQuery) -> dict[str, Any]:
    """A PromptQuery's text fields as :meth:`Lookups.tokens_of` keywords (its JSON fields decoded)."""

    def loads(field: str, kind: type) -> Any:
        raw = getattr(q, field)
        if not raw:
            return None
        try:
            value = json.loads(raw)
        except ValueError as exc:
            raise LookupFailed(INVALID, f"PromptQuery.{field} is not JSON: {exc}") from None
        if not isinstance(value, kind):
            raise LookupFailed(INVALID, f"PromptQuery.{field} must be a JSON {kind.__name__}")
        return value

    messages = loads("messages_json", list)
    if q.prompt and messages is not None:
        raise LookupFailed(INVALID, "PromptQuery: give prompt or messages_json, not both")
    return {"prompt": q.prompt if messages is None else None, "messages": messages,
            "tools": loads("tools_json", list),
            "chat_template_kwargs": loads("chat_template_kwargs_json", dict),
            "add_special_tokens": q.add_special_tokens if q.HasField("add_special_tokens") else None,
            "add_generation_prompt": q.add_generation_prompt if q.HasField("add_generation_prompt") else None}


class Malformed:
    """Stands in for a request that failed to parse; handlers answer INVALID_ARGUMENT."""

    __slots__ = ("reason", "type_name")

    def __init__(self, type_name: str, reason: str) -> None:
        self.type_name = type_name
        self.reason = reason


def _parser(cls: type[M]) -> Callable[[bytes], M | Malformed]:
    def parse(data: bytes) -> M | Malformed:
        try:
            return cls.FromString(data)
        except (DecodeError, ValueError, RuntimeError) as exc:
            return Malformed(cls.__name__, str(exc) or type(exc).__name__)

    return parse


SHUTDOWN_DRAIN = 0.25  # seconds a stopping coordinator waits for a stream's pending replies


_GRPC_LOGGER = "grpc._cython.cygrpc"
_ABANDONED = f"ExecuteBatchError raised in core by servicer method [/{SERVICE}/Lookup]"


class _AbandonedLookups(logging.Filter):
    """The lookups abandoned in the last microseconds, after :meth:`CoordinatorServicer._unless_abandoned`
    looked: gRPC's core fails to send their answer and logs an ERROR traceback. A client's deadline is
    normal work: count it, as the other abandoned lookups, and keep it out of the log."""

    def __init__(self, state: CoordinatorState) -> None:
        super().__init__()
        self.state = state

    def filter(self, record: logging.LogRecord) -> bool:
        if record.getMessage() != _ABANDONED:
            return True
        self.state.metrics.lookups_cancelled.inc()
        log.debug("a lookup's client went away before its answer was sent")
        return False


class CoordinatorServicer:
    """RPC handlers over a :class:`CoordinatorState`."""

    def __init__(self, state: CoordinatorState, auth: Authenticator) -> None:
        self.state = state
        self.lookups = Lookups(state)
        self.auth = auth
        self._ingest_tasks: set[asyncio.Task[Any]] = set()
        self.shutting_down = False
        self._abandoned = _AbandonedLookups(state)
        logging.getLogger(_GRPC_LOGGER).addFilter(self._abandoned)

    async def shutdown_streams(self, timeout: float) -> int:
        """Coordinator stopping: end every open Ingest stream with UNAVAILABLE now (not after the
        server's grace period), so agents fail over to another replica at once.

        Waits (up to ``timeout``) until each stream's status is sent: if gRPC's own shutdown got
        there first, agents would see a bare "Cancelling all calls". Returns how many were ended."""
        self.shutting_down = True
        logging.getLogger(_GRPC_LOGGER).removeFilter(self._abandoned)
        tasks = list(self._ingest_tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        return len(tasks)

    def generic_handler(self) -> grpc.GenericRpcHandler:
        handlers = {
            "Ingest": grpc.stream_stream_rpc_method_handler(
                self.Ingest,  # messages arrive as bytes: batches may skip protobuf (see Ingest)
                response_serializer=pb.CoordinatorMessage.SerializeToString,
            ),
        }
        unary: dict[str, tuple[Any, type[Message], type[Message]]] = {
            "Lookup": (self.Lookup, pb.LookupRequest, pb.LookupResponse),
            "ListNodes": (self.ListNodes, pb.ListNodesRequest, pb.ListNodesResponse),
            "Heartbeat": (self.Heartbeat, pb.HeartbeatRequest, pb.HeartbeatResponse),
            "DrainNode": (self.DrainNode, pb.DrainNodeRequest, pb.DrainNodeResponse),
            "RemoveNode": (self.RemoveNode, pb.RemoveNodeRequest, pb.RemoveNodeResponse),
            "Stats": (self.Stats, pb.StatsRequest, pb.StatsResponse),
            "Ping": (self.Ping, pb.PingRequest, pb.PingResponse),
        }
        handlers["Reserve"] = grpc.stream_unary_rpc_method_handler(
            self.Reserve, request_deserializer=_parser(pb.ReserveBatch),
            response_serializer=pb.ReserveSummary.SerializeToString)
        for name, (fn, req, resp) in unary.items():
            handlers[name] = grpc.unary_unary_rpc_method_handler(
                fn, request_deserializer=_parser(req), response_serializer=resp.SerializeToString
            )
        return grpc.method_handlers_generic_handler(SERVICE, handlers)

    # --- helpers ----------------------------------------------------------------------------
    async def _principal(self, context: grpc.aio.ServicerContext) -> Principal:
        if not self.auth.enabled:
            return self.auth.principal(None)
        try:
            return self.auth.principal(context.invocation_metadata())
        except AuthError as exc:
            await context.abort(exc.code, exc.message)
            raise  # unreachable: abort raises

    @staticmethod
    async def _check(request: object, context: grpc.aio.ServicerContext) -> None:
        if isinstance(request, Malformed):
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"malformed {request.type_name}: {request.reason}"
            )

    async def _manage(self, request: Any, context: grpc.aio.ServicerContext, what: str) -> NodeRecord:
        await self._check(request, context)
        principal = await self._principal(context)
        if not principal.may_manage():
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"a {principal.role} token may not {what} nodes (admin only)",
            )
        rec = self.state.registry.get(request.node_id)
        if rec is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown node {shown(request.node_id)}")
        assert rec is not None
        return rec

    # --- ingest -----------------------------------------------------------------------------
    async def Ingest(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        """One agent's stream; messages arrive as bytes (see ``IngestSession.handle_bytes``)."""
        principal = await self._principal(context)
        if principal.role == ROUTER:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED, "a router token may only query (not Ingest)"
            )
        if self.shutting_down:
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        await self._check_streams(context)
        outbox = Outbox(context)
        session = IngestSession(self.state, principal, outbox.put, outbox.ack)
        self.state.metrics.streams.inc()
        task = asyncio.current_task()
        if task is not None:
            self._ingest_tasks.add(task)
        messages = aiter(request_iterator)
        try:
            first = await self._first_message(messages, context)
            if first is None or not await self._handle(session, context, outbox, first):
                return
            async for data in messages:
                if not await self._handle(session, context, outbox, data):
                    return
            await outbox.drain()
        except asyncio.CancelledError:
            if not self.shutting_down:
                raise
            # Cancelled by shutdown_streams: end the stream with a status agents fail over on. A
            # write still in flight would make gRPC refuse the status, so let the writer finish first.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(outbox.drain(), SHUTDOWN_DRAIN)
            await context.abort(grpc.StatusCode.UNAVAILABLE, SHUTTING_DOWN)
        finally:
            if task is not None:
                self._ingest_tasks.discard(task)
            session.close()
            outbox.close()
            self.state.metrics.streams.dec()

    async def Reserve(self, request_iterator: AsyncIterator[Any],
                      context: grpc.aio.ServicerContext) -> pb.ReserveSummary:
        """One router's reservations (:mod:`kvcoord.coordinator.reservations`); its end drops them."""
        await self._principal(context)
        n = await take_stream(self.state.reservations, request_iterator, self.state.log_once)
        return pb.ReserveSummary(received=n)

    async def _check_streams(self, context: grpc.aio.ServicerContext) -> None:
        """Refuse a stream past ``max_streams`` (as Redis' ``maxclients``): RESOURCE_EXHAUSTED, counted."""
        limit = self.state.config.limits.max_streams
        open_streams = len(self._ingest_tasks) + self.state.local_feeds
        if open_streams >= limit:
            self.state.metrics.stream_refused("max_streams")
            self.state.log_once("refused:max_streams", logging.WARNING,
                                "ingest stream from %s refused: %d streams open (%d of them registered "
                                "engines relayed here), max_streams is %d (logged once)", context.peer(),
                                open_streams, self.state.local_feeds, limit)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many ingest streams: max_streams is {limit}; retry later")

    async def _first_message(
        self, messages: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> bytes | None:
        """The stream's first message (its Hello), or None when the stream ended. A stream that sends
        nothing within ``hello_timeout_s`` is closed with DEADLINE_EXCEEDED: idle, it would hold memory
        and a ``max_streams`` slot forever."""
        timeout = self.state.config.limits.hello_timeout_s
        try:
            async with asyncio.timeout(timeout):  # not wait_for: shutdown cancels this task (kvcoord.waits)
                return await anext(messages)
        except StopAsyncIteration:
            return None
        except TimeoutError:
            pass
        self.state.metrics.stream_refused("hello_timeout")
        self.state.log_once("refused:hello_timeout", logging.INFO,
                            "ingest stream from %s closed: no Hello within %g s (logged once)",
                            context.peer(), timeout)
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no Hello within hello_timeout_s ({timeout:g} s): send Hello first")
        return None  # unreachable: abort raises

    async def _handle(
        self, session: IngestSession, context: grpc.aio.ServicerContext, outbox: Outbox, data: bytes
    ) -> bool:
        """One message of the stream, its replies queued; False once the stream was aborted."""
        try:
            out = await session.handle_bytes(data)
        except IngestAbort as exc:
            # gRPC keeps the abort's exception, and through its traceback the frames' locals (a staged
            # snapshot can be gigabytes): drop them, and the session's state, before aborting.
            traceback.clear_frames(exc.__traceback__)
            session.close()
            await self._abort_ingest(session, context, outbox, exc)
            return False
        for reply in out:
            outbox.put(reply)
        return True

    async def _abort_ingest(
        self, session: IngestSession, context: grpc.aio.ServicerContext, outbox: Outbox, exc: IngestAbort
    ) -> None:
        peer = session.node_id or context.peer()
        log.info("ingest stream of %s aborted: %s %s", peer, exc.code.name, exc.message)
        await outbox.drain()
        await context.abort(exc.code, exc.message)

    # --- lookup -----------------------------------------------------------------------------
    async def Lookup(
        self, request: pb.LookupRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        t0 = time.perf_counter()
        query = "invalid"
        try:
            resp = await self._lookup(request, context)
            if isinstance(request, pb.LookupRequest):
                query = request.WhichOneof("query") or "none"
            self._unless_abandoned(context)
        except asyncio.CancelledError:
            self.state.metrics.lookups_cancelled.inc()
            raise
        finally:
            # Aborted lookups (bad input, index down) count too, as query="invalid".
            self.state.metrics.lookup_done(query, time.perf_counter() - t0)
        if resp.num_blocks:
            best = max(n.matched_blocks for n in resp.nodes) if resp.nodes else 0
            self.state.metrics.matched_fraction.observe(best / resp.num_blocks)
        return resp

    async def _lookup(
        self, request: pb.LookupRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.LookupResponse:
        await self._check(request, context)
        assert isinstance(request, pb.LookupRequest)
        await self._principal(context)
        remaining = context.time_remaining()
        try:
            return await self._answer(request, 0.0 if remaining is None else max(0.0, remaining - 0.01))
        except LookupFailed as exc:
            self._unless_abandoned(context)
            self.state.metrics.lookup_errors[exc.kind] += 1
            cause = ((CAUSE_METADATA, TOKENIZER_CAUSE),) if exc.kind == TOKENIZER_DOWN else ()
            await context.abort(_LOOKUP_STATUS[exc.kind], exc.message, trailing_metadata=cause)
            raise  # unreachable: abort raises

    def _unless_abandoned(self, context: grpc.aio.ServicerContext) -> None:
        """Raise CancelledError when the client already gave up on this lookup (cancelled, or its deadline
        passed while the answer was computed): nobody waits for the answer, and sending it would fail in
        gRPC's core, which logs an ERROR traceback (``ExecuteBatchError``). gRPC takes a CancelledError as
        the end of a cancelled call; it is counted, as a router's deadline is part of normal work."""
        remaining = context.time_remaining()
        if context.cancelled() or (remaining is not None and remaining <= 0):
            raise asyncio.CancelledError("the client abandoned the lookup")

    async def _answer(self, request: pb.LookupRequest, wait: float = 0.0) -> pb.LookupResponse:
        """``wait``: how long this lookup may wait for another router's hold on its new prefix."""
        lookups, model = self.lookups, request.model
        which = request.WhichOneof("query")
        hashes: Sequence[BlockHash64]
        block_size = num_tokens = 0
        keys: RequestKeys | None
        if which == "tokens":
            q = request.tokens
            try:
                tokens = unpack_tokens(q.token_ids)
            except ValueError as exc:
                raise LookupFailed(INVALID, f"TokenQuery.{exc}") from None
            try:
                keys = RequestKeys(
                    lora_name=q.lora_name if q.HasField("lora_name") else None,
                    lora_path=q.lora_path if q.HasField("lora_path") else None,
                    cache_salt=q.cache_salt if q.HasField("cache_salt") else None,
                    mm_items=tuple(MultiModalItem(m.identifier, m.offset, m.length) for m in q.mm_items),
                    prompt_embeds_digests=tuple(q.prompt_embeds_digests) if q.prompt_embeds_digests else None,
                )
            except (ValueError, TypeError) as exc:
                raise LookupFailed(INVALID, f"cannot hash the query: {exc}") from None
            profile, hashes = lookups.hash_tokens(model, tokens, keys)
            block_size, num_tokens = profile.block_size, len(tokens)
        elif which == "hashes":
            known = lookups.profile(model)
            raw = request.hashes.block_hashes
            lookups.check_blocks(len(raw) // 8, "")
            try:
                hashes = unpack_u64(raw, "HashQuery")
            except InvalidEvent as exc:
                raise LookupFailed(INVALID, str(exc)) from None
            block_size = known.block_size if known is not None else 0
        elif which == "prompt":
            pq = request.prompt
            ids, mm_items = await lookups.tokens_of(model, **_prompt_query(pq))
            tokens = array("I", ids)
            keys = prompt_keys(mm_items, pq.lora_name if pq.HasField("lora_name") else None,
                               pq.cache_salt if pq.HasField("cache_salt") else None)
            profile, hashes = lookups.hash_tokens(model, tokens, keys)
            block_size, num_tokens = profile.block_size, len(tokens)
        else:
            lookups.profile(model)
            raise LookupFailed(INVALID, "LookupRequest needs either tokens or hashes")
        candidates = {(c.node_id, c.dp_rank) for c in request.candidates} or None
        matches = await lookups.match(model, hashes, candidates, request.include_unmatched)
        resp = pb.LookupResponse(model=model, block_size=block_size, num_blocks=len(hashes),
                                 num_tokens=num_tokens)
        if request.want_block_hashes:
            resp.block_hashes = raw if which == "hashes" else pack_u64(hashes)
        add = resp.nodes.add
        for m in matches:
            # Filled in place (nested message constructors would be built, then copied in).
            nm = add(node_id=m.node_id, dp_rank=m.dp_rank, matched_blocks=m.matched_blocks, trust=m.trust,
                     serving_url=m.serving_url, trust_cause=m.trust_cause, pool=m.pool)
            if m.pool:
                nm.pool_tier = self.state.pools.tier(m.pool).name
            tiers, tc = m.tiers, nm.tiers
            if tiers:
                tc.gpu = tiers[0]
                if len(tiers) > 1:
                    tc.cpu = tiers[1]
                    if len(tiers) > 2:
                        tc.storage = tiers[2]
                        if len(tiers) > 3:
                            tc.pool = tiers[3]
            if m.pull is not None:
                nm.pull.node_id, nm.pull.host_port, nm.pull.tier, nm.pull.blocks = m.pull
            load_to_proto(m.load, nm.load)
        await self._reserved(request, hashes, resp, wait)
        return resp

    async def _reserved(self, request: pb.LookupRequest, hashes: Sequence[BlockHash64],
                        resp: pb.LookupResponse, wait: float) -> None:
        """Other routers' reservations into the answer's nodes, after this router's hold on its new prefix
        (its first block no node holds) waited for theirs (:mod:`kvcoord.coordinator.reservations`)."""
        start = max((n.matched_blocks for n in resp.nodes), default=0)
        overlay = await lookup_view(self.state.reservations, request.router_id, request.reserve_id,
                                    request.model, hashes, start, wait)
        for nm in resp.nodes if overlay else ():
            got = overlay.get((nm.node_id, nm.dp_rank))
            if got is not None:
                nm.reserved_blocks, nm.reserved_requests = got.blocks, got.requests
                nm.reserved_prefill_tokens = got.prefill_tokens

    # --- nodes ------------------------------------------------------------------------------
    async def ListNodes(
        self, request: pb.ListNodesRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.ListNodesResponse:
        await self._check(request, context)
        assert isinstance(request, pb.ListNodesRequest)
        await self._principal(context)
        # Routers read load here: the list is marked, not refused, while the index is down.
        return pb.ListNodesResponse(nodes=self._nodes(request.model), index_stale=not self.state.health.up)

    def _nodes(self, model: str = "") -> list[pb.NodeInfo]:
        """Every node the fleet's replicas hold: this replica's own records, and the nodes other
        replicas hold (from the shared directory, with ``replica`` naming the holder)."""
        now, lease = time.monotonic(), self.state.registry.lease
        recs = self.state.registry
        out = {r.node_id: node_info(r, now, lease) for r in recs if not model or r.model == model}
        now_wall = time.time()
        for other in self.state.replicas.remote_nodes():
            if not model or other.model == model:
                out[other.node_id] = remote_node_info(other, now_wall, lease)
        relayed = self.state.relayed_nodes() if self.state.relayed_nodes is not None else {}
        for node_id, node in relayed.items():
            if (model and node.model != model) or node.status == ACTIVE:
                continue
            info = out.get(node_id)
            if info is None:  # its engine never answered (or not for longer than an expired record is kept)
                info = out[node_id] = pb.NodeInfo(node_id=node_id, model=node.model,
                                                  dp_ranks=list(node.dp_ranks), trust=RESYNCING)
            elif info.state != "expired":
                continue  # still in answers, or out of them for a reason of its own
            info.state = node.status
            info.trust_reason = f"registered engine {node.status}: {node.reason}" if node.reason else (
                f"registered engine {node.status}")
        return [with_model_profile(out[k], self.state.config) for k in sorted(out)]

    async def Heartbeat(
        self, request: pb.HeartbeatRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.HeartbeatResponse:
        await self._check(request, context)
        assert isinstance(request, pb.HeartbeatRequest)
        principal = await self._principal(context)
        if principal.role == ROUTER or not principal.may_publish(request.node_id):
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this token may not heartbeat for node {shown(request.node_id)}",
            )
        reg = self.state.registry
        rec = reg.get(request.node_id)
        now = time.monotonic()
        known = (
            rec is not None
            and not rec.expired
            and rec.epoch == request.epoch
            and now - rec.last_heard <= reg.lease
        )
        if known:
            assert rec is not None
            reg.heard(rec)
            if request.HasField("load"):
                rec.load = load_from_proto(request.load)
        return pb.HeartbeatResponse(lease_seconds=reg.lease, known=known)

    async def DrainNode(
        self, request: pb.DrainNodeRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.DrainNodeResponse:
        rec = await self._manage(request, context, "drain")
        assert isinstance(request, pb.DrainNodeRequest)
        self.state.registry.drain(rec.node_id, not request.undrain)
        if request.undrain:
            log.info("node %s: drain ended (served in lookups again)", rec.node_id)
        else:
            log.info("node %s: draining (left out of lookups)", rec.node_id)
        self.state.update_node_gauges()
        return pb.DrainNodeResponse()

    async def RemoveNode(
        self, request: pb.RemoveNodeRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.RemoveNodeResponse:
        rec = await self._manage(request, context, "remove")
        self.state.leases.drop(rec.node_id)
        log.info("node %s: removed", rec.node_id)
        return pb.RemoveNodeResponse()

    # --- stats ------------------------------------------------------------------------------
    async def Stats(
        self, request: pb.StatsRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.StatsResponse:
        await self._check(request, context)
        await self._principal(context)
        st = self.state
        # While the index is down, the last figures known, marked stale (asking would wait on a dead backend).
        stats, stale = await st.stats.exact() if st.health.up else (st.stats.last, True)
        m = st.metrics
        nodes = self._nodes()
        by_state = st.registry.by_state()
        for n in nodes:
            if n.replica:
                by_state[n.state] = by_state.get(n.state, 0) + 1
        resp = pb.StatsResponse(
            index_backend=st.index.backend,
            events_applied=dict(m.applied_by_type),
            events_rejected=dict(m.rejected_by_reason),
            nodes=nodes,
            nodes_by_state=by_state,
            replica_id=st.replicas.replica_id,
            native=",".join(native_paths()),
            hash_mismatches=m.hash_mismatch_total,
            snapshots_requested=m.snapshots_requested_total,
            leases_expired=m.leases_expired_total,
        )
        if stats is not None:
            resp.entries, resp.blocks, resp.index_bytes = stats.entries, stats.blocks, stats.bytes
            resp.blocks_upper_bound = stats.blocks_upper_bound
        resp.index_stats_stale = stale or stats is None
        return resp

    async def Ping(
        self, request: pb.PingRequest | Malformed, context: grpc.aio.ServicerContext
    ) -> pb.PingResponse:
        await self._check(request, context)
        if self.auth.enabled:
            await self._principal(context)
        return pb.PingResponse()
