"""Image parts of a chat (:mod:`kvcoord.tokenize.media`): identifiers, the placeholder rule, and the
multimodal extra keys, checked against vLLM's definition of ``_gen_mm_extra_hash_keys`` (written out
here independently: a block's keys are ``(identifier, item offset - block start)`` for every item
overlapping it, in prompt order)."""

from __future__ import annotations

import base64
import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.extra_keys import MultiModalItem, RequestKeys, block_extra_keys
from kvcoord.hashing import HashProfile, hash_request_tokens
from kvcoord.sim.http import _BadRequest, _chat_prompt
from kvcoord.tokenize import toktok
from kvcoord.tokenize.base import InvalidChat, TokenizeError
from kvcoord.tokenize.media import (
    MediaRule,
    assign_uuids,
    encode_media_chat,
    expand_placeholders,
    has_media,
    media_uuid,
    with_placeholders,
)

PNG = base64.b64encode(b"\x89PNG\r\n\x1a\n fake image bytes").decode()
DATA_URL = f"data:image/png;base64,{PNG}"


def _image(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def _vllm_mm_keys(items: list[MultiModalItem], start: int, end: int) -> list[tuple[str, int]]:
    """vLLM's multimodal extra keys of the block ``[start, end)``."""
    return [(it.identifier, it.offset - start) for it in items
            if it.offset < end and it.offset + it.length > start]


def test_identifiers_are_the_clients_uuid_or_a_digest_of_what_the_part_points_at() -> None:
    data = media_uuid("p", _image(DATA_URL))
    assert data == "kvc-" + hashlib.sha256(b"data\0" + base64.b64decode(PNG)).hexdigest()
    assert media_uuid("p", _image("https://x.test/cat.png")) == "kvc-" + hashlib.sha256(
        b"url\0https://x.test/cat.png").hexdigest()
    assert media_uuid("p", _image(DATA_URL, uuid="mine")) == "mine"
    # Responses' input_image names the URL directly
    assert media_uuid("p", {"type": "input_image", "image_url": DATA_URL}) == data


@pytest.mark.parametrize("part, message", [
    (_image("data:image/png;base64,@@@"), "not valid base64"),
    (_image("data:image/png," + PNG), "data:image/<type>;base64"),
    (_image("data:text/plain;base64," + PNG), "data:image/<type>;base64"),
    (_image("data:image/png;base64,"), "empty"),
    (_image("ftp://x.test/a.png"), "data: or http(s)://"),
    ({"type": "image_url", "image_url": 7}, "image_url.url"),
    ({"type": "image_url"}, "image_url.url"),
    (_image(DATA_URL, uuid=3), "uuid must be a non-empty string"),
])
def test_malformed_image_parts_are_refused_in_one_line(part: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidChat, match=r"^messages\[0\]") as err:
        assign_uuids([{"role": "user", "content": [part]}])
    assert message in str(err.value) and "\n" not in str(err.value)


def test_assign_uuids_touches_only_image_parts_and_copies() -> None:
    msgs = [{"role": "system", "content": "s"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, _image(DATA_URL)]}]
    out = assign_uuids(msgs)
    assert out[0] is msgs[0]
    assert out[1]["content"][0] is msgs[1]["content"][0]
    assert out[1]["content"][1]["uuid"].startswith("kvc-")
    assert "uuid" not in msgs[1]["content"][1]
    assert has_media(out) and not has_media([msgs[0]]) and not has_media("x")


def test_placeholders_go_first_then_the_text_as_in_vllms_string_format() -> None:
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what"}, _image(DATA_URL, uuid="a"),
                                         {"type": "text", "text": "is this"}, _image(DATA_URL, uuid="b")]}]
    text_only, uuids = with_placeholders(msgs, MediaRule("<image>", 4))
    assert text_only == [{"role": "user", "content": "<image>\n<image>\nwhat\nis this"}]
    assert uuids == ["a", "b"]
    audio = [{"role": "user", "content": [_image(DATA_URL), {"type": "input_audio", "input_audio": {}}]}]
    with pytest.raises(InvalidChat, match="only images"):
        with_placeholders(audio, MediaRule())


def test_expansion_and_a_placeholder_count_that_does_not_match() -> None:
    ids, items = expand_placeholders([1, 9, 5, 8, 5], 5, ["a", "b"], MediaRule("<image>", 3))
    assert ids == [1, 9, 5, 5, 5, 8, 5, 5, 5]
    assert items == (MultiModalItem("a", 2, 3), MultiModalItem("b", 6, 3))
    with pytest.raises(InvalidChat, match="holds 2 image placeholders"):
        expand_placeholders([5, 5], 5, ["a"], MediaRule("<image>", 3))


WORD = st.sampled_from(["alpha", "beta", "gamma", "delta"])


