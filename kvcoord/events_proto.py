"""Lossless codec between the event model (:mod:`kvcoord.events`) and the ``kvcoord.v1`` protobuf messages.

Agents convert engine events to protobuf before streaming them; the coordinator converts them back
and hands the model to the index. Hashes keep the form the engine published (uint64 ints in
``block_hashes``, raw digests in ``block_digests``) so that the coordinator can verify them against
token ids; ``extra_keys`` travel as msgpack so tuples, bytes, ints and strings survive exactly as vLLM
publishes them.

Every field of the model travels, including the later ``locality``, ``ownership``, ``session_id`` and
``lookahead_token_ids`` (the index ignores them), and a batch's missing dp rank (``dp_rank_absent``).

Speed: validation of the long lists (hashes, token ids) runs in C (``set(map(type, ...))`` plus
``array("Q", ...)``) and falls back to the per-item loop only to name the offending item. The
coordinator decodes with ``tokens=False`` when it will not verify hashes: the same validation, but
``token_ids`` stays empty instead of becoming a tuple of ints nobody reads.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

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
    normalize_medium,
)
from kvcoord.index.memory import RAW_CLEAR, RAW_REMOVE, RAW_STORE, RawEvent
from kvcoord.proto.v1 import kvcoord_pb2 as pb

try:
    from kvcoord._wirescan import pack_uint64 as _pack_uint64
except ImportError:  # pragma: no cover - built whenever a compiler is present (CI requires it)
    _pack_uint64 = None  # type: ignore[assignment]

__all__ = [
    "batch_from_proto",
    "batch_to_proto",
    "event_from_proto",
    "event_to_proto",
    "events_for_index",
    "events_from_proto",
    "events_to_proto",
    "raw_events_for_index",
    "tier_from_proto",
    "tier_to_proto",
    "tupleize",
]

_UINT64_MAX = (1 << 64) - 1
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)

_INT_T = {int}
_BYTES_T = {bytes}

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder()


# --- hashes ------------------------------------------------------------------------------------
def _u64_ok(values: Sequence[int]) -> bool:
    """True when every value (all exact ``int``) is in [0, 2**64): one C-level pass."""
    try:
        array("Q", values)
    except (OverflowError, TypeError, ValueError):
        return False
    return True


def _token_ids(tokens: Sequence[int], what: str) -> Sequence[int]:
    """Token ids as uint64s, or ValueError naming the first bad one (fast path: all plain ints)."""
    if not tokens or (set(map(type, tokens)) == _INT_T and _u64_ok(tokens)):
        return tokens
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= _UINT64_MAX:
            raise ValueError(f"{what}: {t!r} is not a uint64 token id")
    return tokens


def _hash_form(hashes: Sequence[EngineHash], what: str) -> tuple[list[int], list[bytes]]:
    """Split a hash list into (ints, digests); exactly one may be non-empty."""
    if not hashes:
        return [], []
    types = set(map(type, hashes))
    if types == _INT_T and _u64_ok(hashes):  # type: ignore[arg-type]
        return hashes, []  # type: ignore[return-value]
    if types == _BYTES_T:
        return [], hashes  # type: ignore[return-value]
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
        out = tuple(digests)
        if not all(out):
            raise ValueError(f"{what}: block_digests[{out.index(b'')}] is empty")
        return out
    return tuple(ints)


def _check_range(value: int | None, lo_hi: tuple[int, int], what: str) -> None:
    if value is not None and not lo_hi[0] <= value <= lo_hi[1]:
        raise ValueError(f"{what} {value} is out of range")


# --- extra keys --------------------------------------------------------------------------------
def tupleize(value: Any) -> Any:
    """msgpack arrays come back as lists; the model (like vLLM's structs, which hashing pickles, where
    a list and a tuple differ) uses tuples. Recursive; dict keys and values too."""
    if isinstance(value, list | tuple):
        return tuple(tupleize(v) for v in value)
    if isinstance(value, dict):
        return {tupleize(k): tupleize(v) for k, v in value.items()}
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
        out.append(tupleize(item))
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
        out = pb.KVEvent()
        _stored_to_proto(event, out.stored)  # filled in place: wrapping a built message would copy it
        return out
    if isinstance(event, BlockRemoved):
        ints, digests = _hash_form(event.block_hashes, "BlockRemoved.block_hashes")
        _check_range(event.group_idx, _INT32, "BlockRemoved.group_idx")
        removed = pb.BlockRemoved(block_hashes=ints, block_digests=digests, medium=event.medium or "")
        if event.group_idx is not None:
            removed.group_idx = event.group_idx
        _set_strings(removed, event, _REMOVED_STRINGS, "BlockRemoved")
        return pb.KVEvent(removed=removed)
    if isinstance(event, AllBlocksCleared):
        return pb.KVEvent(cleared=pb.AllBlocksCleared())
    raise ValueError(f"not a KV event: {type(event).__name__}")


def event_to_wire(event: KVEvent) -> bytes:
    """``event_to_proto(event).SerializeToString()``, parsing to the same message (the bytes may
    order fields differently): a BlockStored's token ids, the bulk of a batch and slow to hand to
    protobuf one int at a time, are packed by ``kvcoord._wirescan.pack_uint64`` when it is built."""
    if _pack_uint64 is not None and isinstance(event, BlockStored) and event.token_ids:
        packed = _pack_uint64(event.token_ids)
        if packed is not None:  # else the protobuf path words the error
            out = pb.KVEvent()
            _stored_to_proto(event, out.stored, tokens=False)
            body = out.stored.SerializeToString() + b"\x2a" + varint(len(packed)) + packed  # token_ids = 5
            return b"\x0a" + varint(len(body)) + body  # KVEvent.stored = 1
    return event_to_proto(event).SerializeToString()


def events_to_wire(events: Iterable[KVEvent]) -> list[bytes]:
    """``event_to_wire`` of each; the first bad event raises ``ValueError`` with its index."""
    return _each(events, event_to_wire)


_T = TypeVar("_T")


def _each(events: Iterable[KVEvent], convert: Callable[[KVEvent], _T]) -> list[_T]:
    out: list[_T] = []
    for i, ev in enumerate(events):
        try:
            out.append(convert(ev))
        except ValueError as exc:
            raise ValueError(f"event {i}: {exc}") from None
    return out


def varint(n: int) -> bytes:
    """Protobuf base-128 varint of a non-negative int (hand-framed messages)."""
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _stored_to_proto(ev: BlockStored, msg: pb.BlockStored, *, tokens: bool = True) -> None:
    ints, digests = _hash_form(ev.block_hashes, "BlockStored.block_hashes")
    if ev.block_size < 0 or ev.block_size > 0xFFFFFFFF:
        raise ValueError(f"BlockStored.block_size {ev.block_size} is out of range")
    _check_range(ev.lora_id, _INT64, "BlockStored.lora_id")
    _check_range(ev.group_idx, _INT32, "BlockStored.group_idx")
    _check_range(ev.kv_cache_spec_sliding_window, _INT32, "BlockStored.kv_cache_spec_sliding_window")
    if ints:
        msg.block_hashes.extend(ints)
    elif digests:
        msg.block_digests.extend(digests)
    if tokens and ev.token_ids:
        try:
            # upb checks each id in C (int, not bool, in uint64 range); the loop only names the culprit.
            msg.token_ids.extend(ev.token_ids)
        except (TypeError, ValueError) as exc:
            _token_ids(ev.token_ids, "BlockStored.token_ids")
            raise ValueError(f"BlockStored.token_ids: {exc}") from None
    msg.block_size = ev.block_size
    if ev.medium:
        msg.medium = ev.medium
    if ev.extra_keys is not None:
        msg.extra_keys_msgpack = _extra_keys_to_bytes(ev.extra_keys)
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
    _set_strings(msg, ev, _STORED_STRINGS, "BlockStored")
    if ev.lookahead_token_ids is not None:
        la = msg.lookahead_token_ids
        la.SetInParent()
        for i, lst in enumerate(ev.lookahead_token_ids):
            if not isinstance(lst, tuple | list):
                raise ValueError(f"BlockStored.lookahead_token_ids[{i}] must be a list of token ids")
            la.lists.add(token_ids=_token_ids(lst, f"BlockStored.lookahead_token_ids[{i}]"))


_STORED_STRINGS = ("locality", "ownership", "session_id")
_REMOVED_STRINGS = ("locality", "ownership")


def _set_strings(msg: Any, ev: Any, names: tuple[str, ...], what: str) -> None:
    for name in names:
        value = getattr(ev, name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{what}.{name} must be a string, not {type(value).__name__}")
            setattr(msg, name, value)



def event_from_proto(msg: pb.KVEvent, *, tokens: bool = True) -> KVEvent:
    """``kvcoord.v1.KVEvent`` -> model event. Raises ``ValueError`` naming what is inconsistent.

    ``tokens=False``: validate everything alike but leave ``token_ids`` (and lookahead tokens) empty,
    for consumers that never read them (the index).
    """
    kind = msg.WhichOneof("event")
    if kind == "stored":
        return _stored_from_proto(msg.stored, tokens)
    if kind == "removed":
        r = msg.removed
        return BlockRemoved(
            block_hashes=_hashes_from(r.block_hashes, r.block_digests, "BlockRemoved"),
            medium=r.medium or None,
            group_idx=r.group_idx if r.HasField("group_idx") else None,
            locality=r.locality if r.HasField("locality") else None,
            ownership=r.ownership if r.HasField("ownership") else None,
        )
    if kind == "cleared":
        return AllBlocksCleared()
    raise ValueError("KVEvent has no event set")


def _stored_from_proto(s: pb.BlockStored, tokens: bool = True) -> BlockStored:
    return BlockStored(*_stored_parts(s, tokens))


def _stored_parts(s: pb.BlockStored, tokens: bool) -> tuple[Any, ...]:
    """A BlockStored's fields in declaration order, after every check the decoder makes."""
    # One ListFields() call tells which fields are set (optional ones included even when set to their
    # default), instead of a HasField call per optional field: this runs for every event ingested.
    f = {fd.name: v for fd, v in s.ListFields()}
    get = f.get
    hashes = _hashes_from(get("block_hashes", ()), get("block_digests", ()), "BlockStored")
    parent: EngineHash | None = get("parent_block_hash")
    if "parent_block_digest" in f:
        if parent is not None:
            raise ValueError("BlockStored: both parent_block_hash and parent_block_digest are set")
        if not f["parent_block_digest"]:
            raise ValueError("BlockStored: parent_block_digest is empty")
        parent = bytes(f["parent_block_digest"])
    token_ids = get("token_ids", ())
    n_tokens = len(token_ids)
    block_size: int = get("block_size", 0)
    if n_tokens:
        if not block_size:
            raise ValueError(f"BlockStored: {n_tokens} token_ids but block_size is 0")
        if n_tokens % block_size:
            raise ValueError(
                f"BlockStored: {n_tokens} token_ids is not a multiple of block_size {block_size}"
            )
    lookahead: tuple[tuple[int, ...], ...] | None = None
    if "lookahead_token_ids" in f:
        lookahead = tuple(tuple(lst.token_ids) for lst in f["lookahead_token_ids"].lists) if tokens else ()
    extra = get("extra_keys_msgpack")
    return (
        hashes,
        parent,
        tuple(token_ids) if tokens and n_tokens else (),
        block_size,
        get("lora_id"),
        get("medium") or None,
        get("lora_name"),
        _extra_keys_from_bytes(extra) if extra else None,
        get("group_idx"),
        get("kv_cache_spec_kind"),
        get("kv_cache_spec_sliding_window"),
        get("locality"),
        get("ownership"),
        get("session_id"),
        lookahead,
    )


