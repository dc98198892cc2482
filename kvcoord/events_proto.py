"""Lossless codec between the event model (:mod:`kvcoord.events`) and the ``kvcoord.v1`` protobuf messages.

Agents convert engine events to protobuf before streaming them; the coordinator converts them back
and hands the model to the index. Hashes keep the form the engine published (uint64 ints in
``block_hashes``, raw digests in ``block_digests``) so that the coordinator can verify them against
token ids; ``extra_keys`` travel as msgpack so tuples, bytes, ints and strings survive exactly as vLLM
publishes them.

Not carried by ``kvcoord.v1`` (yet): ``locality``, ``ownership``, ``session_id`` and
``lookahead_token_ids``; :func:`event_to_proto` drops them (they do not affect the index).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import msgspec

from kvcoord.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineHash,
    ExtraKeys,
    KVEvent,
    KVEventBatch,
    Tier,
)
from kvcoord.proto.v1 import kvcoord_pb2 as pb

__all__ = [
    "batch_from_proto",
    "batch_to_proto",
    "event_from_proto",
    "event_to_proto",
    "events_from_proto",
    "events_to_proto",
    "tier_from_proto",
    "tier_to_proto",
]

_UINT64_MAX = (1 << 64) - 1
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


# --- hashes ------------------------------------------------------------------------------------
def _hash_form(hashes: Sequence[EngineHash], what: str) -> tuple[list[int], list[bytes]]:
    """Split a hash list into (ints, digests); exactly one may be non-empty."""
    ints: list[int] = []
    digests: list[bytes] = []
    for h in hashes:
        if isinstance(h, bytes):
            digests.append(h)
        elif isinstance(h, int) and not isinstance(h, bool):
            if not 0 <= h <= _UINT64_MAX:
                raise ValueError(f"{what}: hash {h} is outside uint64")
            ints.append(h)
        else:
            raise ValueError(f"{what}: hash must be int or bytes, not {type(h).__name__}")
    if ints and digests:
        raise ValueError(f"{what}: mixes int and bytes hashes in one event")
    return ints, digests


def _hashes_from(ints: Sequence[int], digests: Sequence[bytes], what: str) -> tuple[EngineHash, ...]:
    if len(ints) and len(digests):
        raise ValueError(
            f"{what}: both block_hashes ({len(ints)}) and block_digests ({len(digests)}) are set"
        )
    if len(digests):
        for i, d in enumerate(digests):
            if not d:
                raise ValueError(f"{what}: block_digests[{i}] is empty")
        return tuple(bytes(d) for d in digests)
    return tuple(int(h) for h in ints)


def _check_range(value: int | None, lo_hi: tuple[int, int], what: str) -> None:
    if value is not None and not lo_hi[0] <= value <= lo_hi[1]:
        raise ValueError(f"{what} {value} is out of range")


# --- extra keys --------------------------------------------------------------------------------
def _tupleize(value: Any) -> Any:
    """msgpack arrays come back as lists; the model (like vLLM's structs) uses tuples."""
    if isinstance(value, list):
        return tuple(_tupleize(v) for v in value)
    if isinstance(value, dict):
        return {_tupleize(k): _tupleize(v) for k, v in value.items()}
    return value


def _extra_keys_to_bytes(extra_keys: tuple[ExtraKeys, ...] | None) -> bytes:
    if extra_keys is None:
        return b""
    try:
        return _ENCODER.encode(extra_keys)
    except (TypeError, OverflowError, msgspec.EncodeError) as exc:
        raise ValueError(f"BlockStored.extra_keys cannot be encoded: {exc}") from exc


def _extra_keys_from_bytes(data: bytes) -> tuple[ExtraKeys, ...] | None:
    if not data:
        return None
    try:
        raw = _DECODER.decode(data)
    except msgspec.DecodeError as exc:
        raise ValueError(f"BlockStored.extra_keys_msgpack is not valid msgpack: {exc}") from exc
    if not isinstance(raw, list):
        raise ValueError(f"BlockStored.extra_keys_msgpack must hold an array, not {type(raw).__name__}")
    out: list[ExtraKeys] = []
    for i, item in enumerate(raw):
        if item is not None and not isinstance(item, list):
            raise ValueError(
                f"BlockStored.extra_keys[{i}] must be an array or nil, not {type(item).__name__}"
            )
        out.append(_tupleize(item))
    return tuple(out)


# --- tiers -------------------------------------------------------------------------------------
def tier_to_proto(tier: Tier) -> pb.Tier.ValueType:
    """Model tier -> proto enum value (the numbers are the same by design)."""
    return pb.Tier.ValueType(int(tier))


def tier_from_proto(value: int) -> Tier:
    """Proto enum value -> model tier; ``ValueError`` for a number this build does not know."""
    try:
        return Tier(value)
    except ValueError:
        raise ValueError(f"unknown tier {value}") from None


# --- events ------------------------------------------------------------------------------------
def event_to_proto(event: KVEvent) -> pb.KVEvent:
    """Model event -> ``kvcoord.v1.KVEvent``. Raises ``ValueError`` for values the wire cannot carry."""
    if isinstance(event, BlockStored):
        return pb.KVEvent(stored=_stored_to_proto(event))
    if isinstance(event, BlockRemoved):
        ints, digests = _hash_form(event.block_hashes, "BlockRemoved.block_hashes")
        _check_range(event.group_idx, _INT32, "BlockRemoved.group_idx")
        removed = pb.BlockRemoved(block_hashes=ints, block_digests=digests, medium=event.medium or "")
        if event.group_idx is not None:
            removed.group_idx = event.group_idx
        return pb.KVEvent(removed=removed)
    if isinstance(event, AllBlocksCleared):
        return pb.KVEvent(cleared=pb.AllBlocksCleared())
    raise ValueError(f"not a KV event: {type(event).__name__}")


def _stored_to_proto(ev: BlockStored) -> pb.BlockStored:
    ints, digests = _hash_form(ev.block_hashes, "BlockStored.block_hashes")
    if ev.block_size < 0 or ev.block_size > 0xFFFFFFFF:
        raise ValueError(f"BlockStored.block_size {ev.block_size} is out of range")
    for t in ev.token_ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _UINT64_MAX:
            raise ValueError(f"BlockStored.token_ids: {t!r} is not a uint64 token id")
    _check_range(ev.lora_id, _INT64, "BlockStored.lora_id")
    _check_range(ev.group_idx, _INT32, "BlockStored.group_idx")
    _check_range(ev.kv_cache_spec_sliding_window, _INT32, "BlockStored.kv_cache_spec_sliding_window")
    msg = pb.BlockStored(
        block_hashes=ints,
        block_digests=digests,
        token_ids=ev.token_ids,
        block_size=ev.block_size,
        medium=ev.medium or "",
        extra_keys_msgpack=_extra_keys_to_bytes(ev.extra_keys),
    )
    parent = ev.parent_block_hash
    if parent is not None:
        p_ints, p_digests = _hash_form((parent,), "BlockStored.parent_block_hash")
        if p_ints:
            msg.parent_block_hash = p_ints[0]
        else:
            msg.parent_block_digest = p_digests[0]
    if ev.lora_id is not None:
        msg.lora_id = ev.lora_id
    if ev.lora_name is not None:
        msg.lora_name = ev.lora_name
    if ev.group_idx is not None:
        msg.group_idx = ev.group_idx
    if ev.kv_cache_spec_kind is not None:
        msg.kv_cache_spec_kind = ev.kv_cache_spec_kind
    if ev.kv_cache_spec_sliding_window is not None:
        msg.kv_cache_spec_sliding_window = ev.kv_cache_spec_sliding_window
    return msg


def event_from_proto(msg: pb.KVEvent) -> KVEvent:
    """``kvcoord.v1.KVEvent`` -> model event. Raises ``ValueError`` naming what is inconsistent."""
    kind = msg.WhichOneof("event")
    if kind == "stored":
        return _stored_from_proto(msg.stored)
    if kind == "removed":
        r = msg.removed
        return BlockRemoved(
            block_hashes=_hashes_from(r.block_hashes, r.block_digests, "BlockRemoved"),
            medium=r.medium or None,
            group_idx=r.group_idx if r.HasField("group_idx") else None,
        )
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError("KVEvent has no event set")


def _stored_from_proto(s: pb.BlockStored) -> BlockStored:
    hashes = _hashes_from(s.block_hashes, s.block_digests, "BlockStored")
    has_int_parent = s.HasField("parent_block_hash")
    has_digest_parent = s.HasField("parent_block_digest")
    if has_int_parent and has_digest_parent:
        raise ValueError("BlockStored: both parent_block_hash and parent_block_digest are set")
    parent: EngineHash | None = None
    if has_int_parent:
        parent = int(s.parent_block_hash)
    elif has_digest_parent:
        if not s.parent_block_digest:
            raise ValueError("BlockStored: parent_block_digest is empty")
        parent = bytes(s.parent_block_digest)
    n_tokens = len(s.token_ids)
    if n_tokens and s.block_size and n_tokens % s.block_size:
        raise ValueError(
            f"BlockStored: {n_tokens} token_ids is not a multiple of block_size {s.block_size}"
        )
    if n_tokens and not s.block_size:
        raise ValueError(f"BlockStored: {n_tokens} token_ids but block_size is 0")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tuple(s.token_ids),
        block_size=s.block_size,
        lora_id=s.lora_id if s.HasField("lora_id") else None,
        medium=s.medium or None,
        lora_name=s.lora_name if s.HasField("lora_name") else None,
        extra_keys=_extra_keys_from_bytes(s.extra_keys_msgpack),
        group_idx=s.group_idx if s.HasField("group_idx") else None,
        kv_cache_spec_kind=s.kv_cache_spec_kind if s.HasField("kv_cache_spec_kind") else None,
        kv_cache_spec_sliding_window=(
            s.kv_cache_spec_sliding_window if s.HasField("kv_cache_spec_sliding_window") else None
        ),
    )


