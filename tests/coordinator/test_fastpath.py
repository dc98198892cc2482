"""The HTTP API's fast path (``kvcoord.coordinator.fastpath``) answers plain lookups as the handler's
general path does, byte for byte, over random fleets, queries and changes, however the client writes the
request; what it does not take gets the general path's answer; and a node that stops being live is never
answered from a stale view."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcoord.coordinator.auth import Authenticator
from kvcoord.coordinator.config import load_config
from kvcoord.coordinator.config_values import ConfigError
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.fastpath import MAX_VIEW_AGE, FastAnswers
from kvcoord.coordinator.httpapi import HttpApi
from kvcoord.coordinator.httpd import HttpServer, Request, Response, render
from kvcoord.coordinator.metrics import PyTally
from kvcoord.coordinator.registry import AnnouncedProfile, NodeRecord
from kvcoord.events import CLEAR, STORE
from kvcoord.hashing import HashProfile, block_hashes64
from kvcoord.index.memory import MemoryIndex
from kvcoord.load import NodeLoad
from kvcoord.native import native

pytestmark = pytest.mark.skipif(native is None, reason="the native extension is not built")

BS = 4
MODELS = ["m,algo=sha256_cbor,block_size=4,seed=42", "p,algo=sha256,block_size=4,seed=7",
          "x,algo=xxhash_cbor,block_size=4,seed=1"]
PROFILES = {"m": HashProfile(algo="sha256_cbor", block_size=BS, seed="42"),
            "p": HashProfile(algo="sha256", block_size=BS, seed="7"),
            "x": HashProfile(algo="xxhash_cbor", block_size=BS, seed="1")}
NODE_IDS = ["a", "b", "node-3", "123", 'q"uote', "ü-node", "back\\slash", "z" * 40]
EXTRA = [("x-kvcoord-replica", "r1")]


class Fleet:
    """One coordinator's state with the HTTP API over it, driven directly (no streams)."""

    def __init__(self, rng: random.Random, max_view_age: float = MAX_VIEW_AGE,
                 fast: type[FastAnswers] = FastAnswers, **overrides: Any) -> None:
        # a lease far longer than any stall of a busy machine: nodes lapse only where a test says so
        cfg = load_config(None, env={}, overrides={"listen": "127.0.0.1:0", "metrics_listen": "",
                                                   "http_listen": "", "models": MODELS,
                                                   "lease_seconds": 3600.0, **overrides})
        self.rng = rng
        self.state = CoordinatorState(cfg, MemoryIndex())
        self.api = HttpApi(self.state, None, Authenticator(cfg.auth))
        self.server = HttpServer(self.api.routes(), self.api.authorize, EXTRA)
        """The general path alone."""
        self.fast_api = HttpApi(self.state, None, Authenticator(cfg.auth))
        self.fast_api.fast = self.fast = fast(self.fast_api, max_view_age)
        self.fast_server = HttpServer(self.fast_api.routes(), self.fast_api.authorize, EXTRA)
        """The fast path first, as ``kvcoord serve`` runs it."""
        self.tokens = [rng.randrange(0, 1 << 17) for _ in range(40 * BS)]
        self.chains = {m: block_hashes64(p, self.tokens) for m, p in PROFILES.items()}
        self.chains["m@g1"] = self.chains["m"]

    def node(self, node_id: str, model: str, ranks: tuple[int, ...]) -> NodeRecord:
        rec, _ = self.state.registry.hello(node_id, model, ranks, 1, index_ok=True)
        rec.resyncing = False
        rng = self.rng
        rec.load = NodeLoad(rng.randrange(0, 9), rng.randrange(0, 9), rng.choice([0.0, 0.25, 1.0]))
        rec.serving_url = self.rng.choice(["", "http://10.0.0.1:8000"])
        for rank in ranks:
            self.store(model, node_id, rank)
        return rec

    def store(self, model: str, node_id: str, rank: int) -> None:
        chain = self.chains[model]
        upto = self.rng.randrange(0, len(chain) + 1)
        cut = self.rng.randrange(0, upto + 1)
        tier = self.rng.randrange(0, 3)
        ops = [(STORE, self.rng.choice([0, tier]), chain[:cut], None, True),
               (STORE, tier, chain[cut:upto], None, True)]
        self.state.index.apply_sync(model, node_id, rank, ops)  # type: ignore[attr-defined]

    def populate(self) -> None:
        for node_id in self.rng.sample(NODE_IDS, self.rng.randrange(1, len(NODE_IDS) + 1)):
            model = self.rng.choice(["m", "m", "p", "x", "m@g1"])
            ranks = tuple(sorted(self.rng.sample(range(4), self.rng.randrange(1, 4))))
            self.node(node_id, model, ranks)

    def mutate(self) -> None:
        """One change a coordinator sees: states, loads, blocks, nodes coming and going."""
        recs = list(self.state.registry)
        rng, st = self.rng, self.state
        if not recs or rng.random() < 0.1:
            self.node(rng.choice(NODE_IDS) + "-new", rng.choice(["m", "p", "x"]), (0,))
            return
        rec = rng.choice(recs)
        what = rng.randrange(9)
        if what == 0:
            rec.draining = not rec.draining
        elif what == 1:
            rec.load = NodeLoad(rng.randrange(0, 50), rng.randrange(0, 50), rng.random())
        elif what == 2:
            rec.resyncing = not rec.resyncing
        elif what == 3:
            rec.hash_mismatch, rec.hash_mismatch_reason = True, "sampled chain did not verify"
        elif what == 4:
            rec.history_lost = {rec.dp_ranks[0]: "20 batch(es) from seq 0 are gone"}
        elif what == 5:
            st.registry.remove(rec.node_id)
            st.index.remove_node_sync(rec.node_id)  # type: ignore[attr-defined]
        elif what == 6:
            st.index.apply_sync(rec.model, rec.node_id, rec.dp_ranks[0], [(CLEAR, 0, (), None, True)])  # type: ignore[attr-defined]
        elif what == 7:
            self.store(rec.model, rec.node_id, rng.choice(rec.dp_ranks))
        else:
            rec.serving_url = rng.choice(["", "http://10.0.0.2:8000/v1"])

    def query(self, rng: random.Random | None = None) -> tuple[str, dict[str, Any]]:
        rng = rng or self.rng
        model = rng.choice(["m", "m", "p", "x", "m@g1", "unknown"])
        name, _, group = model.partition("@")
        n = rng.randrange(0, 42)
        body: dict[str, Any] = {"model_name": name}
        if group or rng.random() < 0.2:
            body["routing_group"] = group or "default"
        if rng.random() < 0.15:
            body["tenant_id"] = "t"
        if rng.random() < 0.5:
            chain: list[int] = [*self.chains.get(model, self.chains["m"])[:n]]
            if rng.random() < 0.3:
                chain = [*chain, rng.randrange(0, 1 << 64)]
            body["block_hashes"] = [h - (1 << 64) if h >= 1 << 63 and rng.random() < 0.5 else h
                                    for h in chain]
            if rng.random() < 0.1:
                body["cache_salt"] = None
            return "/query_by_hash", body
        tokens = self.tokens[: n * BS + rng.randrange(0, BS)]
        if rng.random() < 0.3 and tokens:
            tokens = [*tokens[:-1], (tokens[-1] + 1) % (1 << 17)]
        body["token_ids"] = tokens
        if rng.random() < 0.1:
            body["lora_name"] = None
        if rng.random() < 0.1:
            body["include_unmatched"] = False
        return "/query", body

    def handler(self, path: str, body: bytes) -> bytes:
        """The Python handler's answer, as the server writes it."""
        req = Request("POST", path, "", {"content-type": "application/json"}, body)
        resp = self.api.query(req) if path == "/query" else self.api.query_by_hash(req)
        assert isinstance(resp, Response)
        return undated(render(resp, True, self.server.extra_headers))

    def answer(self, raw: bytes) -> bytes | None:
        """The fast path's answer (without its Date) of the one request in ``raw``, or None where it
        leaves the request to the general path."""
        req = parse(raw)
        if req is None:
            return None
        counts = self.state.metrics.lookup_answers
        before = counts["fast"]
        resp = self.fast_server.dispatch(req)
        if counts["fast"] == before:
            return None
        assert isinstance(resp, Response) and counts["fast"] == before + 1
        return undated(render(resp, True, self.server.extra_headers))


