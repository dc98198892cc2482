"""vLLM-exact block hashing: real-engine fixtures, vLLM-produced wire fixtures, the CLI, and
property tests proving the native chains identical to the pure-Python reference, both run in-process
(``fast=False`` forces the reference)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import subprocess
from array import array
from typing import Any

import cbor2
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord import hashing
from kvcoord.extra_keys import (
    ExtraKeyStyle,
    MultiModalItem,
    RequestKeys,
    block_extra_keys,
    published_extra_keys,
)
from kvcoord.hashing import (
    DEFAULT_NONE_HASH_SEED,
    HASH_ALGOS,
    HashProfile,
    RequestBlockHasher,
    block_hashes64,
    coarsen,
    hash_block_tokens,
    hash_request_tokens,
    to_block_hash64,
)
from kvcoord.native import native
from tests.procs import FIXTURES, REPO, kvcoord_cmd

ENGINE = FIXTURES / "vllm-engine"
WIRE = FIXTURES / "vllm-wire"
WIRE_SIDECARS = sorted(WIRE.glob("*/*.json"))


def _engine(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ENGINE / f"kv_event_{name}.json").read_text())
    return data


def _run_cli(args: list[str], stdin: str, *, seed_env: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed_env is not None:
        env["PYTHONHASHSEED"] = seed_env
    return subprocess.run(
        kvcoord_cmd("hash", *args), input=stdin, capture_output=True, text=True, env=env, cwd=REPO, timeout=60
    )


# --- real engine -------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["base", "lora"])
def test_real_engine_fixture_library(name: str) -> None:
    d = _engine(name)
    assert d["block_size"] == 16 and d["parent_block_hash"] is None and len(d["block_hashes"]) == 25
    profile = HashProfile("sha256_cbor", d["block_size"], seed=d["hash_seed"])
    keys = RequestKeys(lora_name=d["lora_name"]) if d.get("lora_name") else None
    assert block_hashes64(profile, d["token_ids"], keys) == d["block_hashes"]
    assert [to_block_hash64(x) for x in hash_request_tokens(profile, d["token_ids"], keys, fast=False)] == d[
        "block_hashes"
    ]
    hasher = RequestBlockHasher(profile, keys)
    got: list[int] = []
    for i in range(0, len(d["token_ids"]), 7):  # odd chunks: blocks complete mid-append
        got += [to_block_hash64(x) for x in hasher.append(d["token_ids"][i : i + 7])]
    assert got == d["block_hashes"]


@pytest.mark.parametrize("name", ["base", "lora"])
def test_real_engine_fixture_cli(name: str) -> None:
    d = _engine(name)
    args = ["--algo", "sha256_cbor", "--seed", str(d["hash_seed"]), "--block-size", str(d["block_size"])]
    if d.get("lora_name"):
        args += ["--lora-name", d["lora_name"]]
    proc = _run_cli(args, json.dumps(d["token_ids"]))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == d["block_hashes"]
    hexes = _run_cli([*args, "--bytes"], json.dumps(d["token_ids"]))
    assert [to_block_hash64(bytes.fromhex(h)) for h in json.loads(hexes.stdout)] == d["block_hashes"]


def test_lora_profile_is_a_different_keyspace() -> None:
    base, lora = _engine("base"), _engine("lora")
    assert base["token_ids"] == lora["token_ids"]
    assert not set(base["block_hashes"]) & set(lora["block_hashes"])


# --- hashes produced by vLLM's own code, per release -------------------------------------------
def _wire_cases() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    cases = []
    for path in WIRE_SIDECARS:
        sidecar = json.loads(path.read_text())
        for i, inputs in enumerate(sidecar["provenance"]["hash_inputs"]):
            cases.append((f"{path.parent.name}/{path.stem}#{i}", sidecar, inputs))
    return cases


def _keys(inputs: dict[str, Any]) -> RequestKeys:
    lora = inputs.get("lora")
    return RequestKeys(
        lora_name=lora[0] if lora else None,
        lora_path=lora[1] if lora else None,
        cache_salt=inputs.get("cache_salt"),
        mm_items=tuple(MultiModalItem(*m) for m in inputs.get("mm") or ()),
    )


WIRE_CASES = _wire_cases()


def test_wire_fixtures_cover_extra_keys_and_both_styles() -> None:
    versions = {sidecar["vllm_version"] for _, sidecar, _ in WIRE_CASES}
    assert {"0.23.0", "0.33.0"} <= versions
    assert any(i["lora"] and i["mm"] and i["cache_salt"] for _, _, i in WIRE_CASES)


@pytest.mark.parametrize(("case", "sidecar", "inputs"), WIRE_CASES, ids=[c[0] for c in WIRE_CASES])
def test_wire_fixture_hash_inputs_reproduce(
    case: str, sidecar: dict[str, Any], inputs: dict[str, Any]
) -> None:
    assert inputs["prompt_embeds"] is False
    profile = HashProfile.for_release(
        sidecar["vllm_version"], inputs["algo"], inputs["block_size"], seed=inputs["PYTHONHASHSEED"]
    )
    tagged = hashing.parse_release(sidecar["vllm_version"]) >= (0, 31)
    assert profile.style == ("tagged" if tagged else "untagged")
    keys = _keys(inputs)
    for fast in (True, False):
        got = hash_request_tokens(profile, inputs["token_ids"], keys, fast=fast)
        assert [d.hex() for d in got] == inputs["all_block_hashes_hex"]
    # the other style gives other hashes whenever the request has extra keys
    other_style: ExtraKeyStyle = "untagged" if profile.style == "tagged" else "tagged"
    other = HashProfile(profile.algo, profile.block_size, profile.seed, other_style)
    if inputs["lora"] or inputs["mm"] or inputs["cache_salt"]:
        assert [d.hex() for d in hash_request_tokens(other, inputs["token_ids"], keys)] != inputs[
            "all_block_hashes_hex"
        ]


def _unwire(value: Any) -> Any:
    if isinstance(value, dict) and set(value) == {"bytes"}:
        return bytes.fromhex(value["bytes"])
    if isinstance(value, list):
        return tuple(_unwire(v) for v in value)
    return value


@pytest.mark.parametrize(("case", "sidecar", "inputs"), WIRE_CASES, ids=[c[0] for c in WIRE_CASES])
def test_wire_fixture_events_carry_untagged_extra_keys(
    case: str, sidecar: dict[str, Any], inputs: dict[str, Any]
) -> None:
    """The published ``extra_keys`` of each stored event are ours, untagged, in every release."""
    profile = HashProfile(inputs["algo"], inputs["block_size"], inputs["PYTHONHASHSEED"])
    all_hex = inputs["all_block_hashes_hex"]
    published = published_extra_keys(_keys(inputs), inputs["block_size"], len(inputs["token_ids"]))
    assert len(published) == len(all_hex)
    ints = [to_block_hash64(bytes.fromhex(h)) for h in all_hex]
    checked = 0
    for event in sidecar["expected"]["events"]:
        if event["type"] != "BlockStored" or event.get("extra_keys") is None:
            continue
        hashes = [_unwire(h) for h in event["block_hashes"]]
        hashes64 = [to_block_hash64(h) for h in hashes]
        if not set(hashes64) <= set(ints):
            continue
        first = ints.index(hashes64[0])
        assert [_unwire(k) for k in event["extra_keys"]] == published[first : first + len(hashes)]
        checked += 1
    assert profile.none_hash()  # the seed resolves
    if inputs["kind"] == "stored":
        assert checked >= 1


# --- seeds and profiles ------------------------------------------------------------------------
def _direct(algo: str, obj: Any) -> bytes:
    if algo == "sha256":
        return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()
    if algo == "sha256_cbor":
        return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
    if algo == "xxhash":
        return xxhash.xxh3_128(pickle.dumps(obj, protocol=5)).digest()
    return xxhash.xxh3_128(cbor2.dumps(obj, canonical=True)).digest()


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_none_hash_is_h_of_the_seed_string(algo: str) -> None:
    p = HashProfile(algo, 16, seed="007")  # type: ignore[arg-type]
    assert p.none_hash() == _direct(algo, "007")
    assert p.none_hash() != HashProfile(algo, 16, seed="7").none_hash()  # type: ignore[arg-type]
    assert len(p.none_hash()) == p.digest_size
    assert p.fingerprint() == hashlib.sha256(p.none_hash()).hexdigest()
    assert "007" not in p.fingerprint()
    # block 0 = H((NONE_HASH, tokens, None)), block 1 chains on block 0's raw digest
    b0 = _direct(algo, (p.none_hash(), (0, 1, 2, 3), None))
    assert hash_request_tokens(HashProfile(algo, 4, seed="007"), list(range(8))) == [  # type: ignore[arg-type]
        b0,
        _direct(algo, (b0, (4, 5, 6, 7), None)),
    ]


def test_seed_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert HashProfile("sha256_cbor", 16).none_hash() == HashProfile("sha256_cbor", 16, seed="42").none_hash()
    monkeypatch.delenv("PYTHONHASHSEED")
    with pytest.raises(ValueError, match="--hash-seed"):
        HashProfile("sha256_cbor", 16).none_hash()
    for release in ("0.29", "0.30.1", "0.31.0", "v0.33.0rc1"):
        for algo in ("sha256", "sha256_cbor"):
            p = HashProfile.for_release(release, algo, 16)
            assert p.none_hash() == _direct(algo, DEFAULT_NONE_HASH_SEED)
        with pytest.raises(ValueError, match="randomly"):
            HashProfile.for_release(release, "xxhash_cbor", 16).none_hash()
    for release in ("0.23", "0.28.9"):
        with pytest.raises(ValueError, match="randomly"):
            HashProfile.for_release(release, "sha256_cbor", 16).none_hash()
    assert HashProfile.for_release("0.30", "sha256", 16).style == "untagged"
    assert HashProfile.for_release("0.31", "sha256", 16).style == "tagged"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"algo": "md5", "block_size": 16},
        {"algo": "sha256", "block_size": 0},
        {"algo": "sha256", "block_size": True},
        {"algo": "sha256", "block_size": 16, "style": "fancy"},
        {"algo": "sha256", "block_size": 16, "external": "hex"},
        {"algo": "sha256", "block_size": 16, "engine_release": "latest"},
        {"algo": "sha256", "block_size": 16, "seed": 42},
    ],
)
def test_bad_profiles_are_rejected(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        HashProfile(**kwargs)


def test_external_forms_and_unsigned() -> None:
    digest = bytes(24) + b"\xff" * 8
    assert to_block_hash64(digest) == 2**64 - 1
    assert HashProfile("sha256", 16, "0").external_hash(digest) == 2**64 - 1
    assert HashProfile("sha256", 16, "0", external="bytes").external_hash(digest) == digest
    hashes = block_hashes64(HashProfile("sha256_cbor", 4, "0"), list(range(4000)))
    assert any(h >= 2**63 for h in hashes) and all(0 <= h < 2**64 for h in hashes)


# --- extra keys ----------------------------------------------------------------------------------
def test_extra_keys_walk_like_vllm() -> None:
    keys = RequestKeys(
        lora_name="L",
        lora_path="/p",
        cache_salt="s",
        mm_items=(MultiModalItem("a", 2, 20), MultiModalItem("b", 22, 3), MultiModalItem("c", 40, 1)),
        prompt_embeds_digests=(b"0", b"1", b"2", b"3"),
    )
    untagged = block_extra_keys(keys, 16, 64)
    assert untagged == [
        ("L", ("a", 2), "s", b"0"),
        ("L", ("a", -14), ("b", 6), b"1"),
        ("L", ("c", 8), b"2"),
        ("L", b"3"),
    ]
    tagged = block_extra_keys(keys, 16, 64, style="tagged")
    assert tagged[0] == (("lora", "L", "/p"), ("mm", "a", 2), ("cache_salt", "s"), ("prompt_embeds", b"0"))
    second = tagged[1]
    assert second is not None and second[1][0] is second[2][0]  # one shared "mm" literal (pickle memo)
    assert published_extra_keys(keys, 16, 64) == untagged
    assert block_extra_keys(RequestKeys(), 16, 64) == [None] * 4
    assert block_extra_keys(RequestKeys(cache_salt=""), 16, 64) == [None] * 4


def test_pickle_memo_of_the_shared_mm_tag_changes_the_hash() -> None:
    shared = ("mm", "x", 0), ("mm", "y", 4)
    distinct = ("mm", "x", 0), ("".join(["m", "m"]), "y", 4)
    assert shared[0][0] is shared[1][0] and distinct[0][0] is not distinct[1][0]
    p = HashProfile("sha256", 16, "0")
    assert hash_block_tokens(p, None, range(16), shared) != hash_block_tokens(p, None, range(16), distinct)
    c = HashProfile("sha256_cbor", 16, "0")  # CBOR has no memo: identity does not matter
    assert hash_block_tokens(c, None, range(16), shared) == hash_block_tokens(c, None, range(16), distinct)


def test_empty_keys_hash_as_none_and_parent_is_raw_digest() -> None:
    for algo in HASH_ALGOS:
        p = HashProfile(algo, 4, "1")
        assert hash_block_tokens(p, None, [1, 2, 3, 4], ()) == hash_block_tokens(p, None, [1, 2, 3, 4], None)
        assert hash_block_tokens(p, b"", [1, 2, 3, 4]) == hash_block_tokens(p, None, [1, 2, 3, 4])
        d0, d1 = hash_request_tokens(p, [1, 2, 3, 4, 5, 6, 7, 8])
        assert hash_block_tokens(p, d0, [5, 6, 7, 8]) == d1
        assert hash_block_tokens(p, to_block_hash64(d0).to_bytes(8, "big"), [5, 6, 7, 8]) != d1


def test_bad_keys_are_rejected_before_hashing() -> None:
    with pytest.raises(ValueError, match="sorted"):
        RequestKeys(mm_items=(MultiModalItem("a", 5, 1), MultiModalItem("b", 1, 1)))
    for bad in (("a", -1, 1), ("a", 0, 0), (3, 0, 1), ("a", True, 1)):
        with pytest.raises(ValueError):
            MultiModalItem(*bad)
    tagged = HashProfile("sha256", 4, "0", "tagged")
    with pytest.raises(ValueError, match="lora_path"):
        hash_request_tokens(tagged, range(8), RequestKeys(lora_name="L"))
    with pytest.raises(ValueError, match="lora_path"):
        RequestBlockHasher(tagged, RequestKeys(lora_name="L"))
    with pytest.raises(ValueError, match="digests"):
        hash_request_tokens(tagged, range(8), RequestKeys(prompt_embeds_digests=(b"x",)))
    p = HashProfile("sha256_cbor", 4, "0")
    for tokens in ([1, 2, -3, 4], [1.0, 2, 3, 4], [2**64, 1, 2, 3], "1234", [None]):
        with pytest.raises(ValueError):
            hash_request_tokens(p, tokens)  # type: ignore[arg-type]


def test_incremental_hasher_validates_before_changing_state() -> None:
    p = HashProfile("xxhash_cbor", 4, "0")
    h = RequestBlockHasher(p)
    assert h.append([1, 2, 3]) == []
    with pytest.raises(ValueError):
        h.append([4, -5])
    assert h.num_tokens == 3 and h.digests == ()
    (d,) = h.append([4, 5])
    assert d == hash_request_tokens(p, [1, 2, 3, 4])[0] and h.num_tokens == 5


def test_incremental_hasher_walks_mm_from_the_last_item_after_block_zero() -> None:
    """vLLM's later hashing calls start at the last mm item (curr_mm_idx = -1); so do we."""
    p = HashProfile("sha256_cbor", 16, "0")
    keys = RequestKeys(mm_items=(MultiModalItem("a", 30, 4), MultiModalItem("b", 36, 2)))
    one_shot = hash_request_tokens(p, range(48), keys)
    h = RequestBlockHasher(p, keys)
    assert h.append(range(32)) == one_shot[:2]
    later = h.append(range(32, 48))  # block 2 overlaps a (offset -2) and b, but vLLM only sees b
    expected = hash_block_tokens(p, one_shot[1], range(32, 48), (("b", 4),))
    assert later == [expected] and later != one_shot[2:]


