"""The HTTP API's lookup answer, encoded once for both of its paths: the handler's general path
(:class:`kvcoord.coordinator.httpapi.HttpApi`, from :class:`~kvcoord.coordinator.lookup.LiveMatch` rows) and
the fast path (:mod:`kvcoord.coordinator.fastpath`, from the table's packed rows and entries encoded
beforehand). Dynamo's ``ScoreResponse`` fields first, then kvcoord's."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import msgspec

from kvcoord.answer_json import NodeJson, PullJson, ReservedJson, TiersJson
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.httpd import JSON, Response
from kvcoord.coordinator.lookup import LiveMatch
from kvcoord.coordinator.pools import PullHint
from kvcoord.coordinator.reservations import Reserved
from kvcoord.index.base import NodeKey
from kvcoord.load import NodeLoad

__all__ = ["SIZES", "Hit", "answer_json", "answered", "lookup_answer", "match_hits", "node_entry",
           "node_tail", "with_pull", "with_reserved"]

_encode = msgspec.json.Encoder().encode


class _Instance(msgspec.Struct):
    """Dynamo's per-instance entry of ``instances`` (tokens)."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


class _Answer(msgspec.Struct, omit_defaults=True):
    """The ``/query`` and ``/query_by_hash`` answer: Dynamo's fields first, then kvcoord's."""

    scores: dict[str, dict[str, int]]
    frequencies: tuple[int, ...]
    """Always empty: Dynamo's indexer service answers no frequencies either."""
    instances: dict[str, _Instance]
    model: str
    block_size: int
    num_blocks: int
    num_tokens: int
    nodes: list[NodeJson | msgspec.Raw]
    """:class:`NodeJson` objects (the general path), or the same entries encoded already (the fast path)."""
    block_hashes: list[int] | None = None
    """The query's block hashes, when asked for (``want_block_hashes``); omitted otherwise."""


Hit = tuple[str, int, int, int, int, int, NodeJson | msgspec.Raw]
"""One (node, rank) of a lookup answer, best first: node id, dp rank, matched blocks, blocks per tier (GPU,
CPU, storage), and its ``nodes`` entry."""


def lookup_answer(state: CoordinatorState, model: str, block_size: int, num_blocks: int, num_tokens: int,
                  hits: Sequence[Hit], query: str, t0: float, path: str,
                  block_hashes: list[int] | None = None) -> Response:
    """A lookup's answer (:func:`answer_json`) and its metrics, ``path`` naming who answered (``fast``,
    ``handler``)."""
    body, best = answer_json(model, block_size, num_blocks, num_tokens, hits, block_hashes)
    return answered(state, body, best, num_blocks, query, t0, path)


def answered(state: CoordinatorState, body: bytes, best: int, num_blocks: int, query: str, t0: float,
             path: str) -> Response:
    """An encoded answer whose best node matched ``best`` blocks of ``num_blocks``, with its metrics."""
    resp = Response(200, body, JSON)
    metrics = state.metrics
    metrics.lookup_done(query, time.perf_counter() - t0)
    metrics.lookup_answers[path] += 1
    if num_blocks:
        metrics.matched_fraction.observe(best / num_blocks)
    return resp


def answer_json(model: str, block_size: int, num_blocks: int, num_tokens: int, hits: Sequence[Hit],
                block_hashes: list[int] | None = None) -> tuple[bytes, int]:
    """Dynamo's ``ScoreResponse`` (tokens; ``scores`` GPU only; ``cpu`` and ``disk`` cumulative through the
    faster tiers), then kvcoord's answer, and the most blocks a node matched. The one encoder of a
    lookup's answer, for both paths."""
    bs = block_size or 1
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, _Instance] = {}
    best = 0
    for node_id, rank, matched, g, c, _, _ in hits:
        if not matched:
            continue
        if matched > best:
            best = matched
        gpu, cpu, disk, dp = g * bs, (g + c) * bs, matched * bs, str(rank)
        if gpu:
            by_rank = scores.get(node_id)
            if by_rank is None:
                scores[node_id] = {dp: gpu}
            else:
                by_rank[dp] = gpu
        inst = instances.get(node_id)
        if inst is None:
            instances[node_id] = _Instance(max(gpu, cpu, disk), gpu, {dp: gpu}, cpu, disk)
        else:  # another rank of the node: the node's best of each
            inst.dp[dp] = gpu
            inst.gpu, inst.cpu = max(inst.gpu, gpu), max(inst.cpu, cpu)
            inst.disk = max(inst.disk, disk)
            inst.longest_matched = max(inst.longest_matched, gpu, cpu, disk)
    nodes = [h[6] for h in hits]
    return _encode(_Answer(scores, (), instances, model, block_size, num_blocks, num_tokens, nodes,
                           block_hashes)), best