def events_for_index(msgs: Sequence[pb.KVEvent]) -> list[KVEvent]:
    """Decode a batch for the index alone: every event is checked exactly as by
    ``events_from_proto(msgs, tokens=False)`` (same errors), then each run of consecutive
    ``BlockStored`` events with the same medium, group and kind becomes one event holding the run's
    hashes. The index reads nothing else of a store, and storing A then B leaves it exactly as storing
    A+B does (same entries, same counts), so applying the result equals applying the events one by one,
    with a fraction of the per-event work. Token ids, parents and the rest are not carried: do not hand
    the result to hash verification. Runs are only merged when the index cannot reject them (known
    medium, non-negative group, for every event of the batch), so an index error still names the
    original event's position: otherwise the batch is decoded unmerged.
    """
    out: list[KVEvent] = []
    run: list[EngineHash] | None = None  # hashes of the open run, whose first event is out[-1]
    run_parts: tuple[Any, ...] = ()
    run_key: tuple[Any, ...] | None = None
    merged = False

    def close() -> None:
        if run is not None and len(run) != len(run_parts[0]):
            out[-1] = BlockStored(tuple(run), *run_parts[1:])

    for i, m in enumerate(msgs):
        try:
            if m.WhichOneof("event") != "stored":
                ev = event_from_proto(m, tokens=False)
            else:
                ev = None
                parts = _stored_parts(m.stored, False)
        except ValueError as exc:
            raise ValueError(f"event {i}: {exc}") from None
        if ev is not None:
            close()
            run, run_key = None, None
            out.append(ev)
            continue
        hashes: tuple[EngineHash, ...] = parts[0]
        key = (parts[5], parts[8], parts[9], type(hashes[0]) if hashes else None)
        if run is not None and key == run_key:
            run.extend(hashes)
            merged = True
            continue
        close()
        run, run_parts, run_key = list(hashes), parts, key
        out.append(BlockStored(*parts))
    close()
    if merged and not all(_indexable_target(ev) for ev in out):
        return list(events_from_proto(msgs, tokens=False))  # let the index name the original event
    return out


