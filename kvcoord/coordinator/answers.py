"""The HTTP API's lookup answer, encoded once for both of its paths: the handler's general path
(:class:`kvcoord.coordinator.httpapi.HttpApi`, from :class:`~kvcoord.coordinator.lookup.LiveMatch` rows) and
the fast path (:mod:`kvcoord.coordinator.fastpath`, from the table's packed rows and entries encoded
beforehand). Dynamo's ``ScoreResponse`` fields first, then kvcoord's.

Why parts: an answer is a handful of per-(node, rank) parts (its ``scores`` and ``instances`` entries and
its ``nodes`` entry) around a fixed frame. Building dicts and Structs per hit for one msgspec encode costs
~1 µs a hit, more than the fast path's lookup; there each part is formatted once per table row from a
template holding every string encoded by msgspec already (:func:`hit_templates`, :func:`fast_hit`), the
rows' parts are kept, and an answer is joined from them (:func:`_joined`). The general path, whose answer
objects change after they are made (pull hints, reservations), encodes its answer whole
(:func:`_counted`): the definition, which ``tests/coordinator/test_answers.py`` holds the join to."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter
from typing import cast

import msgspec

from kvcoord.answer_json import NodeJson, PullJson, ReservedJson, TiersJson
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.httpd import JSON, Response
from kvcoord.coordinator.lookup import LiveMatch
from kvcoord.coordinator.pools import PullHint
from kvcoord.coordinator.reservations import Reserved
from kvcoord.index.base import NodeKey
from kvcoord.load import NodeLoad

__all__ = ["SIZES", "Hit", "answer_json", "answered", "fast_hit", "hit_templates", "lookup_answer",
           "match_hits", "with_pull", "with_reserved"]

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


Hit = tuple[str, int, int, int, int, int, "NodeJson | bytes", "tuple[bytes, bytes] | None"]
"""One (node, rank) of a lookup answer, best first: node id, dp rank, matched blocks, blocks per tier (GPU,
CPU, storage), its ``nodes`` entry (a :class:`NodeJson`, or encoded already), and its ``scores`` and
``instances`` entries as this rank alone makes them (the fast path's, :func:`fast_hit`, kept per table
row), or None (the general path's: made from the counts)."""

SIZES = b',"num_blocks":%d,"num_tokens":%d,"nodes":'
"""The part of an answer between its model and block size and its ``nodes`` (:func:`answer_json`): the
fast path keeps an answer's bytes around it, per table rows, and writes the query's sizes in."""

_NODE_ID, _MATCHED, _NODE, _PARTS = itemgetter(0), itemgetter(2), itemgetter(6), itemgetter(7)
_JOINED = b'{"scores":{%b},"frequencies":[],"instances":{%b},"model":%b,"block_size":%d' + SIZES + b"[%b]}"
"""The answer as :class:`_Answer` encodes it without block hashes, from its parts (:func:`_joined`)."""
_SCORE = b'%b:{"%d":%%d}'
_INSTANCE = b'%b:{"longest_matched":%%d,"gpu":%%d,"dp":{"%d":%%d},"cpu":%%d,"disk":%%d}'
_ENTRY = b'{"node_id":%b,"dp_rank":%d,"matched_blocks":%%d,"tiers":{"GPU":%%d,"CPU":%%d,"STORAGE":%%d}%b'


def _literal(data: bytes) -> bytes:
    """``data`` as a %-format's literal text."""
    return data.replace(b"%", b"%%")


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
    faster tiers), then kvcoord's answer, and the most blocks a node matched. The one encoder of a lookup's
    answer, for both paths: joined from the hits' own parts where they have them (:func:`_joined`), else
    encoded whole from their counts (:func:`_counted`, the definition; ``tests/coordinator/test_answers.py``
    holds the first to it)."""
    joined = _joined(model, block_size, num_blocks, num_tokens, hits) if block_hashes is None else None
    return joined or _counted(model, block_size, num_blocks, num_tokens, hits, block_hashes)


def _joined(model: str, block_size: int, num_blocks: int, num_tokens: int,
            hits: Sequence[Hit]) -> tuple[bytes, int] | None:
    """The answer joined from its hits' parts, where every hit is matched, has its ``scores`` and
    ``instances`` parts and its ``nodes`` entry encoded (:func:`fast_hit`), and no node answers on two ranks
    (Dynamo merges those): the fast path's, mostly. None otherwise."""
    if not hits or hits[0][7] is None:  # the general path's
        return None
    parts = list(map(_PARTS, hits))
    if None in parts or 0 in map(_MATCHED, hits) or len(set(map(_NODE_ID, hits))) < len(hits):
        return None
    nodes = list(map(_NODE, hits))
    if NodeJson in map(type, nodes):
        return None
    scores, instances = zip(*cast("list[tuple[bytes, bytes]]", parts), strict=True)
    return _JOINED % (b",".join(filter(None, scores)), b",".join(instances), _encode(model), block_size,
                      num_blocks, num_tokens, b",".join(cast("list[bytes]", nodes))), max(map(_MATCHED, hits))


