"""The vLLM/SGLang msgpack codec against payloads vLLM itself produced, and against bad input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventDecodeError,
    KVEvent,
    KVEventBatch,
    decode_vllm_batch,
    encode_vllm_batch,
)
from tests.procs import FIXTURES

WIRE = FIXTURES / "vllm-wire"
PAYLOADS = sorted(WIRE.glob("*/*.msgpack"))


def _sidecar(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.with_suffix(".json").read_text())
    return data


def _jsonish(value: object) -> object:
    """Our decoded values in the sidecar's notation: bytes as {"bytes": hex}, tuples as lists."""
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, tuple | list):
        return [_jsonish(v) for v in value]
    return value


def _event_json(ev: KVEvent) -> dict[str, object]:
    out: dict[str, object] = {"type": type(ev).__name__}
    for f in msgspec.structs.fields(ev):
        out[f.name] = _jsonish(getattr(ev, f.name))
    return out


def test_fixtures_present() -> None:
    assert len(PAYLOADS) == 11, PAYLOADS


@pytest.mark.parametrize("path", PAYLOADS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fixture_decodes_to_sidecar(path: Path) -> None:
    expected = _sidecar(path)["expected"]
    batch = decode_vllm_batch(path.read_bytes())
    assert batch.ts == expected["ts"]
    assert batch.data_parallel_rank == expected["data_parallel_rank"]
    assert len(batch.events) == len(expected["events"])
    for ev, want in zip(batch.events, expected["events"], strict=True):
        got = _event_json(ev)
        for key, value in want.items():
            assert got[key] == value, (key, got[key], value)
        # Fields the release does not have (absent from the sidecar) decode as None.
        for key in got.keys() - want.keys():
            assert got[key] is None, key


@pytest.mark.parametrize("path", PAYLOADS, ids=lambda p: f"{p.parent.name}/{p.stem}")
def test_fixture_reencodes_byte_identical(path: Path) -> None:
    payload = path.read_bytes()
    form = _sidecar(path)["event_encoding"]
    assert encode_vllm_batch(decode_vllm_batch(payload), form=form) == payload


def test_big_unsigned_and_bytes_hashes() -> None:
    big = 2**64 - 1
    digest = bytes(range(32))
    batch = KVEventBatch(1.5, (BlockStored((big, 2**63), digest, (1, 2), 2, None, "GPU", None),
                               BlockRemoved((digest,), "CPU_PINNED")), 3)
    for form in ("map", "array"):
        back = decode_vllm_batch(encode_vllm_batch(batch, form=form))  # type: ignore[arg-type]
        assert back == batch


def test_sglang_positional_forms() -> None:
    """SGLang's copy of the structs: 5-field BlockStored, hash-only BlockRemoved, batch without rank."""
    enc = msgspec.msgpack.encode
    payload = enc([2.0, [["BlockStored", [7, 8], None, [1, 2, 3, 4], 2, None],
                         ["BlockRemoved", [7]], ["AllBlocksCleared"]]])
    batch = decode_vllm_batch(payload)
    assert batch.data_parallel_rank is None
    assert batch.events == (BlockStored((7, 8), None, (1, 2, 3, 4), 2, None), BlockRemoved((7,)),
                            AllBlocksCleared())
    # Newer SGLang: medium names of its own, and signed int64 hashes when asked to accept them.
    signed = enc([2.0, [["BlockStored", [-1, 5], -2, [1, 2], 1, None, "CPU_PINNED"]], 1])
    with pytest.raises(EventDecodeError) as err:
        decode_vllm_batch(signed)
    assert err.value.kind == "bad_hash"
    got = decode_vllm_batch(signed, signed_hashes=True).events[0]
    assert isinstance(got, BlockStored)
    assert got.block_hashes == (2**64 - 1, 5) and got.parent_block_hash == 2**64 - 2
    assert got.medium == "CPU_PINNED"


def test_newer_release_extra_keys_ignored_and_map_batch() -> None:
    enc = msgspec.msgpack.encode
    ev = {"type": "BlockRemoved", "block_hashes": [9], "medium": "GPU", "some_future_field": {"x": 1}}
    assert decode_vllm_batch(enc([1.0, [ev], 0])).events == (BlockRemoved((9,), "GPU"),)
    # A batch encoded as a map (non-array_like EventBatch) decodes the same.
    as_map = enc({"ts": 1.0, "events": [ev], "data_parallel_rank": 4})
    assert decode_vllm_batch(as_map) == KVEventBatch(1.0, (BlockRemoved((9,), "GPU"),), 4)


def test_mixed_forms_in_turn() -> None:
    """The decoder's preferred form flips without losing either (relays may see both)."""
    for path in PAYLOADS * 2:
        assert decode_vllm_batch(path.read_bytes()).events


GOOD = (WIRE / "0.33.0" / "02_stored_int_parent_lora_mm_salt.msgpack").read_bytes()


def _bad(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


BAD_CASES: list[tuple[str, bytes, str, str]] = [
    ("empty", b"", "truncated", "empty payload"),
    ("truncated", GOOD[:-7], "truncated", "truncated"),
    ("not_msgpack", b"\xc1\xc1", "msgpack", "msgpack"),
    ("batch_not_array", _bad("hello"), "bad_batch", "got str"),
    ("events_not_array", _bad([1.0, 5, 0]), "bad_batch", "events must be an array"),
    ("unknown_tag_map", _bad([1.0, [{"type": "BlockMoved", "block_hashes": [1]}], 0]), "unknown_event",
     "'BlockMoved'"),
    ("unknown_tag_array", _bad([1.0, [["BlockMoved", [1]]], 0]), "unknown_event", "'BlockMoved'"),
    ("negative_hash", _bad([1.0, [{"type": "BlockRemoved", "block_hashes": [-5], "medium": None}], 0]),
     "bad_hash", "`$[1][0].block_hashes[0]`"),
    ("float_hash_beyond_uint64", _bad([1.0, [["BlockRemoved", [2.0**64], None, None]], 0]), "bad_hash",
     "block_hashes[0]"),
    ("empty_bytes_hash", _bad([1.0, [["BlockRemoved", [b""], None, None]], 0]), "bad_hash", "block_hashes"),
    ("string_parent", _bad([1.0, [["BlockStored", [1], "x", [1], 1, None, None, None]], 0]), "bad_hash",
     "parent_block_hash"),
    ("token_ids_wrong_type", _bad([1.0, [{"type": "BlockStored", "block_hashes": [1],
                                          "parent_block_hash": None, "token_ids": "abc",
                                          "block_size": 1}], 0]),
     "wrong_type",
     "token_ids"),
    ("medium_wrong_type", _bad([1.0, [["BlockRemoved", [1], 7, None]], 0]), "wrong_type", "medium"),
    ("missing_field", _bad([1.0, [{"type": "BlockStored", "block_hashes": [1]}], 0]), "missing_field",
     "missing required field"),
    ("negative_dp_rank", _bad([1.0, [], -1]), "bad_value", "data_parallel_rank"),
    ("ts_wrong_type", _bad(["now", [], 0]), "wrong_type", "ts"),
]


@pytest.mark.parametrize(("payload", "kind", "fragment"), [c[1:] for c in BAD_CASES],
                         ids=[c[0] for c in BAD_CASES])
def test_malformed_payload_raises_precise_error(payload: bytes, kind: str, fragment: str) -> None:
    before = decode_vllm_batch(GOOD)
    with pytest.raises(EventDecodeError) as err:
        decode_vllm_batch(payload)
    assert err.value.kind == kind, str(err.value)
    assert fragment in str(err.value)
    assert isinstance(err.value, ValueError)
    # The codec keeps working (no state was damaged by the bad frame).
    assert decode_vllm_batch(GOOD) == before


def test_encode_rejects_unrepresentable() -> None:
    for bad_hash in (2**64, -1):
        with pytest.raises(ValueError, match="outside uint64"):
            encode_vllm_batch(KVEventBatch(1.0, (BlockRemoved((bad_hash,), None),)))
    stored = BlockStored((1,), None, (1,), 1, None, None, None, session_id="s")
    with pytest.raises(ValueError, match="positional"):
        encode_vllm_batch(KVEventBatch(1.0, (stored,)), form="array")
    with pytest.raises(ValueError, match="form"):
        encode_vllm_batch(KVEventBatch(1.0, ()), form="json")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- property test

hashes = st.one_of(st.integers(0, 2**64 - 1), st.binary(min_size=1, max_size=32))
opt_int = st.none() | st.integers(0, 2**31)
opt_str = st.none() | st.text(max_size=8)
extra_entry = st.none() | st.tuples(st.text(max_size=4), st.tuples(st.text(max_size=4), st.integers(-64, 64)))


@st.composite
def stored(draw: st.DrawFn, newer: bool) -> BlockStored:
    n = draw(st.integers(1, 4))
    return BlockStored(
        tuple(draw(st.lists(hashes, min_size=n, max_size=n))),
        draw(st.none() | hashes),
        tuple(draw(st.lists(st.integers(0, 2**31), max_size=8))),
        draw(st.integers(0, 64)),
        draw(opt_int),
        draw(opt_str),
        draw(opt_str),
        draw(st.none() | st.lists(extra_entry, min_size=n, max_size=n).map(tuple)),
        draw(opt_int),
        draw(opt_str),
        draw(opt_int),
        draw(opt_str) if newer else None,
        draw(opt_str) if newer else None,
        draw(opt_str) if newer else None,
        draw(st.none() | st.lists(st.lists(st.integers(0, 99), max_size=2).map(tuple), max_size=2).map(tuple))
        if newer else None,
    )


@st.composite
def batches(draw: st.DrawFn, newer: bool) -> KVEventBatch:
    removed = st.builds(BlockRemoved, st.lists(hashes, min_size=1, max_size=4).map(tuple), opt_str, opt_int,
                        *((opt_str, opt_str) if newer else ()))
    events = draw(st.lists(stored(newer) | removed | st.just(AllBlocksCleared()), max_size=5))
    return KVEventBatch(draw(st.floats(allow_nan=False, allow_infinity=False)), tuple(events), draw(opt_int))


@settings(max_examples=150, deadline=None)
@given(batches(newer=True))
def test_roundtrip_map(batch: KVEventBatch) -> None:
    payload = encode_vllm_batch(batch, form="map")
    back = decode_vllm_batch(payload)
    assert back == batch
    assert encode_vllm_batch(back, form="map") == payload


@settings(max_examples=150, deadline=None)
@given(batches(newer=False))
def test_roundtrip_array(batch: KVEventBatch) -> None:
    payload = encode_vllm_batch(batch, form="array")
    back = decode_vllm_batch(payload)
    assert back == batch
    assert encode_vllm_batch(back, form="array") == payload


def test_sglang_cache_salt_is_kept() -> None:
    """SGLang's BlockStored carries the storing request's cache_salt; the model keeps it (it was dropped)."""
    ev = {"type": "BlockStored", "block_hashes": [-5], "parent_block_hash": None, "token_ids": [1, 2],
          "block_size": 2, "lora_id": None, "medium": "GPU", "cache_salt": "s1", "session_id": "q",
          "lora_name": "ad"}
    got = decode_vllm_batch(msgspec.msgpack.encode([1.0, [ev], 0]), signed_hashes=True).events[0]
    assert isinstance(got, BlockStored)
    assert (got.cache_salt, got.session_id, got.lora_name) == ("s1", "q", "ad")
    assert got.block_hashes == (2**64 - 5,)