def parse(raw: bytes) -> Request | None:
    """The one whole request in ``raw`` as the server frames it (httptools), or None."""
    parts: dict[str, Any] = {"url": b"", "headers": {}, "body": b"", "done": 0}

    class Sink:
        def on_url(self, url: bytes) -> None:
            parts["url"] += url

        def on_header(self, name: bytes, value: bytes) -> None:
            parts["headers"][name.decode("latin-1").lower()] = value.decode("latin-1")

        def on_body(self, body: bytes) -> None:
            parts["body"] += body

        def on_message_complete(self) -> None:
            parts["done"] += 1

    parser = httptools.HttpRequestParser(Sink())
    try:
        parser.feed_data(raw)
    except httptools.HttpParserError:
        return None
    if parts["done"] != 1:
        return None
    url = httptools.parse_url(parts["url"])
    return Request(parser.get_method().decode(), url.path.decode("latin-1"),
                   (url.query or b"").decode("latin-1"), parts["headers"], parts["body"])


def undated(answer: bytes) -> bytes:
    """An answer without its Date header (a second may turn between two answers compared)."""
    return re.sub(rb"\r\ndate: [^\r]*", b"", answer, count=1)


def raw_request(path: str, body: bytes, headers: str = "content-type: application/json\r\n") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: kvcoord\r\n{headers}content-length: {len(body)}\r\n\r\n"
    return head.encode() + body