def _counted(model: str, block_size: int, num_blocks: int, num_tokens: int, hits: Sequence[Hit],
             block_hashes: list[int] | None) -> tuple[bytes, int]:
    """The answer (:func:`answer_json`) encoded whole from its hits' counts: a node answering on several
    ranks has them all in its ``scores`` and ``dp``, and its best of each count, as Dynamo's
    ``ScoreResponse``."""
    bs = block_size or 1
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, _Instance] = {}
    best = 0
    for node_id, rank, matched, g, c, _, _, _ in hits:
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
    entries: list[NodeJson | bytes] = list(map(_NODE, hits))
    nodes = cast("list[NodeJson | msgspec.Raw]", entries)
    if bytes in map(type, entries):  # the fast path's entries, encoded already
        nodes = [msgspec.Raw(entry) if isinstance(entry, bytes) else entry for entry in entries]
    return _encode(_Answer(scores, (), instances, model, block_size, num_blocks, num_tokens, nodes,
                           block_hashes)), best


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


def hit_templates(node_id: str, rank: int, load: NodeLoad, url: str, trust: str,
                  cause: str) -> tuple[bytes, bytes, bytes]:
    """A live (node, rank)'s ``nodes``, ``scores`` and ``instances`` entries with their counts left to
    fill in (:func:`fast_hit`), as :class:`NodeJson` and :func:`_counted` encode them: the fast path's views
    keep them per (node, rank)."""
    entry = _encode(NodeJson(node_id, rank, 0, TiersJson(0, 0, 0), _load_json(load), trust, url or None,
                             cause))
    key = _literal(_encode(node_id))
    head = _ENTRY % (key, rank, b"") % (0, 0, 0, 0)
    if not entry.startswith(head):
        raise AssertionError("a nodes entry does not start as expected")
    return _ENTRY % (key, rank, _literal(entry[len(head):])), _SCORE % (key, rank), _INSTANCE % (key, rank)


def fast_hit(node_id: str, rank: int, templates: tuple[bytes, bytes, bytes], matched: int, gpu: int,
             cpu: int, sto: int, block_size: int) -> Hit:
    """A (node, rank)'s hit from its :func:`hit_templates` and its blocks in all and per tier (not negative,
    as the table's: the longest run is the disk one), its Dynamo counts in tokens: ``cpu`` and ``disk``
    cumulative through the faster tiers."""
    entry, score, instance = templates
    bs = block_size or 1
    g, c, d = gpu * bs, (gpu + cpu) * bs, matched * bs
    return (node_id, rank, matched, gpu, cpu, sto, entry % (matched, gpu, cpu, sto),
            (score % g if g else b"", instance % (d, g, g, c, d)))


def with_pull(entry: NodeJson | bytes, hint: PullHint) -> NodeJson | bytes:
    """A fast-path ``nodes`` entry (no pool fields) with its pull hint, as :class:`NodeJson` encodes it
    last."""
    if isinstance(entry, NodeJson):
        entry.pull = PullJson(*hint)
        return entry
    return b'%b,"pull":%b}' % (entry[:-1], _encode(PullJson(*hint)))


def with_reserved(hits: Sequence[Hit], view: Mapping[NodeKey, Reserved]) -> None:
    """The general path's hits with the reservations on their (node, rank) (:func:`lookup_view
    <kvcoord.coordinator.reservations.lookup_view>`)."""
    for node_id, rank, _, _, _, _, node, _ in hits:
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
                        cause, pool, pool_tier(pool) if pool else "",
                        None if pull is None else PullJson(*pull))
        hits.append((node_id, rank, matched, g, c, d + p, node, None))
    return hits
