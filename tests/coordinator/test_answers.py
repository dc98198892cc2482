"""The lookup answer's encoder (``kvcoord.coordinator.answers``), which builds the answer from byte
fragments, against its reference: the same answer as msgspec Structs and dicts encoded whole (the encoder
it replaced), byte for byte, over random hits: node ids that need escaping or hold ``%``, nodes on several
ranks, unmatched rows, entries encoded already (the fast path's) or not (the general path's), pull hints,
reservations and the query's block hashes."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.answer_json import NodeJson, ReservedJson, TiersJson
from kvcoord.coordinator.answers import (
    Hit,
    _joined,
    answer_json,
    fast_hit,
    hit_templates,
    with_pull,
)
from kvcoord.coordinator.pools import PullHint
from kvcoord.load import NodeLoad

_encode = msgspec.json.Encoder().encode

NODE_IDS = ["1", "a", "50%", "%d%b%%", 'q"uote', "ü-node", "back\\slash", "tab\there", "z" * 40]
URLS = ["", "http://10.0.0.1:8000", "http://h:1/p%20q%d"]


class _Instance(msgspec.Struct):
    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class _Answer(msgspec.Struct, omit_defaults=True):
    scores: dict[str, dict[str, int]]
    frequencies: tuple[int, ...]
    instances: dict[str, _Instance]
    model: str
    block_size: int
    num_blocks: int
    num_tokens: int
    nodes: list[NodeJson | msgspec.Raw]
    block_hashes: list[int] | None = None


def reference(model: str, block_size: int, num_blocks: int, num_tokens: int, hits: Sequence[Hit],
              block_hashes: list[int] | None) -> tuple[bytes, int]:
    """The answer as the encoder before fragments made it: dicts and Structs, one msgspec encode."""
    bs = block_size or 1
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, _Instance] = {}
    best = 0
    for node_id, rank, matched, g, c, *_ in hits:
        if not matched:
            continue
        best = max(best, matched)
        gpu, cpu, disk, dp = g * bs, (g + c) * bs, matched * bs, str(rank)
        if gpu:
            scores.setdefault(node_id, {})[dp] = gpu
        inst = instances.get(node_id)
        if inst is None:
            instances[node_id] = _Instance(max(gpu, cpu, disk), gpu, {dp: gpu}, cpu, disk)
        else:
            inst.dp[dp] = gpu
            inst.gpu, inst.cpu = max(inst.gpu, gpu), max(inst.cpu, cpu)
            inst.disk = max(inst.disk, disk)
            inst.longest_matched = max(inst.longest_matched, gpu, cpu, disk)
    nodes = [h[6] if isinstance(h[6], NodeJson) else msgspec.Raw(h[6]) for h in hits]
    return _encode(_Answer(scores, (), instances, model, block_size, num_blocks, num_tokens, nodes,
                           block_hashes)), best


_row = st.tuples(st.sampled_from(NODE_IDS), st.integers(0, 3), st.integers(0, 3000), st.integers(0, 3000),
                 st.integers(0, 3000), st.sampled_from(URLS), st.sampled_from(["exact", "degraded"]),
                 st.booleans(), st.booleans())


def _hit(row: tuple[str, int, int, int, int, str, str, bool, bool], block_size: int, fast: bool) -> Hit:
    """A hit as either path makes it: the fast path's entry from its view's template, or a NodeJson."""
    node_id, rank, g, c, s, url, trust, pulled, reserved = row
    matched = g + c + s
    load = NodeLoad(g % 7, c % 5, 0.25)
    cause = "" if trust == "exact" else "history_lost"
    templates = hit_templates(node_id, rank, load, url, trust, cause)
    hit = fast_hit(node_id, rank, templates, matched, g, c, s, block_size)
    if not fast:
        node = NodeJson(node_id, rank, matched, TiersJson(g, c, s), msgspec.Raw(_encode(load.to_json())),
                        trust, url or None, cause, reserved=ReservedJson(1, 2, 3) if reserved else None)
        assert reserved or _encode(node) == hit[6]  # the fast path's template encodes as NodeJson does
        hit = (*hit[:6], node, None)
    if pulled:
        entry = with_pull(hit[6], PullHint("peer%d", "10.0.0.9:80", "CPU", 7))
        assert isinstance(entry, bytes) == fast
        hit = (*hit[:6], entry, hit[7])
    return hit


@settings(max_examples=400, deadline=None)
@given(st.lists(_row, max_size=12), st.sampled_from([0, 1, 16]), st.booleans(),
       st.sampled_from(["m", 'm"%d', "ü"]), st.integers(0, 1 << 20), st.integers(0, 1 << 24),
       st.none() | st.lists(st.integers(0, (1 << 64) - 1), max_size=4))
def test_answer_equals_its_reference(rows: list[tuple[str, int, int, int, int, str, str, bool, bool]],
                                     block_size: int, fast: bool, model: str, num_blocks: int,
                                     num_tokens: int, block_hashes: list[int] | None) -> None:
    hits = [_hit(row, block_size, fast) for row in rows]
    expected = reference(model, block_size, num_blocks, num_tokens, hits, block_hashes)
    assert answer_json(model, block_size, num_blocks, num_tokens, hits, block_hashes) == expected


def test_a_fast_answer_is_joined_from_its_parts() -> None:
    """The fast path's common answer (one rank a node, all matched) is joined, not encoded from counts."""
    hits = [_hit((node_id, i % 2, 10 + i, i, 1, URLS[i % 3], "exact", i == 3, False), 16, True)
            for i, node_id in enumerate(NODE_IDS)]
    joined = _joined("m", 16, 5, 80, hits)
    assert joined is not None and joined == reference("m", 16, 5, 80, hits, None)
