"""The HTTP API's lookup answer, encoded once for both of its paths: the handler's general path
(:class:`kvcoord.coordinator.httpapi.HttpApi`, from :class:`~kvcoord.coordinator.lookup.LiveMatch` rows) and
the fast path (:mod:`kvcoord.coordinator.fastpath`, from the table's packed rows and entries encoded
beforehand). Dynamo's ``ScoreResponse`` fields first, then kvcoord's.

Why fragments: an answer is a handful of per-(node, rank) parts (its ``scores`` and ``instances`` entries
and its ``nodes`` entry) around a fixed frame. Building dicts and Structs per hit for one msgspec encode
cost ~1 µs a hit, as much as the lookup; here each part is made once from a template that holds every
string already encoded by msgspec (:func:`hit_templates`, :func:`entry_template`), only integers are
formatted in, and the fast path keeps the parts of the rows it has seen."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from operator import itemgetter

import msgspec

from kvcoord.answer_json import NodeJson, PullJson, ReservedJson, TiersJson
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.httpd import JSON, Response
from kvcoord.coordinator.lookup import LiveMatch
from kvcoord.coordinator.pools import PullHint
from kvcoord.coordinator.reservations import Reserved
from kvcoord.index.base import NodeKey
from kvcoord.load import NodeLoad

__all__ = ["SIZES", "Hit", "answer_json", "answer_parts", "answered", "entry_template", "hit_parts",
           "hit_templates", "lookup_answer", "match_hits", "node_tail", "with_pull", "with_reserved"]

_encode = msgspec.json.Encoder().encode


class _Instance(msgspec.Struct):
    """Dynamo's per-instance entry of ``instances`` (tokens), for a node answered on several ranks."""

    longest_matched: int
    gpu: int
    dp: dict[str, int]
    cpu: int
    disk: int


Hit = tuple[str, int, int, int, int, int, "NodeJson | bytes", bytes, bytes]
"""One (node, rank) of a lookup answer, best first: node id, dp rank, matched blocks, blocks per tier (GPU,
CPU, storage), its ``nodes`` entry (a :class:`NodeJson`, or encoded already), and its ``scores`` and
``instances`` entries as this rank alone makes them (:func:`hit_parts`; ``b""`` for no score)."""

SIZES = b',"num_blocks":%d,"num_tokens":%d,"nodes":'
"""The part of an answer between its model and block size and its ``nodes`` (:func:`answer_parts`): the
fast path keeps an answer's bytes around it, per table rows, and writes the query's sizes in."""

_MATCHED, _NODE = itemgetter(2), itemgetter(6)
_HEAD = b'{"scores":{%b},"frequencies":[],"instances":{%b},"model":%b,"block_size":%d'
"""Dynamo's ``ScoreResponse`` (``frequencies`` always empty, as Dynamo's indexer service answers), then
kvcoord's ``model`` and ``block_size``; :data:`SIZES` and the ``nodes`` follow."""
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
    """A lookup's whole answer (:func:`answer_parts` around the query's sizes) and the most blocks a node
    matched."""
    head, tail, best = answer_parts(model, block_size, hits, block_hashes)
    return b"".join((head, SIZES % (num_blocks, num_tokens), tail)), best


def answer_parts(model: str, block_size: int, hits: Sequence[Hit],
                 block_hashes: list[int] | None = None) -> tuple[bytes, bytes, int]:
    """Dynamo's ``ScoreResponse`` (tokens; ``scores`` GPU only; ``cpu`` and ``disk`` cumulative through the
    faster tiers), then kvcoord's answer: its bytes before :data:`SIZES` and after, and the most blocks a
    node matched. The one encoder of a lookup's answer, for both paths."""
    nodes = list(map(_NODE, hits))
    try:
        nodes_json = b",".join(nodes)
    except TypeError:  # the general path's entries, not encoded yet
        nodes_json = b",".join([node if type(node) is bytes else _encode(node) for node in nodes])
    if 0 in map(_MATCHED, hits):  # unmatched rows (include_unmatched) have a nodes entry only
        hits = [hit for hit in hits if hit[2]]
    scores_json, instances_json, best = _dynamo(block_size, hits)
    head = _HEAD % (scores_json, instances_json, _encode(model), block_size)
    if block_hashes is None:
        return head, b"[%b]}" % nodes_json, best
    return head, b'[%b],"block_hashes":%b}' % (nodes_json, _encode(block_hashes)), best


