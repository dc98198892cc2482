"""``kvcoord._wirescan`` (the C ingest fast path) against the protobuf path it stands in for.

The scanner may only *decline* (return None) an input it does not read exactly; for every input it
accepts, the outcome must be the protobuf path's. Checked at two levels:

- scanner: for random ``AgentMessage`` bytes (valid ones, and ones mutated at the wire level:
  duplicated, unknown, unpacked, split, reordered or mistyped fields, overlong varints, truncations,
  byte flips) ``scan`` never raises, and what it returns agrees field by field with
  ``pb.AgentMessage.FromString`` and ``raw_events_for_index`` (the merged store runs included);
- session: two coordinators, one fed ``IngestSession.handle_bytes`` (scanner first), one fed
  ``IngestSession.handle`` with the protobuf message, end every step alike: replies, acks, aborts,
  the node record, the index contents, the verifier and the metrics.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import msgspec
import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcoord.coordinator.auth import OPEN_PRINCIPAL
from kvcoord.coordinator.config import CoordinatorConfig, Limits, ModelConfig
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.ingest import IngestAbort, IngestSession
from kvcoord.events_proto import raw_events_for_index
from kvcoord.hashing import HashProfile, hash_block_tokens, to_block_hash64
from kvcoord.index.memory import MemoryIndex
from kvcoord.proto.v1 import kvcoord_pb2 as pb

try:
    from kvcoord import _wirescan
except ImportError:  # pragma: no cover - CI builds it (KVCOORD_REQUIRE_SPEEDUPS)
    _wirescan = None  # type: ignore[assignment]

REQUIRED = bool(os.environ.get("KVCOORD_REQUIRE_SPEEDUPS"))
needs_scan = pytest.mark.skipif(_wirescan is None, reason="optional C extension kvcoord._wirescan not built")

MODEL = "m"
NODE = "n1"
RANKS = (0, 1)
LIMIT = 8
"""``max_events_per_batch`` of the session tests (small, so oversized batches are cheap)."""
PROFILE = HashProfile("sha256_cbor", 4, seed="42")

SETTINGS = settings(
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)


def scan(data: bytes) -> Any:
    assert _wirescan is not None
    return _wirescan.scan(data)


# --- random messages -------------------------------------------------------------------------------
U64 = 2**64 - 1
HASH = st.one_of(st.sampled_from([0, 1, 2**63, U64]), st.integers(0, U64))
MEDIA = ["", "GPU", "CPU", "cpu", "disk", "bogus", " gpu ", "CPU_PINNED"]
KINDS = [None, "full_attention", "mla_attention", "sliding_window", "mamba", ""]
NIL = msgspec.msgpack.encode


def _nil_array(n: int) -> bytes:
    return bytes(NIL([None] * n))


EXTRA_ODD = [
    bytes(NIL([None, [1, "a"]])),
    bytes(NIL([[b"x", 3]])),
    bytes(NIL({"a": 1})),
    bytes(NIL(None)),
    bytes(NIL([None, 1])),
    b"\xdc\x00\x02\xc0\xc0",  # array16 of 2 nils (not the canonical form)
    b"\xdd\x00\x00\x00\x01\xc0",  # array32 of 1 nil
    b"\x92\xc0",  # truncated
    b"\x91\xc0\xc0",  # trailing byte
    b"\xc1",
]


@st.composite
def stored_event(draw: st.DrawFn, wild: bool = True) -> pb.KVEvent:
    s = pb.BlockStored()
    n = draw(st.integers(0, 6))
    if wild and draw(st.integers(0, 15)) == 0:
        s.block_digests.extend(draw(st.lists(st.binary(max_size=3), min_size=1, max_size=3)))
        if draw(st.booleans()):
            s.block_hashes.extend(draw(st.lists(HASH, max_size=2)))
    else:
        s.block_hashes.extend(draw(st.lists(HASH, min_size=n, max_size=n)))
    parent = draw(st.sampled_from(["none", "int", "int", "digest", "both"] if wild else ["none", "int"]))
    if parent in ("int", "both"):
        s.parent_block_hash = draw(HASH)
    if parent in ("digest", "both"):
        s.parent_block_digest = draw(st.binary(max_size=4))
    bs = draw(st.sampled_from([4, 4, 16, 0, 1, 2**32 - 1] if wild else [4, 16]))
    s.block_size = bs
    n_tok = n * bs if bs < 64 else 0
    if wild and draw(st.integers(0, 5)) == 0:
        n_tok = draw(st.integers(0, 9))
    if draw(st.integers(0, 4)):
        big = draw(st.sampled_from([0, 1, 2**32, U64])) if wild else 0
        s.token_ids.extend([(i * 7919 + big) % (U64 + 1) for i in range(n_tok)])
    medium = draw(st.sampled_from(MEDIA if wild else ["", "GPU", "CPU"]))
    if medium or draw(st.booleans()):
        s.medium = medium
    if draw(st.booleans()):
        s.group_idx = draw(st.sampled_from([0, 1, 3, -1, -(2**31), 2**31 - 1]) if wild else st.integers(0, 3))
    kind = draw(st.sampled_from(KINDS if wild else [None, "full_attention"]))
    if kind is not None:
        s.kv_cache_spec_kind = kind
    if draw(st.booleans()):
        s.lora_id = draw(st.sampled_from([0, 7, -1, -(2**63), 2**63 - 1]))
    if draw(st.booleans()):
        s.lora_name = draw(st.sampled_from(["", "adapter", "é"]))
    extra = draw(st.integers(0, 9))
    if extra < 5:
        s.extra_keys_msgpack = _nil_array(n if extra < 4 else draw(st.integers(0, 20)))
    elif wild and extra < 8:
        s.extra_keys_msgpack = draw(st.one_of(st.sampled_from(EXTRA_ODD), st.binary(min_size=1, max_size=5)))
    if wild and draw(st.integers(0, 5)) == 0:
        which = draw(st.sampled_from(["window", "locality", "ownership", "session", "lookahead"]))
        if which == "window":
            s.kv_cache_spec_sliding_window = draw(st.sampled_from([0, 128, -1]))
        elif which == "lookahead":
            s.lookahead_token_ids.SetInParent()
            for lst in draw(st.lists(st.lists(st.integers(0, 99), max_size=3), max_size=2)):
                s.lookahead_token_ids.lists.add(token_ids=lst)
        else:
            setattr(s, {"session": "session_id"}.get(which, which), draw(st.sampled_from(["", "x"])))
    return pb.KVEvent(stored=s)


@st.composite
def removed_event(draw: st.DrawFn, wild: bool = True) -> pb.KVEvent:
    r = pb.BlockRemoved()
    if wild and draw(st.integers(0, 15)) == 0:
        r.block_digests.extend(draw(st.lists(st.binary(max_size=3), min_size=1, max_size=3)))
    else:
        r.block_hashes.extend(draw(st.lists(HASH, max_size=5)))
    medium = draw(st.sampled_from(MEDIA if wild else ["", "GPU", "CPU"]))
    if medium or draw(st.booleans()):
        r.medium = medium
    if draw(st.booleans()):
        r.group_idx = draw(st.sampled_from([0, 1, 3, -1, 2**31 - 1]) if wild else st.integers(0, 3))
    if wild and draw(st.integers(0, 5)) == 0:
        r.locality = "rack1"
    if wild and draw(st.integers(0, 5)) == 0:
        r.ownership = ""
    return pb.KVEvent(removed=r)


def kv_event(wild: bool = True) -> st.SearchStrategy[pb.KVEvent]:
    return st.one_of(
        stored_event(wild),
        stored_event(wild),
        removed_event(wild),
        st.just(pb.KVEvent(cleared=pb.AllBlocksCleared())),
        *([st.just(pb.KVEvent())] if wild else []),
    )


@st.composite
def event_batch(draw: st.DrawFn, wild: bool = True, max_events: int = 6) -> pb.EventBatch:
    b = pb.EventBatch(
        seq=draw(st.one_of(st.integers(0, 40), st.sampled_from([U64, 2**32]))),
        dp_rank=draw(st.sampled_from([0, 0, 1, 7, 2**32 - 1])),
        dp_rank_absent=draw(st.booleans()),
    )
    if draw(st.booleans()):
        b.ts = draw(st.floats(allow_nan=True, allow_infinity=True) if wild else st.floats(0, 2e9))
    b.events.extend(draw(st.lists(kv_event(wild), max_size=max_events)))
    return b


@st.composite
def agent_message(draw: st.DrawFn, wild: bool = True) -> pb.AgentMessage:
    if draw(st.booleans()):
        return pb.AgentMessage(batch=draw(event_batch(wild)))
    n = draw(st.integers(1, 20))
    return pb.AgentMessage(
        batches=pb.EventBatches(batches=draw(st.lists(event_batch(wild, 3), min_size=n, max_size=n)))
    )


# --- the wire format, by hand ----------------------------------------------------------------------
SUBMESSAGES: dict[str, dict[int, str]] = {
    "AgentMessage": {1: "Hello", 2: "EventBatch", 3: "Snapshot", 4: "AgentHeartbeat", 5: "EventBatches"},
    "EventBatches": {1: "EventBatch"},
    "EventBatch": {4: "KVEvent"},
    "KVEvent": {1: "BlockStored", 2: "BlockRemoved", 3: "AllBlocksCleared"},
    "BlockStored": {17: "LookaheadTokens"},
    "LookaheadTokens": {1: "TokenList"},
}
PACKED: dict[str, set[int]] = {
    "BlockStored": {1, 5},
    "BlockRemoved": {1},
    "TokenList": {1},
    "Snapshot": {4, 5},
}


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def read_varint(data: bytes, pos: int) -> tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise ValueError("bad varint")
        b = data[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return v, pos


@dataclass
class Field:
    num: int
    wt: int
    val: Any
    """int (varint), bytes (length-delimited or fixed), or list[Field] (a known submessage)."""
    kind: str | None = None
    """The submessage type when ``val`` is a list."""
    raw: bytes | None = None
    """A varint's exact encoding, when not the shortest one."""


