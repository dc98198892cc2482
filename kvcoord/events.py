"""The typed KV-event model shared by every layer, and its codecs.

The model mirrors vLLM's ``vllm/distributed/kv_events.py`` field for field, so that nothing an
engine publishes is lost between the wire and the index. Hashes keep the form the engine
published (``int`` or raw digest ``bytes``); the index reduces them with
:func:`kvcoord.hashing.to_block_hash64`.

Codecs: :func:`decode_vllm_batch` / :func:`encode_vllm_batch` speak the msgpack wire format of
vLLM's ``ZmqEventPublisher`` (map-encoded events since 0.24, positional arrays before) and of
SGLang's copy of it. Decoding is typed msgspec decoding straight into wire structs, so a bad
frame is rejected in C before any Python object of ours exists.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

EngineHash: TypeAlias = int | bytes
"""A block hash as an engine publishes it: uint64 int, or the raw digest."""

ExtraKeys: TypeAlias = tuple[object, ...] | None
"""One block's published extra keys (LoRA name, ``(mm_id, offset)`` pairs, cache salt, digest)."""


class Tier(enum.IntEnum):
    """Where a node keeps a block. Small ints so the index can pack them into bitmasks."""

    GPU = 0
    CPU = 1
    STORAGE = 2


_MEDIUM_ALIASES: dict[str, Tier] = {
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "DEVICE": Tier.GPU,
    "HBM": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "HOST": Tier.CPU,
    "DRAM": Tier.CPU,
    "STORAGE": Tier.STORAGE,
    "DISK": Tier.STORAGE,
    "SSD": Tier.STORAGE,
    "LOCAL_FILE": Tier.STORAGE,
    "FILE": Tier.STORAGE,
    "REMOTE": Tier.STORAGE,
}


def normalize_medium(medium: str | None) -> Tier:
    """Map an engine's ``medium`` string to a tier; a missing medium means GPU.

    Raises ``ValueError`` for a medium nobody has published, rather than guessing a tier.
    """
    if medium is None:
        return Tier.GPU
    tier = _MEDIUM_ALIASES.get(medium.strip().upper())
    if tier is None:
        raise ValueError(f"unknown medium {medium!r} (known: {', '.join(sorted(_MEDIUM_ALIASES))})")
    return tier


FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention"})
"""Group kinds whose blocks are prefix-matchable. Events of other groups (sliding window,
Mamba, …) describe caches that cannot serve a prefix hit on their own, so the index skips them."""


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks that became cached (and reusable) on one node, in chain order."""

    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[ExtraKeys, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None

    def is_prefix_indexable(self) -> bool:
        """True for full-attention groups (kind absent, ``full_attention`` or ``mla_attention``)."""
        return self.kv_cache_spec_kind is None or self.kv_cache_spec_kind in FULL_ATTENTION_KINDS


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from one medium of one node."""

    block_hashes: tuple[EngineHash, ...]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The node dropped its whole prefix cache (reset, or restart)."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """One published batch: a timestamp (seconds since the epoch), events, and the DP rank."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None


# --- msgpack codec (vLLM / SGLang ZMQ payloads) -------------------------------------------------

UINT64_MAX = (1 << 64) - 1


