"""The media map (:mod:`kvcoord.media`): every name the engines and caches publish has a tier by default,
configuration adds or moves names, an unknown name is skipped on every validation path (the same events,
merged or not, as events or decoded views) and counted with a bounded label set."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvcoord import media, validate
from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.config_values import ConfigError
from kvcoord.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    Tier,
    decode_vllm_views,
    encode_vllm_batch,
)
from kvcoord.media import MediaTally, configure_media, normalize_medium, parse_media
from tests.engine.test_relay import merged_oracle
from tests.procs import FIXTURES

PUBLISHED: dict[str, dict[str, Tier]] = {
    # project: the medium names its sources publish, and the tier each lands on (docs/semantics.md)
    "vLLM": {"GPU": Tier.GPU, "CPU": Tier.CPU, "Disk": Tier.STORAGE},
    "SGLang": {"GPU": Tier.GPU, "CPU": Tier.CPU, "CPU_PINNED": Tier.CPU, "DISK": Tier.STORAGE,
               "EXTERNAL": Tier.STORAGE},
    "LMCache": {"cpu": Tier.CPU, "CXL": Tier.CPU},
    "Mooncake": {"cpu": Tier.CPU, "disk": Tier.STORAGE},
    "llm-d": {"GPU": Tier.GPU, "SHARED_STORAGE": Tier.STORAGE, "OBJECT_STORE": Tier.STORAGE},
    "Dynamo": {"GPU": Tier.GPU, "DEVICE": Tier.GPU, "CPU": Tier.CPU, "CPU_PINNED": Tier.CPU,
               "CPU_TIER1": Tier.CPU, "DISK": Tier.STORAGE, "STORAGE": Tier.STORAGE,
               "CPU_TIER2": Tier.STORAGE, "NVME": Tier.STORAGE, "EXTERNAL": Tier.STORAGE,
               "NETWORK": Tier.STORAGE, "REMOTE": Tier.STORAGE, "SHARED": Tier.STORAGE},
}


@pytest.fixture(autouse=True)
def default_map() -> Iterator[None]:
    configure_media(None)
    yield
    configure_media(None)


@pytest.mark.parametrize("project", sorted(PUBLISHED))
def test_every_published_name_has_its_tier_by_default(project: str) -> None:
    for name, tier in PUBLISHED[project].items():
        assert normalize_medium(name) == tier, (project, name)
        assert validate.tier(name, "e") == tier
    assert normalize_medium(None) == Tier.GPU and normalize_medium(" gpu ") == Tier.GPU
    assert normalize_medium("TAPE") is None and validate.tier("TAPE", "e") is None


def test_configuration_adds_and_moves_names_and_the_validator_follows() -> None:
    assert validate.tier("SHARED_STORAGE", "e") == Tier.STORAGE  # now cached by the validator
    configure_media(parse_media({"shared_storage": "cpu", "my-pool": "STORAGE"}, "media"))
    assert validate.tier("SHARED_STORAGE", "e") == Tier.CPU and validate.tier("My-Pool", "e") == Tier.STORAGE
    assert media.media_map()["GPU"] == Tier.GPU  # the defaults stay
    configure_media(None)
    assert validate.tier("SHARED_STORAGE", "e") == Tier.STORAGE and validate.tier("my-pool", "e") is None


@pytest.mark.parametrize(("table", "message"), [
    ({"SSD": "FLASH"}, "media.SSD: the tier must be one of GPU, CPU, STORAGE, not 'FLASH'"),
    ({"SSD": 2}, "media.SSD: the tier must be one of GPU, CPU, STORAGE, not 2"),
    ({"x" * 65: "GPU"}, "media: a medium name is at most 64 characters, not 65"),
])
def test_a_bad_entry_is_one_line(table: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as ei:
        parse_media(table, "media")
    assert str(ei.value) == message


def test_the_config_file_media_table(tmp_path: Path) -> None:
    good = tmp_path / "good.toml"
    good.write_text('[media]\nlmcache_remote = "storage"\nCXL = "GPU"\n')
    assert dict(load_config(good, env={}).media) == {"LMCACHE_REMOTE": Tier.STORAGE, "CXL": Tier.GPU}
    assert dict(load_config(None, env={}).media) == {}
    bad = tmp_path / "bad.toml"
    for text, message in (('[media]\nSSD = "FLASH"\n', "media.SSD: the tier must be one of"),
                          ('media = "GPU"\n', "media")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=message) as ei:
            load_config(bad, env={})
        assert "\n" not in str(ei.value)


def test_the_tally_caps_its_names_and_logs_each_once(caplog: pytest.LogCaptureFixture) -> None:
    tally = MediaTally(cap=3)
    with caplog.at_level(logging.WARNING, logger="kvcoord.media"):
        for name in ("a", "b", "a", "c", "d", "e", "a"):
            tally.add(name)
        tally.add("b", 5, fresh=False, where="node n1")
    assert tally.total == {"a": 3, "b": 6, "c": 1, "other": 2}
    assert tally.take() == {"a": 3, "b": 1, "c": 1, "other": 2} and tally.take() == {}
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 4 and "'d'" in logged[3] and "counted as 'other'" in logged[3], logged


def _store(h: int, medium: Any = None, group: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=(h,), parent_block_hash=None, token_ids=(), block_size=4, medium=medium,
                       group_idx=group)


MIXED: list[tuple[str, list[Any], list[int]]] = [
    # name, batch, the positions of the events kept
    ("all unknown", [_store(1, "TAPE"), BlockRemoved((2,), "TAPE")], []),
    ("unknown between a run", [_store(1), _store(2, "TAPE"), _store(3)], [0, 2]),
    ("unknown removal of a stored block", [_store(1, "CPU"), BlockRemoved((1,), "tape"), _store(4)], [0, 2]),
    ("two unknown names, a clear", [_store(1, "x"), AllBlocksCleared(), _store(2, "y"), _store(3, "disk")],
     [1, 3]),
    ("unknown with a group", [BlockRemoved((5,), group_idx=1), BlockRemoved((6,), "TAPE", 1),
                              BlockRemoved((7,), None, 1)], [0, 2]),
]


@pytest.mark.parametrize(("name", "batch", "kept"), MIXED, ids=[m[0] for m in MIXED])
def test_merged_and_plain_paths_skip_the_same_events(name: str, batch: list[Any], kept: list[int]) -> None:
    """The fast merged path (``op_runs``, on events and on the relay's decoded views) and the slow one
    (``ops_of``, an op per event) keep the same events and make the same ops of them."""
    views = decode_vllm_views(encode_vllm_batch(KVEventBatch(1.0, tuple(batch)))).events
    slow = validate.known_runs(batch, merge=False)
    assert list(slow.events) == [batch[i] for i in kept] and slow.spans == [1] * len(kept)
    oracle, oracle_spans = merged_oracle(slow.ops)
    for events in (batch, views):
        fast = validate.known_runs(events)
        assert len(fast.events) == len(kept) and fast.spans == oracle_spans
        assert [(*op[:2], list(op[2]), *op[3:]) for op in fast.ops] == \
            [(*op[:2], list(op[2]), *op[3:]) for op in oracle]
        assert [(*op[:2], list(op[2]), *op[3:]) for op in validate.ops_of(events)] == \
            [(*op[:2], list(op[2]), *op[3:]) for op in slow.ops]


def test_an_unknown_medium_never_hides_a_bad_event_nor_shifts_its_position() -> None:
    batch: list[Any] = [_store(1, "TAPE"), _store(2), _store(3, group=-1)]
    for path in (validate.ops_of, validate.op_runs):
        with pytest.raises(validate.InvalidEvent, match=r"^event 2: group_idx must be"):
            path(batch)
    for bad in (3, b"GPU"):  # a medium that is not a string is still a bad event
        with pytest.raises(validate.InvalidEvent, match=r"^event 1: medium must be a string"):
            validate.op_runs([_store(1), _store(2, bad)])


VLLM_033 = sorted((FIXTURES / "vllm-wire" / "0.33.0").glob("*.msgpack"))


@pytest.mark.parametrize("path", VLLM_033, ids=lambda p: p.stem)
def test_a_real_vllm_payload_with_a_new_medium_keeps_its_other_events(path: Path) -> None:
    """vLLM 0.33's own payloads (captured from its ZmqEventPublisher), each event of medium CPU renamed to
    one no map knows: the relay's decoded views keep exactly the other events, with their ops."""
    raw = msgspec.msgpack.decode(path.read_bytes())
    events = raw[1]
    renamed = [i for i, ev in enumerate(events) if isinstance(ev, dict) and ev.get("medium") == "CPU"]
    for i in renamed:
        events[i]["medium"] = "HBM3_POOL_OF_THE_FUTURE"
    original = decode_vllm_views(path.read_bytes()).events
    views = decode_vllm_views(msgspec.msgpack.encode(raw)).events
    known = validate.known_runs(views)
    assert len(known.events) == len(views) - len(renamed)
    keep = [i for i in range(len(views)) if i not in renamed]
    assert validate.ops_of([original[i] for i in keep]) == validate.ops_of(views)
    assert known.ops == validate.op_runs([original[i] for i in keep])[0]


def test_some_real_payload_has_a_cpu_event_to_rename() -> None:
    media_seen = {ev.get("medium") for p in VLLM_033 for ev in msgspec.msgpack.decode(p.read_bytes())[1]
                  if isinstance(ev, dict)}
    assert {"GPU", "CPU"} <= media_seen, media_seen