def encodings(body: dict[str, Any], rng: random.Random) -> bytes:
    style = rng.randrange(3)
    if style == 0:
        return json.dumps(body, separators=(",", ":")).encode()
    if style == 1:
        return json.dumps(body).encode()
    return (" \n" + json.dumps(body, indent=1) + "\r\n").encode()


@pytest.mark.parametrize("seed", range(8))
def test_fast_answers_equal_the_general_paths(seed: int) -> None:
    rng = random.Random(seed)
    fleet = Fleet(rng)
    fleet.populate()
    claimed = 0
    for _ in range(250):
        if rng.random() < 0.3:
            fleet.mutate()
        path, body = fleet.query()
        data = encodings(body, rng)
        expected = fleet.handler(path, data)
        got = fleet.answer(raw_request(path, data))
        if got is not None:
            assert got == expected, (path, body)
            claimed += 1
        elif body["model_name"] in PROFILES and "routing_group" not in body:
            # a configured model with a table: always claimed
            assert fleet.state.index.native_view(body["model_name"]) is None, (path, body)
    assert claimed > 60


def test_views_follow_every_change() -> None:
    """A view is stale, and rebuilt, after a change of a watched field, a new slot, or its lease. (Views
    live an hour here, not MAX_VIEW_AGE: a stall of a quarter second on a busy machine would rebuild one
    where the test expects it kept; the age itself is set to 0 below.)"""
    rng = random.Random(1)
    refreshed: list[str] = []

    class Recording(FastAnswers):
        def _refresh(self, model: str, now: float) -> bool:
            refreshed.append(model)
            return super()._refresh(model, now)

    fleet = Fleet(rng, max_view_age=3600.0, fast=Recording)
    rec = fleet.node("a", "m", (0,))
    fleet.state.index.apply_sync("m", "a", 0, [(STORE, 0, fleet.chains["m"][:8], None, True)])  # type: ignore[attr-defined]
    data = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:8]}).encode()
    raw = raw_request("/query_by_hash", data)
    kept = fleet.fast._kept

    def hit(stale: bool = False) -> bool:
        del refreshed[:]
        got = fleet.answer(raw)
        assert got is not None and got == fleet.handler("/query_by_hash", data)
        assert refreshed == (["m"] if stale else []), refreshed
        return b'"node_id":"a"' in got

    assert hit(stale=True)  # no view yet
    view = kept["m"]
    assert hit()
    # a view is valid for a while at most, and stale after it (a lease may have run out by then)
    assert view.valid_until <= time.monotonic() + fleet.fast.max_view_age
    view.valid_until = view.fresh_until = 0.0
    assert hit(stale=True) and kept["m"] is not view
    view = kept["m"]
    rec.draining = True
    assert not hit(stale=True) and kept["m"] is view  # brought up to date in place: one node
    rec.draining = False
    assert hit(stale=True)
    rec.load = NodeLoad(running_requests=77)
    assert hit(stale=True) and kept["m"] is view
    assert b'"running_requests":77' in (fleet.answer(raw) or b"")
    fleet.node("b", "m", (0,))  # a new slot moves the table's layout
    layout_view = kept["m"]
    assert hit(stale=True) and kept["m"] is not layout_view
    fleet.state.registry.remove("a")
    assert fleet.answer(raw) == fleet.handler("/query_by_hash", data)
    assert b'"node_id":"a"' not in fleet.handler("/query_by_hash", data)


def test_an_answer_kept_for_its_rows_says_each_querys_sizes() -> None:
    """Queries the table gives the same rows for share one kept answer, each with its own sizes; a change
    of a node's entry drops it."""
    fleet = Fleet(random.Random(5))
    rec = fleet.node("a", "m", (0,))
    ops = [(CLEAR, 0, (), None, True), (STORE, 0, fleet.chains["m"][:8], None, True)]
    fleet.state.index.apply_sync("m", "a", 0, ops)  # type: ignore[attr-defined]
    for n in (8, 9, 12, 8):
        data = json.dumps({"model_name": "m", "token_ids": fleet.tokens[:n * BS + 1]}).encode()
        assert fleet.answer(raw_request("/query", data)) == fleet.handler("/query", data)
        data = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:n]}).encode()
        assert fleet.answer(raw_request("/query_by_hash", data)) == fleet.handler("/query_by_hash", data)
    kept = fleet.fast._kept["m"]
    assert len(kept.answers) == 1  # one block size, one set of rows
    rec.load = NodeLoad(running_requests=5)
    data = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:8]}).encode()
    got = fleet.answer(raw_request("/query_by_hash", data))
    assert got == fleet.handler("/query_by_hash", data) and b'"running_requests":5' in (got or b"")