def parse(data: bytes, msg: str) -> list[Field]:
    out: list[Field] = []
    pos = 0
    while pos < len(data):
        key, pos = read_varint(data, pos)
        num, wt = key >> 3, key & 7
        if wt == 0:
            v, pos = read_varint(data, pos)
            out.append(Field(num, 0, v))
        elif wt == 1:
            out.append(Field(num, 1, data[pos : pos + 8]))
            pos += 8
        elif wt == 5:
            out.append(Field(num, 5, data[pos : pos + 4]))
            pos += 4
        elif wt == 2:
            n, pos = read_varint(data, pos)
            body = data[pos : pos + n]
            pos += n
            sub = SUBMESSAGES.get(msg, {}).get(num)
            out.append(Field(num, 2, parse(body, sub), sub) if sub else Field(num, 2, body))
        else:
            raise ValueError(f"wire type {wt}")
    return out


def encode(fields: Sequence[Field]) -> bytes:
    out = bytearray()
    for f in fields:
        out += varint(f.num << 3 | f.wt)
        if f.wt == 0:
            out += f.raw if f.raw is not None else varint(f.val)
        elif f.wt == 2:
            body = encode(f.val) if isinstance(f.val, list) else f.val
            out += varint(len(body)) + body
        else:
            out += f.val
    return bytes(out)