def raw_events_for_index(msgs: Sequence[pb.KVEvent]) -> tuple[list[RawEvent], int, int, int]:
    """Decode a batch for ``MemoryIndex.apply_raw_sync``: every event checked exactly as by
    ``events_from_proto(msgs, tokens=False)`` (same errors, naming the event's index), but each becomes
    a :data:`RawEvent` tuple whose hashes are the message's own repeated field (no event objects, no
    copies). Also returns how many stored, removed and cleared events the batch holds (for metrics).
    The messages must outlive the result (the tuples reference their fields).
    """
    out: list[RawEvent] = []
    append = out.append
    stored = removed = cleared = 0
    for i, m in enumerate(msgs):
        which = m.WhichOneof("event")
        try:
            if which == "stored":
                s = m.stored
                hashes: Sequence[Any] = s.block_hashes
                digests = s.block_digests
                if digests:
                    hashes = _checked_digests(hashes, digests, "BlockStored")
                if s.HasField("parent_block_digest"):
                    if s.HasField("parent_block_hash"):
                        raise ValueError(
                            "BlockStored: both parent_block_hash and parent_block_digest are set"
                        )
                    if not s.parent_block_digest:
                        raise ValueError("BlockStored: parent_block_digest is empty")
                n_tokens = len(s.token_ids)
                if n_tokens:
                    block_size = s.block_size
                    if not block_size:
                        raise ValueError(f"BlockStored: {n_tokens} token_ids but block_size is 0")
                    if n_tokens % block_size:
                        raise ValueError(
                            f"BlockStored: {n_tokens} token_ids is not a multiple of block_size {block_size}"
                        )
                extra = s.extra_keys_msgpack
                if extra:
                    _extra_keys_from_bytes(extra)
                append(
                    (
                        RAW_STORE,
                        hashes,
                        s.medium or None,
                        s.group_idx if s.HasField("group_idx") else None,
                        s.kv_cache_spec_kind if s.HasField("kv_cache_spec_kind") else None,
                    )
                )
                stored += 1
            elif which == "removed":
                r = m.removed
                hashes = r.block_hashes
                digests = r.block_digests
                if digests:
                    hashes = _checked_digests(hashes, digests, "BlockRemoved")
                group = r.group_idx if r.HasField("group_idx") else None
                append((RAW_REMOVE, hashes, r.medium or None, group, None))
                removed += 1
            elif which == "cleared":
                append(_RAW_CLEARED)
                cleared += 1
            else:
                raise ValueError("KVEvent has no event set")
        except ValueError as exc:
            raise ValueError(f"event {i}: {exc}") from None
    return out, stored, removed, cleared