def test_a_nodes_change_drops_only_its_rows_and_the_answers_naming_it() -> None:
    """A new load (every heartbeat of a busy engine) must not empty the view's kept rows and answers: the
    other nodes' stay, and every answer is still the general path's."""
    fleet = Fleet(random.Random(6))
    chain = fleet.chains["m"]
    a, b = fleet.node("a", "m", (0,)), fleet.node("b", "m", (0,))
    for node, upto in (("a", 8), ("b", 4)):
        ops = [(CLEAR, 0, (), None, True), (STORE, 0, chain[:upto], None, True)]
        fleet.state.index.apply_sync("m", node, 0, ops)  # type: ignore[attr-defined]
    # a's own tail (only a holds blocks 4-7) and the shared head (both hold blocks 0-3)
    only_a = json.dumps({"model_name": "m", "block_hashes": chain[4:8]}).encode()
    both = json.dumps({"model_name": "m", "block_hashes": chain[:8]}).encode()

    def answers_agree() -> None:
        for data in (only_a, both):
            assert fleet.answer(raw_request("/query_by_hash", data)) == fleet.handler("/query_by_hash", data)

    answers_agree()
    kept = fleet.fast._kept["m"]
    assert len(kept.answers) == 2
    slot_a, slot_b = (kept.by_node[n][0][0] for n in ("a", "b"))
    b.load = NodeLoad(running_requests=9)
    answers_agree()  # brings the view up to date: b's rows and the answer naming b go, then come back
    assert len(kept.answers) == 2 and kept is fleet.fast._kept["m"]
    assert b'"running_requests":9' in (fleet.answer(raw_request("/query_by_hash", both)) or b"")
    rows_a = list(kept.rows_of[slot_a])
    b.load = NodeLoad(running_requests=10)
    fleet.answer(raw_request("/query_by_hash", only_a))
    assert kept.rows_of[slot_a] == rows_a and slot_b not in kept.rows_of  # a's rows kept, b's gone
    assert [slots for *_, slots in kept.answers.values()] == [(slot_a,)]  # only the answer naming a
    a.load = NodeLoad(running_requests=3)
    answers_agree()
    assert all(kept.answers_of[s] <= kept.answers.keys() for s in kept.answers_of)


def test_tally_is_its_twin() -> None:
    """kvcoord._native.Tally and PyTally bucket and sum alike (bounds as the metrics use them)."""
    assert native is not None
    rng = random.Random(7)
    for bounds in [(0.0, 0.1, 0.5, 1.0), (0.0001, 0.001, 1.0), (), (-1.0, 2.5)]:
        a, b = native.Tally(bounds), PyTally(bounds)
        for _ in range(500):
            v = rng.choice([*bounds, 0.0, rng.uniform(-2, 3), rng.random() * 1e-3])
            a.observe(v)
            b.observe(v)
        assert a.counts() == b.counts()
    with pytest.raises(ValueError):
        native.Tally((1.0, 1.0))
    with pytest.raises(ValueError):
        PyTally((1.0, 1.0))