SIZES = b',"num_blocks":%d,"num_tokens":%d,"nodes":'
"""The part of an answer between its model and block size and its ``nodes`` (:func:`answer_json`): the
fast path keeps an answer's bytes around it, per table rows, and writes the query's sizes in."""


def node_entry(key: bytes, rank: int, matched: int, gpu: int, cpu: int, sto: int, tail: bytes) -> msgspec.Raw:
    """A ``nodes`` entry from its node id as JSON and its tail (:meth:`HttpApi.node_tail`): as
    :class:`NodeJson` encodes."""
    return msgspec.Raw(_NODE_ENTRY % (key, rank, matched, gpu, cpu, sto, tail))


_NODE_ENTRY = b'{"node_id":%b,"dp_rank":%d,"matched_blocks":%d,"tiers":{"GPU":%d,"CPU":%d,"STORAGE":%d}%b'


_LOAD_JSON: dict[int, tuple[NodeLoad, msgspec.Raw]] = {}


def _load_json(load: NodeLoad) -> msgspec.Raw:
    """``load.to_json()`` encoded, remembered per object: a node keeps one load object until its next
    heartbeat, and an identity lookup skips the dataclass's Python-level ``__hash__``/``__eq__`` (the
    entry holds the object, so its id cannot be reused while it is cached)."""
    hit = _LOAD_JSON.get(id(load))
    if hit is not None and hit[0] is load:
        return hit[1]
    if len(_LOAD_JSON) >= 4096:
        _LOAD_JSON.clear()
    raw = msgspec.Raw(_encode(load.to_json()))
    _LOAD_JSON[id(load)] = (load, raw)
    return raw


def node_tail(node_id: str, rank: int, load: NodeLoad, url: str, trust: str, cause: str) -> bytes:
    """The ``nodes`` entry of a live (node, rank) after its ``tiers``, as :class:`NodeJson` encodes it: the
    fast path's views keep it per (node, rank) and complete it with :func:`node_entry`."""
    entry = _encode(NodeJson(node_id, rank, 0, TiersJson(0, 0, 0), _load_json(load), trust, url or None,
                             cause))
    head = bytes(node_entry(_encode(node_id), rank, 0, 0, 0, 0, b""))
    if not entry.startswith(head):
        raise AssertionError("a nodes entry does not start as expected")
    return entry[len(head):]


def with_pull(entry: NodeJson | msgspec.Raw, hint: PullHint) -> NodeJson | msgspec.Raw:
    """A fast-path ``nodes`` entry (no pool fields) with its pull hint, as :class:`NodeJson` encodes it
    last."""
    if isinstance(entry, NodeJson):
        entry.pull = PullJson(*hint)
        return entry
    return msgspec.Raw(bytes(entry)[:-1] + b',"pull":' + _encode(PullJson(*hint)) + b"}")


def with_reserved(hits: Sequence[Hit], view: Mapping[NodeKey, Reserved]) -> None:
    """The general path's hits with the reservations on their (node, rank) (:func:`lookup_view
    <kvcoord.coordinator.reservations.lookup_view>`)."""
    for node_id, rank, *_, node in hits:
        got = view.get((node_id, rank))
        if got is not None and isinstance(node, NodeJson):
            node.reserved = ReservedJson(got.blocks, got.requests, got.prefill_tokens)


def match_hits(matches: Sequence[LiveMatch], pool_tier: Callable[[str], str]) -> list[Hit]:
    """The general path's live matches as hits (no tiers: all on GPU); a pool's blocks count as storage in
    Dynamo's fields."""
    hits: list[Hit] = []
    for node_id, rank, matched, t, load, url, trust, cause, pool, pull in matches:
        g, c, d, p = (*t, 0, 0, 0)[:4] if t else (matched, 0, 0, 0)
        node = NodeJson(node_id, rank, matched, TiersJson(g, c, d, p), _load_json(load), trust, url or None,
                     cause, pool, pool_tier(pool) if pool else "", None if pull is None else PullJson(*pull))
        hits.append((node_id, rank, matched, g, c, d + p, node))
    return hits