class EventDecodeError(ValueError):
    """A payload that is not a valid KV-event batch. ``kind`` is a short label for counters/logs."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


_UHash = Annotated[int, msgspec.Meta(ge=0)] | Annotated[bytes, msgspec.Meta(min_length=1)]
_SHash = Annotated[int, msgspec.Meta(ge=-(1 << 63))] | Annotated[bytes, msgspec.Meta(min_length=1)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]
_WireExtra = tuple[tuple[Any, ...] | None, ...] | None


def _decode_structs(array_like: bool, hash_t: Any) -> Any:
    """Build lenient decode-side wire structs for one event form and hash signedness.

    Every field after the ones all releases had is optional, so older engines (SGLang's 5-field
    BlockStored, vLLM <= 0.8) and newer ones (extra map keys are ignored) decode alike.
    """
    stored_fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("block_hashes", tuple[hash_t, ...]),
        ("parent_block_hash", hash_t | None),
        ("token_ids", tuple[int, ...]),
        ("block_size", _NonNeg),
        ("lora_id", int | None, None),
        ("medium", str | None, None),
        ("lora_name", str | None, None),
        ("extra_keys", _WireExtra, None),
        ("group_idx", _NonNeg | None, None),
        ("kv_cache_spec_kind", str | None, None),
        ("kv_cache_spec_sliding_window", int | None, None),
        ("locality", str | None, None),
        ("ownership", str | None, None),
        ("session_id", str | None, None),
        ("lookahead_token_ids", tuple[tuple[int, ...], ...] | None, None),
    ]
    removed_fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("block_hashes", tuple[hash_t, ...]),
        ("medium", str | None, None),
        ("group_idx", _NonNeg | None, None),
        ("locality", str | None, None),
        ("ownership", str | None, None),
    ]
    stored = msgspec.defstruct("BlockStored", stored_fields, tag=True, array_like=array_like, gc=False)
    removed = msgspec.defstruct("BlockRemoved", removed_fields, tag=True, array_like=array_like, gc=False)
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag=True, array_like=array_like, gc=False)
    return stored | removed | cleared


def _batch_decoders(event_union: Any) -> tuple[msgspec.msgpack.Decoder[Any], msgspec.msgpack.Decoder[Any]]:
    """(array-encoded batch, map-encoded batch) decoders for one event union."""
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
        ("ts", float), ("events", list[event_union]), ("data_parallel_rank", _NonNeg | None, None)]
    arr = msgspec.defstruct("KVEventBatch", fields, array_like=True, gc=False)
    mapped = msgspec.defstruct("KVEventBatch", fields, gc=False)
    return msgspec.msgpack.Decoder(arr), msgspec.msgpack.Decoder(mapped)


_EVENT_TAGS = ("BlockStored", "BlockRemoved", "AllBlocksCleared")


class _Codec:
    """Typed decoders for every (batch form, event form) pair, with a sticky preferred event form."""

    __slots__ = ("_decoders", "_pref", "_signed", "_stored_types")

    def __init__(self, signed: bool) -> None:
        hash_t = _SHash if signed else _UHash
        unions = (_decode_structs(False, hash_t), _decode_structs(True, hash_t))  # map events, array events
        arr_m, map_m = _batch_decoders(unions[0])
        arr_a, map_a = _batch_decoders(unions[1])
        # _decoders[batch_is_map][event_form] with event_form 0 = map, 1 = array
        self._decoders = ((arr_m, arr_a), (map_m, map_a))
        self._pref = 0
        self._signed = signed
        self._stored_types = tuple(u.__args__[0] for u in unions)

    def decode(self, payload: bytes) -> KVEventBatch:
        if not payload:
            raise EventDecodeError("truncated", "empty payload")
        first = payload[0]
        decs = self._decoders[1 if (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)) else 0]
        pref = self._pref
        try:
            raw = decs[pref].decode(payload)
        except msgspec.ValidationError as e1:
            try:
                raw = decs[1 - pref].decode(payload)
            except msgspec.ValidationError as e2:
                raise _diagnose(payload, e1 if pref == 0 else e2, e2 if pref == 0 else e1) from None
            self._pref = 1 - pref
        except msgspec.DecodeError as exc:
            raise _framing_error(exc) from None
        return self._convert(raw)

    def _convert(self, raw: Any) -> KVEventBatch:
        out: list[KVEvent] = []
        stored_types = self._stored_types
        signed = self._signed
        for ev in raw.events:
            if type(ev) in stored_types:
                hashes = ev.block_hashes
                parent = ev.parent_block_hash
                if signed:
                    hashes = _wrap_signed(hashes)
                    if type(parent) is int and parent < 0:
                        parent &= UINT64_MAX
                extra = ev.extra_keys
                out.append(
                    BlockStored(
                        hashes,
                        parent,
                        ev.token_ids,
                        ev.block_size,
                        ev.lora_id,
                        ev.medium,
                        ev.lora_name,
                        None if extra is None else _tuplify_extra(extra),
                        ev.group_idx,
                        ev.kv_cache_spec_kind,
                        ev.kv_cache_spec_sliding_window,
                        ev.locality,
                        ev.ownership,
                        ev.session_id,
                        ev.lookahead_token_ids,
                    )
                )
            elif hasattr(ev, "block_hashes"):
                hashes = _wrap_signed(ev.block_hashes) if signed else ev.block_hashes
                out.append(BlockRemoved(hashes, ev.medium, ev.group_idx, ev.locality, ev.ownership))
            else:
                out.append(AllBlocksCleared())
        return KVEventBatch(raw.ts, tuple(out), raw.data_parallel_rank)


def _wrap_signed(hashes: tuple[EngineHash, ...]) -> tuple[EngineHash, ...]:
    """SGLang publishes int64 hashes; reinterpret negatives as the same 64 bits unsigned."""
    if any(type(h) is int and h < 0 for h in hashes):
        return tuple(h & UINT64_MAX if type(h) is int else h for h in hashes)
    return hashes


def _tuplify(value: object) -> object:
    if isinstance(value, list):
        return tuple(_tuplify(v) for v in value)
    return value


def _tuplify_extra(extra: tuple[tuple[Any, ...] | None, ...]) -> tuple[ExtraKeys, ...]:
    """Nested arrays (``[mm_id, offset]`` pairs) arrive as lists; make them hashable tuples."""
    return tuple(
        None if keys is None else (keys if not any(isinstance(k, list) for k in keys)
                                   else tuple(_tuplify(k) for k in keys))
        for keys in extra
    )


def _framing_error(exc: msgspec.DecodeError) -> EventDecodeError:
    msg = str(exc)
    kind = "truncated" if "truncated" in msg else "msgpack"
    return EventDecodeError(kind, f"invalid KV event batch: not valid msgpack ({msg})")


def _diagnose(payload: bytes, map_err: msgspec.ValidationError,
              arr_err: msgspec.ValidationError) -> EventDecodeError:
    """Slow path: name the kind and position of a bad batch (only runs on invalid input)."""
    try:
        generic = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:  # pragma: no cover - typed decode would have said so
        return _framing_error(exc)
    if isinstance(generic, dict):
        events = generic.get("events")
    elif isinstance(generic, list) and len(generic) >= 2:
        events = generic[1]
    else:
        shape = type(generic).__name__ if not isinstance(generic, list) else f"array of {len(generic)}"
        return EventDecodeError("bad_batch",
                                f"invalid KV event batch: expected [ts, events, dp_rank], got {shape}")
    if not isinstance(events, list):
        return EventDecodeError("bad_batch", f"invalid KV event batch: events must be an array, "
                                             f"got {type(events).__name__}")
    err = map_err
    for i, ev in enumerate(events):
        if isinstance(ev, dict):
            tag = ev.get("type")
        elif isinstance(ev, list):
            tag = ev[0] if ev else None
            err = arr_err
        else:
            return EventDecodeError("bad_event", f"invalid KV event batch: event {i} is a "
                                                 f"{type(ev).__name__}, not a map or array")
        if tag not in _EVENT_TAGS:
            return EventDecodeError("unknown_event", f"invalid KV event batch: event {i} has unknown type "
                                                     f"{tag!r} (known: {', '.join(_EVENT_TAGS)})")
        if isinstance(ev, dict):
            break
        if isinstance(ev, list):
            break
    msg = _name_array_fields(str(err), events)
    if "missing required field" in msg or "at least length" in msg:
        kind = "missing_field"
    elif "block_hashes" in msg or "parent_block_hash" in msg:
        kind = "bad_hash"
    elif "Expected `" in msg and ">=" not in msg:
        kind = "wrong_type"
    else:
        kind = "bad_value"
    return EventDecodeError(kind, f"invalid KV event batch: {msg}")


_FIELD_NAMES = {
    "BlockStored": ("type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                    "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
                    "kv_cache_spec_sliding_window", "locality", "ownership", "session_id",
                    "lookahead_token_ids"),
    "BlockRemoved": ("type", "block_hashes", "medium", "group_idx", "locality", "ownership"),
}
_ARRAY_PATH = re.compile(r"`\$\[1\]\[(\d+)\]\[(\d+)\]")


def _name_array_fields(msg: str, events: list[Any]) -> str:
    """msgspec names positional fields by index (``$[1][0][1]``); say ``$[1][0].block_hashes``."""
    if msg.endswith("`$[0]`"):
        return msg[:-6] + "`$[0]` (ts)"
    if msg.endswith("`$[2]`"):
        return msg[:-6] + "`$[2]` (data_parallel_rank)"
    m = _ARRAY_PATH.search(msg)
    if m is None:
        return msg
    i, j = int(m.group(1)), int(m.group(2))
    ev = events[i] if i < len(events) else None
    names = _FIELD_NAMES.get(ev[0], ()) if isinstance(ev, list) and ev else ()
    if j >= len(names):
        return msg
    return f"{msg[:m.start()]}`$[1][{i}].{names[j]}{msg[m.end():]}"


_STRICT = _Codec(signed=False)
_SIGNED = _Codec(signed=True)


def decode_vllm_batch(payload: bytes, *, signed_hashes: bool = False) -> KVEventBatch:
    """Decode one ZMQ payload (msgpack ``KVEventBatch``) from vLLM (any release) or SGLang.

    Accepts map-encoded events (vLLM >= 0.24; unknown keys from newer releases are ignored) and
    positional ``[tag, field, ...]`` arrays (vLLM <= 0.23, SGLang), int or bytes hashes. Ints are
    uint64; a negative hash is rejected unless ``signed_hashes`` (SGLang publishes int64 hashes:
    they are reinterpreted as the same 64 bits unsigned). Raises :class:`EventDecodeError`.
    """
    return (_SIGNED if signed_hashes else _STRICT).decode(payload)


# Encode-side structs: exactly vLLM's own definitions, so msgspec produces vLLM's bytes.
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapStored(_MapEvent, tag="BlockStored"):
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[ExtraKeys, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None


class _MapRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: tuple[EngineHash, ...]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


class _ArrEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrStored(_ArrEvent, tag="BlockStored"):
    block_hashes: tuple[EngineHash, ...]
    parent_block_hash: EngineHash | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: tuple[ExtraKeys, ...] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrRemoved(_ArrEvent, tag="BlockRemoved"):
    block_hashes: tuple[EngineHash, ...]
    medium: str | None
    group_idx: int | None = None


class _ArrCleared(_ArrEvent, tag="AllBlocksCleared"):
    pass


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


_ENCODER = msgspec.msgpack.Encoder()


def _check_hashes(hashes: tuple[EngineHash, ...], what: str) -> None:
    for h in hashes:
        if type(h) is int:
            if not 0 <= h <= UINT64_MAX:
                raise ValueError(f"{what}: block hash {h} is outside uint64")
        elif not isinstance(h, bytes) or not h:
            raise ValueError(f"{what}: block hash must be int or non-empty bytes, got {h!r}")


def _to_wire(ev: KVEvent, form: Literal["map", "array"]) -> msgspec.Struct:
    if isinstance(ev, BlockStored):
        _check_hashes(ev.block_hashes, "BlockStored")
        if ev.parent_block_hash is not None:
            _check_hashes((ev.parent_block_hash,), "BlockStored parent")
        common = (ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size, ev.lora_id, ev.medium,
                  ev.lora_name, ev.extra_keys, ev.group_idx, ev.kv_cache_spec_kind,
                  ev.kv_cache_spec_sliding_window)
        if form == "map":
            return _MapStored(*common, ev.locality, ev.ownership, ev.session_id, ev.lookahead_token_ids)
        if (ev.locality, ev.ownership, ev.session_id, ev.lookahead_token_ids) != (None, None, None, None):
            raise ValueError("BlockStored with locality/ownership/session_id/lookahead_token_ids "
                             "cannot be encoded as positional arrays (vLLM <= 0.23 has no such fields)")
        return _ArrStored(*common)
    if isinstance(ev, BlockRemoved):
        _check_hashes(ev.block_hashes, "BlockRemoved")
        if form == "map":
            return _MapRemoved(ev.block_hashes, ev.medium, ev.group_idx, ev.locality, ev.ownership)
        if (ev.locality, ev.ownership) != (None, None):
            raise ValueError("BlockRemoved with locality/ownership cannot be encoded as positional arrays")
        return _ArrRemoved(ev.block_hashes, ev.medium, ev.group_idx)
    if isinstance(ev, AllBlocksCleared):
        return _MapCleared() if form == "map" else _ArrCleared()
    raise TypeError(f"not a KV event: {type(ev).__name__}")


def encode_vllm_batch(batch: KVEventBatch, *, form: Literal["map", "array"] = "map") -> bytes:
    """Encode a batch exactly as vLLM's publisher does: ``map`` = vLLM >= 0.24, ``array`` = <= 0.23.

    Raises ``ValueError`` for a hash outside uint64 or a field the chosen form cannot carry.
    """
    if form not in ("map", "array"):
        raise ValueError(f"form must be 'map' or 'array', not {form!r}")
    wire = [_to_wire(ev, form) for ev in batch.events]
    return _ENCODER.encode(_WireBatch(float(batch.ts), wire, batch.data_parallel_rank))