def test_what_the_fast_path_leaves_to_the_general_path() -> None:
    """Every plain lookup is taken, whatever its head says; lookups with extra keys or unmatched nodes,
    and every error, are the general path's."""
    rng = random.Random(3)
    fleet = Fleet(rng)
    fleet.node("a", "m", (0,))
    tokens = fleet.tokens[:16]
    good = json.dumps({"model_name": "m", "token_ids": tokens}).encode()
    too_many = fleet.state.config.limits.max_query_blocks
    for raw in [
        raw_request("/query", good),
        raw_request("/query", good, "content-type: application/json\r\nexpect: 100-continue\r\n"),
        raw_request("/query", good, "content-type: application/json\r\nconnection: close\r\n"),
        raw_request("/query?x=1", good),
        raw_request("/query", good).replace(b"HTTP/1.1", b"HTTP/1.0", 1),
        raw_request("/query", json.dumps({"model_name": "m", "token_ids": tokens, "prompt": "hi"}).encode()),
        raw_request("/query", json.dumps({"model_name": "m", "token_ids": tokens, "lora_name": None,
                                          "cache_salt": ""}).encode()),
    ]:
        req = parse(raw)
        assert req is not None
        assert fleet.answer(raw) == fleet.handler(req.path, req.body), raw[:120]
    for raw in [
        raw_request("/query", good, "content-type: text/plain\r\n"),
        raw_request("/query", json.dumps({"model_name": "m", "token_ids": tokens,
                                          "lora_name": "l"}).encode()),
        raw_request("/query", json.dumps({"model_name": "m", "token_ids": tokens,
                                          "cache_salt": "s"}).encode()),
        raw_request("/query", json.dumps({"model_name": "m", "token_ids": tokens,
                                          "include_unmatched": True}).encode()),
        raw_request("/query", b'{"model_name":"m","model_name":"m","token_ids":[1,2,3,4]}'),
        raw_request("/query", b'{"model_name":"m","token_ids":[1,2,3,4.0]}'),
        raw_request("/query", b'{"model_name":"m","token_ids":[1,2,3,4294967296]}'),
        raw_request("/query", b'{"model_name":"\xff","token_ids":[1,2,3,4]}'),
        raw_request("/query", b'{"model_name":"m","token_ids":null}'),
        raw_request("/query", b'{"model_name":"m"}'),
        raw_request("/query", b'{"model_name":"nope","token_ids":[1,2,3,4]}'),
        raw_request("/query_by_hash", json.dumps({"model_name": "m", "block_hashes": [1],
                                                  "cache_salt": "s"}).encode()),
        raw_request("/query_by_hash", b'{"model_name":"m","block_hashes":[18446744073709551616]}'),
        raw_request("/query", json.dumps({"model_name": "m",
                                          "token_ids": [1] * BS * (too_many + 1)}).encode()),
        raw_request("/query_by_hash", json.dumps({"model_name": "m",
                                                  "block_hashes": [1] * (too_many + 1)}).encode()),
        b"GET /query HTTP/1.1\r\n\r\n",
    ]:
        assert fleet.answer(raw) is None, raw[:120]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_any_bytes_are_answered_exactly_or_left_alone(data: st.DataObject) -> None:
    """Random edits of real requests: the fast path leaves them to the general path, or answers as it
    does; the index never changes."""
    fleet = _shared_fleet()
    path, body = fleet.query(random.Random(data.draw(st.integers(0, 1 << 32))))
    raw = bytearray(raw_request(path, json.dumps(body).encode()))
    for _ in range(data.draw(st.integers(0, 3))):
        at = data.draw(st.integers(0, len(raw) - 1))
        edit = data.draw(st.sampled_from(["flip", "drop", "insert"]))
        if edit == "flip":
            raw[at] = data.draw(st.sampled_from(list(b' ,:"[]{}-0123456789e.\\\r\nA\x00\xff')))
        elif edit == "drop":
            del raw[at]
        else:
            raw.insert(at, data.draw(st.integers(0, 255)))
    before = fleet.state.index.stats_sync()  # type: ignore[attr-defined]
    got = fleet.answer(bytes(raw))
    if got is not None:
        req = parse(bytes(raw))
        assert req is not None and got == fleet.handler(req.path, req.body)
    assert fleet.state.index.stats_sync() == before  # type: ignore[attr-defined]


_FLEET: list[Fleet] = []


def _shared_fleet() -> Fleet:
    if not _FLEET:
        fleet = Fleet(random.Random(11), lease_seconds=3600.0)
        fleet.populate()
        _FLEET.append(fleet)
    return _FLEET[0]