def messages_of(fields: list[Field], kind: str) -> list[tuple[list[Field], str]]:
    """Every (sub)message of a parsed tree with its type, the root first."""
    out = [(fields, kind)]
    for f in fields:
        if isinstance(f.val, list) and f.kind is not None:
            out += messages_of(f.val, f.kind)
    return out


def unpack(body: bytes) -> list[int]:
    vals, pos = [], 0
    while pos < len(body):
        v, pos = read_varint(body, pos)
        vals.append(v)
    return vals


def mutate_tree(rng: random.Random, fields: list[Field]) -> str:
    """One structural change somewhere in the tree (length prefixes stay right); returns its name."""
    msgs = messages_of(fields, "AgentMessage")
    op = rng.choice(
        [
            "dup",
            "dup",
            "unknown",
            "unpack",
            "unpack",
            "split",
            "overlong",
            "big",
            "swap",
            "drop",
            "wrong_wt",
            "second_member",
            "empty",
        ]
    )
    if op in ("unpack", "split"):
        msgs = [m for m in msgs if any(f.wt == 2 and f.num in PACKED.get(m[1], ()) for f in m[0])] or msgs
    target, kind = rng.choice(msgs[1:] if len(msgs) > 1 and rng.random() < 0.9 else msgs)
    if op == "unpack" or op == "split":
        packed = [i for i, f in enumerate(target) if f.wt == 2 and f.num in PACKED.get(kind, ())]
        if not packed:
            op = "dup"
        else:
            i = rng.choice(packed)
            f = target[i]
            assert isinstance(f.val, bytes)
            vals = unpack(f.val)
            if op == "unpack":
                target[i : i + 1] = [Field(f.num, 0, v) for v in vals]
            else:
                cut = rng.randint(0, len(vals))
                target[i : i + 1] = [
                    Field(f.num, 2, b"".join(map(varint, vals[:cut]))),
                    Field(f.num, 2, b"".join(map(varint, vals[cut:]))),
                ]
            return op
    if op in ("overlong", "big"):
        ints = [f for f in target if f.wt == 0]
        if not ints:
            op = "unknown"
        else:
            f = rng.choice(ints)
            if op == "big":
                f.val = rng.choice([2**31, 2**32, 2**32 + 5, 2**63, U64, 2])
                f.raw = None
            else:
                enc = bytearray(varint(f.val))
                pad = rng.randint(1, max(1, 10 - len(enc)))
                enc[-1] |= 0x80
                enc += b"\x80" * (pad - 1) + b"\x00"
                if rng.random() < 0.3:
                    enc = bytearray(
                        b"\xff" * 9 + bytes([rng.choice([1, 2, 0x7F])])
                    )  # 10 bytes, maybe > 64 bits
                f.raw = bytes(enc)
            return op
    if op == "dup" and target:
        i = rng.randrange(len(target))
        target.insert(rng.randint(0, len(target)), _copy(target[i]))
    elif op == "swap" and len(target) >= 2:
        i, j = rng.sample(range(len(target)), 2)
        target[i], target[j] = target[j], target[i]
    elif op == "drop" and target:
        del target[rng.randrange(len(target))]
    elif op == "wrong_wt" and target:
        f = target[rng.randrange(len(target))]
        if f.wt == 0:
            f.wt, f.val, f.raw = 2, varint(f.val), None
        elif f.wt == 2:
            f.wt, f.val, f.kind = 0, rng.randint(0, 5), None
        else:
            f.wt, f.val = (5, f.val[:4]) if f.wt == 1 else (1, f.val + f.val)
    elif op == "second_member":
        sub = SUBMESSAGES.get(kind)
        if sub:
            num = rng.choice(list(sub))
            target.insert(rng.randint(0, len(target)), Field(num, 2, [], sub[num]))
    elif op == "empty":
        subs = [f for f in target if isinstance(f.val, list)]
        if subs:
            rng.choice(subs).val = []
    else:  # unknown
        num = rng.choice([18, 19, 31, 99, 1000, 2**29 - 1, 6, 7, 8, 9])
        wt = rng.choice([0, 1, 2, 5])
        val: Any = {0: rng.randint(0, 300), 1: b"\x00" * 8, 2: b"zz", 5: b"\x01\x02\x03\x04"}[wt]
        target.insert(rng.randint(0, len(target)), Field(num, wt, val))
        op = "unknown"
    return op


def _copy(f: Field) -> Field:
    val = [_copy(g) for g in f.val] if isinstance(f.val, list) else f.val
    return Field(f.num, f.wt, val, f.kind, f.raw)


