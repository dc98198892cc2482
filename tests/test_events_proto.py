"""The protobuf codec is lossless for everything the index and hash verification need, and rejects
inconsistent messages with a precise reason."""

from __future__ import annotations

import contextlib
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, KVEventBatch, Tier
from kvcoord.events_proto import (
    batch_from_proto,
    batch_to_proto,
    event_from_proto,
    event_to_proto,
    event_to_wire,
    events_for_index,
    events_from_proto,
    events_to_wire,
    tier_from_proto,
    tier_to_proto,
)
from kvcoord.proto.v1 import kvcoord_pb2 as pb
from tests.procs import FIXTURES

u64 = st.integers(min_value=0, max_value=2**64 - 1)
digest = st.binary(min_size=1, max_size=32)
medium = st.one_of(st.none(), st.sampled_from(["GPU", "CPU", "CPU_PINNED", "DISK", "cpu"]))
leaf = st.one_of(
    st.text(max_size=8),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.binary(max_size=16),
    st.tuples(st.text(max_size=8), st.integers(min_value=0, max_value=10_000)),
)
block_keys = st.one_of(st.none(), st.lists(leaf, max_size=3).map(tuple))
extra = st.one_of(st.none(), st.lists(block_keys, max_size=4).map(tuple))


opt_text = st.one_of(st.none(), st.text(max_size=8))


@st.composite
def stored(draw: st.DrawFn) -> BlockStored:
    n = draw(st.integers(min_value=0, max_value=4))
    hashes = draw(st.one_of(st.lists(u64, min_size=n, max_size=n), st.lists(digest, min_size=n, max_size=n)))
    bs = draw(st.integers(min_value=1, max_value=8))
    with_tokens = draw(st.booleans())
    tokens = draw(st.lists(st.integers(0, 2**32), min_size=n * bs, max_size=n * bs)) if with_tokens else []
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=draw(st.one_of(st.none(), u64, digest)),
        token_ids=tuple(tokens),
        block_size=bs,
        lora_id=draw(st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1))),
        medium=draw(medium),
        lora_name=draw(st.one_of(st.none(), st.text(max_size=10))),
        extra_keys=draw(extra),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 2**31 - 1))),
        kv_cache_spec_kind=draw(
            st.one_of(st.none(), st.sampled_from(["full_attention", "sliding_window", ""]))
        ),
        kv_cache_spec_sliding_window=draw(st.one_of(st.none(), st.integers(0, 4096))),
        locality=draw(opt_text),
        ownership=draw(opt_text),
        session_id=draw(opt_text),
        lookahead_token_ids=draw(st.one_of(
            st.none(), st.lists(st.lists(u64, max_size=4).map(tuple), max_size=3).map(tuple))),
    )


@st.composite
def removed(draw: st.DrawFn) -> BlockRemoved:
    hashes = draw(st.one_of(st.lists(u64, max_size=5), st.lists(digest, max_size=5)))
    return BlockRemoved(
        block_hashes=tuple(hashes),
        medium=draw(medium),
        group_idx=draw(st.one_of(st.none(), st.integers(0, 7))),
        locality=draw(opt_text),
        ownership=draw(opt_text),
    )


events = st.one_of(stored(), removed(), st.just(AllBlocksCleared()))


@settings(max_examples=300, deadline=None)
@given(events)
def test_event_round_trip(ev: KVEvent) -> None:
    msg = event_to_proto(ev)
    wire = pb.KVEvent.FromString(msg.SerializeToString())
    assert event_from_proto(wire) == ev


@settings(max_examples=300, deadline=None)
@given(events)
def test_event_to_wire_parses_to_the_same_message(ev: KVEvent) -> None:
    """The agent's fast encoder (token ids packed in C) is the protobuf encoder, field for field."""
    assert pb.KVEvent.FromString(event_to_wire(ev)) == event_to_proto(ev)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=64))
def test_event_to_wire_packs_every_uint64_token(tokens: list[int]) -> None:
    ev = BlockStored(block_hashes=(7,) * len(tokens), parent_block_hash=3, token_ids=tuple(tokens),
                     block_size=1)
    assert list(pb.KVEvent.FromString(event_to_wire(ev)).stored.token_ids) == tokens
    assert pb.KVEvent.FromString(event_to_wire(ev)) == event_to_proto(ev)


@settings(max_examples=100, deadline=None)
@given(st.lists(events, max_size=6), st.floats(0, 2e9), st.one_of(st.none(), st.integers(0, 7)),
       st.integers(1, 2**64 - 1))
def test_batch_round_trip(evs: list[KVEvent], ts: float, rank: int | None, seq: int) -> None:
    batch = KVEventBatch(ts=ts, events=tuple(evs), data_parallel_rank=rank)
    msg = pb.EventBatch.FromString(batch_to_proto(batch, seq).SerializeToString())
    assert msg.seq == seq
    assert batch_from_proto(msg) == batch


