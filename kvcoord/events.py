"""The KV-event model every layer shares, the msgpack codec of vLLM's and SGLang's publishers, and the decoder
of engines' gRPC batches (``smg.grpc.common.KvEventBatch``: :func:`decode_smg_batch`).

The model *is* vLLM's own: one msgspec Struct per event (``vllm/distributed/kv_events.py``), field for
field, so nothing an engine publishes is lost and msgspec (vLLM's codec) decodes straight into it, in
C. Hashes keep the form the engine published (``int`` or raw digest ``bytes``); the index reduces them
with :func:`kvcoord.hashing.to_block_hash64`.

Every other struct here is *derived* from these definitions by :func:`_derive`, never written out
again: vLLM's positional-array form (releases <= 0.23, SGLang), its exact encoding (fields without a
default in vLLM are always written), SGLang's signed int64 hashes, and the relay's lazy *views*, which
leave token ids and extra keys undecoded (msgspec ``Raw``) because the relay forwards them only for
the few events the coordinator verifies.
"""

from __future__ import annotations

import enum
import re
from array import array
from collections.abc import Callable, Iterator, Sequence
from itertools import chain
from typing import Annotated, Any, ClassVar, Literal, TypeAlias, cast

import msgspec

from kvcoord.hashing import to_block_hash64
from kvcoord.native import native

EngineHash: TypeAlias = int | bytes
"""A block hash as an engine publishes it: uint64 int, or the raw digest."""

ExtraKeys: TypeAlias = tuple[Any, ...] | None
"""One block's published extra keys (LoRA name, ``(mm_id, offset)`` pairs, cache salt, digest)."""

UINT64_MAX = (1 << 64) - 1
STORE, REMOVE, CLEAR = 0, 1, 2
"""Event kinds (``KIND`` of BlockStored, BlockRemoved, AllBlocksCleared)."""


class Tier(enum.IntEnum):
    """Where a node keeps a block. Small ints so the index can pack them into bitmasks."""

    GPU = 0
    CPU = 1
    STORAGE = 2


