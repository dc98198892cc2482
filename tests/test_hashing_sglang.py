"""The sglang hash profile is bit-identical to SGLang's own code (its wheel's hash extension, utils and
event recorder: tests/sglang_ref.py), natively and in the pure-Python reference."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import time
import types
from array import array
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcoord import hashing, sglang_hash
from kvcoord.extra_keys import RequestKeys
from kvcoord.hashing import HashProfile
from tests import sglang_ref
from tests.http_util import get_text, http_json
from tests.procs import free_port, kvcoord_cmd, running, until, wait_for_port
from tests.tokenizers import build_tokenizer

pytestmark = pytest.mark.timeout(1200)  # the first run downloads the wheel (~38 MB) and compiles

_settings = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

# Token ids around SGLang's two encodings: uint32, wider (0xFF + uint64), and its int64 ceiling.
_token = st.one_of(
    st.integers(0, 200_000),
    st.integers(0, 2**32 - 1),
    st.integers(2**32, 2**63 - 1),
    st.sampled_from([0, 2**32 - 1, 2**32, 2**63 - 1]),
)
_salt = st.one_of(st.none(), st.just(""), st.text(max_size=12))
_lora = st.one_of(
    st.none(), st.tuples(st.text(min_size=1, max_size=8), st.one_of(st.none(), st.text(max_size=8))))


@pytest.fixture(scope="module")
def sgl() -> types.SimpleNamespace:
    try:
        return sglang_ref.load()
    except sglang_ref.Unavailable as exc:
        if os.environ.get("KVCOORD_REQUIRE_SGLANG"):
            raise
        pytest.skip(f"SGLang's wheel is not available here: {exc}")


@_settings
@given(tokens=st.lists(_token, max_size=40), page_size=st.integers(1, 8))
def test_page_chain_matches_sglang_extension(sgl: Any, tokens: list[int], page_size: int) -> None:
    """The chain's digests equal SGLang's get_hash_str (its C++ extension) page by page."""
    theirs = sgl.utils.get_hash_str(tokens, None, page_size)
    full = len(tokens) // page_size
    profile = HashProfile("sglang", page_size)
    for fast in (True, False):
        ours = hashing.hash_request_tokens(profile, tokens, fast=fast)
        assert [d.hex() for d in ours] == theirs[:full]
    for typecode in ("Q", "I"):
        if typecode == "I" and any(t > 2**32 - 1 for t in tokens):
            continue
        ours = hashing.hash_request_tokens(profile, array(typecode, tokens))
        assert [d.hex() for d in ours] == theirs[:full]


class _Node:
    """A radix-tree node as SGLang's event recorder reads it."""

    def __init__(self, key: Any, parent: _Node | None) -> None:
        self.key = key
        self.parent = parent
        self.hash_value: list[str] | None = None
        self.event_hash_value: list[str] | None = None


def _recorded(
    sgl: Any, tokens: list[int], page_size: int, salt: str | None, lora: tuple[str, str | None] | None,
    splits: tuple[int, ...] = (1,), dynamo: bool = False,
) -> list[Any]:
    """The events SGLang's KVCacheEventRecorder records for ``tokens`` stored as a path of radix nodes cut
    at ``splits`` (page counts), with the request's LoRA (its extra key: the adapter's id) and salt."""
    names = sgl.events.KvEventLoraNames()
    extra_key = None
    if lora is not None:
        name, path = lora
        extra_key = sgl.lora_registry.LoRARef.deterministic_id(name, name if path is None else path)
        names.register(types.SimpleNamespace(lora_id=extra_key, extra_key=extra_key), name)
    recorder = sgl.events.KVCacheEventRecorder(
        enabled=True, page_size=page_size, dynamo_format=dynamo, lora_names=names)

    class Key:  # SGLang's RadixKey as the recorder reads it (radix_cache.py imports torch)
        def __init__(self, ids: list[int]) -> None:
            self.token_ids = array("q", ids)
            self.extra_key = extra_key if ids else None
            self.cache_salt = (salt or None) if ids else None
            self.is_bigram = False

        def __len__(self) -> int:
            return len(self.token_ids)

    node = _Node(Key([]), None)
    node.hash_value = []
    bounds = sorted({0, *(s * page_size for s in splits), len(tokens)})
    for a, b in itertools.pairwise(bounds):
        node = _Node(Key(tokens[a:b]), node)
        recorder.record_store(node)
    return list(recorder.take())


