"""The agent-to-coordinator wire (``kvcoord.v2``), once: validated ops and verification samples to
protobuf and back.

Both directions apply :mod:`kvcoord.validate`'s rules, so a batch that reaches an index is valid by
construction and a bad one is refused whole, naming the event. Hashes travel packed (see the .proto),
so converting a batch costs per event, never per block. Token ids travel only on the events a
:class:`TokenSampler` picks for hash verification (the coordinator names the rule in its Welcome).
"""

from __future__ import annotations

import sys
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from operator import attrgetter
from typing import Any, NamedTuple

import msgspec
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from kvcoord.events import (
    CLEAR,
    REMOVE,
    STORE,
    ExtraKeys,
    Tier,
    decode_extra_keys,
    stored_extra_keys,
    stored_tokens,
)
from kvcoord.hashing import BlockHash64, to_block_hash64
from kvcoord.load import NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import (
    CLEAR_KEY,
    CLEAR_OP,
    InvalidEvent,
    Op,
    RunKey,
    check_tiers,
    hashes64,
    known_runs,
    pack_u64,
    run_key,
    unpack_u64,
)

_LITTLE = sys.byteorder == "little"
_U32_MAX = 0xFFFFFFFF
_ENCODER = msgspec.msgpack.Encoder()


class Sample(NamedTuple):
    """What verifying one BlockStored needs: the engine's hashes as published, its chain and tokens."""

    block_hashes: tuple[int | bytes, ...]
    parent: int | bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None
    extra_keys: tuple[ExtraKeys, ...] | None

    @classmethod
    def of(cls, ev: Any) -> Sample:
        """From a BlockStored model event or relay view."""
        return cls(tuple(ev.block_hashes), ev.parent_block_hash, stored_tokens(ev), ev.block_size,
                   ev.lora_name, stored_extra_keys(ev))


class TokenSampler:
    """Picks the BlockStored events whose tokens go on the wire, by the coordinator's ``VerifySample``:
    the first ``first`` whose chain the coordinator can follow (a head, a digest-form parent, or a
    parent it was sent), then one in ``every``; and any event of another block size than the model's
    (the coordinator reports that at once). Remembers the last ``memory`` sampled hashes."""

    __slots__ = ("_seen", "_sent", "block_size", "every", "first", "memory")

    def __init__(self, first: int = 0, every: int = 0, block_size: int = 0, memory: int = 65_536) -> None:
        self.first, self.every, self.block_size, self.memory = first, every, block_size, memory
        self._seen = 0
        self._sent: OrderedDict[int, None] = OrderedDict()

    def configure(self, verify: pb.VerifySample) -> None:
        """Take the Welcome's rule (a restarted stream starts counting again)."""
        self.first, self.every, self.block_size = verify.first, verify.every, verify.block_size
        self._seen = 0

    @property
    def active(self) -> bool:
        return bool(self.first or self.every)

    def pick(self, ev: Any) -> Sample | None:
        """The sample to send with this BlockStored, or None."""
        if not self.active or not ev.block_hashes:
            return None
        if self.block_size and ev.block_size != self.block_size:
            return Sample.of(ev)
        parent = ev.parent_block_hash
        if not (parent is None or isinstance(parent, bytes) or to_block_hash64(parent) in self._sent):
            return None
        self._seen += 1
        if self._seen > self.first and (not self.every or self._seen % self.every):
            return None
        sent = self._sent
        sent.update(dict.fromkeys(hashes64(ev.block_hashes, "sample")))
        while len(sent) > self.memory:
            sent.popitem(last=False)
        return Sample.of(ev)


# --- events -----------------------------------------------------------------------------------
stated_once: Callable[[Any], tuple[int, str | None]] = attrgetter("block_size", "kv_cache_spec_kind")
"""What a stored wire event states once, from its first event, for all the engine events it stands for,
besides its op's :func:`kvcoord.validate.run_key`: their block size (which the coordinator checks) and
spec kind. Stores of one run that differ in it go as separate wire events (``run_piece`` of the agent)."""