def test_coarsen() -> None:
    p = HashProfile("sha256_cbor", 16, "0")
    fine = hash_request_tokens(p, range(160))
    assert coarsen(fine, 4) == [fine[3], fine[7]]
    assert coarsen(fine, 1) == fine
    with pytest.raises(ValueError):
        coarsen(fine, 0)


# --- CLI ---------------------------------------------------------------------------------------
def test_cli_extra_keys_match_the_library() -> None:
    tokens = list(range(100, 164))
    args = ["--algo", "sha256", "--seed", "0", "--block-size", "16", "--engine-release", "0.33.0",
            "--lora-name", "sql-lora", "--lora-path", "/adapters/sql-lora", "--cache-salt", "t",
            "--mm", "img:1:20:20", "--mm", "vid:40:6", "--prompt-embeds-digests", "00ff,01,02,03"]
    proc = _run_cli(args, json.dumps(tokens))
    assert proc.returncode == 0, proc.stderr
    keys = RequestKeys("sql-lora", "/adapters/sql-lora", "t",
                       (MultiModalItem("img:1", 20, 20), MultiModalItem("vid", 40, 6)),
                       (b"\x00\xff", b"\x01", b"\x02", b"\x03"))
    profile = HashProfile.for_release("0.33.0", "sha256", 16, "0")
    assert json.loads(proc.stdout) == block_hashes64(profile, tokens, keys)


