"""One rule, one function: the run key (:func:`kvcoord.validate.run_key`), the one validation of events
(``ops_of`` and ``op_runs`` are one loop) and the hash rule (:func:`kvcoord.hashing.to_block_hash64`) give
the same answer on every path: events, the relay's decoded views, the wire as the agent cuts it (its runs
cut by ``run_piece``, written by ``fill_event``) and the coordinator's merge of it (``ops_from_proto``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord import validate
from kvcoord.agent.link import run_piece
from kvcoord.events import (
    STORE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_vllm_views,
    encode_vllm_batch,
)
from kvcoord.hashing import to_block_hash64
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import InvalidEvent, Op, op_runs, ops_of, pack_u64
from kvcoord.wire import event_to_proto, fill_event, ops_from_proto
from tests.engine.test_relay import merged_oracle

HASH = st.integers(2, 2**64 - 1)
MEDIA = st.sampled_from([None, "GPU", "cpu", "DISK", "shared_storage", "TAPE", "nvme-of-the-future"])
"""Known names and unknown ones (their events are skipped on every path)."""
GROUPS = st.sampled_from([None, 0, 1])
SPECS = st.sampled_from([None, "full_attention", "mla_attention", "sliding_window"])

stores = st.builds(
    lambda hs, medium, g, spec, size: BlockStored(
        block_hashes=tuple(hs), parent_block_hash=None, token_ids=(), block_size=size, medium=medium,
        group_idx=g, kv_cache_spec_kind=spec),
    st.lists(HASH, max_size=3), MEDIA, GROUPS, SPECS, st.sampled_from([4, 8]))
removals = st.builds(lambda hs, medium, g: BlockRemoved(block_hashes=tuple(hs), medium=medium, group_idx=g),
                     st.lists(HASH, max_size=3), MEDIA, GROUPS)
batches = st.lists(st.one_of(stores, removals, removals, st.just(AllBlocksCleared())),
                   min_size=1, max_size=24)


def plain(ops: Sequence[Op]) -> list[tuple[Any, ...]]:
    return [(op.kind, op.tier, [int(h) for h in op.hashes], op.group, op.indexable) for op in ops]


def agent_wire(events: Sequence[Any]) -> list[pb.KVEvent]:
    """``events`` as the agent puts them on the wire: each op of ``op_runs`` cut by ``run_piece`` (a batch
    with room for all of them, nothing sampled) and written by ``fill_event``."""
    out: list[pb.KVEvent] = []
    ops, spans = op_runs(events)
    e = 0
    for op, span in zip(ops, spans, strict=True):
        run, packed = events[e:e + span], pack_u64(op.hashes)
        e += span
        i = pos = 0
        while i < len(run):
            j, end = run_piece(run, i, pos, len(packed), op.kind == STORE, None, 10_000, 10_000)
            m = pb.KVEvent()
            fill_event(m, op, run[i], None, packed[pos:end], j - i)
            out.append(m)
            i, pos = j, end
    return out


@settings(max_examples=300, deadline=None)
@given(batches)
def test_every_path_keys_runs_alike(events: list[Any]) -> None:
    """events -> ops, events -> runs, views -> runs, events -> wire -> ops: one answer, and the same events
    of unknown media skipped by each."""
    ops, (runs, spans) = ops_of(events), op_runs(events)
    kept = validate.known_runs(events).events
    unknown = ("TAPE", "nvme-of-the-future")
    assert list(kept) == [ev for ev in events if getattr(ev, "medium", None) not in unknown]
    assert list(validate.known_runs(events, merge=False).events) == list(kept)
    oracle, oracle_spans = merged_oracle(ops)
    assert plain(runs) == plain(oracle) and spans == oracle_spans and sum(spans) == len(kept)
    views = decode_vllm_views(encode_vllm_batch(KVEventBatch(1.0, tuple(events)))).events
    view_runs, view_spans = op_runs(views)
    assert plain(view_runs) == plain(runs) and view_spans == spans
    assert plain(ops_of(views)) == plain(ops)
    wire = agent_wire(kept)
    assert plain(ops_from_proto(wire, merge=True)) == plain(runs)
    # one wire event per engine event (an agent that predates runs): the same ops, merged or not
    single = [event_to_proto(op, ev) for op, ev in zip(ops, kept, strict=True)]
    assert plain(ops_from_proto(single)) == plain(ops)
    assert plain(ops_from_proto(single, merge=True)) == plain(runs)
    # what a wire event states once holds for every engine event it stands for
    e = 0
    for m in wire:
        n = m.events or 1
        if m.WhichOneof("event") == "stored":
            assert {(ev.block_size, ev.kv_cache_spec_kind) for ev in kept[e:e + n]} == {
                (m.stored.block_size, m.stored.kv_cache_spec_kind if m.stored.HasField("kv_cache_spec_kind")
                 else None)}
        e += n
    assert e == len(kept)


def test_the_key_is_the_same_rule_for_events_and_the_wire() -> None:
    """The wire's unknown tier and the events' bad group or spec kind are refused by the one key rule, with
    the message naming the event, on every path."""
    stored = pb.KVEvent(stored=pb.BlockStored(block_hashes=pack_u64([5]), block_size=4))
    bad_tier = pb.KVEvent(stored=pb.BlockStored(block_hashes=pack_u64([5]), block_size=4, tier=7))  # type: ignore[arg-type]
    with pytest.raises(InvalidEvent, match=r"^event 1: unknown tier 7$"):
        ops_from_proto([stored, bad_tier], merge=True)
    assert validate.run_key(STORE, 0, None, "sliding_window", 0) == (STORE, 0, None, False)
    for bad, message in ((-1, "group_idx must be a non-negative int"), (True, "group_idx must be")):
        events: list[Any] = [BlockRemoved(block_hashes=(5,)), BlockRemoved(block_hashes=(6,), group_idx=bad)]
        for path in (ops_of, op_runs):
            with pytest.raises(InvalidEvent, match=rf"^event 1: {message}"):
                path(events)
    spec: list[Any] = [BlockStored(block_hashes=(5,), parent_block_hash=None, token_ids=(), block_size=4,
                                   kv_cache_spec_kind=3)]  # type: ignore[arg-type]
    for path in (ops_of, op_runs):
        with pytest.raises(InvalidEvent, match=r"^event 0: kv_cache_spec_kind must be a string$"):
            path(spec)


def test_an_earlier_bad_hash_is_named_before_a_later_bad_field() -> None:
    """Merged runs check their hashes at the end; a later event's bad medium must not hide an earlier
    event's bad hash (``ops_of`` checks in order, and so does ``op_runs``)."""
    events: list[Any] = [BlockRemoved(block_hashes=(5,)), BlockRemoved(block_hashes=(2**64,)),
                         BlockRemoved(block_hashes=(6,)), AllBlocksCleared(),
                         BlockRemoved(block_hashes=(7,), medium=3)]  # type: ignore[arg-type]
    for path in (ops_of, op_runs):
        with pytest.raises(InvalidEvent, match=r"^event 1: block_hashes\[0\]: block hash \d+ is outside"):
            path(events)