async def _exchange(port: int, chunks: list[bytes], answers: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in chunks:
            writer.write(chunk)
            await writer.drain()
            await asyncio.sleep(0)
        out = b""
        for _ in range(answers):
            head = await reader.readuntil(b"\r\n\r\n")
            length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length:"))
            out += b"\r\n".join(line for line in head.split(b"\r\n") if not line.startswith(b"date:"))
            out += await reader.readexactly(length)
        return out
    finally:
        writer.close()
        await writer.wait_closed()


def _cases(fleet: Fleet) -> Iterator[tuple[list[bytes], int, int]]:
    """(writes, answers, of which the fast path's)."""
    good = json.dumps({"model_name": "m", "token_ids": fleet.tokens[:64]}).encode()
    by_hash = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:20]}).encode()
    req, hreq = raw_request("/query", good), raw_request("/query_by_hash", by_hash)
    head = req.index(b"\r\n\r\n") + 4
    yield [req], 1, 1
    yield [req[:head], req[head:]], 1, 1  # head, then body: as http.client and requests write
    yield [req[i:i + 1] for i in range(len(req))], 1, 1  # byte by byte
    yield [hreq[i:i + 7] for i in range(0, len(hreq), 7)], 1, 1
    yield [req[:30], req[30:]], 1, 1  # split inside the headers
    yield [req[: len(req) - 10], req[len(req) - 10:]], 1, 1  # split inside the body
    yield [req + hreq], 2, 2  # pipelined
    yield [req, hreq, req], 3, 3  # keep-alive, one after another
    yield [b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n" + req], 2, 1
    yield [raw_request("/query", b'{"model_name":"nope","token_ids":[1,2,3,4]}')], 1, 0
    yield [raw_request("/query", b'{"model_name":"m","token_ids":[1,2,3,4]', )[:-1] + b"x"], 1, 0


async def test_live_servers_with_and_without_the_fast_path_agree() -> None:
    """The same bytes to two real servers over one state, one with the fast path: the same answers, and
    every plain lookup answered by the fast path, however the client wrote it (at once, head and body
    apart, byte by byte, pipelined)."""
    fleet = Fleet(random.Random(5))
    fleet.populate()
    fleet.node("a", "m", (0, 1))
    counts = fleet.state.metrics.lookup_answers
    ports = [await fleet.fast_server.start("127.0.0.1", 0), await fleet.server.start("127.0.0.1", 0)]
    try:
        for chunks, answers, plain in _cases(fleet):
            before = counts["fast"]
            fast = await _exchange(ports[0], chunks, answers)
            assert counts["fast"] == before + plain, chunks[:3]
            assert fast == await _exchange(ports[1], chunks, answers), chunks[:3]
            assert counts["fast"] == before + plain
        metric = fleet.state.metrics.registry.get_sample_value
        assert metric("kvcoord_lookup_answers_total", {"path": "fast"}) == counts["fast"] > 0
        assert metric("kvcoord_lookup_answers_total", {"path": "handler"}) == counts["handler"] > 0
    finally:
        await fleet.fast_server.stop()
        await fleet.server.stop()


@pytest.mark.parametrize(("ctype", "claimed"), [
    ("application/json", True), ("Application/JSON", True), ("application/json; charset=utf-8", True),
    ("application/json ;charset=utf-8", True), ("application/jsonx", False),
    ("application/problem+json", True), ("text/json", False)])
def test_content_types(ctype: str, claimed: bool) -> None:
    fleet = Fleet(random.Random(6))
    fleet.node("a", "m", (0,))
    body = json.dumps({"model_name": "m", "token_ids": fleet.tokens[:32]}).encode()
    got = fleet.answer(raw_request("/query", body, f"content-type: {ctype}\r\n"))
    if not claimed:
        assert got is None
    else:
        req = Request("POST", "/query", "", {"content-type": ctype}, body)
        resp = fleet.api.query(req)
        assert isinstance(resp, Response) and resp.status == 200
        assert got == undated(render(resp, True, fleet.server.extra_headers))
    assert fleet.state.metrics.registry.get_sample_value("kvcoord_lookup_answers_total",
                                                         {"path": "fast"}) == (1 if claimed else 0)


@pytest.mark.parametrize("header", [None, "Bearer wrong", "Basic cm91dGVy", "Bearer router-secret"])
def test_with_tokens_only_a_token_that_may_look_up_is_answered(header: str | None) -> None:
    fleet = Fleet(random.Random(4), router_tokens=["router-secret"], admin_tokens=["admin-secret"])
    fleet.node("a", "m", (0,))
    body = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:8]}).encode()
    extra = f"authorization: {header}\r\n" if header is not None else ""
    raw = raw_request("/query_by_hash", body, "content-type: application/json\r\n" + extra)
    req = Request("POST", "/query_by_hash", "", {"content-type": "application/json",
                                                 **({"authorization": header} if header else {})}, body)
    refused = fleet.api.authorize(req)
    got = fleet.answer(raw)
    if refused is not None:  # the handler's 401 answers it
        assert got is None and refused.status == 401
    else:
        assert got == fleet.handler("/query_by_hash", body)