def test_cli_seed_from_environment_and_release_default() -> None:
    tokens = json.dumps(list(range(32)))
    by_env = _run_cli(["--algo", "sha256_cbor", "--block-size", "16"], tokens, seed_env="42")
    by_arg = _run_cli(["--algo", "sha256_cbor", "--block-size", "16", "--seed", "42"], tokens)
    assert by_env.returncode == 0 and json.loads(by_env.stdout) == json.loads(by_arg.stdout)
    default = _run_cli(["--algo", "sha256_cbor", "--block-size", "16", "--engine-release", "0.29"], tokens)
    expected = block_hashes64(HashProfile("sha256_cbor", 16, DEFAULT_NONE_HASH_SEED), list(range(32)))
    assert default.returncode == 0 and json.loads(default.stdout) == expected


@pytest.mark.parametrize(
    ("args", "stdin", "needle"),
    [
        (["--algo", "sha256_cbor", "--seed", "1", "--block-size", "2"], '[1, "2"]', "integer"),
        (["--algo", "sha256_cbor", "--seed", "1", "--block-size", "2"], "[1, 2.5]", "integer"),
        (["--algo", "sha256_cbor", "--seed", "1", "--block-size", "2"], "[1, -2]", "non-negative"),
        (["--algo", "sha256_cbor", "--seed", "1", "--block-size", "2"], "[1, true]", "integer"),
        (["--algo", "sha256_cbor", "--seed", "1", "--block-size", "2"], '{"a": 1}', "list"),
        (["--algo", "sha256_cbor", "--seed", "1", "--block-size", "2"], "[1, 2", "JSON"),
        (["--algo", "md5", "--seed", "1", "--block-size", "2"], "[1, 2]", "unknown hash algorithm"),
        (["--algo", "sha256_cbor", "--block-size", "2"], "[1, 2]", "--hash-seed"),
        (["--algo", "xxhash", "--block-size", "2", "--engine-release", "0.33"], "[1, 2]", "randomly"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "0"], "[1, 2]", "--block-size: 0 must be > 0"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "2", "--mm", "x:1"], "[1, 2]", "--mm"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "2", "--mm", "x:-1:2"], "[1, 2]", "--mm"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "2", "--mm", ":1:2"], "[1, 2]", "--mm"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "2", "--mm", "b:4:1", "--mm", "a:0:1"], "[1, 2]",
         "sorted"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "2", "--prompt-embeds-digests", "zz"], "[1, 2]",
         "digests"),
        (["--algo", "sha256", "--seed", "1", "--block-size", "2", "--style", "tagged", "--lora-name", "L"],
         "[1, 2]", "lora"),
    ],
)
def test_cli_bad_input_is_one_line_and_exit_2(args: list[str], stdin: str, needle: str) -> None:
    proc = _run_cli(args, stdin)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvcoord hash:") and needle in lines[0], proc.stderr