DEFAULT_TIER_WEIGHTS: tuple[float, float, float] = (1.0, 0.8, 0.5)
"""Fraction of a block's prefill a hit on each tier saves (GPU, CPU, STORAGE): how lookup answers are
ordered (``[tier_weights]`` of the coordinator) and how the prefix-aware policy scores a node.

A GPU hit is free; a CPU hit costs a PCIe copy (about a fifth of recomputing it for an 8B model);
a storage hit costs a disk or network read, about half of recomputing it."""

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""Group kinds whose blocks are prefix-matchable (``sink_full_attention``: full attention with sink tokens,
as hybrid models such as DeepSeek-V4 publish it). Events of other groups (sliding window, Mamba, …) describe
caches that cannot serve a prefix hit on their own, so the index skips them."""

indexable_spec: Callable[[str | None], bool] = frozenset({None, *FULL_ATTENTION_KINDS}).__contains__
"""Whether a store's ``kv_cache_spec_kind`` is prefix-indexable: absent, or full attention (a set lookup,
in C: it runs for every run of events)."""

_UHash = Annotated[int, msgspec.Meta(ge=0)] | Annotated[bytes, msgspec.Meta(min_length=1)]
""":func:`kvcoord.hashing.to_block_hash64`'s rule as the decoder's type, checked in C (msgpack ints end at
2**64-1)."""

NOT_SEQ = (str, bytes, bytearray, memoryview)
"""Sequences that are never a list of hashes."""


def py_u64_ok(raw: object) -> bool:
    """True when ``raw`` is a sequence of plain ints in [0, 2**64) (False: check each with
    :func:`kvcoord.hashing.to_block_hash64`, which names what is wrong or reduces a digest)."""
    if not isinstance(raw, Sequence) or isinstance(raw, NOT_SEQ):
        return False
    if not raw:
        return True
    try:
        array("Q", raw)  # C-level check: ints (or __index__) in [0, 2**64)
    except (TypeError, OverflowError, ValueError):
        return False
    # array() accepts bools (True == 1, False == 0) and __index__ objects: only plain big ints pass here.
    return bool(min(raw) > 1)


u64_ok: Callable[[object], bool] = native.validate_u64_seq if native is not None else py_u64_ok
"""The all-good check of a sequence of hashes: native when built (the same answers as :func:`py_u64_ok`)."""


_SHash = Annotated[int, msgspec.Meta(ge=-(1 << 63))] | Annotated[bytes, msgspec.Meta(min_length=1)]
_NonNeg = Annotated[int, msgspec.Meta(ge=0)]


# --- the model (vLLM's structs, map-encoded as since vLLM 0.24) --------------------------------
class KVEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, frozen=True):
    """One event of a published batch; ``KIND`` says which."""

    KIND: ClassVar[int]


class BlockStored(KVEvent, tag="BlockStored", frozen=True):
    """Blocks that became cached (and reusable) on one node, in chain order."""

    KIND: ClassVar[int] = STORE
    block_hashes: tuple[_UHash, ...]
    parent_block_hash: _UHash | None
    token_ids: tuple[int, ...]
    block_size: _NonNeg
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: tuple[tuple[Any, ...] | None, ...] | None = None
    group_idx: _NonNeg | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: tuple[tuple[int, ...], ...] | None = None
    cache_salt: str | None = None
    """SGLang's: the salt of the request that stored the blocks (its hashes are already seeded by it;
    vLLM carries the salt in ``extra_keys`` instead). Last, so the positional forms keep their order."""

    def is_prefix_indexable(self) -> bool:
        """True for full-attention groups (kind absent, or one of :data:`FULL_ATTENTION_KINDS`)."""
        return indexable_spec(self.kv_cache_spec_kind)


class BlockRemoved(KVEvent, tag="BlockRemoved", frozen=True):
    """Blocks evicted from one medium of one node."""

    KIND: ClassVar[int] = REMOVE
    block_hashes: tuple[_UHash, ...]
    medium: str | None = None
    group_idx: _NonNeg | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVEvent, tag="AllBlocksCleared", frozen=True):
    """The node dropped its whole prefix cache (reset, or restart)."""

    KIND: ClassVar[int] = CLEAR


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, frozen=True):
    """One published batch: a timestamp (seconds since the epoch), events, and the DP rank."""

    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: _NonNeg | None = None


_EVENTS: tuple[type[KVEvent], ...] = (BlockStored, BlockRemoved, AllBlocksCleared)
_VLLM_REQUIRED = {"BlockStored": 7, "BlockRemoved": 2}
"""How many leading fields vLLM declares without a default (it always writes those)."""
_ARRAY_FIELDS = {"BlockStored": 11, "BlockRemoved": 3}
"""How many fields the positional form (vLLM <= 0.23) has: the later ones did not exist yet."""


def _derive(cls: type[KVEvent], *, array_like: bool, signed: bool = False, exact: bool = False,
            view: bool = False) -> type[msgspec.Struct]:
    """A struct for one wire form of ``cls``, built from ``cls``'s own fields.

    ``exact``: vLLM's encoding (its required fields have no default, so they are always written; the
    positional form has only the fields of vLLM <= 0.23); ``signed``: SGLang's int64 hashes; ``view``:
    token ids and extra keys left undecoded (``Raw``); ``array_like``: the positional form. A decoded
    model event's struct subclasses ``cls`` (``isinstance`` holds); a view's and an encoder's do not.
    """
    name = cls.__name__
    infos = msgspec.structs.fields(cls)
    if array_like and exact:
        infos = infos[: _ARRAY_FIELDS.get(name, len(infos))]
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    for i, f in enumerate(infos):
        typ: Any = f.type
        if signed and f.name in ("block_hashes", "parent_block_hash"):
            typ = tuple[_SHash, ...] if f.name == "block_hashes" else _SHash | None
        if view and f.name in ("token_ids", "extra_keys"):
            typ = msgspec.Raw
            if f.default is not msgspec.NODEFAULT:
                fields.append((f.name, typ, msgspec.Raw(b"")))
                continue
        if (exact and i < _VLLM_REQUIRED.get(name, 0)) or f.default is msgspec.NODEFAULT:
            fields.append((f.name, typ))
        else:
            fields.append((f.name, typ, f.default))
    bases = () if (exact or view) else (cls,)  # model forms stay KVEvents until made canonical
    struct = msgspec.defstruct(name, fields, bases=bases, tag=name, array_like=array_like, omit_defaults=True,
                               gc=False, frozen=True, namespace={"KIND": cls.KIND})
    if view:
        _VIEWS.append(struct)
    return struct


_VIEWS: list[type[msgspec.Struct]] = []
"""Every view struct :func:`_derive` built (see :data:`VIEW_TYPES`)."""


class _Form:
    """Decoders of one (signedness, model-or-view) family, for each batch and event form."""

    __slots__ = ("decoders", "pref", "signed", "view")

    def __init__(self, *, signed: bool, view: bool) -> None:
        self.signed = signed
        self.view = view
        # decoders[batch_is_map][events_are_arrays]
        self.decoders = tuple(
            tuple(self._decoder(batch_map, arrays) for arrays in (False, True)) for batch_map in (False, True)
        )
        self.pref = 0

    def _decoder(self, batch_map: bool, arrays: bool) -> msgspec.msgpack.Decoder[Any]:
        if not (arrays or self.signed or self.view):
            events: Any = BlockStored | BlockRemoved | AllBlocksCleared
        else:
            kinds = [_derive(c, array_like=arrays, signed=self.signed, view=self.view) for c in _EVENTS]
            events = kinds[0] | kinds[1] | kinds[2]
        fields: list[tuple[str, Any] | tuple[str, Any, Any]] = [
            ("ts", float), ("events", tuple[events, ...]), ("data_parallel_rank", _NonNeg | None, None)]
        batch = msgspec.defstruct("KVEventBatch", fields, array_like=not batch_map, gc=False, frozen=True)
        return msgspec.msgpack.Decoder(batch)

    def decode(self, payload: bytes) -> Any:
        if not payload:
            raise EventDecodeError("truncated", "empty payload")
        first = payload[0]
        decs = self.decoders[1 if (0x80 <= first <= 0x8F or first in (0xDE, 0xDF)) else 0]
        pref = self.pref
        try:
            raw = decs[pref].decode(payload)
        except msgspec.ValidationError as e1:
            try:
                raw = decs[1 - pref].decode(payload)
            except msgspec.ValidationError as e2:
                raise _diagnose(payload, e1 if pref == 0 else e2, e2 if pref == 0 else e1) from None
            self.pref = 1 - pref
        except msgspec.DecodeError as exc:
            raise _framing_error(exc) from None
        if self.signed:
            raw = _unsigned(raw)
        if self.view:
            return raw
        return KVEventBatch(raw.ts, _canonical(raw.events), raw.data_parallel_rank)


_CANONICAL = {c.__name__: c for c in _EVENTS}


def _canonical(events: tuple[Any, ...]) -> tuple[Any, ...]:
    """Events of a derived form (positional, signed) as the model's own structs (equal to one built by
    hand), and nested extra keys (``[mm_id, offset]`` arrives as a list) as hashable tuples. Map-encoded
    events without extra keys are the model's structs already and pass through."""
    if all(type(ev) in _EVENTS and getattr(ev, "extra_keys", None) is None for ev in events):
        return events
    out = []
    for ev in events:
        if type(ev) not in _EVENTS:
            ev = _CANONICAL[type(ev).__name__](*msgspec.structs.astuple(ev))
        if getattr(ev, "extra_keys", None) is not None:
            ev = msgspec.structs.replace(ev, extra_keys=stored_extra_keys(ev))
        out.append(ev)
    return tuple(out)