def fill_event(out: pb.KVEvent, op: Op, ev: Any, sample: Sample | None, packed: bytes | None = None,
               events: int = 1) -> None:
    """Write one validated event into ``out``, a ``kvcoord.v2.KVEvent`` (in place: a batch's events are
    added to it, wrapping built messages would copy them): its kind, tier and group from ``op`` (its own,
    or that of the run it is in), its hashes as ``packed`` (default: ``op``'s, packed). ``events`` > 1:
    it stands for that many like events (a run, ``ev`` its first), whose hashes ``packed`` holds."""
    kind, tier, hashes, group, _ = op
    if events > 1:
        out.events = events
    if kind == CLEAR:
        out.cleared.SetInParent()
        return
    if packed is None:
        packed = pack_u64(hashes)
    if kind != STORE:
        removed = out.removed
        removed.block_hashes = packed
        if tier:
            removed.tier = pb.Tier.ValueType(tier)
        if group is not None:
            removed.group_idx = group
        return
    s = out.stored
    s.block_hashes = packed
    if tier:
        s.tier = pb.Tier.ValueType(tier)
    s.block_size, spec = stated_once(ev)
    parent = ev.parent_block_hash
    if parent is not None:
        s.parent_block_hash = to_block_hash64(parent)
    if group is not None:
        s.group_idx = group
    if spec is not None:
        s.kv_cache_spec_kind = spec
    if sample is not None:
        _sample_to_proto(sample, s)


def event_to_proto(op: Op, ev: Any, sample: Sample | None = None) -> pb.KVEvent:
    """:func:`fill_event` into a new message."""
    out = pb.KVEvent()
    fill_event(out, op, ev, sample)
    return out


def _sample_to_proto(sample: Sample, s: pb.BlockStored) -> None:
    try:
        s.token_ids = pack_tokens(sample.token_ids)
    except ValueError:
        return  # ids past uint32 (no tokenizer has them): this event simply is not verified
    if sample.lora_name is not None:
        s.lora_name = sample.lora_name
    if sample.extra_keys is not None:
        s.extra_keys_msgpack = _ENCODER.encode(sample.extra_keys)
    if sample.block_hashes and isinstance(sample.block_hashes[0], bytes):
        s.block_digests = b"".join(sample.block_hashes)  # type: ignore[arg-type]
    if isinstance(sample.parent, bytes):
        s.parent_block_digest = sample.parent


def as_received(sample: Sample) -> Sample:
    """``sample`` as the coordinator reads it back from the wire (:func:`fill_event`, then
    :func:`samples_from_proto`), without the round trip: for the coordinator's own relays."""
    tokens = sample.token_ids
    try:
        pack_tokens(tokens)  # the wire's own test: what does not pack is not verified
    except ValueError:
        return Sample((), None, (), sample.block_size, None, None)
    hashes = sample.block_hashes
    if not (hashes and isinstance(hashes[0], bytes)):
        hashes = tuple(to_block_hash64(h) for h in hashes)
    parent = sample.parent
    if parent is not None and not isinstance(parent, bytes):
        parent = to_block_hash64(parent)
    return Sample(hashes, parent, tuple(tokens), sample.block_size, sample.lora_name, sample.extra_keys)


def ops_from_proto(events: Sequence[pb.KVEvent], *, merge: bool = False) -> list[Op]:
    """The wire's events as validated ops; ``InvalidEvent`` names the first bad one. ``merge``: each run
    of like events (one :func:`kvcoord.validate.run_key`) as one op, their packed hashes joined once."""
    ops: list[Op] = []
    key: RunKey | None = None
    keys = _WIRE_KEYS
    raw: tuple[int, int, int | None, str | None]
    last: tuple[int, int, int | None, str | None] | None = None
    k = CLEAR_KEY
    parts: list[bytes] = []
    for i, m in enumerate(events):
        which = m.WhichOneof("event")
        if which == "removed":
            e: pb.BlockRemoved | pb.BlockStored = m.removed
            raw = (REMOVE, e.tier, e.group_idx if e.HasField("group_idx") else None, None)
        elif which == "stored":
            e = m.stored
            raw = (STORE, e.tier, e.group_idx if e.HasField("group_idx") else None,
                   e.kv_cache_spec_kind if e.HasField("kv_cache_spec_kind") else None)
        elif which == "cleared":
            if key is not None:
                ops.append(_run_op(key, parts))
                key = None
            ops.append(CLEAR_OP)
            continue
        else:
            raise InvalidEvent(f"event {i}: KVEvent has no event set")
        if raw != last:  # (most events are like the one before)
            last, found = raw, keys.get(raw)
            k = run_key(*raw, i) if found is None else found
            if found is None and len(keys) < 256:
                keys[raw] = k
        data = e.block_hashes
        if len(data) % 8:  # each event's, before runs are joined: unpack_u64 says what is wrong
            unpack_u64(data, f"event {i}")
        if merge and k == key:
            parts.append(data)
            continue
        if key is not None:
            ops.append(_run_op(key, parts))
        key, parts = k, [data]
    if key is not None:
        ops.append(_run_op(key, parts))
    return ops