def _published(
    sgl: Any, tokens: list[int], splits: list[int], page_size: int, salt: str | None,
    lora: tuple[str, str | None] | None, dynamo: bool,
) -> list[int]:
    """The block hashes SGLang publishes for the request (see :func:`_recorded`), checked to chain."""
    out: list[int] = []
    prev = None
    for ev in _recorded(sgl, tokens, page_size, salt, lora, tuple(splits), dynamo):
        assert ev.parent_block_hash == prev  # one chain, linked by the published hashes
        out.extend(ev.block_hashes)
        prev = ev.block_hashes[-1]
    return out


@_settings
@given(
    pages=st.lists(st.lists(_token, min_size=8, max_size=8), min_size=1, max_size=5),
    page_size=st.integers(1, 8),
    splits=st.lists(st.integers(1, 40), max_size=3),
    salt=_salt,
    lora=_lora,
    dynamo=st.booleans(),
)
def test_published_hashes_match_sglang_event_recorder(
    sgl: Any, pages: list[list[int]], page_size: int, splits: list[int], salt: str | None,
    lora: tuple[str, str | None] | None, dynamo: bool,
) -> None:
    """block_hashes64 (and the CLI's signed form) equal what SGLang's event recorder publishes, through
    its cache-salt seed, LoRA namespace, Dynamo format and node splits."""
    flat = [t for p in pages for t in p]
    tokens = flat[: len(flat) // page_size * page_size]
    theirs = _published(sgl, tokens, splits, page_size, salt, lora, dynamo)
    profile = HashProfile("sglang", page_size, style="dynamo" if dynamo else "untagged")
    name, path = lora if lora is not None else (None, None)
    keys = RequestKeys(cache_salt=salt, lora_name=name, lora_path=path)
    for fast in (True, False):
        ours = hashing.block_hashes64(profile, tokens, keys, fast=fast)
        assert [sglang_hash.to_signed64(k) for k in ours] == theirs
        assert [k & hashing.UINT64_MASK for k in theirs] == ours  # the index key: int & (2**64-1)


def test_lora_id_is_sglangs_deterministic_id(sgl: Any) -> None:
    for name, path in (("a", "b"), ("x", None), ("é", "/p/q")):
        assert sglang_hash.lora_id(name, path) == sgl.lora_registry.LoRARef.deterministic_id(
            name, name if path is None else path)


def test_namespace_seed_matches_sglang(sgl: Any) -> None:
    for extra, salt in ((None, None), ("k", None), (None, "s"), ("a", "bc"), ("ab", "c"), ("", "")):
        theirs = sgl.kv_events.kv_event_namespace_seed(extra_key=extra, cache_salt=salt)
        assert sglang_hash.namespace_seed(extra, salt) == (theirs or b"")


def test_sglang_batches_decode_with_their_cache_salt(sgl: Any) -> None:
    """A batch as SGLang encodes it keeps BlockStored's cache_salt (and lora_name) in the event model."""
    import msgspec

    from kvcoord.events import BlockStored, decode_vllm_batch

    events = _recorded(sgl, list(range(8)), 4, "tenant-a", ("ad", None))
    payload = msgspec.msgpack.encode(sgl.kv_events.KVEventBatch(ts=1.0, events=events))
    got = decode_vllm_batch(payload, signed_hashes=True).events
    assert [type(e) for e in got] == [BlockStored] * len(got)
    assert {(e.cache_salt, e.lora_name) for e in got if isinstance(e, BlockStored)} == {("tenant-a", "ad")}
    hashes = [h & hashing.UINT64_MASK for ev in events for h in ev.block_hashes]
    assert [h for e in got if isinstance(e, BlockStored) for h in e.block_hashes] == hashes


def test_ids_beyond_int64_are_refused_like_sglang(sgl: Any) -> None:
    profile = HashProfile("sglang", 2)
    with pytest.raises(Exception, match="int64"):
        sgl.utils.get_hash_str(array("Q", [1, 2**63]), None, 2)
    for fast in (True, False):
        with pytest.raises(ValueError, match="int64"):
            hashing.block_hashes64(profile, [1, 2**63], fast=fast)


# --- SGLang's own publisher, through a real agent and coordinator --------------------------------------
def _lookup(grpc: int, *args: str) -> dict[str, Any]:
    proc = subprocess.run(kvcoord_cmd("lookup", "--coordinator", f"127.0.0.1:{grpc}", "--model", "m", *args),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout)
    return out


def _matched(res: dict[str, Any]) -> int:
    return max((int(n["matched_blocks"]) for n in res["nodes"] if n["node_id"] == "n1"), default=0)


@pytest.mark.slow
def test_sglang_publisher_feeds_lookups_by_tokens_prompt_chat_and_hashes(sgl: Any, tmp_path: Path) -> None:
    """SGLang's event recorder and ZmqEventPublisher (from its wheel) feed `kvcoord agent --signed-hashes`;
    `serve --model m,algo=sglang` then answers lookups by tokens (plain, salted, LoRA), prompt and chat
    with exactly the stored blocks, `lookup --hashes` takes the published int64s, and `kvcoord hash --algo
    sglang` prints them."""
    from transformers import AutoTokenizer

    grpc, pub, replay, http = free_port(), free_port(), free_port(), free_port()
    page = 4
    tok_dir = build_tokenizer(tmp_path / "tok")
    hf = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    prompt = "The quick brown fox jumps over the lazy dog, again and again and again."
    prompt_ids = list(hf(prompt, add_special_tokens=True)["input_ids"])
    chat = [{"role": "user", "content": "What is the weather in Paris today? It is sunny and warm."}]
    chat_ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
    if not isinstance(chat_ids, list):  # transformers 5 returns an encoding
        chat_ids = chat_ids["input_ids"]
    requests: list[tuple[list[int], str | None, tuple[str, str | None] | None]] = [
        # (tokens, salt, lora): each stored as SGLang's radix cache would (two nodes, full pages)
        (list(range(1, 13)), None, None),
        ([7, 2**32 - 1, 9, 10, 11, 12, 13, 14], "tenant-a", None),  # lookups carry uint32 ids
        ([5] * 8 + [6] * 4, None, ("ad", "/adapters/ad")),
        (prompt_ids[: len(prompt_ids) // page * page], None, None),
        (list(chat_ids)[: len(chat_ids) // page * page], None, None),
    ]
    published = [_published(sgl, toks, [1], page, salt, lora, False) for toks, salt, lora in requests]
    publisher = sgl.kv_events.ZmqEventPublisher(
        0, endpoint=f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}", bind=True)
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{grpc}", "--http-listen", f"127.0.0.1:{http}",
                        "--model", f"m,algo=sglang,block_size={page},tokenizer={tok_dir}")
    agent = kvcoord_cmd("agent", "--coordinator", f"127.0.0.1:{grpc}", "--node-id", "n1", "--model", "m",
                        "--zmq-endpoint", f"tcp://127.0.0.1:{pub}", "--replay-endpoint",
                        f"tcp://127.0.0.1:{replay}", "--signed-hashes")
    try:
        with running(serve, log=tmp_path / "serve.log"):
            wait_for_port(grpc)
            with running(agent, log=tmp_path / "agent.log"):
                def stored() -> bool:  # republish (idempotent stores) until the subscriber has joined
                    for toks, salt, lora in requests:
                        events = _recorded(sgl, toks, page, salt, lora)
                        publisher.publish(sgl.kv_events.KVEventBatch(ts=time.time(), events=events))
                    return all(_matched(_lookup(grpc, *_query(t, s, lo))) == len(t) // page
                               for t, s, lo in requests)

                until(stored, "the SGLang blocks in the index", timeout=90, interval=0.3,
                      diagnose=lambda: (tmp_path / "agent.log").read_text()[-2000:])
                for (toks, salt, lora), hashes in zip(requests, published, strict=True):
                    # a lookup without the request's salt or adapter hits nothing of the namespaced chains
                    plain = _matched(_lookup(grpc, "--tokens", ",".join(map(str, toks))))
                    assert plain == (len(toks) // page if salt is None and lora is None else 0)
                    assert _matched(_lookup(grpc, f"--hashes={','.join(map(str, hashes))}")) == len(hashes)
                    flags = _keys_flags(salt, lora)
                    cmd = kvcoord_cmd("hash", "--algo", "sglang", "--block-size", str(page), *flags)
                    cli = subprocess.run(
                        cmd, input=json.dumps(toks), capture_output=True, text=True, timeout=60, check=True)
                    assert json.loads(cli.stdout) == hashes
                assert _matched(_lookup(grpc, "--prompt", prompt)) == len(prompt_ids) // page
                for toks, salt, lora in requests:  # the HTTP API's token query (no lora_path there)
                    body: dict[str, Any] = {"model_name": "m", "token_ids": toks, "cache_salt": salt}
                    if lora is None or lora[1] is None:
                        got = _http_query(http, body)
                        assert got["scores"] == {"n1": {"0": len(toks) // page * page}}, got
                assert _http_query(http, {"model_name": "m", "prompt": prompt})["scores"] == {
                    "n1": {"0": len(prompt_ids) // page * page}}
                messages = tmp_path / "chat.json"
                messages.write_text(json.dumps({"messages": chat}))
                assert _matched(_lookup(grpc, "--messages-file", str(messages))) == len(chat_ids) // page
    finally:
        publisher.shutdown()


def _http_query(port: int, body: dict[str, Any]) -> dict[str, Any]:
    status, answer = _post(port, "/query", body)
    assert status == 200, answer
    return answer


def _keys_flags(salt: str | None, lora: tuple[str, str | None] | None) -> list[str]:
    flags = [] if salt is None else ["--cache-salt", salt]
    if lora is not None:
        flags += ["--lora-name", lora[0]] + ([] if lora[1] is None else ["--lora-path", lora[1]])
    return flags


def _query(toks: list[int], salt: str | None, lora: tuple[str, str | None] | None) -> list[str]:
    return ["--tokens", ",".join(map(str, toks)), *_keys_flags(salt, lora)]


@pytest.mark.parametrize(("args", "words"), [
    (("hash", "--algo", "sglang", "--block-size", "4", "--seed", "7"), ("no seed",)),
    (("hash", "--algo", "sglang", "--block-size", "4", "--style", "tagged"), ("event format", "tagged")),
    (("hash", "--algo", "sglang", "--block-size", "4", "--mm", "img:0:2"), ("token ids only",)),
    (("hash", "--algo", "sglng", "--block-size", "4"), ("unknown hash algorithm", "sglang")),
    (("serve", "--listen", "127.0.0.1:0", "--model", "m,algo=sglang,block_size=4,seed=1"), ("no seed",)),
    (("serve", "--listen", "127.0.0.1:0", "--model", "m,algo=sglang,block_size=4,style=tagged"),
     ("event format",)),
    (("lookup", "--coordinator", "127.0.0.1:1", "--model", "m", "--hashes", f"1,{-(2**63) - 1}"),
     ("uint64 or int64",)),
])
def test_sglang_cli_mistakes_are_one_line(args: tuple[str, ...], words: tuple[str, ...]) -> None:
    proc = subprocess.run(kvcoord_cmd(*args), input="[1,2,3,4,5,6,7,8]", capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), proc.stderr


def test_config_file_sglang_model(tmp_path: Path) -> None:
    """[models."m"] algo = "sglang" in the config file: serve takes it (a token lookup hashes it), and a
    seed there is refused in one line."""
    grpc = free_port()
    good = tmp_path / "good.toml"
    good.write_text('[models."m"]\nalgo = "sglang"\nblock_size = 4\nstyle = "dynamo"\n')
    with running(kvcoord_cmd("serve", "--listen", f"127.0.0.1:{grpc}", "--config", str(good)),
                 log=tmp_path / "serve.log"):
        wait_for_port(grpc)
        res = _lookup(grpc, "--tokens", ",".join(map(str, range(10))), "--cache-salt", "s")
        assert res["num_blocks"] == 2 and res["block_size"] == 4
    bad = tmp_path / "bad.toml"
    bad.write_text('[models."m"]\nalgo = "sglang"\nblock_size = 4\nseed = "42"\n')
    proc = subprocess.run(kvcoord_cmd("serve", "--listen", "127.0.0.1:0", "--config", str(bad)),
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode != 0 and len(proc.stderr.strip().splitlines()) == 1
    assert 'models."m"' in proc.stderr and "no seed" in proc.stderr


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    status, answer = http_json("POST", f"http://127.0.0.1:{port}{path}", body, timeout=60)
    return status, dict(answer)


def test_sglang_publisher_registered_over_http(sgl: Any, tmp_path: Path) -> None:
    """SGLang's ZmqEventPublisher registered with `serve --model m,algo=sglang` over POST /register, once
    naming its engine (`"engine": "sglang"`) and once relying on the model's profile: lookups by tokens
    find exactly the blocks it holds on both nodes, its int64 hashes relayed (no batch malformed, both
    nodes exact). A contradicting or unknown engine is refused."""
    grpc, pub, replay, http, metrics = (free_port() for _ in range(5))
    page = 4
    requests: list[tuple[list[int], str | None, tuple[str, str | None] | None]] = [
        (list(range(1, 13)), None, None),
        ([7, 2**32 - 1, 9, 10, 11, 12, 13, 14], "tenant-a", None),
        ([5] * 8 + [6] * 4, None, ("ad", "/adapters/ad")),
        (list(range(100, 140)), None, None),
    ]
    published = [_published(sgl, toks, [1], page, salt, lora, False) for toks, salt, lora in requests]
    assert any(h < 0 for hs in published for h in hs)  # the hashes a uint64 decoder refuses
    publisher = sgl.kv_events.ZmqEventPublisher(
        0, endpoint=f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{replay}", bind=True)
    serve = kvcoord_cmd("serve", "--listen", f"127.0.0.1:{grpc}", "--http-listen", f"127.0.0.1:{http}",
                        "--metrics-listen", f"127.0.0.1:{metrics}",
                        "--model", f"m,algo=sglang,block_size={page}")
    engine = {"endpoint": f"tcp://127.0.0.1:{pub}", "replay_endpoint": f"tcp://127.0.0.1:{replay}",
              "model_name": "m", "block_size": page}
    try:
        with running(serve, log=tmp_path / "serve.log"):
            wait_for_port(http)
            assert _post(http, "/register", {"instance_id": 5, **engine, "engine": "sglang"})[0] == 201
            assert _post(http, "/register", {"instance_id": 6, **engine})[0] == 201

            def held(res: dict[str, Any]) -> dict[str, int]:
                return {n["node_id"]: int(n["matched_blocks"]) for n in res["nodes"]}

            def stored() -> bool:  # republish (idempotent stores) until both relays have joined
                for toks, salt, lora in requests:
                    events = _recorded(sgl, toks, page, salt, lora)
                    publisher.publish(sgl.kv_events.KVEventBatch(ts=time.time(), events=events))
                return all(held(_lookup(grpc, *_query(t, s, lo))) == dict.fromkeys(("5", "6"), len(t) // page)
                           for t, s, lo in requests)

            until(stored, "the SGLang blocks in the index on both nodes", timeout=90, interval=0.3,
                  diagnose=lambda: (tmp_path / "serve.log").read_text()[-2000:])
            for (toks, salt, lora), hashes in zip(requests, published, strict=True):
                res = _lookup(grpc, *_query(toks, salt, lora))
                assert {(n["node_id"], n["trust"]) for n in res["nodes"]} == {("5", "exact"), ("6", "exact")}
                assert held(_lookup(grpc, f"--hashes={','.join(map(str, hashes))}")) == {
                    "5": len(hashes), "6": len(hashes)}
                longer = [*toks, *range(900, 900 + page)]  # one page SGLang does not hold
                assert held(_lookup(grpc, *_query(longer, salt, lora))) == {"5": len(toks) // page,
                                                                            "6": len(toks) // page}
            page_text = get_text(f"http://127.0.0.1:{metrics}/metrics", timeout=60)
            assert not [ln for ln in page_text.splitlines()
                        if ln.startswith("kvcoord_relay_malformed_total{") and not ln.endswith(" 0.0")]
            assert "malformed" not in (tmp_path / "serve.log").read_text()
            st, err = _post(http, "/register", {"instance_id": 7, **engine, "engine": "vllm"})
            assert (st, err["error"]) == (409, "engine mismatch for model=m routing_group=default: existing="
                                               "sglang (its hash profile is algo=sglang), requested=vllm")
            st, err = _post(http, "/register", {"instance_id": 7, **engine, "engine": "trtllm"})
            assert st == 400 and "invalid engine" in err["error"], err
            status, workers = http_json("GET", f"http://127.0.0.1:{http}/workers", timeout=60)
            assert status == 200, workers
            listed = {w["instance_id"]: w["engine"] for w in workers}
            assert listed == {5: "sglang", 6: "sglang"}
    finally:
        publisher.shutdown()