def mutate_bytes(rng: random.Random, data: bytes) -> bytes:
    b = bytearray(data)
    op = rng.choice(["truncate", "flip", "flip", "insert", "delete", "append"])
    if op == "truncate" and b:
        return bytes(b[: rng.randrange(len(b))])
    if op == "flip" and b:
        for _ in range(rng.randint(1, 3)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif op == "insert":
        b.insert(rng.randint(0, len(b)), rng.randrange(256))
    elif op == "delete" and b:
        del b[rng.randrange(len(b))]
    else:
        b += rng.choice([b"\x00", b"\x08\x01", b"\x12\x00", b"\xa2\x01\x00", b"\x2a\x00"])
    return bytes(b)


# --- the scanner's answer vs protobuf's ------------------------------------------------------------
def _parse(data: bytes) -> pb.AgentMessage | None:
    try:
        return pb.AgentMessage.FromString(data)
    except (DecodeError, ValueError, RuntimeError):
        return None


def _bits(x: float) -> bytes:
    return struct.pack("<d", x)


def _expected_ops(raw: Sequence[Any]) -> list[tuple[int, list[int], Any, Any, Any]]:
    """``raw_events_for_index``'s events with runs of stores to one target merged, as the scanner does."""
    out: list[tuple[int, list[int], Any, Any, Any]] = []
    prev_store = False
    for kind, hashes, medium, group, spec in raw:
        key = (medium, group, spec)
        if kind == 0 and prev_store and out[-1][2:] == key:
            out[-1][1].extend(hashes)
        else:
            out.append((kind, list(hashes), medium, group, spec))
        prev_store = kind == 0
    return out


def check_scan(data: bytes) -> bool:
    """Assert that ``scan(data)`` declines or agrees with protobuf; True when it accepted."""
    res = scan(data)  # never raises
    if res is None:
        return False
    msg = _parse(data)
    assert msg is not None, f"scan accepted bytes protobuf rejects: {data.hex()}"
    which = msg.WhichOneof("msg")
    assert which in ("batch", "batches"), which
    batches = [msg.batch] if which == "batch" else list(msg.batches.batches)
    assert isinstance(res, list)
    assert len(res) == len(batches)
    for got, b in zip(res, batches, strict=True):
        seq, ts, dp_rank, absent, n_events, n_st, n_rm, n_cl, ops, stored_info, start, end = got
        assert (seq, dp_rank, absent, n_events) == (b.seq, b.dp_rank, b.dp_rank_absent, len(b.events))
        assert type(seq) is int and type(dp_rank) is int and type(absent) is bool
        assert _bits(ts) == _bits(b.ts) or (math.isnan(ts) and math.isnan(b.ts))
        kinds = [e.WhichOneof("event") for e in b.events]
        assert (n_st, n_rm, n_cl) == (kinds.count("stored"), kinds.count("removed"), kinds.count("cleared"))
        assert pb.EventBatch.FromString(data[start:end]) == b
        # The protobuf path must find the batch decodable too (the scanned path never decodes it).
        raw, p_st, p_rm, p_cl = raw_events_for_index(b.events)
        assert (p_st, p_rm, p_cl) == (n_st, n_rm, n_cl)
        got_ops = []
        for kind, hashes, medium, group, spec in ops:
            if kind != 2:
                assert isinstance(hashes, memoryview) and hashes.format == "Q" and hashes.c_contiguous
            got_ops.append((kind, list(hashes), medium, group, spec))
        assert got_ops == _expected_ops(raw)
        # concatenated hashes per kind, in order
        for k, name in ((0, "stored"), (1, "removed")):
            sent = [
                h for e in b.events if e.WhichOneof("event") == name for h in getattr(e, name).block_hashes
            ]
            assert [h for op in got_ops if op[0] == k for h in op[1]] == sent
        want_info = []
        for e in b.events:
            if e.WhichOneof("event") != "stored":
                continue
            s = e.stored
            parent: Any = None
            if s.HasField("parent_block_hash"):
                parent = s.parent_block_hash
            elif s.HasField("parent_block_digest"):
                parent = bytes(s.parent_block_digest)
            spec = s.kv_cache_spec_kind if s.HasField("kv_cache_spec_kind") else None
            want_info.append((len(s.block_hashes), len(s.token_ids), s.block_size, parent, spec))
        assert stored_info == want_info
    return True


@needs_scan
@SETTINGS
@given(agent_message())
def test_scan_agrees_with_protobuf(msg: pb.AgentMessage) -> None:
    check_scan(msg.SerializeToString())


@needs_scan
@settings(SETTINGS, max_examples=300)
@given(st.booleans().flatmap(agent_message), st.integers(0, 2**32), st.integers(1, 3), st.booleans())
def test_scan_agrees_on_mutated_wire(msg: pb.AgentMessage, seed: int, n_tree: int, byte_level: bool) -> None:
    rng = random.Random(seed)  # uniform choices (hypothesis' own randoms lean to the first option)
    fields = parse(msg.SerializeToString(), "AgentMessage")
    for _ in range(n_tree):
        mutate_tree(rng, fields)
    data = encode(fields)
    check_scan(data)
    if byte_level:
        check_scan(mutate_bytes(rng, data))


@needs_scan
@settings(SETTINGS, max_examples=300)
@given(st.one_of(st.binary(max_size=64), st.binary(max_size=8).map(lambda b: b"\x12" + bytes([len(b)]) + b)))
def test_scan_never_raises_on_arbitrary_bytes(data: bytes) -> None:
    check_scan(data)
    check_scan(b"\x2a" + varint(len(data) + 2) + b"\x0a" + varint(len(data)) + data)


def test_scan_handles_non_bytes_buffers() -> None:
    if _wirescan is None:
        pytest.skip("kvcoord._wirescan not built")
    data = pb.AgentMessage(batch=pb.EventBatch(seq=3)).SerializeToString()
    for buf in (bytearray(data), memoryview(data)):
        res = scan(buf)  # type: ignore[arg-type]
        assert res is not None and res[0][0] == 3
    with pytest.raises(TypeError):
        scan("not bytes")  # type: ignore[arg-type]


def _vllm_batch(seq: int, n_events: int, medium: str, rng: random.Random, bs: int = 16) -> pb.EventBatch:
    events = []
    for i in range(n_events):
        n = rng.randint(1, 8)
        s = pb.BlockStored(
            block_hashes=[rng.getrandbits(64) for _ in range(n)],
            token_ids=[rng.randrange(150_000) for _ in range(n * bs)],
            block_size=bs,
            medium=medium,
            extra_keys_msgpack=_nil_array(n),
            group_idx=i % 2,
            lora_id=3,
            lora_name="adapter",
        )
        if i:
            s.parent_block_hash = rng.getrandbits(64)
        events.append(pb.KVEvent(stored=s))
    events.append(pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[1, 2, U64], medium=medium)))
    events.append(pb.KVEvent(cleared=pb.AllBlocksCleared()))
    return pb.EventBatch(seq=seq, ts=1.7e9, dp_rank=1, events=events)