_WIRE_KEYS: dict[tuple[int, int, int | None, str | None], RunKey] = {}
""":func:`kvcoord.validate.run_key` of the wire's fields, remembered (at most 256: a fleet uses a handful).
Protobuf gives exact ints and strings, so equal fields make one key."""


def _run_op(key: RunKey, parts: list[bytes]) -> Op:
    data = parts[0] if len(parts) == 1 else b"".join(parts)
    return Op(key[0], key[1], unpack_u64(data, "run"), key[2], key[3])


def samples_from_proto(events: Sequence[pb.KVEvent]) -> list[tuple[int, Sample]]:
    """``(event position, sample)`` of every stored event that carries one (or whose block size may
    differ from the model's: those come with their size only, so the check needs no tokens)."""
    out: list[tuple[int, Sample]] = []
    for i, m in enumerate(events):
        if m.WhichOneof("event") != "stored":
            continue
        s = m.stored
        if not s.token_ids and not s.block_digests:
            out.append((i, _sized(s)))
            continue
        where = f"event {i}"
        tokens = _tokens(s.token_ids, where)
        n = len(s.block_hashes) // 8
        if s.block_size == 0 or len(tokens) != n * s.block_size:
            raise InvalidEvent(f"{where}: {len(tokens)} token_ids for {n} blocks of {s.block_size}")
        hashes: tuple[int | bytes, ...] = tuple(unpack_u64(s.block_hashes, where))
        if s.block_digests:
            if not n or len(s.block_digests) % n:  # no hashes: digests of no block
                raise InvalidEvent(f"{where}: block_digests is not {n} digests of one size")
            size = len(s.block_digests) // n
            hashes = tuple(s.block_digests[k * size:(k + 1) * size] for k in range(n))
        parent: int | bytes | None = None
        if s.HasField("parent_block_digest"):
            parent = bytes(s.parent_block_digest)
        elif s.HasField("parent_block_hash"):
            parent = s.parent_block_hash
        out.append((i, Sample(hashes, parent, tokens, s.block_size,
                              s.lora_name if s.HasField("lora_name") else None,
                              _extra_keys(s.extra_keys_msgpack, where))))
    return out


def _sized(s: pb.BlockStored) -> Sample:
    """A stored event without tokens: only its block size can be checked."""
    return Sample((), None, (), s.block_size, None, None)


def _tokens(data: bytes, where: str) -> tuple[int, ...]:
    try:
        return tuple(unpack_tokens(data))
    except ValueError as e:
        raise InvalidEvent(f"{where}: {e}") from None