def _unsigned(batch: Any) -> Any:
    """SGLang publishes int64 hashes; reinterpret negatives as the same 64 bits unsigned."""
    events = []
    changed = False
    for ev in batch.events:
        hashes = getattr(ev, "block_hashes", ())
        parent = getattr(ev, "parent_block_hash", None)
        if any(type(h) is int and h < 0 for h in hashes) or (type(parent) is int and parent < 0):
            changes: dict[str, Any] = {"block_hashes": tuple(h & UINT64_MAX if type(h) is int else h
                                                             for h in hashes)}
            if hasattr(ev, "parent_block_hash"):
                changes["parent_block_hash"] = parent & UINT64_MAX if type(parent) is int else parent
            ev = msgspec.structs.replace(ev, **changes)
            changed = True
        events.append(ev)
    return msgspec.structs.replace(batch, events=tuple(events)) if changed else batch


class EventDecodeError(ValueError):
    """A payload that is not a valid KV-event batch. ``kind`` is a short label for counters/logs."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _framing_error(exc: msgspec.DecodeError) -> EventDecodeError:
    msg = str(exc)
    kind = "truncated" if "truncated" in msg else "msgpack"
    return EventDecodeError(kind, f"invalid KV event batch: not valid msgpack ({msg})")


_TAGS = tuple(c.__name__ for c in _EVENTS)


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
        if tag not in _TAGS:
            return EventDecodeError("unknown_event", f"invalid KV event batch: event {i} has unknown type "
                                                     f"{tag!r} (known: {', '.join(_TAGS)})")
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


_FIELD_NAMES = {c.__name__: ("type", *(f.name for f in msgspec.structs.fields(c))) for c in _EVENTS}
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


_MODEL = _Form(signed=False, view=False)
_MODEL_SIGNED = _Form(signed=True, view=False)
_VIEW = _Form(signed=False, view=True)
_VIEW_SIGNED = _Form(signed=True, view=True)
VIEW_TYPES: frozenset[type[Any]] = frozenset(_VIEWS)
"""The relay's view structs. Only the decoder builds them, so their fields have the declared types
(``medium`` a str or None, ``group_idx`` an int >= 0 or None, ``block_hashes`` a tuple): a run of them
needs those checks once (:func:`kvcoord.validate.op_runs`)."""


def decode_vllm_batch(payload: bytes, *, signed_hashes: bool = False) -> KVEventBatch:
    """Decode one ZMQ payload (msgpack ``KVEventBatch``) from vLLM (any release) or SGLang.

    Accepts map-encoded events (vLLM >= 0.24; unknown keys from newer releases are ignored) and
    positional ``[tag, field, ...]`` arrays (vLLM <= 0.23, SGLang), int or bytes hashes. Ints are
    uint64; a negative hash is rejected unless ``signed_hashes`` (SGLang publishes int64 hashes:
    they are reinterpreted as the same 64 bits unsigned). Raises :class:`EventDecodeError`.
    Events of the positional form come back as structs derived from the model's (same fields).
    """
    batch: KVEventBatch = (_MODEL_SIGNED if signed_hashes else _MODEL).decode(payload)
    return batch


def decode_vllm_views(payload: bytes, *, signed_hashes: bool = False) -> Any:
    """:func:`decode_vllm_batch` for the relay: the same checks and fields, except that each
    BlockStored's ``token_ids`` and ``extra_keys`` stay undecoded (``msgspec.Raw``; see
    :func:`stored_tokens`), which saves most of the decoding of a batch."""
    return (_VIEW_SIGNED if signed_hashes else _VIEW).decode(payload)


_TOKENS = msgspec.msgpack.Decoder(tuple[int, ...])
_EXTRA = msgspec.msgpack.Decoder(tuple[tuple[Any, ...] | None, ...] | None)


def stored_tokens(ev: Any) -> tuple[int, ...]:
    """A BlockStored's token ids, from a model event or a relay view."""
    tokens = ev.token_ids
    if isinstance(tokens, msgspec.Raw):
        return _TOKENS.decode(tokens) if len(tokens) else ()
    return tuple(tokens)