# --- native == reference ------------------------------------------------------------------------
# ``fast=True`` (the default) runs the native chains where native code runs; ``fast=False`` runs the
# pure-Python reference (cbor2/pickle + hashlib/xxhash: the definition) in the same process. Without
# native code (not built, or KVCOORD_NATIVE=0) both are the reference, checked against the fixtures.
needs_native = pytest.mark.skipif(native is None, reason="native code not built or KVCOORD_NATIVE=0")


TOKEN = st.one_of(
    st.integers(0, 23),
    st.integers(24, 255),
    st.integers(256, 65535),
    st.integers(65536, 2**32 - 1),
    st.integers(2**32, 2**64 - 1),
)
TEXT = st.text(max_size=12)


@st.composite
def request_keys(draw: st.DrawFn, num_tokens: int, block_size: int) -> RequestKeys | None:
    if draw(st.booleans()):
        return None
    items: list[MultiModalItem] = []
    pos = 0
    for _ in range(draw(st.integers(0, 4))):
        pos += draw(st.integers(0, 2 * block_size))
        length = draw(st.integers(1, 2 * block_size))
        items.append(MultiModalItem(draw(TEXT), pos, length))
    nblocks = num_tokens // block_size
    digests = None
    if draw(st.booleans()):
        digests = tuple(draw(st.binary(min_size=0, max_size=40)) for _ in range(nblocks))
    lora = draw(st.none() | TEXT)
    return RequestKeys(
        lora_name=lora,
        lora_path=draw(TEXT) if lora is not None else None,
        cache_salt=draw(st.none() | TEXT),
        mm_items=tuple(items),
        prompt_embeds_digests=digests,
    )