@st.composite
def chats(draw: st.DrawFn) -> tuple[list[dict[str, Any]], int, int]:
    """A conversation whose user turns mix text and (possibly repeated) images."""
    msgs: list[dict[str, Any]] = [{"role": "system", "content": " ".join(draw(st.lists(WORD, max_size=20)))}]
    for _ in range(draw(st.integers(1, 3))):
        parts: list[dict[str, Any]] = []
        for _ in range(draw(st.integers(1, 4))):
            if draw(st.booleans()):
                parts.append(_image(DATA_URL, uuid=draw(st.sampled_from(["x", "y", "z"]))))
            else:
                parts.append({"type": "text", "text": " ".join(draw(st.lists(WORD, max_size=12)))})
        msgs.append({"role": "user", "content": parts})
    return msgs, draw(st.integers(1, 40)), draw(st.sampled_from([1, 4, 8, 16]))


@settings(max_examples=120, deadline=None)
@given(chats())
def test_sim_engine_chat_items_give_vllms_mm_extra_keys(chat: tuple[list[dict[str, Any]], int, int]) -> None:
    messages, tokens, block = chat
    ids, items = _chat_prompt({"messages": messages}, MediaRule("<image>", tokens))
    uuids = [p["uuid"] for m in messages if isinstance(m["content"], list)
             for p in m["content"] if p["type"] == "image_url"]
    assert [it.identifier for it in items] == uuids
    for it in items:  # every image is its run of placeholder tokens
        assert ids[it.offset:it.offset + it.length] == [toktok.IMAGE] * tokens
    assert ids.count(toktok.IMAGE) == tokens * len(uuids)
    keys = RequestKeys(mm_items=items)
    got = block_extra_keys(keys, block, len(ids))
    for b, extra in enumerate(got):
        want = _vllm_mm_keys(list(items), b * block, (b + 1) * block)
        assert (extra or ()) == tuple(want)


def test_the_image_changes_the_blocks_it_overlaps_and_those_after_only() -> None:
    profile = HashProfile("sha256_cbor", 4, "0")
    base = [{"role": "system", "content": "alpha beta gamma delta " * 3}]

    def hashes(uuid: str) -> list[bytes]:
        parts = [_image(DATA_URL, uuid=uuid), {"type": "text", "text": "q"}]
        msgs = [*base, {"role": "user", "content": parts}]
        ids, items = _chat_prompt({"messages": msgs}, MediaRule("<image>", 6))
        return hash_request_tokens(profile, ids, RequestKeys(mm_items=items))

    a, b = hashes("a"), hashes("b")
    first = next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
    _, items = _chat_prompt({"messages": [*base, {"role": "user", "content": [
        _image(DATA_URL, uuid="a"), {"type": "text", "text": "q"}]}]}, MediaRule("<image>", 6))
    assert first == items[0].offset // 4  # the block holding the image's first token
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_sim_engine_refuses_a_malformed_image_part() -> None:
    with pytest.raises(_BadRequest, match="not valid base64"):
        _chat_prompt({"messages": [{"role": "user", "content": [_image("data:image/png;base64,!!")]}]},
                     MediaRule())


def test_sim_engine_uses_a_given_uuid_and_otherwise_its_own_identifier() -> None:
    def ident(part: dict[str, Any]) -> str:
        msgs = [{"role": "user", "content": [part, {"type": "text", "text": "q"}]}]
        return _chat_prompt({"messages": msgs}, MediaRule("<image>", 2))[1][0].identifier

    routed = assign_uuids([{"role": "user", "content": [_image(DATA_URL)]}])[0]["content"][0]
    assert ident(routed) == routed["uuid"]  # a router's uuid, forwarded, keys the engine's blocks
    own = ident(_image(DATA_URL))
    assert own.startswith("sim-") and own != routed["uuid"]  # as vLLM's own digest, not the router's


class _RecordingToyTokenizer(toktok.ToyTokenizer):
    """The sim-engine's toy tokenizer (what its /tokenize answers), recording the prompts it encodes."""

    def __init__(self) -> None:
        super().__init__("toy")
        self.prompts: list[str] = []

    async def encode_prompt(self, prompt: str, *, add_special_tokens: bool = True) -> list[int]:
        self.prompts.append(prompt)
        return await super().encode_prompt(prompt, add_special_tokens=add_special_tokens)


@settings(max_examples=40, deadline=None)
@given(chats())
async def test_a_router_renders_what_the_engine_renders(chat: tuple[list[dict[str, Any]], int, int]) -> None:
    messages, tokens, _ = chat
    rule = MediaRule("<image>", tokens)
    tok = _RecordingToyTokenizer()
    got = await encode_media_chat(tok, messages, rule, tools=None, add_generation_prompt=True,
                                  continue_final_message=False, add_special_tokens=False)
    assert got == _chat_prompt({"messages": messages}, rule)
    await encode_media_chat(tok, messages, rule, tools=None, add_generation_prompt=True,
                            continue_final_message=False, add_special_tokens=False)
    assert tok.prompts == ["<image>"]  # the placeholder's id is asked once per tokenizer


async def test_a_placeholder_that_is_not_one_token_is_a_bad_request() -> None:
    msgs = [{"role": "user", "content": [_image(DATA_URL)]}]
    with pytest.raises(TokenizeError, match="is 2 tokens, not one") as err:
        await encode_media_chat(_RecordingToyTokenizer(), msgs, MediaRule("two words"))
    assert err.value.bad_request