@needs_scan
@pytest.mark.parametrize("medium", ["", "GPU", "CPU"])
def test_scan_reads_the_common_shapes(medium: str) -> None:
    """The fast path really runs: plain vLLM-like batches are accepted, never declined."""
    rng = random.Random(medium)
    one = pb.AgentMessage(batch=_vllm_batch(5, 6, medium, rng))
    many = pb.AgentMessage(
        batches=pb.EventBatches(batches=[_vllm_batch(s, 3, medium, rng) for s in range(1, 21)])
    )
    plain = pb.AgentMessage(
        batch=pb.EventBatch(seq=1, events=[pb.KVEvent(stored=pb.BlockStored(block_hashes=[0]))])
    )
    empty = pb.AgentMessage(batch=pb.EventBatch(seq=9))
    huge = pb.AgentMessage(batch=pb.EventBatch(seq=U64, dp_rank=2**32 - 1, ts=-1.0, dp_rank_absent=True))
    for m in (one, many, plain, empty, huge):
        assert check_scan(m.SerializeToString()), m


@needs_scan
@pytest.mark.parametrize(
    "event",
    [
        pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], medium="disk")),  # the index's error
        pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], kv_cache_spec_kind="sliding_window")),
        pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], kv_cache_spec_kind="")),
        pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[1], medium="bogus")),
        pb.KVEvent(
            stored=pb.BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=2, parent_block_hash=0)
        ),
    ],
)
def test_scan_reads_events_the_index_judges(event: pb.KVEvent) -> None:
    data = pb.AgentMessage(batch=pb.EventBatch(seq=1, events=[event, event])).SerializeToString()
    assert check_scan(data)


@needs_scan
@pytest.mark.parametrize(
    "stored",
    [
        pb.BlockStored(block_hashes=[1], group_idx=-1),
        pb.BlockStored(block_digests=[b"ab"]),
        pb.BlockStored(block_hashes=[1], token_ids=[1, 2, 3], block_size=2),
        pb.BlockStored(block_hashes=[1], token_ids=[1], block_size=0),
        pb.BlockStored(block_hashes=[1], parent_block_hash=1, parent_block_digest=b"x"),
        pb.BlockStored(block_hashes=[1], parent_block_digest=b""),
        pb.BlockStored(block_hashes=[1], extra_keys_msgpack=b"\x91\x01"),
        pb.BlockStored(block_hashes=[1], extra_keys_msgpack=b"\xc1"),
    ],
)
def test_scan_declines_what_python_words(stored: pb.BlockStored) -> None:
    """Inputs the protobuf path rejects with its own wording are left to it."""
    data = pb.AgentMessage(batch=pb.EventBatch(seq=1, events=[pb.KVEvent(stored=stored)])).SerializeToString()
    assert scan(data) is None


@needs_scan
def test_scan_declines_hand_made_encodings() -> None:
    ev = encode([Field(1, 2, [Field(1, 2, b"\x01\x02")], "BlockStored")])  # KVEvent{stored{hashes=[1,2]}}
    good = encode([Field(2, 2, [Field(1, 0, 1), Field(4, 2, parse(ev, "KVEvent"), "KVEvent")], "EventBatch")])
    assert check_scan(good)
    variants = {
        "unpacked hashes": [Field(1, 0, 1), Field(1, 0, 2)],
        "split packed": [Field(1, 2, b"\x01"), Field(1, 2, b"\x02")],
        "unknown field": [Field(1, 2, b"\x01\x02"), Field(99, 0, 1)],
        "digests": [Field(2, 2, b"ab")],
        "duplicate medium": [Field(8, 2, b"GPU"), Field(8, 2, b"CPU")],
        "bad utf-8": [Field(8, 2, b"\xc3\x28")],
        "group > int32": [Field(11, 0, 2**31)],
        "block_size > uint32": [Field(6, 0, 2**32)],
    }
    for name, stored in variants.items():
        data = encode(
            [
                Field(
                    2,
                    2,
                    [Field(1, 0, 1), Field(4, 2, [Field(1, 2, stored, "BlockStored")], "KVEvent")],
                    "EventBatch",
                )
            ]
        )
        check_scan(data)
        assert scan(data) is None, name
    for top in (
        [Field(2, 2, b""), Field(2, 2, b"")],  # the oneof twice: protobuf merges
        [Field(3, 2, b"")],  # a snapshot
        [Field(5, 2, b"")],  # an empty EventBatches
    ):
        data = encode(top)
        check_scan(data)
        assert scan(data) is None


# --- sessions --------------------------------------------------------------------------------------
@dataclass
class Side:
    """One coordinator with one ingest stream, and what the stream queued."""

    state: CoordinatorState
    session: IngestSession
    pushed: list[bytes] = field(default_factory=list)
    acks: list[tuple[int, int]] = field(default_factory=list)


def _side(config: CoordinatorConfig, with_ack: bool) -> Side:
    state = CoordinatorState(config, MemoryIndex())
    pushed: list[bytes] = []
    acks: list[tuple[int, int]] = []
    session = IngestSession(
        state,
        OPEN_PRINCIPAL,
        lambda m: pushed.append(m.SerializeToString()),
        (lambda e, s: acks.append((e, s))) if with_ack else None,
    )
    return Side(state, session, pushed, acks)


async def _via_protobuf(session: IngestSession, data: bytes) -> list[pb.CoordinatorMessage]:
    """``handle_bytes`` without the scanner: parse, wrap a parse error alike, ``handle``."""
    try:
        msg = pb.AgentMessage.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise IngestAbort(
            grpc.StatusCode.INVALID_ARGUMENT, f"malformed AgentMessage: {str(exc) or type(exc).__name__}"
        ) from None
    return await session.handle(msg)


async def _outcome(call: Callable[[], Any]) -> tuple[str, Any]:
    try:
        replies = await call()
    except IngestAbort as exc:
        return "abort", (exc.code, exc.message)
    return "ok", [r.SerializeToString() for r in replies]