@st.composite
def requests(draw: st.DrawFn) -> tuple[HashProfile, list[int], RequestKeys | None]:
    block_size = draw(st.sampled_from([1, 2, 3, 16, 23, 24, 32, 255, 256]))
    tokens = draw(st.lists(TOKEN, max_size=block_size * 6))
    profile = HashProfile(
        draw(st.sampled_from(HASH_ALGOS)),
        block_size,
        draw(st.text(max_size=8)),
        draw(st.sampled_from(["untagged", "tagged"])),
    )
    return profile, tokens, draw(request_keys(len(tokens), block_size))


@settings(max_examples=150, deadline=None)
@given(requests())
def test_native_equals_reference(req: tuple[HashProfile, list[int], RequestKeys | None]) -> None:
    profile, tokens, keys = req
    reference = hash_request_tokens(profile, tokens, keys, fast=False)
    assert len(reference) == len(tokens) // profile.block_size
    assert all(len(d) == profile.digest_size for d in reference)
    assert hash_request_tokens(profile, tokens, keys) == reference
    # an incremental hasher that gets the whole prompt in one call agrees too
    assert RequestBlockHasher(profile, keys).append(tokens) == reference
    if keys is None or not keys.mm_items:  # (vLLM re-walks mm items per call: test above)
        # one fed in uneven chunks (blocks completed across calls, parent carried over)
        hasher = RequestBlockHasher(profile, keys)
        got = [d for i in range(0, len(tokens), 5) for d in hasher.append(tokens[i : i + 5])]
        assert got == reference


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(HASH_ALGOS),
    st.none() | st.binary(max_size=300),
    st.lists(TOKEN, max_size=40),
    st.none()
    | st.tuples()
    | st.lists(
        st.recursive(
            st.none() | st.booleans() | st.integers(-(2**70), 2**70) | TEXT | st.binary(max_size=8)
            | st.floats(allow_nan=False),
            lambda inner: st.tuples(inner, inner) | st.lists(inner, max_size=3),
            max_leaves=6,
        ),
        max_size=4,
    ).map(tuple),
)
def test_single_block_native_equals_reference(
    algo: str, parent: bytes | None, tokens: list[int], extra: tuple[Any, ...] | None
) -> None:
    """Arbitrary extra keys (bools, floats, bignums: their CBOR tail is cbor2's) and parents (past 255
    bytes the pickle algorithms take the reference)."""
    p = HashProfile(algo, 16, "3")  # type: ignore[arg-type]
    reference = hash_block_tokens(p, parent, tokens, extra, fast=False)
    assert hash_block_tokens(p, parent, tokens, extra) == reference


