"""Python client of the coordinator, for routers: ``CoordinatorClient`` (blocking) and
``AsyncCoordinatorClient`` (asyncio), with typed results.

Errors from the coordinator surface as :class:`CoordinatorError` carrying the gRPC status code.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import grpc
import grpc.aio

from kvcoord.load import EXACT, NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.proto.v2 import kvcoord_pb2_grpc as pbg
from kvcoord.router.answer import Candidate, LookupResult, PullSource
from kvcoord.transport import CAUSE_METADATA, ChannelSecurity, open_aio_channel, open_channel
from kvcoord.validate import pack_u64, unpack_u64
from kvcoord.wire import load_from_proto, load_to_proto, pack_tokens

__all__ = [
    "AsyncCoordinatorClient",
    "CoordinatorClient",
    "CoordinatorError",
    "CoordinatorStats",
    "HeartbeatResult",
    "NodeStatus",
]

_UINT64_MAX = (1 << 64) - 1
_NO_LOAD = NodeLoad()


class CoordinatorError(RuntimeError):
    """An RPC failed; ``code`` is the ``grpc.StatusCode``, ``details`` the coordinator's message, ``cause``
    what the coordinator named as the cause (``kvcoord.transport.CAUSE_METADATA``; e.g. ``tokenizer``:
    the model's tokenizer failed, the coordinator did not), "" when it named none."""

    def __init__(self, code: Any, details: str, cause: str = "") -> None:
        self.code = code
        self.details = details
        self.cause = cause
        super().__init__(f"{getattr(code, 'name', code)}: {details}")

    @classmethod
    def from_rpc(cls, exc: Any) -> CoordinatorError:
        cause = ""
        for key, value in exc.trailing_metadata() or ():
            if key == CAUSE_METADATA:
                cause = value.decode() if isinstance(value, bytes) else str(value)
        return cls(exc.code(), exc.details() or "", cause)


# --- results -----------------------------------------------------------------------------------
def lookup_result(msg: pb.LookupResponse) -> LookupResult:
    """The wire answer as the type the placement policies take."""
    nodes = [
        Candidate(n.node_id, n.dp_rank, n.matched_blocks,
                  (n.tiers.gpu, n.tiers.cpu, n.tiers.storage, n.tiers.pool) if n.tiers.pool
                  else (n.tiers.gpu, n.tiers.cpu, n.tiers.storage),
                  load_from_proto(n.load), n.serving_url, n.trust or EXACT, n.trust_cause, n.reserved_blocks,
                  NodeLoad(running_requests=n.reserved_requests, prefill_tokens=n.reserved_prefill_tokens)
                  if n.reserved_requests or n.reserved_prefill_tokens else _NO_LOAD,
                  n.pool, n.pool_tier or "STORAGE",
                  PullSource(n.pull.node_id, n.pull.host_port, n.pull.tier, n.pull.blocks)
                  if n.HasField("pull") else None)
        for n in msg.nodes
    ]
    hashes = tuple(unpack_u64(msg.block_hashes, "LookupResponse")) if msg.block_hashes else ()
    return LookupResult(msg.model, msg.block_size, msg.num_blocks, nodes, msg.num_tokens, hashes)


@dataclass(frozen=True, slots=True)
class NodeStatus:
    node_id: str
    model: str
    dp_ranks: tuple[int, ...]
    state: str
    epoch: int
    last_seq: int
    last_heartbeat_age_seconds: float
    load: NodeLoad
    hash_mismatch: bool
    hash_mismatch_reason: str
    hash_profile: dict[str, Any] | None
    replica: str = ""
    """Id of the coordinator replica holding the node's stream; empty: the one that answered."""
    serving_url: str = ""
    """The engine's own URL, as its agent announced it; empty when unknown."""
    trust: str = EXACT
    """``exact``, ``resyncing``, ``degraded`` or ``approximate`` (see docs/semantics.md);
    ``trust_reason`` says why."""
    trust_reason: str = ""
    trust_cause: str = ""
    """Why degraded, for machines: ``hash_mismatch`` or ``history_lost``; empty otherwise."""
    model_profile: dict[str, Any] | None = None
    """The profile the coordinator hashes the model's tokens with: algo, block_size, style and ``source``
    (``configured``, or ``learned`` from the events); None while the model has none."""
    role: str = ""
    """Its P/D role, as its Hello or ``/register`` declared it: ``prefill``, ``decode``, ``both``; "" none."""

    @classmethod
    def from_proto(cls, n: pb.NodeInfo) -> NodeStatus:
        hp = n.hash_profile
        profile = ({"algo": hp.algo, "block_size": hp.block_size, "style": hp.style,
                    "none_hash_fingerprint": hp.none_hash_fingerprint, "engine_release": hp.engine_release}
                   if n.HasField("hash_profile") else None)
        mp = n.model_profile
        model_profile = ({"algo": mp.algo, "block_size": mp.block_size, "style": mp.style,
                          "source": n.model_profile_source} if n.HasField("model_profile") else None)
        return cls(n.node_id, n.model, tuple(n.dp_ranks), n.state, n.epoch, n.last_seq,
                   n.last_heartbeat_age_seconds, load_from_proto(n.load), n.hash_mismatch,
                   n.hash_mismatch_reason, profile, n.replica, n.serving_url, n.trust or EXACT,
                   n.trust_reason, n.trust_cause, model_profile, n.role)

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "model": self.model, "dp_ranks": list(self.dp_ranks),
                "state": self.state, "epoch": self.epoch, "last_seq": self.last_seq,
                "last_heartbeat_age_seconds": round(self.last_heartbeat_age_seconds, 3),
                "load": self.load.to_json(),
                "hash_mismatch": self.hash_mismatch, "hash_mismatch_reason": self.hash_mismatch_reason,
                "hash_profile": self.hash_profile, "replica": self.replica,
                "trust": self.trust, "trust_reason": self.trust_reason, "trust_cause": self.trust_cause,
                "model_profile": self.model_profile, "role": self.role}