def stored_extra_keys(ev: Any) -> tuple[ExtraKeys, ...] | None:
    """A BlockStored's extra keys as hashable tuples, from a model event or a relay view."""
    extra = ev.extra_keys
    if isinstance(extra, msgspec.Raw):
        return decode_extra_keys(extra)
    return _hashable_keys(extra)


def decode_extra_keys(data: bytes | msgspec.Raw) -> tuple[ExtraKeys, ...] | None:
    """Extra keys as msgpack carries them (a view's field, the wire's ``extra_keys_msgpack``) as hashable
    tuples; empty: none. msgspec's ``DecodeError``/``ValidationError`` say what is wrong."""
    return _hashable_keys(_EXTRA.decode(data)) if len(data) else None


def _hashable_keys(extra: Sequence[Any] | None) -> tuple[ExtraKeys, ...] | None:
    if extra is None:
        return None
    return tuple(None if keys is None else tuple(_tuplify(k) for k in keys) for keys in extra)


def to_model(ev: Any) -> KVEvent:
    """Any decoded event (a model struct, a derived form, or a relay view) as the model's own struct."""
    if type(ev) in _EVENTS and not isinstance(getattr(ev, "token_ids", ()), ProtoTokens):
        return ev  # type: ignore[no-any-return]
    cls = _CANONICAL[type(ev).__name__]
    values = {f.name: getattr(ev, f.name) for f in msgspec.structs.fields(ev)}
    if cls is BlockStored:
        values["token_ids"] = stored_tokens(ev)
        values["extra_keys"] = stored_extra_keys(ev)
    return cls(**values)