@pytest.mark.parametrize("bad", [True, -1, 2**64, 2.5, b"", "ab", None])
def test_one_hash_rule_for_the_index_and_the_encoder(bad: Any) -> None:
    """What the index refuses as a hash the vLLM-exact encoder refuses too, by the same rule."""
    with pytest.raises((TypeError, ValueError)) as rule:
        to_block_hash64(bad)
    with pytest.raises(InvalidEvent) as index:
        ops_of([BlockRemoved(block_hashes=(5, bad))])
    assert str(rule.value) in str(index.value)
    with pytest.raises(ValueError) as encoder:
        encode_vllm_batch(KVEventBatch(1.0, (BlockRemoved(block_hashes=(5, bad)),)))
    assert str(encoder.value) == f"BlockRemoved: {rule.value}"


def piece_oracle(run: Sequence[Any], i: int, pos: int, stores: bool, samples: Sequence[object] | None,
                 room_events: int, room_blocks: int) -> tuple[int, int]:
    """``run_piece`` as it was written event by event (before the scans ran in C), for comparison."""
    j, end, blocks_in = i, pos, 0
    while j < len(run):
        ev = run[j]
        if j > i and stores and ((ev.block_size, ev.kv_cache_spec_kind) != (run[i].block_size,
                                                                           run[i].kv_cache_spec_kind)
                                 or (samples is not None and samples[j] is not None)):
            break
        blocks_in += len(ev.block_hashes)
        end += 8 * len(ev.block_hashes)
        j += 1
        if j - i >= room_events or max(1, blocks_in) >= room_blocks or (
                stores and samples is not None and samples[j - 1] is not None):
            break
    return j, end