def _observe(side: Side) -> dict[str, Any]:
    st = side.state
    rec = st.registry.get(NODE)
    idx = st.index
    assert isinstance(idx, MemoryIndex)
    stats = idx.stats_sync()
    mi = idx._models.get(MODEL)
    metrics: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for fam in st.metrics.registry.collect():
        for s in fam.samples:
            if s.name.endswith("_created") or (fam.type == "histogram" and not s.name.endswith("_count")):
                continue  # timestamps, and lags measured a moment apart
            metrics[(s.name, tuple(sorted(s.labels.items())))] = s.value
    v = st.verifier
    return {
        "rec": None
        if rec is None
        else (
            rec.last_seq,
            rec.resyncing,
            rec.hash_mismatch,
            rec.hash_mismatch_reason,
            rec.verify_seen,
            sorted(rec.indexed),
        ),
        "entries": {r: idx.export_node_sync(MODEL, NODE, r) for r in (*RANKS, 7)},
        "stats": (
            stats.entries,
            stats.blocks,
            stats.nodes,
            stats.entries_by_model_tier,
            stats.blocks_by_model,
        ),
        "skip_groups": None if mi is None else {k: sorted(g) for k, g in mi.skip_groups.items()},
        "applied": dict(st.metrics.applied_by_type),
        "rejected": dict(st.metrics.rejected_by_reason),
        "totals": (st.metrics.hash_mismatch_total, st.metrics.snapshots_requested_total),
        "metrics": metrics,
        "verifier": (v.verified, v.skipped, list(v._lru.items())),
        "pushed": list(side.pushed),
    }


class Pair:
    """Session A (``handle_bytes``: scanner first) and session B (protobuf ``handle``) fed alike."""

    def __init__(self, config: CoordinatorConfig, with_ack: bool) -> None:
        self.a = _side(config, with_ack)
        self.b = _side(config, with_ack)
        self.with_ack = with_ack
        self.scanned = 0
        self.steps = 0

    async def feed(self, data: bytes) -> tuple[str, Any]:
        self.steps += 1
        a, b = self.a, self.b
        if a.session.rec is not None and scan(data) is not None:
            self.scanned += 1
        na, nb = len(a.acks), len(b.acks)
        out_a = await _outcome(lambda: a.session.handle_bytes(data))
        out_b = await _outcome(lambda: _via_protobuf(b.session, data))
        ctx = f"step {self.steps}, data {data.hex()}"
        assert out_a == out_b, ctx
        new_a, new_b = a.acks[na:], b.acks[nb:]
        # Acks are cumulative: a group applied in one call queues only its last one; the protobuf path
        # queues one per batch. The last ack queued, and every ack of A being one of B's, must agree.
        assert new_a[-1:] == new_b[-1:], ctx
        assert all(x in new_b for x in new_a), ctx
        if not self.with_ack:
            assert not new_a and not new_b
        assert _observe(a) == _observe(b), ctx
        return out_a

    @property
    def rec_last(self) -> int:
        rec = self.a.state.registry.get(NODE)
        assert rec is not None
        return rec.last_seq

    @property
    def resyncing(self) -> bool:
        rec = self.a.state.registry.get(NODE)
        return rec is not None and rec.resyncing


def _config(profile: bool) -> CoordinatorConfig:
    models = {MODEL: ModelConfig(MODEL, PROFILE)} if profile else {}
    return CoordinatorConfig(models=models, limits=Limits(max_events_per_batch=LIMIT))


def _msg(*batches: pb.EventBatch, group: bool | None = None) -> bytes:
    if group is False or (group is None and len(batches) == 1):
        assert len(batches) == 1
        return pb.AgentMessage(batch=batches[0]).SerializeToString()
    return pb.AgentMessage(batches=pb.EventBatches(batches=batches)).SerializeToString()


async def _open(pair: Pair, epoch: int = 1) -> None:
    hello = pb.AgentMessage(hello=pb.Hello(node_id=NODE, model=MODEL, epoch=epoch, dp_ranks=list(RANKS)))
    await pair.feed(hello.SerializeToString())
    for rank in RANKS:
        snap = pb.Snapshot(
            epoch=epoch, seq=0, dp_rank=rank, block_hashes=[rank + 100], final=rank == RANKS[-1]
        )
        await pair.feed(pb.AgentMessage(snapshot=snap).SerializeToString())


class Chains:
    """Block chains hashed with ``PROFILE``, so the verifier has something to verify."""

    def __init__(self) -> None:
        self.tails: list[tuple[int, bytes]] = []

    def event(self, rng: random.Random, *, wrong: bool = False, medium: str = "") -> pb.KVEvent:
        n = rng.randint(1, 3)
        bs = PROFILE.block_size
        tokens = [rng.randrange(1000) for _ in range(n * bs)]
        tail = rng.choice(self.tails) if self.tails and rng.random() < 0.6 else None
        parent = tail[1] if tail is not None else None
        hashes: list[int] = []
        for i in range(n):
            parent = hash_block_tokens(PROFILE, parent, tokens[i * bs : (i + 1) * bs], None)
            hashes.append(to_block_hash64(parent))
        assert parent is not None
        if wrong:
            hashes[-1] ^= 1
        else:
            self.tails.append((hashes[-1], parent))
        s = pb.BlockStored(
            block_hashes=hashes,
            token_ids=tokens,
            block_size=bs,
            medium=medium,
            extra_keys_msgpack=_nil_array(n),
        )
        if tail is not None:
            s.parent_block_hash = tail[0]
        return pb.KVEvent(stored=s)