_RAW_CLEARED: RawEvent = (RAW_CLEAR, (), None, None, None)


def _checked_digests(ints: Sequence[int], digests: Sequence[bytes], what: str) -> Sequence[bytes]:
    """``_hashes_from``'s checks for the digest form (the caller saw digests set)."""
    if len(ints):
        raise ValueError(
            f"{what}: both block_hashes ({len(ints)}) and block_digests ({len(digests)}) are set"
        )
    if not all(digests):
        raise ValueError(f"{what}: block_digests[{list(digests).index(b'')}] is empty")
    return digests


def _indexable_target(ev: KVEvent) -> bool:
    """The index accepts this event's medium and group. Checked for every event, not only merged
    stores: once a run merged, every later position shifts, so an index error about any later event
    (a removal with a bad group, say) would name the wrong position."""
    if not isinstance(ev, BlockStored | BlockRemoved):
        return True
    if ev.group_idx is not None and ev.group_idx < 0:
        return False
    try:
        normalize_medium(ev.medium)
    except ValueError:
        return False
    return True


def events_to_proto(events: Iterable[KVEvent]) -> list[pb.KVEvent]:
    """Convert a sequence of events; the first bad one raises ``ValueError`` with its index."""
    return _each(events, event_to_proto)


def events_from_proto(msgs: Iterable[pb.KVEvent], *, tokens: bool = True) -> tuple[KVEvent, ...]:
    """Decode a whole list first, so a bad event rejects the batch before anything is applied."""
    out: list[KVEvent] = []
    for i, m in enumerate(msgs):
        try:
            out.append(event_from_proto(m, tokens=tokens))
        except ValueError as exc:
            raise ValueError(f"event {i}: {exc}") from None
    return tuple(out)