@settings(max_examples=400, deadline=None)
@given(st.lists(st.tuples(st.lists(HASH, max_size=4), SPECS, st.sampled_from([4, 8]), st.booleans()),
                min_size=1, max_size=30),
       st.booleans(), st.booleans(), st.integers(1, 40), st.integers(1, 60), st.data())
def test_run_piece_cuts_where_it_did(shape: list[tuple[list[int], str | None, int, bool]], stores: bool,
                                     sampling: bool, room_events: int, room_blocks: int,
                                     data: st.DataObject) -> None:
    """Every cut of ``run_piece`` (room, samples, what a wire event states once) is where the event-by-event
    loop put it."""
    run = [BlockStored(block_hashes=tuple(hs), parent_block_hash=None, token_ids=(), block_size=size,
                       kv_cache_spec_kind=spec) if stores else BlockRemoved(block_hashes=tuple(hs))
           for hs, spec, size, _ in shape]
    samples = [object() if sampled else None for *_, sampled in shape] if sampling and stores else None
    size = 8 * sum(len(hs) for hs, *_ in shape)
    i = data.draw(st.integers(0, len(run) - 1))
    pos = 8 * sum(len(hs) for hs, *_ in shape[:i])
    got = run_piece(run, i, pos, size, stores, samples, room_events, room_blocks)
    if not stores and len(run) - i <= room_events and max(1, (size - pos) >> 3) < room_blocks:
        assert got == (len(run), size)  # a removal run that fits goes whole
    else:
        assert got == piece_oracle(run, i, pos, stores, samples, room_events, room_blocks)


BAD_EVENTS: list[Any] = [
    BlockRemoved(block_hashes=(5,), medium=3), BlockRemoved(block_hashes=(2**64,)),  # type: ignore[arg-type]
    BlockRemoved(block_hashes=(5,), group_idx=-1), BlockRemoved(block_hashes=(b"",)), "not an event",
    BlockStored(block_hashes=(5,), parent_block_hash=None, token_ids=(), block_size=4,
                kv_cache_spec_kind=3),  # type: ignore[arg-type]
]


@settings(max_examples=200, deadline=None)
@given(batches, st.sampled_from(BAD_EVENTS), st.data())
def test_a_bad_event_is_named_alike_merged_or_not(events: list[Any], bad: Any, data: st.DataObject) -> None:
    """One bad event anywhere in a batch: ``ops_of`` and ``op_runs`` (events and views alike) refuse the
    batch with the same message, naming its position."""
    at = data.draw(st.integers(0, len(events)))
    batch = [*events[:at], bad, *events[at:]]
    with pytest.raises(InvalidEvent) as plain_error:
        ops_of(batch)
    with pytest.raises(InvalidEvent) as merged_error:
        op_runs(batch)
    assert str(plain_error.value).startswith(f"event {at}: ")
    assert str(merged_error.value) == str(plain_error.value)