def _tuplify(value: object) -> object:
    if isinstance(value, list | tuple):
        return tuple(_tuplify(v) for v in value)
    return value


# --- the engines' gRPC stream (smg.grpc.common.KvEventBatch, PyPI's smg-grpc-proto) ----------------
SMG_TIER_MEDIA = {1: "DEVICE", 2: "HOST", 3: "DISK", 4: "EXTERNAL"}
"""``KvCacheTier`` values as medium names the media map knows (:mod:`kvcoord.media`), for a store or removal
that names a tier and no ``medium``; another value becomes ``TIER_<n>``, an unknown medium (skipped and
counted)."""
_SMG_LOCALITY = {1: "local", 2: "remote"}
_SMG_OPTIONAL = ("lora_name", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "ownership",
                 "session_id", "cache_salt")


def decode_smg_batch(msg: Any) -> KVEventBatch:
    """One ``smg.grpc.common.KvEventBatch`` (an engine's ``SubscribeKvEvents`` stream) as the model's batch.

    Hashes are int64 on that wire (SMG's servicers reduce an engine's hash to its low 64 bits, signed): they
    become the same 64 bits unsigned, as SGLang's msgpack ones do. A store's blocks become one BlockStored
    (their token ids in order, read when asked for: :class:`ProtoTokens`; every block must have one
    ``block_size``); ``tier`` without
    ``medium`` becomes a medium name (:data:`SMG_TIER_MEDIA`). Validation is the model's
    (:mod:`kvcoord.validate`); a batch this cannot map raises :class:`EventDecodeError`."""
    events: list[KVEvent] = []
    for i, ev in enumerate(msg.events):
        which = ev.WhichOneof("data")
        if which == "stored":
            events.append(_smg_stored(ev.stored, i))
        elif which == "removed":
            rm = ev.removed
            events.append(BlockRemoved(tuple(h & UINT64_MAX for h in rm.block_hashes), _smg_medium(rm),
                                       rm.group_idx if rm.HasField("group_idx") else None, _smg_locality(rm),
                                       rm.ownership if rm.HasField("ownership") else None))
        elif which == "cleared":
            events.append(AllBlocksCleared())
        else:
            raise EventDecodeError("event", f"event {i} is none of stored, removed, cleared")
    return KVEventBatch(msg.timestamp, tuple(events), msg.dp_rank if msg.HasField("dp_rank") else None)


class ProtoTokens(Sequence[int]):
    """A gRPC store's token ids, left in its protobuf blocks until asked for: the relay forwards them only
    on the few stores sampled for verification (:func:`stored_tokens`), as the msgpack views leave theirs
    undecoded; copying them costs most of a batch's decoding."""

    __slots__ = ("_blocks",)

    def __init__(self, blocks: Sequence[Any]) -> None:
        self._blocks = blocks

    def __iter__(self) -> Iterator[int]:
        return chain.from_iterable(b.token_ids for b in self._blocks)

    def __len__(self) -> int:
        return sum(len(b.token_ids) for b in self._blocks)

    def __getitem__(self, i: Any) -> Any:
        return tuple(self)[i]