def test_native_big_prompts_and_every_id_range() -> None:
    """Long prompts with ids of every CBOR width, given as list, tuple and iterator, all == reference."""
    import random

    rng = random.Random(7)
    for algo in HASH_ALGOS:
        p = HashProfile(algo, 16, "0")
        for top in (200, 152_000, 2**21, 2**64 - 1):
            tokens = [rng.randrange(top) for _ in range(16 * 300 + 5)]
            reference = hash_request_tokens(p, tokens, fast=False)
            assert hash_request_tokens(p, tokens) == reference
            assert hash_request_tokens(p, tuple(tokens)) == reference
            assert hash_request_tokens(p, iter(tokens)) == reference


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_pickle_chain_is_pickle_dumps_at_every_int_width(algo: str) -> None:
    """The C pickler's opcodes for each int width (BININT1/2, BININT, LONG1 of 5-9 bytes), each
    tuple size (EMPTY_TUPLE, TUPLE1-3, MARK...TUPLE) and the frame, against ``pickle.dumps``; blocks
    past 4096 tokens (one pickle frame no longer holds them) take the Python path."""
    import random

    rng = random.Random(5)
    edges = [0, 1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**55, 2**56 - 1,
             2**56, 2**63 - 1, 2**63, 2**64 - 1]
    for block_size in (1, 2, 3, 4, 5, 16, 4096, 4097):
        p = HashProfile(algo, block_size, "0")  # type: ignore[arg-type]
        tokens = [rng.choice(edges) if rng.random() < 0.5 else rng.getrandbits(rng.randint(1, 64))
                  for _ in range(block_size * 3 + 1)]
        reference = hash_request_tokens(p, tokens, fast=False)
        assert hash_request_tokens(p, tokens) == reference, block_size