@dataclass(frozen=True, slots=True)
class CoordinatorStats:
    index_backend: str
    entries: int
    blocks: int
    index_bytes: int
    events_applied: dict[str, int]
    events_rejected: dict[str, int]
    nodes: list[NodeStatus]
    nodes_by_state: dict[str, int]
    hash_mismatches: int
    snapshots_requested: int
    leases_expired: int
    blocks_upper_bound: bool = False
    """``blocks`` is an upper bound, not an exact distinct count."""
    index_stats_stale: bool = False
    """The index did not answer: entries, blocks and index_bytes are the last figures known."""
    replica_id: str = ""
    """The answering replica's id (other replicas' nodes name theirs in ``NodeStatus.replica``)."""

    @classmethod
    def from_proto(cls, m: pb.StatsResponse) -> CoordinatorStats:
        return cls(m.index_backend, m.entries, m.blocks, m.index_bytes, dict(m.events_applied),
                   dict(m.events_rejected), [NodeStatus.from_proto(n) for n in m.nodes],
                   dict(m.nodes_by_state), m.hash_mismatches, m.snapshots_requested, m.leases_expired,
                   m.blocks_upper_bound, m.index_stats_stale, m.replica_id)

    def to_json(self) -> dict[str, Any]:
        return {"index_backend": self.index_backend, "entries": self.entries, "blocks": self.blocks,
                "index_bytes": self.index_bytes, "events_applied": dict(sorted(self.events_applied.items())),
                "events_rejected": dict(sorted(self.events_rejected.items())),
                "nodes": [n.to_json() for n in self.nodes],
                "nodes_by_state": dict(sorted(self.nodes_by_state.items())),
                "hash_mismatches": self.hash_mismatches, "snapshots_requested": self.snapshots_requested,
                "leases_expired": self.leases_expired, "blocks_upper_bound": self.blocks_upper_bound,
                "index_stats_stale": self.index_stats_stale, "replica_id": self.replica_id}


@dataclass(frozen=True, slots=True)
class HeartbeatResult:
    lease_seconds: float
    known: bool
    """False: the coordinator no longer knows the node; it must reconnect with Hello and a snapshot."""

    @classmethod
    def from_proto(cls, m: pb.HeartbeatResponse) -> HeartbeatResult:
        return cls(m.lease_seconds, m.known)