def _smg_stored(st: Any, i: int) -> BlockStored:
    blocks = st.blocks
    if not blocks:
        raise EventDecodeError("event", f"event {i}: a store of no blocks")
    first = blocks[0]
    size = first.block_size
    hashes = []
    keyed = False
    for b in blocks:  # one pass: a batch's blocks are most of its decoding
        if b.block_size != size:
            raise EventDecodeError("block_size", f"event {i}: blocks of several block sizes "
                                                 f"{sorted({b.block_size for b in blocks})}")
        hashes.append(b.block_hash & UINT64_MAX)
        keyed = keyed or bool(b.extra_keys)
    extra = tuple(tuple(_smg_key(k) for k in b.extra_keys) or None for b in blocks) if keyed else None
    opt = {f: getattr(st, f) for f in _SMG_OPTIONAL if st.HasField(f)}
    return BlockStored(
        tuple(hashes), st.parent_block_hash & UINT64_MAX if st.HasField("parent_block_hash") else None,
        cast("tuple[int, ...]", ProtoTokens(blocks)), size,
        lora_id=first.lora_id if first.HasField("lora_id") else None, medium=_smg_medium(st),
        extra_keys=extra, locality=_smg_locality(st), **opt)


def _smg_medium(ev: Any) -> str | None:
    if ev.HasField("medium"):
        return str(ev.medium)
    if ev.HasField("tier") and ev.tier:
        return SMG_TIER_MEDIA.get(ev.tier, f"TIER_{ev.tier}")
    return None


def _smg_locality(ev: Any) -> str | None:
    return _SMG_LOCALITY.get(ev.locality, str(ev.locality)) if ev.HasField("locality") else None


def _smg_key(key: Any) -> object:
    which = key.WhichOneof("key")
    if which == "multimodal":
        return (key.multimodal.identifier, key.multimodal.offset)
    return getattr(key, which) if which is not None else None


# --- encoding, exactly as vLLM's publisher ------------------------------------------------------
_EXACT = {(c, form): _derive(c, array_like=form == "array", exact=True) for c in _EVENTS
          for form in ("map", "array")}
_ENCODER = msgspec.msgpack.Encoder()


class _WireBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


def _check_hashes(hashes: Sequence[object], what: str) -> None:
    """Every hash valid by :func:`kvcoord.hashing.to_block_hash64`'s rule (``ValueError`` naming ``what``)."""
    if u64_ok(hashes):
        return
    for h in hashes:
        try:
            to_block_hash64(h)  # type: ignore[arg-type]  # it checks the type itself
        except (TypeError, ValueError) as e:
            raise ValueError(f"{what}: {e}") from None


def _to_wire(ev: KVEvent, form: Literal["map", "array"]) -> msgspec.Struct:
    kind = type(ev)
    base = next((c for c in _EVENTS if isinstance(ev, c) or c.__name__ == kind.__name__), None)
    if base is None:
        raise TypeError(f"not a KV event: {kind.__name__}")
    values = msgspec.structs.astuple(ev)
    if base is not AllBlocksCleared:
        _check_hashes(values[0], base.__name__)
        if base is BlockStored and values[1] is not None:
            _check_hashes((values[1],), "BlockStored parent")
    exact = _EXACT[(base, form)]
    n = len(msgspec.structs.fields(exact))
    if any(v is not None for v in values[n:]):
        names = [f.name for f in msgspec.structs.fields(base)[n:]]
        raise ValueError(f"{base.__name__} with {'/'.join(names)} cannot be encoded as positional arrays "
                         "(vLLM <= 0.23 has no such fields)")
    return exact(*values[:n])


def encode_vllm_batch(batch: KVEventBatch, *, form: Literal["map", "array"] = "map") -> bytes:
    """Encode a batch exactly as vLLM's publisher does: ``map`` = vLLM >= 0.24, ``array`` = <= 0.23.

    Raises ``ValueError`` for a hash outside uint64 or a field the chosen form cannot carry.
    """
    if form not in ("map", "array"):
        raise ValueError(f"form must be 'map' or 'array', not {form!r}")
    wire = [_to_wire(ev, form) for ev in batch.events]
    return _ENCODER.encode(_WireBatch(float(batch.ts), wire, batch.data_parallel_rank))