def test_tokens_may_be_any_integer_sequence() -> None:
    p = HashProfile("sha256_cbor", 4, "0")
    ref = hash_request_tokens(p, [1, 2, 3, 4, 5, 6, 7, 8])
    assert hash_request_tokens(p, array("Q", range(1, 9))) == ref
    assert hash_request_tokens(p, range(1, 9)) == ref
    assert hash_request_tokens(p, (x for x in range(1, 9))) == ref



@pytest.mark.parametrize("fast", [True, False], ids=["native", "reference"])
def test_real_engine_fixtures_through_both_paths(fast: bool) -> None:
    for name in ("base", "lora"):
        d = _engine(name)
        profile = HashProfile("sha256_cbor", d["block_size"], seed=d["hash_seed"])
        keys = RequestKeys(lora_name=d["lora_name"]) if d.get("lora_name") else None
        got = hash_request_tokens(profile, d["token_ids"], keys, fast=fast)
        assert [to_block_hash64(x) for x in got] == d["block_hashes"]


@needs_native
def test_native_covers_every_chain_but_pickle_with_extra_keys() -> None:
    """The native path is not silently the reference: it hashes every CBOR chain and every pickle
    chain without extra keys (blocks up to 4096 tokens, parents under 256 bytes)."""
    arr = array("Q", range(64))
    for algo in HASH_ALGOS:
        none = HashProfile(algo, 16, "0").none_hash()
        assert hashing._chain_native(algo, none, arr, 16, [None] * 4) is not None
        with_keys = hashing._chain_native(algo, none, arr, 16, [("lora",)] * 4)
        assert (with_keys is not None) == algo.endswith("_cbor")
        long_parent = hashing._chain_native(algo, bytes(300), arr, 16, [None])
        assert (long_parent is not None) == algo.endswith("_cbor")
    assert hashing._chain_native("sha256", none, array("Q", range(4097)), 4097, [None]) is None