def test_absent_dp_rank_is_distinct_from_rank_zero() -> None:
    none = batch_to_proto(KVEventBatch(ts=1.0, events=(), data_parallel_rank=None), 1)
    zero = batch_to_proto(KVEventBatch(ts=1.0, events=(), data_parallel_rank=0), 1)
    assert none.dp_rank == zero.dp_rank == 0 and none.dp_rank_absent and not zero.dp_rank_absent
    assert batch_from_proto(none).data_parallel_rank is None
    assert batch_from_proto(zero).data_parallel_rank == 0
    with pytest.raises(ValueError, match="dp_rank_absent is set but dp_rank is 3"):
        batch_from_proto(pb.EventBatch(dp_rank=3, dp_rank_absent=True))


def test_tokens_false_validates_alike_but_skips_token_tuples() -> None:
    ev = BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=(5, 6, 7, 8), block_size=2,
                     lookahead_token_ids=((1, 2),), session_id="s")
    back = event_from_proto(event_to_proto(ev), tokens=False)
    assert back == BlockStored(block_hashes=(1, 2), parent_block_hash=None, token_ids=(), block_size=2,
                               lookahead_token_ids=(), session_id="s")
    bad = pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], token_ids=[1, 2, 3], block_size=2))
    with pytest.raises(ValueError, match="not a multiple of block_size"):
        event_from_proto(bad, tokens=False)


def test_real_engine_fixture_round_trips() -> None:
    fx = json.loads((FIXTURES / "vllm-engine" / "kv_event_base.json").read_text())
    ev = BlockStored(
        block_hashes=tuple(fx["block_hashes"]),
        parent_block_hash=fx["parent_block_hash"],
        token_ids=tuple(fx["token_ids"]),
        block_size=fx["block_size"],
        medium=fx["medium"],
    )
    msg = event_to_proto(ev)
    assert list(msg.stored.block_hashes) == fx["block_hashes"]
    assert not msg.stored.block_digests
    assert msg.stored.extra_keys_msgpack == b""
    assert event_from_proto(msg) == ev


def test_forms_and_defaults_map_exactly() -> None:
    ev = BlockStored(block_hashes=(b"\x01" * 32,), parent_block_hash=b"\x02" * 32, token_ids=(),
                     block_size=16, extra_keys=(("Alice", ("mm", 3)),))
    msg = event_to_proto(ev).stored
    assert list(msg.block_digests) == [b"\x01" * 32] and not msg.block_hashes
    assert msg.HasField("parent_block_digest") and not msg.HasField("parent_block_hash")
    assert msg.medium == "" and not msg.HasField("lora_id")
    back = event_from_proto(event_to_proto(ev))
    assert isinstance(back, BlockStored)
    assert back.extra_keys == (("Alice", ("mm", 3)),)
    assert isinstance(back.extra_keys[0], tuple)
    assert back.medium is None


def test_tiers_share_numbers() -> None:
    for t in Tier:
        assert tier_from_proto(tier_to_proto(t)) is t
        assert pb.Tier.Name(tier_to_proto(t)) == f"TIER_{t.name}"
    with pytest.raises(ValueError, match="unknown tier 9"):
        tier_from_proto(9)


@pytest.mark.parametrize(
    ("msg", "reason"),
    [
        (pb.KVEvent(), "no event set"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], block_digests=[b"x"])), "both block_hashes"),
        (pb.KVEvent(removed=pb.BlockRemoved(block_hashes=[1], block_digests=[b"x"])), "both block_hashes"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], parent_block_hash=1, parent_block_digest=b"p")),
         "both parent_block_hash and parent_block_digest"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], token_ids=[1, 2, 3], block_size=2)),
         "3 token_ids is not a multiple of block_size 2"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], token_ids=[1, 2], block_size=0)),
         "block_size is 0"),
        (pb.KVEvent(stored=pb.BlockStored(block_digests=[b""])), "block_digests\\[0\\] is empty"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], extra_keys_msgpack=b"\xc1")),
         "not valid msgpack"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], extra_keys_msgpack=b"\x01")),
         "must hold an array"),
        (pb.KVEvent(stored=pb.BlockStored(block_hashes=[1], extra_keys_msgpack=b"\x91\x01")),
         "extra_keys\\[0\\] must be an array or nil"),
    ],
)
def test_inconsistent_messages_are_rejected(msg: pb.KVEvent, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        event_from_proto(msg)


def test_bad_event_in_list_names_its_index_and_decodes_nothing() -> None:
    good = event_to_proto(BlockRemoved(block_hashes=(1,)))
    with pytest.raises(ValueError, match=r"^event 1: KVEvent has no event set"):
        events_from_proto([good, pb.KVEvent(), good])


@pytest.mark.parametrize(
    ("ev", "reason"),
    [
        (BlockRemoved(block_hashes=(1, b"x")), "mixes int and bytes"),
        (BlockRemoved(block_hashes=(-1,)), "outside uint64"),
        (BlockRemoved(block_hashes=(2**64,)), "outside uint64"),
        (BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(-5,), block_size=1),
         "not a uint64 token id"),
        (BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(), block_size=1,
                     extra_keys=((object(),),)), "extra_keys cannot be encoded"),
        (BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(), block_size=1, group_idx=2**40),
         "group_idx"),
        (BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(True,), block_size=1),
         "not a uint64 token id"),
        (BlockStored(block_hashes=(1,), parent_block_hash=None, token_ids=(), block_size=1,
                     lookahead_token_ids=((2**64,),)), "lookahead_token_ids\\[0\\]"),
        (BlockRemoved(block_hashes=(True,)), "hash must be int or bytes"),
        (BlockRemoved(block_hashes=(1,), locality=3), "locality must be a string"),  # type: ignore[arg-type]
    ],
)
def test_unencodable_events_are_rejected(ev: KVEvent, reason: str) -> None:
    with pytest.raises(ValueError, match=reason):
        event_to_proto(ev)
    with pytest.raises(ValueError, match=reason):
        event_to_wire(ev)
    with pytest.raises(ValueError, match="^event 1: .*" + reason):
        events_to_wire([AllBlocksCleared(), ev])