BAD_EVENTS = [
    pb.KVEvent(stored=pb.BlockStored(block_hashes=[5], medium="bogus")),
    pb.KVEvent(stored=pb.BlockStored(block_hashes=[5], medium="disk")),
    pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[5], medium="bogus")),
    pb.KVEvent(stored=pb.BlockStored(block_hashes=[5], group_idx=-2)),
    pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[5], group_idx=-1)),
    pb.KVEvent(stored=pb.BlockStored(block_hashes=[5], token_ids=[1, 2, 3], block_size=2)),
    pb.KVEvent(stored=pb.BlockStored(block_digests=[b""])),
    pb.KVEvent(stored=pb.BlockStored(block_hashes=[5], extra_keys_msgpack=b"\xc1")),
    pb.KVEvent(),
]


def _good_event(rng: random.Random, chains: Chains | None, medium: str, group: int | None) -> pb.KVEvent:
    r = rng.random()
    if chains is not None and r < 0.5:
        return chains.event(rng, wrong=rng.random() < 0.05, medium=medium)
    if r < 0.7:
        n = rng.randint(0, 4)
        s = pb.BlockStored(
            block_hashes=[rng.choice([0, U64, rng.randrange(64), rng.getrandbits(64)]) for _ in range(n)],
            medium=medium,
            extra_keys_msgpack=_nil_array(n),
        )
        if chains is not None and rng.random() < 0.98:
            s.block_size = PROFILE.block_size  # no token ids: not verifiable, and not a mismatch either
        if group is not None:
            s.group_idx = group
        if rng.random() < 0.2:
            s.kv_cache_spec_kind = rng.choice(["full_attention", "sliding_window"])
        if rng.random() < 0.5:
            s.parent_block_hash = rng.randrange(64)
        return pb.KVEvent(stored=s)
    if r < 0.95:
        rm = pb.BlockRemoved(
            block_hashes=[rng.randrange(64) for _ in range(rng.randint(0, 4))], medium=medium
        )
        if group is not None:
            rm.group_idx = group
        return pb.KVEvent(removed=rm)
    return pb.KVEvent(cleared=pb.AllBlocksCleared())


def _random_batch(
    rng: random.Random, seq: int, chains: Chains | None, *, bad: float, size: int | None = None
) -> pb.EventBatch:
    rank = rng.choice(RANKS) if rng.random() < 0.95 else 7
    medium = rng.choice(["", "", "GPU", "CPU", "cpu"])
    group = rng.choice([None, None, 0, 1])
    n = size if size is not None else rng.randint(0, 5)
    events = []
    for _ in range(n):
        if rng.random() < 0.3:  # runs of stores to one target get merged by the scanner
            medium, group = rng.choice(["", "GPU", "CPU"]), rng.choice([None, 0, 1])
        events.append(_good_event(rng, chains, medium, group))
    if events and rng.random() < bad:
        events[rng.randrange(len(events))] = rng.choice(BAD_EVENTS)
    b = pb.EventBatch(seq=seq, dp_rank=rank, events=events)
    if rng.random() < 0.5:
        b.ts = rng.choice([1.0, 1.7e9, 4e9])
    return b


async def _random_stream(
    pair: Pair, rng: random.Random, chains: Chains | None, steps: int, *, bad: float, mutate: bool = True
) -> None:
    """Hello, snapshot, then ``steps`` messages; with ``mutate``, some are mangled or oversized (these
    usually abort the stream, which ends it)."""
    await _open(pair)
    for _ in range(steps):
        r = rng.random()
        if pair.resyncing and r < 0.5:  # answer the SnapshotRequest, so the stream goes on
            snap = pb.Snapshot(
                epoch=1,
                seq=pair.rec_last + rng.randint(0, 3),
                dp_rank=0,
                final=True,
                block_hashes=[rng.randrange(64) for _ in range(3)],
            )
            await pair.feed(pb.AgentMessage(snapshot=snap).SerializeToString())
            continue
        if r < 0.05:
            await pair.feed(pb.AgentMessage(heartbeat=pb.AgentHeartbeat()).SerializeToString())
            continue
        k = rng.choice([1, 1, 2, 3, 5])
        seq = pair.rec_last + 1
        batches = []
        for _ in range(k):
            s = seq
            p = rng.random()
            if p < 0.06:
                s = max(0, seq - rng.randint(1, 3))  # duplicate
            elif p < 0.1:
                s = seq + rng.randint(1, 3)  # gap
            size = LIMIT + rng.randint(1, 2) if mutate and rng.random() < 0.03 else None
            batches.append(_random_batch(rng, s, chains, bad=bad, size=size))
            seq = s + 1
        data = _msg(*batches, group=None if k > 1 else rng.random() < 0.2)
        if mutate and rng.random() < 0.05:
            fields = parse(data, "AgentMessage")
            mutate_tree(rng, fields)
            data = encode(fields)
        elif mutate and rng.random() < 0.03:
            data = mutate_bytes(rng, data)
        kind, _ = await pair.feed(data)
        if kind == "abort":
            return


@needs_scan
@settings(SETTINGS, max_examples=150)
@given(st.integers(0, 2**32), st.booleans(), st.booleans(), st.integers(1, 30))
def test_sessions_agree(seed: int, profile: bool, with_ack: bool, steps: int) -> None:
    _need_packed()
    rng = random.Random(seed)
    pair = Pair(_config(profile), with_ack)
    chains = Chains() if profile else None
    asyncio.run(_random_stream(pair, rng, chains, steps, bad=0.15))


@needs_scan
def test_sessions_agree_long_runs() -> None:
    """A few longer deterministic streams, counting that the scanner really carried most batches."""
    _need_packed()
    scanned = steps = 0
    for seed in range(6):
        rng = random.Random(seed)
        profile = seed % 2 == 0
        pair = Pair(_config(profile), with_ack=seed % 3 != 0)
        asyncio.run(_random_stream(pair, rng, Chains() if profile else None, 120, bad=0.1, mutate=False))
        scanned += pair.scanned
        steps += pair.steps
    assert scanned > steps // 2, (scanned, steps)