# --- requests --------------------------------------------------------------------------------
class _MMItem(Protocol):
    @property
    def identifier(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def length(self) -> int: ...


MMItemLike = _MMItem | tuple[str, int, int]


def _set_optional(msg: Any, **fields: object) -> None:
    """Set the ``optional`` fields that were given (None: left unset, so the coordinator's default holds)."""
    for name, value in fields.items():
        if value is not None:
            setattr(msg, name, value)


def check_lookup_query(model: str, tokens: object, hashes: object, prompt: object, messages: object,
                       chat_options: bool) -> None:
    """``ValueError`` unless a lookup names a model and exactly one of tokens, hashes, prompt or messages,
    with chat options (tools, template kwargs, generation prompt) for messages only; for both transports
    (:mod:`kvcoord.router.http_lookup`)."""
    if not model:
        raise ValueError("model must be non-empty")
    given = sum(x is not None for x in (tokens, hashes, prompt, messages))
    if given != 1:
        raise ValueError("give exactly one of tokens, hashes, prompt or messages")
    if chat_options and messages is None:
        raise ValueError("tools, chat_template_kwargs and add_generation_prompt apply to chat messages only")


def build_lookup_request(
    model: str,
    *,
    tokens: Sequence[int] | None = None,
    hashes: Sequence[int] | None = None,
    lora_name: str | None = None,
    lora_path: str | None = None,
    cache_salt: str | None = None,
    mm_items: Sequence[MMItemLike] = (),
    prompt_embeds_digests: Sequence[bytes] | None = None,
    candidates: Iterable[tuple[str, int]] | None = None,
    include_unmatched: bool = False,
    want_block_hashes: bool = False,
    prompt: str | None = None,
    messages: Sequence[Mapping[str, Any]] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    chat_template_kwargs: Mapping[str, Any] | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool | None = None,
    router_id: str = "",
    reserve_id: str = "",
) -> pb.LookupRequest:
    """Validate locally (exactly one of tokens, hashes, prompt or messages; uint64 values) and build the
    request. A prompt or chat is tokenized by the coordinator with the model's tokenizer, as the engine's
    OpenAI server would (``add_special_tokens`` defaults to True for a prompt, False for a chat).
    ``router_id`` / ``reserve_id``: a router that reserves its picks (:class:`ReserveStream
    <kvcoord.gateway.reserve.ReserveStream>`), and the request id its reservation of this pick will carry."""
    chat_options = tools is not None or chat_template_kwargs is not None or add_generation_prompt is not None
    check_lookup_query(model, tokens, hashes, prompt, messages, chat_options)
    req = pb.LookupRequest(model=model)
    if prompt is not None or messages is not None:
        if lora_path or mm_items or prompt_embeds_digests:
            raise ValueError("lora_path, multimodal items and prompt embeds apply to token queries only")
        pq = req.prompt
        if prompt is not None:
            pq.prompt = prompt
        else:
            pq.messages_json = json.dumps(list(messages or ()))
        if tools is not None:
            pq.tools_json = json.dumps(list(tools))
        if chat_template_kwargs is not None:
            pq.chat_template_kwargs_json = json.dumps(dict(chat_template_kwargs))
        _set_optional(pq, add_special_tokens=add_special_tokens, add_generation_prompt=add_generation_prompt,
                      lora_name=lora_name, cache_salt=cache_salt)
        req.prompt.SetInParent()
    elif tokens is not None:
        q = req.tokens
        q.token_ids = pack_tokens(tokens)
        _set_optional(q, lora_name=lora_name, lora_path=lora_path, cache_salt=cache_salt)
        for item in mm_items:
            ident, off, length = (item if isinstance(item, tuple)
                                  else (item.identifier, item.offset, item.length))
            if off < 0 or length < 0:
                raise ValueError(f"multimodal item {ident!r}: offset and length must be >= 0")
            q.mm_items.add(identifier=ident, offset=off, length=length)
        if prompt_embeds_digests is not None:
            q.prompt_embeds_digests.extend(prompt_embeds_digests)
        req.tokens.SetInParent()
    else:
        assert hashes is not None
        if lora_name or lora_path or cache_salt or mm_items or prompt_embeds_digests:
            raise ValueError("lora/cache_salt/multimodal keys apply to token queries only "
                             "(block hashes already include them)")
        req.hashes.block_hashes = pack_u64(hashes)
        req.hashes.SetInParent()
    for node_id, rank in candidates or ():
        req.candidates.add(node_id=node_id, dp_rank=rank)
    req.include_unmatched = include_unmatched
    req.want_block_hashes = want_block_hashes
    if router_id:
        req.router_id = router_id
        req.reserve_id = reserve_id
    return req


# --- calls: each RPC's request and answer, once for both clients -----------------------------
_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class _Rpc(Generic[_T]):
    """One call as both clients make it: the method, its request, and how its answer becomes the result."""

    name: str
    request: Any
    decode: Callable[[Any], _T]


def _nothing(_resp: object) -> None:
    """The result of a call whose success is its answer."""


def _same(resp: pb.LookupResponse) -> pb.LookupResponse:
    """``lookup_raw``'s result: the answer as it came."""
    return resp


def _lookup(model: str, query: dict[str, Any]) -> _Rpc[LookupResult]:
    return _Rpc("Lookup", build_lookup_request(model, **query), lookup_result)


def _stats() -> _Rpc[CoordinatorStats]:
    return _Rpc("Stats", pb.StatsRequest(), CoordinatorStats.from_proto)


def _list_nodes(model: str) -> _Rpc[list[NodeStatus]]:
    return _Rpc("ListNodes", pb.ListNodesRequest(model=model),
                lambda resp: [NodeStatus.from_proto(n) for n in resp.nodes])


def _heartbeat(node_id: str, epoch: int, load: NodeLoad | None) -> _Rpc[HeartbeatResult]:
    req = pb.HeartbeatRequest(node_id=node_id, epoch=epoch, load=load_to_proto(load or NodeLoad()))
    return _Rpc("Heartbeat", req, HeartbeatResult.from_proto)


def _drain(node_id: str, undrain: bool) -> _Rpc[None]:
    return _Rpc("DrainNode", pb.DrainNodeRequest(node_id=node_id, undrain=undrain), _nothing)


def _remove(node_id: str) -> _Rpc[None]:
    return _Rpc("RemoveNode", pb.RemoveNodeRequest(node_id=node_id), _nothing)


def _ping() -> _Rpc[None]:
    return _Rpc("Ping", pb.PingRequest(), _nothing)


# --- retries: which replica, how often, until when -------------------------------------------
IDEMPOTENT = frozenset({"Lookup", "Stats", "ListNodes", "Ping"})
"""The calls a client may repeat on another replica: they only read."""
RETRY_PAUSE = 0.05
"""Seconds between rounds over all replicas, while every one of them is unavailable."""


def replica_addresses(address: str | Sequence[str]) -> list[str]:
    """``"h1:p1,h2:p2"`` or a list: the coordinator replicas, in order of preference."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    out = [a.strip() for a in parts if a.strip()]
    if not out:
        raise ValueError("no coordinator address given")
    return out


class _Attempts:
    """One call's attempts, the retry policy of both clients' loops. A client asks the replica that last
    answered; each attempt gets what is left of the call's deadline; an idempotent call that finds its
    replica UNAVAILABLE (refused, reset, restarting) is repeated on the next one until that deadline,
    pausing ``RETRY_PAUSE`` after each round over all of them; other errors, and every error of a call
    that writes, are the answer."""

    __slots__ = ("_client", "_name", "_tried", "deadline")

    def __init__(self, client: _Connected[Any], name: str, timeout: float) -> None:
        self._client = client
        self._name = name
        self._tried = 0
        self.deadline = time.monotonic() + timeout

    def method(self) -> Any:
        """The stub's method on the replica to ask now."""
        return getattr(self._client._stubs[self._client._current], self._name)

    def time_left(self) -> float:
        return max(0.001, self.deadline - time.monotonic())

    def pause_after(self, exc: Any) -> float:
        """After a failed attempt: the pause before the next (which goes to the next replica), or
        :class:`CoordinatorError` raised: the call's answer."""
        self._tried += 1
        client = self._client
        count = len(client._stubs)
        if self._name not in IDEMPOTENT or count < 2 or exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise CoordinatorError.from_rpc(exc) from None
        pause = 0.0 if self._tried % count else RETRY_PAUSE
        if time.monotonic() + pause >= self.deadline:
            raise CoordinatorError.from_rpc(exc) from None
        client._current = (client._current + 1) % count
        return pause


# --- clients: thin transports that run the calls above -----------------------------------------
_Channel = TypeVar("_Channel", grpc.Channel, grpc.aio.Channel)


class _Connected(Generic[_Channel]):
    """What both clients hold: the replicas, the security, the default timeout, and a channel and a stub
    per replica (opened by ``open_``)."""

    def __init__(self, address: str | Sequence[str], security: ChannelSecurity | None, timeout: float,
                 open_: Callable[[str, ChannelSecurity, int], _Channel], max_message_bytes: int) -> None:
        addresses = replica_addresses(address)
        self.address = ",".join(addresses)
        self.security = security or ChannelSecurity()
        self.timeout = timeout
        self._channels = [open_(a, self.security, max_message_bytes) for a in addresses]
        self._stubs = [pbg.CoordinatorStub(c) for c in self._channels]
        self._current = 0
        """The replica asked first: the last one that answered."""
        self._md = self.security.metadata() or None

    def _attempts(self, rpc: _Rpc[Any], timeout: float | None) -> _Attempts:
        """``timeout`` (seconds) overrides the client's for this call."""
        return _Attempts(self, rpc.name, self.timeout if timeout is None else timeout)


class CoordinatorClient(_Connected[grpc.Channel]):
    """Blocking client. ``timeout`` (seconds) bounds every call. ``address`` may name several replicas
    (``"h1:p1,h2:p2"`` or a list): reads go to one and move to the next while it is unavailable."""

    def __init__(self, address: str | Sequence[str], *, security: ChannelSecurity | None = None,
                 timeout: float = 5.0, max_message_bytes: int = 64 << 20) -> None:
        super().__init__(address, security, timeout, open_channel, max_message_bytes)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> CoordinatorClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, rpc: _Rpc[_T]) -> _T:
        attempts = self._attempts(rpc, None)
        while True:
            try:
                resp = attempts.method()(rpc.request, timeout=attempts.time_left(), metadata=self._md)
            except grpc.RpcError as exc:
                time.sleep(attempts.pause_after(exc))
            else:
                return rpc.decode(resp)

    def lookup(self, model: str, **query: Any) -> LookupResult:
        """See :func:`build_lookup_request` for the query keywords (tokens= or hashes=, keys, candidates)."""
        return self._run(_lookup(model, query))

    def stats(self) -> CoordinatorStats:
        return self._run(_stats())

    def list_nodes(self, model: str = "") -> list[NodeStatus]:
        return self._run(_list_nodes(model))

    def heartbeat(self, node_id: str, epoch: int, load: NodeLoad | None = None) -> HeartbeatResult:
        return self._run(_heartbeat(node_id, epoch, load))

    def drain(self, node_id: str, *, undrain: bool = False) -> None:
        """Leave ``node_id`` out of lookups (``undrain=True``: serve it again)."""
        self._run(_drain(node_id, undrain))

    def remove(self, node_id: str) -> None:
        self._run(_remove(node_id))

    def ping(self) -> None:
        self._run(_ping())