def events_to_proto(events: Iterable[KVEvent]) -> list[pb.KVEvent]:
    """Convert a sequence of events; the first bad one raises ``ValueError`` with its index."""
    out: list[pb.KVEvent] = []
    for i, ev in enumerate(events):
        try:
            out.append(event_to_proto(ev))
        except ValueError as exc:
            raise ValueError(f"event {i}: {exc}") from None
    return out


def events_from_proto(msgs: Iterable[pb.KVEvent]) -> tuple[KVEvent, ...]:
    """Decode a whole list first, so a bad event rejects the batch before anything is applied."""
    out: list[KVEvent] = []
    for i, m in enumerate(msgs):
        try:
            out.append(event_from_proto(m))
        except ValueError as exc:
            raise ValueError(f"event {i}: {exc}") from None
    return tuple(out)


# --- batches -----------------------------------------------------------------------------------
def batch_to_proto(batch: KVEventBatch, seq: int) -> pb.EventBatch:
    """Model batch -> numbered ``EventBatch``. A missing dp rank is rank 0 (as vLLM treats it)."""
    rank = batch.data_parallel_rank or 0
    if not 0 <= rank <= 0xFFFFFFFF:
        raise ValueError(f"data_parallel_rank {rank} is out of range")
    if not 0 <= seq <= _UINT64_MAX:
        raise ValueError(f"seq {seq} is out of range")
    return pb.EventBatch(seq=seq, ts=batch.ts, dp_rank=rank, events=events_to_proto(batch.events))


def batch_from_proto(msg: pb.EventBatch) -> KVEventBatch:
    """``EventBatch`` -> model batch (its ``seq`` is the stream's business, not the model's)."""
    return KVEventBatch(ts=msg.ts, events=events_from_proto(msg.events), data_parallel_rank=msg.dp_rank)