# --- batches -----------------------------------------------------------------------------------
def batch_to_proto(batch: KVEventBatch, seq: int) -> pb.EventBatch:
    """Model batch -> numbered ``EventBatch``. A missing dp rank travels as rank 0 (as vLLM treats it)
    with ``dp_rank_absent`` set, so the receiver can tell it from an explicit 0."""
    rank = batch.data_parallel_rank or 0
    if not 0 <= rank <= 0xFFFFFFFF:
        raise ValueError(f"data_parallel_rank {rank} is out of range")
    if not 0 <= seq <= _UINT64_MAX:
        raise ValueError(f"seq {seq} is out of range")
    return pb.EventBatch(seq=seq, ts=batch.ts, dp_rank=rank, events=events_to_proto(batch.events),
                         dp_rank_absent=batch.data_parallel_rank is None)


def batch_from_proto(msg: pb.EventBatch) -> KVEventBatch:
    """``EventBatch`` -> model batch (its ``seq`` is the stream's business, not the model's)."""
    if msg.dp_rank_absent and msg.dp_rank:
        raise ValueError(f"EventBatch: dp_rank_absent is set but dp_rank is {msg.dp_rank}")
    rank = None if msg.dp_rank_absent else msg.dp_rank
    return KVEventBatch(ts=msg.ts, events=events_from_proto(msg.events), data_parallel_rank=rank)
