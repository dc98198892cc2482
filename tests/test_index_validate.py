"""The one rule set (kvcoord.validate) that turns events into index ops: the accepted shapes, the
InvalidEvent messages, and the wire's conversion (kvcoord.wire) applying the same rules."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvcoord import validate
from kvcoord.engine.mirror import BlockMirror
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier, py_u64_ok, u64_ok
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.redis.writes import compile_ops
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import InvalidEvent, ops_of, snapshot_columns
from kvcoord.wire import event_to_proto, ops_from_proto

U64_CHECKS = [pytest.param(py_u64_ok, id="py"), pytest.param(u64_ok, id="native")]


@pytest.mark.parametrize("u64_ok", U64_CHECKS)
def test_the_native_all_good_check_answers_as_the_python_one(u64_ok: Callable[[object], bool]) -> None:
    assert u64_ok([5, 7]) and u64_ok((2, 2**64 - 1)) and u64_ok([])  # (0 and 1 may take the slow path)
    for bad in ([True], [3, 2.5], [2**64], [-1], [b"x"], "ab", b"ab", {1, 2}, None):
        assert not u64_ok(bad), bad


def test_hashes_accept_any_ordered_sequence() -> None:
    assert list(validate.hashes64([5, 7], "e")) == [5, 7]
    assert list(validate.hashes64((0, 1, 2**64 - 1), "e")) == [0, 1, 2**64 - 1]
    assert list(validate.hashes64(range(3, 5), "e")) == [3, 4]
    assert list(validate.hashes64([bytes(24) + (9).to_bytes(8, "big")], "e")) == [9]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([True], "e: block_hashes[0]: block hash must be int or bytes, not bool"),
        ([3, 2.5], "e: block_hashes[1]: block hash must be int or bytes, not float"),
        ([2**64], "e: block_hashes[0]: block hash 18446744073709551616 is outside uint64"),
        ([-1], "e: block_hashes[0]: block hash -1 is outside uint64"),
        ([b""], "e: block_hashes[0]: block hash is an empty digest"),
        ("ab", "e: block_hashes must be a list, not str"),
        (b"ab", "e: block_hashes must be a list, not bytes"),
        ({1, 2}, "e: block_hashes must be a list, not set"),
    ],
)
def test_hashes_reject(raw: object, message: str) -> None:
    with pytest.raises(InvalidEvent) as ei:
        validate.hashes64(raw, "e")
    assert str(ei.value) == message


def test_tier_group_target_kind_rules() -> None:
    assert validate.tier(None, "e") == 0 and validate.tier("cpu", "e") == Tier.CPU
    assert validate.tier("TAPE", "e") is None  # unknown: its events are skipped, not refused
    assert validate.tier(" shared_storage ", "e") == Tier.STORAGE
    with pytest.raises(InvalidEvent, match=r"^e: medium must be a string, not int$"):
        validate.tier(1, "e")
    assert validate.group(None, "e") is None and validate.group(3, "e") == 3
    for bad in (True, -1, "1"):
        with pytest.raises(InvalidEvent, match=r"^e: group_idx must be a non-negative int"):
            validate.group(bad, "e")
    assert validate.indexable_kind(None, "e") and validate.indexable_kind("mla_attention", "e")
    assert not validate.indexable_kind("sliding_window", "e")
    with pytest.raises(InvalidEvent, match=r"^e: kv_cache_spec_kind must be a string$"):
        validate.indexable_kind(3, "e")
    validate.check_target("m", "n", 0)
    with pytest.raises(InvalidEvent, match=r"^dp_rank must be a non-negative int, not True$"):
        validate.check_target("m", "n", True)
    with pytest.raises(InvalidEvent, match=r"^node_id must be a non-empty string, not ''$"):
        validate.check_target("m", "", 0)


def test_snapshot_columns_and_tiers() -> None:
    hashes, tiers = snapshot_columns([(5, Tier.CPU), (b"\x07", 0), (6, 2)])
    assert validate.snapshot_per_tier(hashes, tiers) == [[7], [5], [6]]
    assert [list(t) for t in validate.snapshot_per_tier([1, 2])] == [[1, 2], [], []]
    with pytest.raises(InvalidEvent, match=r"^snapshot entry 1: tier must be a Tier, not 3$"):
        snapshot_columns([(5, 0), (6, 3)])
    with pytest.raises(InvalidEvent, match=r"^snapshot entry 0 must be \(hash, tier\)"):
        snapshot_columns([5])  # type: ignore[list-item]
    with pytest.raises(InvalidEvent, match=r"^snapshot: block_hashes\[0\]: block hash must be"):
        validate.snapshot_per_tier([True])
    with pytest.raises(InvalidEvent, match=r"^snapshot has 2 block_hashes but 1 tiers$"):
        validate.snapshot_per_tier([1, 2], b"\x01")
    with pytest.raises(InvalidEvent, match=r"^snapshot has an unknown tier 7$"):
        validate.snapshot_per_tier([1], b"\x07")


def test_packed_hashes_round_trip_and_refuse_a_ragged_buffer() -> None:
    values = [0, 1, 2**63, 2**64 - 1]
    assert list(validate.unpack_u64(validate.pack_u64(values), "e")) == values
    with pytest.raises(InvalidEvent, match=r"^e: block_hashes is 9 bytes, not a multiple of 8$"):
        validate.unpack_u64(bytes(9), "e")
    with pytest.raises(ValueError, match=r"0\.\.2\*\*64-1"):
        validate.pack_u64([2**64])


BAD_BATCH = [BlockStored((5, 6), None, (), 16), BlockRemoved((True,), "GPU")]
BAD_MESSAGE = "event 1: block_hashes[0]: block hash must be int or bytes, not bool"


def test_every_consumer_refuses_the_same_batch_alike() -> None:
    """The mirror and the indexes take ops only, made by one rule set: the same message, and nothing
    applied anywhere."""
    idx = MemoryIndex()
    mirror = BlockMirror()
    for refuse in (lambda: ops_of(BAD_BATCH), lambda: mirror.apply(0, BAD_BATCH)):
        with pytest.raises(InvalidEvent) as ei:
            refuse()
        assert str(ei.value) == BAD_MESSAGE
    assert idx.stats_sync().entries == 0
    assert mirror.ranks() == []


def test_the_wire_carries_ops_exactly_and_refuses_what_the_rules_refuse() -> None:
    events = [BlockStored((5, 6), 4, (1,) * 32, 16, medium="CPU", group_idx=2),
              BlockStored((9,), None, (2,) * 16, 16, kv_cache_spec_kind="sliding_window"),
              BlockRemoved((5,), "DISK", group_idx=1), AllBlocksCleared()]
    ops = ops_of(events)
    wire = [event_to_proto(op, ev) for op, ev in zip(ops, events, strict=True)]
    back = ops_from_proto(wire)
    assert [(o.kind, o.tier, list(o.hashes), o.group, o.indexable) for o in back] == [
        (o.kind, o.tier, list(o.hashes), o.group, o.indexable) for o in ops]
    bad_tier = pb.KVEvent(removed=pb.BlockRemoved(block_hashes=bytes(8), tier=7))  # type: ignore[arg-type]
    with pytest.raises(InvalidEvent, match=r"^event 1: unknown tier 7$"):
        ops_from_proto([wire[0], bad_tier])
    with pytest.raises(InvalidEvent, match=r"^event 0: block_hashes is 3 bytes"):
        ops_from_proto([pb.KVEvent(stored=pb.BlockStored(block_hashes=b"abc"))])
    with pytest.raises(InvalidEvent, match=r"^event 0: KVEvent has no event set$"):
        ops_from_proto([pb.KVEvent()])


def test_every_backend_takes_ops_of_a_non_list_sequence() -> None:
    batch = [BlockStored(range(5, 8), None, (), 16, medium="CPU"), AllBlocksCleared()]  # type: ignore[arg-type]
    ops, skipped = compile_ops(ops_of(batch[:1]))
    assert skipped == 0 and ops == [("S1", b"".join(h.to_bytes(8, "big") for h in (5, 6, 7)))]
    idx = MemoryIndex()
    assert idx.apply_sync("m", "n", 0, ops_of(batch[:1])).stored == 3
    mirror = BlockMirror()
    mirror.apply(0, batch[:1])
    assert sorted(mirror.snapshot()[0]) == [(5, Tier.CPU), (6, Tier.CPU), (7, Tier.CPU)]