MALFORMED: list[tuple[str, bytes]] = [
    ("/query_by_hash", b'{"modKl_name": "m1b", "block_hasXes": []}'),  # issue 23
    ("/query_by_hash", b"{}"),
    ("/query_by_hash", b'{"model_name": "m"}'),
    ("/query_by_hash", b'{"block_hashes": [1]}'),
    ("/query_by_hash", b'{"block_hashes": [1], "modl_name": "m"}'),
    ("/query_by_hash", b'{"model_name": 5, "block_hashes": [1]}'),
    ("/query_by_hash", b'{"model_name": 5, "block_hashes": "x"}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": "x"}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [1, "2"]}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [[1]]}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": {"a": [1]}}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [1], "routing_group": 5}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [1], "include_unmatched": "yes"}'),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [1], "x": {"y": [[[{"z": null}]]]}}'),
    ("/query_by_hash", b'{"model_name": null, "block_hashes": null}'),
    ("/query_by_hash", b'[{"model_name": "m", "block_hashes": [1]}]'),
    ("/query_by_hash", b"[" * 5000 + b"]" * 5000),
    ("/query_by_hash", b'{"model_name": "m", "block_hashes": [1], "cache_salt": {"a": "b"}}'),
    ("/query", b"{}"),
    ("/query", b'{"modKl_name": "m", "tokXn_ids": [1]}'),
    ("/query", b'{"token_ids": [1, 2, 3, 4]}'),
    ("/query", b'{"model_name": ["m"], "token_ids": [1]}'),
    ("/query", b'{"model_name": "m", "token_ids": [-1]}'),
    ("/query", b'{"model_name": "m", "token_ids": [1, 2.5]}'),
    ("/query", b'{"model_name": "m", "token_ids": "1234"}'),
    ("/query", b'{"model_name": "m", "token_ids": [[1, 2]]}'),
    ("/query", b'{"model_name": "m", "token_ids": [1], "messages": 5}'),
    ("/query", b'{"model_name": "m", "token_ids": [1], "lora_name": {"a": 1}}'),
    ("/query", b'{"model_name": "m", "token_ids": [1], "routing_group": [], "tenant_id": {}}'),
    ("/query", b'{"model_name": "m", "token_ids": [1], "nested": ' + b"[" * 300 + b"]" * 300 + b"}"),
    ("/query", b'{"model_name": "m", "token_ids": [1], "messages": [' + b'{"c":' * 200 + b"1" + b"}" * 200
     + b"]}"),
    ("/query", b'{"a":' * 2000 + b"1" + b"}" * 2000),
    ("/query", b'{"model_name": "m", "token_ids": [1, 2, 3, 4]'),
    ("/query", b'{"model_name": "m", "token_ids": [1, 2, 3, 4], }'),
]
"""Malformed lookups (missing fields, wrong types, misspelled keys, nested garbage): with native code and
without, each must get the same answer, byte for byte (issue 23); the sanitizer's fuzz feeds them to the
native code too."""


def test_malformed_lookups_answer_alike_with_and_without_native(tmp_path: Path) -> None:
    """Two real ``kvcoord serve``, one with ``KVCOORD_NATIVE=0``: the same answer (status, headers but the
    replica's id and the date, body) to every malformed lookup, natively decoded or not."""
    from tests.coordinator.test_http_hostile import exchange, post, serve

    with serve(tmp_path, native=True) as fast, serve(tmp_path, native=False) as slow:
        for path, body in MALFORMED:
            got = []
            for port in (fast.port, slow.port):
                status, headers, answer = exchange(port, post(path, body))
                kept = {k: v for k, v in headers.items() if k not in ("date", "x-kvcoord-replica")}
                got.append((status, kept, answer))
            assert got[0] == got[1], (path, body[:100])
            assert got[0][0] < 500, (path, body[:100], got[0])  # (unknown keys are ignored, as Dynamo does)