def _need_packed() -> None:
    if not MemoryIndex().takes_packed:
        if REQUIRED:
            pytest.fail(
                "MemoryIndex has no C core (kvcoord._indexcore) though KVCOORD_REQUIRE_SPEEDUPS is set"
            )
        pytest.skip("MemoryIndex without its C core never takes the scanner's path")


def _stores(*media: str, group: int | None = None) -> list[pb.KVEvent]:
    out = []
    for i, medium in enumerate(media):
        s = pb.BlockStored(block_hashes=[10 + i, 20 + i], medium=medium, extra_keys_msgpack=_nil_array(2))
        if group is not None:
            s.group_idx = group
        out.append(pb.KVEvent(stored=s))
    return out


EXPLICIT: dict[str, list[list[pb.EventBatch]]] = {
    "bad medium in the 3rd of 4 stores": [
        [pb.EventBatch(seq=1, events=_stores("GPU", "GPU", "bogus", "GPU"))]
    ],
    "bad medium after a merged run": [
        [pb.EventBatch(seq=1, events=[*_stores("", "", ""), pb.KVEvent(removed=pb.BlockRemoved(medium="x"))])]
    ],
    "bad kind inside a run": [
        [pb.EventBatch(seq=1, events=[*_stores("CPU", "CPU"), *_stores("disk"), *_stores("CPU")])]
    ],
    "group: bad 2nd batch": [
        [
            pb.EventBatch(seq=1, events=_stores("", "")),
            pb.EventBatch(seq=2, events=_stores("", "bogus", "")),
            pb.EventBatch(seq=3, events=_stores("CPU")),
        ]
    ],
    "group: oversized 3rd batch": [
        [
            pb.EventBatch(seq=1, events=_stores("")),
            pb.EventBatch(seq=2, events=_stores("")),
            pb.EventBatch(seq=3, events=_stores(*[""] * (LIMIT + 1))),
        ]
    ],
    "group: wrong rank in the middle": [
        [
            pb.EventBatch(seq=1, events=_stores("")),
            pb.EventBatch(seq=2, dp_rank=7, events=_stores("")),
            pb.EventBatch(seq=3, events=_stores("")),
        ]
    ],
    "group: mixed ranks": [
        [pb.EventBatch(seq=1, events=_stores("")), pb.EventBatch(seq=2, dp_rank=1, events=_stores("CPU"))]
    ],
    "group: duplicate then new": [
        [pb.EventBatch(seq=1, events=_stores(""))],
        [pb.EventBatch(seq=1, events=_stores("")), pb.EventBatch(seq=2, events=_stores("GPU"))],
    ],
    "group: all good": [
        [pb.EventBatch(seq=s, dp_rank=1, events=_stores("", "", "CPU", group=0)) for s in range(1, 5)]
    ],
    "group: gap": [[pb.EventBatch(seq=2, events=_stores("")), pb.EventBatch(seq=3, events=_stores(""))]],
    "skipped groups then removal": [
        [
            pb.EventBatch(
                seq=1,
                events=[
                    pb.KVEvent(
                        stored=pb.BlockStored(
                            block_hashes=[1], group_idx=1, kv_cache_spec_kind="sliding_window"
                        )
                    ),
                    pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], group_idx=0)),
                    pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[1], group_idx=1)),
                ],
            ),
            pb.EventBatch(seq=2, events=[pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[1], group_idx=0))]),
        ]
    ],
}


@needs_scan
@pytest.mark.parametrize("with_ack", [False, True])
@pytest.mark.parametrize("case", list(EXPLICIT))
def test_sessions_agree_explicit(case: str, with_ack: bool) -> None:
    _need_packed()

    pair = Pair(_config(False), with_ack)

    async def run() -> list[tuple[str, Any]]:
        await _open(pair)
        outs = []
        for batches in EXPLICIT[case]:
            data = _msg(*batches)
            assert scan(data) is not None, "the scanner must carry this case"
            outs.append(await pair.feed(data))
        return outs

    outs = asyncio.run(run())
    if case == "bad medium in the 3rd of 4 stores":
        kind, replies = outs[0]
        assert kind == "ok"
        reason = pb.CoordinatorMessage.FromString(replies[0]).snapshot_request.reason
        assert "event 2:" in reason and "bogus" in reason, reason
    if case == "group: all good" and with_ack:
        # applied as one group (one index call) where protobuf applies each batch; either way the group
        # gets one cumulative Ack, as a reply, after its last batch
        assert outs[0] == ("ok", [pb.CoordinatorMessage(ack=pb.Ack(epoch=1, seq=4)).SerializeToString()])
        assert pair.a.acks == [] and pair.b.acks == []
    if case == "group: oversized 3rd batch":
        assert outs[0] == (
            "abort",
            (
                grpc.StatusCode.INVALID_ARGUMENT,
                f"batch 3 has {LIMIT + 1} events; max_events_per_batch is {LIMIT}",
            ),
        )


def test_wirescan_built_when_required() -> None:
    """CI sets KVCOORD_REQUIRE_SPEEDUPS=1: the scanner must then be built, not silently skipped."""
    if _wirescan is None:
        if REQUIRED:
            pytest.fail("kvcoord._wirescan is not built (needs a C compiler and the Python headers)")
        pytest.skip("optional C extension kvcoord._wirescan not built; ingest parses with protobuf")
    assert callable(_wirescan.scan)
    assert (_wirescan.STORE, _wirescan.REMOVE, _wirescan.CLEAR) == (0, 1, 2)
    state = CoordinatorState(CoordinatorConfig(), MemoryIndex())
    session = IngestSession(state, OPEN_PRINCIPAL)
    assert session._scan is _wirescan.scan or not MemoryIndex().takes_packed