class AsyncCoordinatorClient(_Connected[grpc.aio.Channel]):
    """asyncio client; same methods as :class:`CoordinatorClient`, as coroutines."""

    def __init__(self, address: str | Sequence[str], *, security: ChannelSecurity | None = None,
                 timeout: float = 5.0, max_message_bytes: int = 64 << 20) -> None:
        super().__init__(address, security, timeout, open_aio_channel, max_message_bytes)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> AsyncCoordinatorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _run(self, rpc: _Rpc[_T], timeout: float | None = None) -> _T:
        attempts = self._attempts(rpc, timeout)
        while True:
            try:
                resp = await attempts.method()(rpc.request, timeout=attempts.time_left(), metadata=self._md)
            except grpc.aio.AioRpcError as exc:
                await asyncio.sleep(attempts.pause_after(exc))
            else:
                return rpc.decode(resp)

    async def lookup(self, model: str, *, timeout: float | None = None, **query: Any) -> LookupResult:
        """``timeout`` (seconds) overrides the client's for this call."""
        return await self._run(_lookup(model, query), timeout)

    async def lookup_raw(self, request: pb.LookupRequest) -> pb.LookupResponse:
        """A prebuilt request, without result conversion (for hot paths and benchmarks)."""
        return await self._run(_Rpc("Lookup", request, _same))

    def reserve_stream(self, batches: AsyncIterator[pb.ReserveBatch]) -> Any:
        """Open a ``Reserve`` stream to the replica lookups go to now (the call, to await its end)."""
        return self._stubs[self._current].Reserve(batches, metadata=self._md)

    async def stats(self) -> CoordinatorStats:
        return await self._run(_stats())

    async def list_nodes(self, model: str = "") -> list[NodeStatus]:
        return await self._run(_list_nodes(model))

    async def heartbeat(self, node_id: str, epoch: int, load: NodeLoad | None = None) -> HeartbeatResult:
        return await self._run(_heartbeat(node_id, epoch, load))

    async def drain(self, node_id: str, *, undrain: bool = False) -> None:
        """Leave ``node_id`` out of lookups (``undrain=True``: serve it again)."""
        await self._run(_drain(node_id, undrain))

    async def remove(self, node_id: str) -> None:
        await self._run(_remove(node_id))

    async def ping(self, *, timeout: float | None = None) -> None:
        await self._run(_ping(), timeout)