def _dynamo(block_size: int, hits: Sequence[Hit]) -> tuple[bytes, bytes, int]:
    """``scores`` and ``instances`` (each without its braces) of matched ``hits``, and the most blocks a
    node matched: each rank's own entries (:func:`hit_parts`), unless a node answers on several."""
    if not hits:
        return b"", b"", 0
    node_ids, _, matched, _, _, _, _, scores, instances = zip(*hits, strict=True)
    if len(set(node_ids)) < len(node_ids):
        return (*_merged(block_size, hits), max(matched))
    return b",".join(filter(None, scores)), b",".join(instances), max(matched)


def _merged(block_size: int, hits: Sequence[Hit]) -> tuple[bytes, bytes]:
    """``scores`` and ``instances`` (each without its braces) of matched ``hits`` where a node answers on
    several ranks: the node's ranks in ``scores`` and ``dp``, and its best of each count, as Dynamo's
    ``ScoreResponse``."""
    bs = block_size or 1
    scores: dict[str, dict[str, int]] = {}
    instances: dict[str, _Instance] = {}
    for node_id, rank, matched, g, c, _, _, _, _ in hits:
        gpu, cpu, disk, dp = g * bs, (g + c) * bs, matched * bs, str(rank)
        if gpu:
            scores.setdefault(node_id, {})[dp] = gpu
        inst = instances.get(node_id)
        if inst is None:
            instances[node_id] = _Instance(max(gpu, cpu, disk), gpu, {dp: gpu}, cpu, disk)
        else:  # another rank of the node: the node's best of each
            inst.dp[dp] = gpu
            inst.gpu, inst.cpu = max(inst.gpu, gpu), max(inst.cpu, cpu)
            inst.disk = max(inst.disk, disk)
            inst.longest_matched = max(inst.longest_matched, gpu, cpu, disk)
    return _encode(scores)[1:-1], _encode(instances)[1:-1]


def hit_templates(key: bytes, rank: int) -> tuple[bytes, bytes]:
    """A (node, rank)'s ``scores`` and ``instances`` entries with their counts left to fill in
    (:func:`hit_parts`), from its node id as JSON: the fast path's views keep them per (node, rank)."""
    literal = _literal(key)
    return _SCORE % (literal, rank), _INSTANCE % (literal, rank)


def hit_parts(templates: tuple[bytes, bytes], matched: int, g: int, c: int,
              block_size: int) -> tuple[bytes, bytes]:
    """A (node, rank)'s ``scores`` entry (``b""`` without blocks on GPU) and ``instances`` entry, in tokens:
    ``cpu`` and ``disk`` cumulative through the faster tiers."""
    bs = block_size or 1
    gpu, cpu, disk = g * bs, (g + c) * bs, matched * bs
    score, instance = templates
    return (score % gpu if gpu else b""), instance % (max(gpu, cpu, disk), gpu, gpu, cpu, disk)


def entry_template(key: bytes, rank: int, tail: bytes) -> bytes:
    """A (node, rank)'s ``nodes`` entry with its matched blocks and tiers left to fill in (``% (matched,
    gpu, cpu, storage)``), from its node id as JSON and its tail (:func:`node_tail`): as :class:`NodeJson`
    encodes it."""
    return _ENTRY % (_literal(key), rank, _literal(tail))


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
    fast path's views keep it per (node, rank) in their :func:`entry_template`."""
    entry = _encode(NodeJson(node_id, rank, 0, TiersJson(0, 0, 0), _load_json(load), trust, url or None,
                             cause))
    head = entry_template(_encode(node_id), rank, b"") % (0, 0, 0, 0)
    if not entry.startswith(head):
        raise AssertionError("a nodes entry does not start as expected")
    return entry[len(head):]


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
    for node_id, rank, _, _, _, _, node, _, _ in hits:
        got = view.get((node_id, rank))
        if got is not None and isinstance(node, NodeJson):
            node.reserved = ReservedJson(got.blocks, got.requests, got.prefill_tokens)


def match_hits(matches: Sequence[LiveMatch], pool_tier: Callable[[str], str], block_size: int) -> list[Hit]:
    """The general path's live matches as hits (no tiers: all on GPU); a pool's blocks count as storage in
    Dynamo's fields."""
    hits: list[Hit] = []
    for node_id, rank, matched, t, load, url, trust, cause, pool, pull in matches:
        g, c, d, p = (*t, 0, 0, 0)[:4] if t else (matched, 0, 0, 0)
        node = NodeJson(node_id, rank, matched, TiersJson(g, c, d, p), _load_json(load), trust, url or None,
                        cause, pool, pool_tier(pool) if pool else "",
                        None if pull is None else PullJson(*pull))
        score, instance = hit_parts(hit_templates(_encode(node_id), rank), matched, g, c, block_size)
        hits.append((node_id, rank, matched, g, c, d + p, node, score, instance))
    return hits