@needs_native
def test_native_chains_reject_bad_arguments() -> None:
    assert native is not None
    toks = array("Q", range(8))
    sha = hashlib.sha256
    good = native.cbor_chain(sha, True, b"p", toks, 4, 2, b"\xf6")
    assert len(good) == 2
    # an unaligned uint64 view (a slice of a bytes buffer cast to 'Q') reads the same tokens
    unaligned = memoryview(b"\0" + toks.tobytes())[1:].cast("Q")
    assert native.cbor_chain(sha, True, b"p", unaligned, 4, 2, b"\xf6") == good
    assert native.pickle_chain(sha, True, b"p", unaligned, 4, 2) == native.pickle_chain(
        sha, True, b"p", toks, 4, 2
    )
    bad: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        ((sha, True, b"p", array("H", range(8)), 4, 2, b"\xf6"), TypeError, "uint64 or uint32"),
        ((7, True, b"p", toks, 4, 2, b"\xf6"), ValueError, "unknown digest code"),
        ((2, True, bytes(256), toks, 4, 2, b"\xf6"), ValueError, "shorter than 256"),
        (("sha", True, b"p", toks, 4, 2, b"\xf6"), TypeError, "digest code or a callable"),
        ((sha, True, b"p", [0, 1, 2, 3], 4, 1, b"\xf6"), TypeError, "bytes-like"),
        ((sha, True, b"p", toks, 4, 3, b"\xf6"), ValueError, "fewer tokens"),
        ((sha, True, b"p", toks, -1, 1, b"\xf6"), ValueError, ">= 0"),
        ((sha, True, "p", toks, 4, 2, b"\xf6"), TypeError, "parent"),
        ((sha, True, b"p", toks, 4, 2, [b"\xf6"]), TypeError, "tails"),
        ((sha, True, b"p", toks, 4, 2, [b"\xf6", "x"]), TypeError, "tails"),
        ((sha, False, b"p", toks, 4, 2, b"\xf6"), TypeError, "must return bytes"),
        ((hashlib.sha256, True, b"p", toks, 4, 2), TypeError, "7 or 8 arguments"),
    ]
    for args, exc, needle in bad:
        with pytest.raises(exc, match=needle):
            native.cbor_chain(*args)
    pickle_bad: list[tuple[tuple[Any, ...], type[Exception], str]] = [
        ((sha, True, bytes(256), toks, 4, 2), ValueError, "shorter than 256"),
        ((sha, True, b"p", array("Q", range(4097)), 4097, 1), ValueError, "4096"),
        ((sha, True, b"p", toks, 4, 3), ValueError, "fewer tokens"),
        ((sha, True, b"p", array("q", range(8)), 4, 2), TypeError, "uint64"),
        ((sha, True, b"p", toks, 4), TypeError, "6 or 7 arguments"),
    ]
    for args, exc, needle in pickle_bad:
        with pytest.raises(exc, match=needle):
            native.pickle_chain(*args)
    assert toks == array("Q", range(8))  # inputs untouched

    tails = [b"\xf6", b"\xf6"]

    def shrinking(msg: bytes) -> bytes:  # a hash function that changes the tails under the loop
        tails.clear()
        return hashlib.sha256(msg).digest()

    with pytest.raises(TypeError, match="tails"):
        native.cbor_chain(shrinking, False, b"p", toks, 4, 2, tails)

    def failing(msg: bytes) -> bytes:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        native.cbor_chain(failing, False, b"p", toks, 4, 2, b"\xf6")


@pytest.mark.skipif(native is None, reason="needs the C extension")
@settings(max_examples=150, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 2**32 - 1), max_size=80),
    block_size=st.integers(1, 9),
    parent=st.binary(min_size=0, max_size=40),
    cbor_form=st.booleans(),
)
def test_c_digests_and_keys_are_the_python_hash_functions(tokens: list[int], block_size: int, parent: bytes,
                                                          cbor_form: bool) -> None:
    """The chain hashed in C (OpenSSL SHA-256, vendored XXH3-128) is the chain hashed by hashlib and the
    xxhash package, digest for digest; keys_only gives each digest's uint64 key, vLLM's int form; uint32
    and uint64 token buffers give the same chain."""
    assert native is not None
    count = len(tokens) // block_size
    wide, narrow = array("Q", tokens), array("I", tokens)
    algos = (("sha256", hashlib.sha256, True), ("xxh3_128", xxhash.xxh3_128_digest, False))
    for name, fn, call_digest in algos:
        code = native.C_DIGESTS.get(name)
        if code is None:
            continue

        def run(h: Any, t: Any, keys: bool = False, call_digest: bool = call_digest) -> Any:
            if cbor_form:
                return native.cbor_chain(h, call_digest, parent, t, block_size, count, b"\xf6", keys)
            return native.pickle_chain(h, call_digest, parent, t, block_size, count, keys)

        digests = run(fn, wide)
        assert run(code, wide) == digests == run(code, narrow) == run(fn, narrow)
        keys = memoryview(run(code, narrow, True)).cast("Q").tolist()
        assert keys == [to_block_hash64(d) for d in digests]
        assert memoryview(run(fn, wide, True)).cast("Q").tolist() == keys