def _extra_keys(data: bytes, where: str) -> tuple[ExtraKeys, ...] | None:
    try:
        return decode_extra_keys(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise InvalidEvent(f"{where}: extra_keys_msgpack is not a list of arrays: {exc}") from None
    except RecursionError:
        raise InvalidEvent(f"{where}: extra_keys_msgpack nests too deeply") from None


def event_counts(events: Sequence[pb.KVEvent]) -> tuple[int, int, int, int]:
    """``(stored, removed, cleared, unknown)`` engine events of a batch, for metrics: a wire event counts
    its ``events`` (a run), one when unset."""
    counts = {"stored": 0, "removed": 0, "cleared": 0, None: 0}
    for m in events:
        counts[m.WhichOneof("event")] += m.events or 1
    return counts["stored"], counts["removed"], counts["cleared"], counts[None]


# --- snapshots, tokens, loads, profiles -----------------------------------------------------------
def snapshot_to_proto(epoch: int, seq: int, dp_rank: int, hashes: Sequence[int],
                      tiers: Sequence[int], final: bool) -> pb.Snapshot:
    """One snapshot chunk; tiers travel as one byte each, and not at all when every block is on GPU."""
    packed_tiers = bytes(tiers) if any(tiers) else b""
    return pb.Snapshot(epoch=epoch, seq=seq, dp_rank=dp_rank, block_hashes=pack_u64(hashes),
                       tiers=packed_tiers, final=final)


def snapshot_from_proto(snap: pb.Snapshot) -> tuple[Sequence[BlockHash64], bytes]:
    """A chunk's hashes and tiers (one byte each; empty: all GPU), checked."""
    hashes = unpack_u64(snap.block_hashes, "snapshot")
    check_tiers(snap.tiers, len(hashes))
    return hashes, snap.tiers


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as packed little-endian uint32 (``ValueError`` for ids outside uint32: the range check is
    the packing itself, no min/max pass first)."""
    try:
        packed = array("I", tokens)
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in 0..2**32-1") from None
    if not _LITTLE:
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(data: bytes) -> array[int]:
    """Packed uint32 token ids as an array (``ValueError`` when the length is not a multiple of 4)."""
    if len(data) % 4:
        raise ValueError(f"token_ids is {len(data)} bytes, not a multiple of 4")
    packed = array("I")
    packed.frombytes(data)
    if not _LITTLE:
        packed.byteswap()
    return packed


def tier_name(value: int) -> str:
    return Tier(value).name


def events_to_proto(events: Sequence[Any], *, sample: bool = False) -> list[pb.KVEvent]:
    """Model events (validated whole first) as wire events; ``sample``: every store carries its tokens."""
    events, ops, _ = known_runs(events, merge=False)  # an unknown medium's events are left out
    return [event_to_proto(op, ev, Sample.of(ev) if sample and op.kind == STORE else None)
            for op, ev in zip(ops, events, strict=True)]


def load_to_proto(load: NodeLoad, out: pb.Load | None = None) -> pb.Load:
    """A load into ``out`` (in place, e.g. a response's field) or a new message."""
    msg = out if out is not None else pb.Load()
    msg.running_requests = load.running_requests
    msg.waiting_requests = load.waiting_requests
    msg.kv_usage = load.kv_usage
    return msg


def load_from_proto(msg: pb.Load) -> NodeLoad:
    """A reported load; a kv usage outside 0..1 (or NaN) reads as 0."""
    kv = float(msg.kv_usage)
    return NodeLoad(int(msg.running_requests), int(msg.waiting_requests), kv if 0.0 <= kv <= 1.0 else 0.0)


def _wide_agent_message() -> Any:
    """``AgentMessage`` reduced to its dp rank fields, declared uint64 instead of uint32 (same field
    numbers): protobuf keeps the low 32 bits of an out-of-range uint32 varint without a word, so a batch
    for rank 2**32 would parse as rank 0. Everything else is left unparsed (unknown fields)."""
    f = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(name="kvcoord/v2/wide_ranks.proto", package="kvcoord.v2.wide",
                                             syntax="proto3")

    def message(name: str, *fields: tuple[str, int, int, str]) -> None:
        d = fdp.message_type.add(name=name)
        for fname, number, label, type_name in fields:
            fd = d.field.add(name=fname, number=number, label=label,
                             type=f.TYPE_MESSAGE if type_name else f.TYPE_UINT64)
            if type_name:
                fd.type_name = f".kvcoord.v2.wide.{type_name}"

    one, many = f.LABEL_OPTIONAL, f.LABEL_REPEATED
    message("Hello", ("dp_ranks", 3, many, ""))
    message("EventBatch", ("dp_rank", 3, one, ""))
    message("EventBatches", ("batches", 1, many, "EventBatch"))
    message("Snapshot", ("dp_rank", 3, one, ""))
    message("AgentMessage", ("hello", 1, one, "Hello"), ("batch", 2, one, "EventBatch"),
            ("snapshot", 3, one, "Snapshot"), ("batches", 5, one, "EventBatches"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("kvcoord.v2.wide.AgentMessage"))


_WIDE = _wide_agent_message()


def check_ranks(data: bytes, which: str | None) -> None:
    """``InvalidEvent`` when a serialised AgentMessage's dp rank (Hello.dp_ranks, EventBatch.dp_rank,
    Snapshot.dp_rank) is past uint32 on the wire. A second, shallow parse (events and hashes stay
    unparsed: ~3 us for a 512-event batch). The 64-bit fields cannot be checked this way: a varint
    carries 64 bits and protobuf drops the rest while it parses (block hashes travel as packed bytes,
    so they never overflow)."""
    if which == "batch":
        rank = _WIDE.FromString(data).batch.dp_rank
        if rank > _U32_MAX:
            raise InvalidEvent(f"EventBatch.dp_rank {rank} is out of range (uint32)")
    elif which == "batches":
        for i, b in enumerate(_WIDE.FromString(data).batches.batches):
            if b.dp_rank > _U32_MAX:
                raise InvalidEvent(f"EventBatches.batches[{i}].dp_rank {b.dp_rank} is out of range (uint32)")
    elif which == "snapshot":
        rank = _WIDE.FromString(data).snapshot.dp_rank
        if rank > _U32_MAX:
            raise InvalidEvent(f"Snapshot.dp_rank {rank} is out of range (uint32)")
    elif which == "hello":
        ranks = [r for r in _WIDE.FromString(data).hello.dp_ranks if r > _U32_MAX]
        if ranks:
            raise InvalidEvent(f"Hello.dp_ranks: {ranks[0]} is out of range (uint32)")
