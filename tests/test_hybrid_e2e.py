"""Hybrid models over real processes: a DeepSeek-V4-style event stream (kvcoord's vLLM-exact ZMQ publisher),
with a full-attention group published as ``sink_full_attention`` and ``full_attention`` (group 0) beside a
sparse sliding-window group (group 1), relayed by ``kvcoord agent`` or by ``kvcoord serve`` after
``POST /register``.

The full-attention stores are indexed (``sink_full_attention`` is prefix-matchable); a well-formed
sliding-window store is not (it cannot serve a prefix hit alone) and is no error; a store whose token count
is not ``block_size`` times its hashes (the sparse group's, or a broken full-attention one) is skipped and
counted in ``kvcoord_misfit_stored_events_total`` per group kind, logged once: never a refused batch, never
a malformed one, the node stays ``exact``."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.events import BlockStored, KVEventBatch, decode_vllm_views
from kvcoord.media import INDEXED_GROUP_KINDS
from kvcoord.native import native
from kvcoord.validate import py_store_fits
from tests.coordinator.test_history_lost import BS, block, tokens
from tests.http_util import by_label
from tests.procs import until
from tests.test_media_e2e import media_stack


def store(i: int, kind: str | None, group: int = 0, *, blocks: int = 1, hashes: int = 1) -> BlockStored:
    """A store of group ``group`` and kind ``kind``: ``hashes`` hashes over ``blocks`` blocks of tokens
    (fewer hashes than blocks: a sparse group's store)."""
    toks = [t for b in range(blocks) for t in tokens(i + b)]
    return BlockStored(block_hashes=tuple(block(i + h) for h in range(hashes)), parent_block_hash=None,
                       token_ids=tuple(toks), block_size=BS, lora_id=None, medium="GPU", group_idx=group,
                       kv_cache_spec_kind=kind)


BATCHES = [
    (store(0, "sink_full_attention"), store(10, "sliding_window", 1, blocks=4, hashes=1),
     store(1, "full_attention")),
    (store(12, "sliding_window", 1, blocks=2, hashes=2), store(2, "sink_full_attention", blocks=3, hashes=2),
     store(5, "sink_full_attention", blocks=2, hashes=2)),
]
"""Group 0's full-attention stores of blocks 0, 1, 5 and 6 are indexed; the sparse sliding-window store
(block 10: one hash over four blocks) and the broken sink store (blocks 2, 3: two hashes over three blocks)
are misfits; the well-formed sliding-window store (blocks 12, 13) is not indexed, and no misfit."""
INDEXED = [0, 1, 5, 6]
MISFITS = {"sliding_window": 1.0, "sink_full_attention": 1.0}


@pytest.mark.parametrize("via", ["agent", "register"])
def test_deepseek_v4_style_stream_indexes_full_attention_and_skips_misfits(tmp_path: Path, via: str) -> None:
    with media_stack(tmp_path) as s:
        node, log = s.relay(via)
        s.publish_all(BATCHES)
        until(lambda: s.held(node, range(14)) == INDEXED, "the full-attention blocks indexed, no other",
              timeout=60)
        s.assert_exact(node, len(INDEXED))

        def misfits() -> dict[str, float]:
            got = by_label(s.scrape(), "kvcoord_misfit_stored_events_total", "group_kind")
            zeros = {label for label, v in got.items() if not v}  # the indexed kinds, there from the start
            assert zeros <= set(INDEXED_GROUP_KINDS), got
            return {label: v for label, v in got.items() if v}

        until(lambda: misfits() == MISFITS, "kvcoord_misfit_stored_events_total per group kind", timeout=60)
        s.assert_exact(node, len(INDEXED))  # the misfits refused nothing
        lines = log.read_text().splitlines()
        for kind in MISFITS:
            assert sum(f"group kind '{kind}' whose token ids" in line for line in lines) == 1, lines


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**31), max_size=70), block_size=st.integers(0, 20),
       hashes=st.integers(0, 5), view=st.booleans())
def test_store_fits_native_and_python_agree(tokens: list[int], block_size: int, hashes: int,
                                            view: bool) -> None:
    """The token-count check: C and Python give the same answer, on model structs and on relay views (whose
    ids are raw msgpack), and it is ``block_size`` ids per hash, or none."""
    ev = BlockStored(block_hashes=tuple(range(1, hashes + 1)), parent_block_hash=None,
                     token_ids=tuple(tokens), block_size=block_size)
    if view:
        ev = decode_vllm_views(msgspec.msgpack.encode(KVEventBatch(ts=1.0, events=[ev]))).events[0]
    want = not tokens or len(tokens) == block_size * hashes
    assert py_store_fits(ev) == want
    if native is not None:
        assert native.store_fits(ev) == want
