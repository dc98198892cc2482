"""The shared input rules (kvcoord.index.validate) that the memory and Redis backends and the relay's
mirror all apply: same accepted shapes, same InvalidEvent messages."""

from __future__ import annotations

import pytest

from kvcoord.agent.relay import BlockMirror
from kvcoord.events import AllBlocksCleared, BlockRemoved, BlockStored, Tier
from kvcoord.index import validate
from kvcoord.index.base import InvalidEvent
from kvcoord.index.memory import MemoryIndex
from kvcoord.index.redis import compile_events

U64_CHECKS = [pytest.param(validate.py_u64_ok, id="py"), pytest.param(validate.fast_u64_ok, id="fast")]


@pytest.mark.parametrize("u64_ok", U64_CHECKS)
def test_hashes_accept_any_ordered_sequence(u64_ok: validate.U64Check) -> None:
    assert list(validate.hashes64([5, 7], "e", u64_ok)) == [5, 7]
    assert list(validate.hashes64((0, 1, 2**64 - 1), "e", u64_ok)) == [0, 1, 2**64 - 1]
    assert list(validate.hashes64(range(3, 5), "e", u64_ok)) == [3, 4]
    assert list(validate.hashes64([bytes(24) + (9).to_bytes(8, "big")], "e", u64_ok)) == [9]


@pytest.mark.parametrize("u64_ok", U64_CHECKS)
@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ([True], "e: block_hashes[0]: block hash must be int or bytes, not bool"),
        ([3, 2.5], "e: block_hashes[1]: block hash must be int or bytes, not float"),
        ([2**64], "e: block_hashes[0]: block hash 18446744073709551616 is outside uint64"),
        ([-1], "e: block_hashes[0]: block hash -1 is outside uint64"),
        ([b""], "e: block_hashes[0] is an empty digest"),
        ("ab", "e: block_hashes must be a list, not str"),
        (b"ab", "e: block_hashes must be a list, not bytes"),
        ({1, 2}, "e: block_hashes must be a list, not set"),
    ],
)
def test_hashes_reject(u64_ok: validate.U64Check, raw: object, message: str) -> None:
    with pytest.raises(InvalidEvent) as ei:
        validate.hashes64(raw, "e", u64_ok)
    assert str(ei.value) == message


def test_tier_group_target_kind_rules() -> None:
    assert validate.tier(None, "e") == 0 and validate.tier("cpu", "e") == Tier.CPU
    with pytest.raises(InvalidEvent, match=r"^e: unknown medium 'TAPE'"):
        validate.tier("TAPE", "e")
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


def test_snapshot_per_tier() -> None:
    assert validate.snapshot_per_tier([(5, Tier.CPU), (b"\x07", 0), (6, 2)]) == [[7], [5], [6]]
    with pytest.raises(InvalidEvent, match=r"^snapshot entry 1: tier must be a Tier, not 3$"):
        validate.snapshot_per_tier([(5, 0), (6, 3)])
    with pytest.raises(InvalidEvent, match=r"^snapshot entry 0 must be \(hash, tier\)"):
        validate.snapshot_per_tier([5])
    with pytest.raises(InvalidEvent, match=r"^snapshot entry 0: block_hashes\[0\]: block hash must be"):
        validate.snapshot_per_tier([(True, 0)])


BAD_BATCH = [BlockStored((5, 6), None, (), 16), BlockRemoved((True,), "GPU")]
BAD_MESSAGE = "event 1: block_hashes[0]: block hash must be int or bytes, not bool"


def test_every_consumer_refuses_the_same_batch_alike() -> None:
    """The memory index, the Redis op compiler and the relay's mirror share one rule set: the same
    message, and nothing applied."""
    idx = MemoryIndex()
    mirror = BlockMirror()
    for refuse in (
        lambda: idx.apply_sync("m", "n", 0, BAD_BATCH),
        lambda: compile_events(BAD_BATCH),
        lambda: mirror.apply(0, BAD_BATCH),
    ):
        with pytest.raises(InvalidEvent) as ei:
            refuse()
        assert str(ei.value) == BAD_MESSAGE
    assert idx.stats_sync().entries == 0
    assert mirror.ranks() == []


def test_every_consumer_takes_a_non_list_sequence() -> None:
    batch = [BlockStored(range(5, 8), None, (), 16, medium="CPU"), AllBlocksCleared()]  # type: ignore[arg-type]
    ops, skipped = compile_events(batch[:1])
    assert skipped == 0 and ops == [("S1", b"".join(h.to_bytes(8, "big") for h in (5, 6, 7)))]
    idx = MemoryIndex()
    assert idx.apply_sync("m", "n", 0, batch[:1]).stored == 3
    mirror = BlockMirror()
    mirror.apply(0, batch[:1])
    assert sorted(mirror.snapshot()[0]) == [(5, Tier.CPU), (6, Tier.CPU), (7, Tier.CPU)]