def fuzz_answer(rng: random.Random, steps: int) -> None:
    """For the sanitizer step (``python -m tests.test_native``): random fleets, changes and edited
    requests through the fast path (the native chain, ``json_take_ints`` and ``Table.rows``); every answer
    it gives is the general path's, and ``Table.rows`` on any bytes answers or raises, never crashes."""
    assert native is not None
    fleet = Fleet(rng, lease_seconds=3600.0)
    fleet.populate()
    for _ in range(steps):
        if rng.random() < 0.3:
            fleet.mutate()
        path, body = fleet.query()
        raw = bytearray(raw_request(path, encodings(body, rng)))
        if rng.random() < 0.2:
            raw = bytearray(raw_request(*rng.choice(MALFORMED)))
        for _ in range(rng.randrange(0, 3)):
            at = rng.randrange(len(raw))
            if rng.random() < 0.5:
                raw[at] = rng.randrange(256)
            else:
                del raw[at:at + rng.randrange(1, 8)]
        got = fleet.answer(bytes(raw))
        if got is not None:
            req = parse(bytes(raw))
            assert req is not None and got == fleet.handler(req.path, req.body)
    tables = [view[0] for model in ("m", "p", "x")
              if (view := fleet.state.index.native_view(model)) is not None] or [native.Table()]
    for _ in range(steps):
        data = rng.randbytes(rng.randrange(0, 80))
        keys: bytes | memoryview = data if rng.random() < 0.5 else memoryview(data)[rng.randrange(0, 8):]
        with contextlib.suppress(ValueError):
            assert len(rng.choice(tables).rows(keys)) % 16 == 0  # (slot, matched, cpu, storage) rows
    tally = native.Tally((1.0,))
    tally.observe(rng.random())
    for _ in range(steps // 4 + 1):
        with contextlib.suppress(TypeError, ValueError):
            native.Tally(tuple(rng.choice([0.5, -1.0, float("nan"), 2.0]) for _ in range(rng.randrange(40))))


def test_trust_is_per_dp_rank() -> None:
    """Lost history degrades the rank that lost it; a hash mismatch, the node's one verification, all."""
    fleet = Fleet(random.Random(8))
    rec = fleet.node("a", "m", (0, 1))
    for rank in (0, 1):
        fleet.state.index.apply_sync("m", "a", rank, [(STORE, 0, fleet.chains["m"][:6], None, True)])  # type: ignore[attr-defined]
    body = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:6]}).encode()

    def trusts() -> dict[int, tuple[str, str]]:
        got = fleet.answer(raw_request("/query_by_hash", body))
        assert got is not None and got == fleet.handler("/query_by_hash", body)
        nodes = json.loads(got.split(b"\r\n\r\n", 1)[1])["nodes"]
        return {n["dp_rank"]: (n["trust"], n.get("trust_cause", "")) for n in nodes}

    assert trusts() == {0: ("exact", ""), 1: ("exact", "")}
    rec.history_lost = {1: "20 batch(es) from seq 0 are gone"}
    assert trusts() == {0: ("exact", ""), 1: ("degraded", "history_lost")}
    assert rec.trust.state == "degraded"  # the node's own trust (ListNodes, metrics): its worst rank
    rec.hash_mismatch, rec.hash_mismatch_reason = True, "sampled chain did not verify"
    assert trusts() == {0: ("degraded", "hash_mismatch"), 1: ("degraded", "hash_mismatch")}


def test_a_lapsed_node_heard_again_is_answered_at_once() -> None:
    """Past its lease (not yet swept) a node is in no answer; a heartbeat then makes it live again without
    changing any watched field, and the fast path's next answer has it, as the general path's does."""
    fleet = Fleet(random.Random(9))
    rec = fleet.node("a", "m", (0,))
    fleet.node("b", "m", (0,))
    for node in ("a", "b"):
        fleet.state.index.apply_sync("m", node, 0, [(STORE, 0, fleet.chains["m"][:6], None, True)])  # type: ignore[attr-defined]
    body = json.dumps({"model_name": "m", "block_hashes": fleet.chains["m"][:6]}).encode()
    raw = raw_request("/query_by_hash", body)
    rec.last_heard = time.monotonic() - 3601.0  # as if its lease went by without a word from it
    lapsed = fleet.answer(raw)
    assert lapsed == fleet.handler("/query_by_hash", body) and b'"node_id":"a"' not in lapsed
    fleet.state.registry.heard(rec)
    again = fleet.answer(raw)
    assert again == fleet.handler("/query_by_hash", body) and b'"node_id":"a"' in again


def test_partitions_without_a_profile_follow_their_nodes() -> None:
    """A partition known only through its nodes: its block size is the one they announced, and with its
    last record gone (even one expired before) it is unknown again, on both paths."""
    fleet = Fleet(random.Random(10))
    rec, _ = fleet.state.registry.hello("a", "u", (0,), 1, index_ok=True)
    rec.resyncing = False
    hashes = block_hashes64(PROFILES["m"], fleet.tokens)[:5]
    fleet.state.index.apply_sync("u", "a", 0, [(STORE, 0, hashes, None, True)])  # type: ignore[attr-defined]
    body = json.dumps({"model_name": "u", "block_hashes": hashes}).encode()
    raw = raw_request("/query_by_hash", body)
    assert fleet.answer(raw) == fleet.handler("/query_by_hash", body)
    assert b'"block_size":0' in fleet.handler("/query_by_hash", body)
    rec.announced = AnnouncedProfile("sha256", 16)
    assert fleet.answer(raw) == fleet.handler("/query_by_hash", body)
    assert b'"block_size":16' in fleet.handler("/query_by_hash", body)
    rec.expired = True
    assert fleet.answer(raw) == fleet.handler("/query_by_hash", body)
    fleet.state.registry.remove("a")
    assert fleet.handler("/query_by_hash", body).startswith(b"HTTP/1.1 404")
    assert fleet.answer(raw) is None


@pytest.mark.parametrize("weight", ["inf", "-inf", "nan"])
def test_tier_weights_must_be_finite(weight: str, tmp_path: Path) -> None:
    """0 x inf is nan: no order would hold, natively or in Python."""
    path = tmp_path / "c.toml"
    path.write_text(f'[tier_weights]\nGPU = {weight}\n')
    with pytest.raises(ConfigError, match="finite"):
        load_config(path, env={})