# --- events_for_index: merged runs apply exactly like the events one by one -----------------------
@st.composite
def index_event(draw: st.DrawFn) -> pb.KVEvent:
    kind = draw(st.sampled_from(["stored", "stored", "stored", "removed", "cleared"]))
    digests = draw(st.booleans()) and draw(st.booleans())
    hashes = draw(st.lists(st.integers(1, 12), max_size=4))
    med = draw(st.sampled_from(["", "GPU", "CPU", "cpu_pinned", "TAPE"]))
    group = draw(st.sampled_from([None, None, 0, 1, -1]))
    if kind == "cleared":
        return pb.KVEvent(cleared=pb.AllBlocksCleared())
    if kind == "removed":
        r = pb.BlockRemoved(medium=med)
        if digests:
            r.block_digests.extend(h.to_bytes(8, "big") for h in hashes)
        else:
            r.block_hashes.extend(hashes)
        if group is not None:
            r.group_idx = group
        return pb.KVEvent(removed=r)
    s = pb.BlockStored(medium=med, block_size=2)
    if digests:
        s.block_digests.extend(h.to_bytes(8, "big") for h in hashes)
    else:
        s.block_hashes.extend(hashes)
    if draw(st.booleans()):
        s.token_ids.extend(range(2 * len(hashes)))
    if group is not None:
        s.group_idx = group
    spec = draw(st.sampled_from([None, None, "full_attention", "sliding_window"]))
    if spec is not None:
        s.kv_cache_spec_kind = spec
    return pb.KVEvent(stored=s)


@settings(max_examples=300, deadline=None)
@given(st.lists(index_event(), max_size=5), st.lists(index_event(), max_size=8))
def test_events_for_index_apply_like_one_by_one(before: list[pb.KVEvent], batch: list[pb.KVEvent]) -> None:
    from kvcoord.index.base import InvalidEvent
    from kvcoord.index.memory import MemoryIndex

    def run(decode: object) -> object:
        idx = MemoryIndex()
        with contextlib.suppress(InvalidEvent):
            idx.apply_sync("m", "n", 0, events_from_proto(before, tokens=False))
        try:
            res: object = idx.apply_sync("m", "n", 0, decode(batch))  # type: ignore[operator]
        except InvalidEvent as exc:
            res = f"InvalidEvent: {exc}"
        return res, idx.export_node_sync("m", "n", 0), idx.match_sync("m", list(range(1, 13)))

    one_by_one = run(lambda b: events_from_proto(b, tokens=False))
    assert run(events_for_index) == one_by_one


def test_events_for_index_merges_runs_and_names_bad_events_as_decoding_does() -> None:
    evs = [event_to_proto(BlockStored(block_hashes=(i, i + 100), parent_block_hash=i - 1 or None,
                                      token_ids=(1, 2, 3, 4), block_size=2)) for i in range(1, 4)]
    evs.insert(2, event_to_proto(BlockRemoved(block_hashes=(1,))))
    out = events_for_index(evs)
    assert [type(e).__name__ for e in out] == ["BlockStored", "BlockRemoved", "BlockStored"]
    assert isinstance(out[0], BlockStored) and out[0].block_hashes == (1, 101, 2, 102)
    bad = [*evs, pb.KVEvent()]
    with pytest.raises(ValueError, match=r"^event 4: KVEvent has no event set"):
        events_for_index(bad)
