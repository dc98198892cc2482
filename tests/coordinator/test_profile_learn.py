"""The profile learner's candidate search (kvcoord.coordinator.learn): which candidates it tries, that the
engine's own profile verifies and no other does (hypothesis, over algorithms, seeds, block sizes and token
ids), adoption after LEARN_CHAINS chains, flagging of an engine that disagrees, the bounded give-up, and
``--model NAME`` without a profile in the configuration."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcoord.coordinator.config import CoordinatorConfig, ModelConfig, parse_model_spec
from kvcoord.coordinator.config_values import ConfigError
from kvcoord.coordinator.core import CoordinatorState
from kvcoord.coordinator.learn import LEARN_CHAINS, MAX_CHAINS_TRIED, candidates, verifies
from kvcoord.hashing import DEFAULT_NONE_HASH_SEED, HASH_ALGOS, HashProfile, hash_request_tokens
from kvcoord.index.memory import MemoryIndex
from kvcoord.wire import Sample

SEEDS = [("0", "the configured seed"), (DEFAULT_NONE_HASH_SEED, "vLLM's default seed")]


def sample(profile: HashProfile, tokens: Sequence[int], extra: bool = False) -> Sample:
    """A chain head's verification sample as the engine with ``profile`` publishes it."""
    digests = hash_request_tokens(profile, tokens)
    n = len(digests)
    return Sample(tuple(profile.external_hash(d) for d in digests), None,
                  tuple(tokens[: n * profile.block_size]), profile.block_size, None,
                  (None,) * n if not extra else None)


def test_candidates_every_algorithm_and_seed_then_sglang() -> None:
    found = candidates(16, SEEDS)
    assert [(c.profile.algo, c.profile.seed) for c in found[:-1]] == [
        (a, s) for s, _ in SEEDS for a in HASH_ALGOS]
    assert found[-1].profile.algo == "sglang" and found[-1].profile.block_size == 16
    # An announced NONE_HASH fingerprint keeps only the seeds (and algorithms) that make it.
    fp = hashlib.sha256(HashProfile("xxhash", 16, seed="0").none_hash()).hexdigest()
    assert [(c.profile.algo, c.profile.seed) for c in candidates(16, SEEDS, fp)] == [("xxhash", "0"),
                                                                                  ("sglang", None)]


@settings(max_examples=25, deadline=None)
@given(algo=st.sampled_from([*HASH_ALGOS, "sglang"]), seed=st.sampled_from([s for s, _ in SEEDS]),
       block_size=st.integers(1, 16), data=st.data())
def test_only_the_engines_own_profile_verifies(algo: str, seed: str, block_size: int,
                                               data: st.DataObject) -> None:
    tokens = data.draw(st.lists(st.integers(0, 2**20), min_size=block_size, max_size=4 * block_size))
    engine = HashProfile(algo, block_size, seed=None if algo == "sglang" else seed)  # type: ignore[arg-type]
    s = sample(engine, tokens)
    verified = [c.profile for c in candidates(block_size, SEEDS) if verifies(c.profile, s)]
    assert verified == [engine]


def test_chains_without_extra_keys_are_no_evidence_for_vllm() -> None:
    engine = HashProfile("sha256_cbor", 4, seed="0")
    s = sample(engine, list(range(8)), extra=True)  # extra keys not published: cannot be recomputed
    assert not any(verifies(c.profile, s) for c in candidates(4, SEEDS))


def _state(model_seed: str | None = "0") -> CoordinatorState:
    models = {"m": ModelConfig("m", None, seed=model_seed)}
    return CoordinatorState(CoordinatorConfig(models=models), MemoryIndex())


def _node(state: CoordinatorState, node_id: str) -> object:
    rec, _ = state.registry.hello(node_id, "m", (0,), 1, index_ok=True, next_seq=1)
    return rec


async def test_adopted_after_enough_chains_and_a_disagreeing_engine_is_flagged(
        caplog: pytest.LogCaptureFixture) -> None:
    state = _state()
    good, other = _node(state, "a"), _node(state, "b")
    engine = HashProfile("xxhash_cbor", 4, seed="0")
    stranger = HashProfile("xxhash_cbor", 4, seed="1")  # a seed nobody configured
    state.learner.observe(state, other, "m", [sample(stranger, [9, 9, 9, 9, 9])])  # type: ignore[arg-type]
    caplog.set_level(logging.WARNING, "kvcoord.coordinator.learn")
    for i in range(LEARN_CHAINS):
        assert state.config.profile("m") is None
        state.learner.observe(state, good, "m", [sample(engine, [i, i + 1, i + 2, i + 3])])  # type: ignore[arg-type]
    learned = state.config.profile("m")
    assert learned == HashProfile("xxhash_cbor", 4, seed="0", style="tagged")
    assert "hash profile learned from the events: algo=xxhash_cbor block_size=4" in caplog.text
    assert "seed=the configured seed" in caplog.text and "seed='0'" not in caplog.text
    assert not good.hash_mismatch  # type: ignore[attr-defined]
    assert other.hash_mismatch and "engines of model m disagree" in other.hash_mismatch_reason  # type: ignore[attr-defined]
    value = state.metrics.profiles_learned.labels("m", "xxhash_cbor")._value.get()
    assert value == 1
    assert not state.learner.wants_samples(state, "m")  # the search is over: no more CPU spent on it


async def test_a_random_seed_gives_up_once_bounded(caplog: pytest.LogCaptureFixture) -> None:
    state = _state(None)
    rec = _node(state, "a")
    engine = HashProfile("xxhash", 4, seed="random-per-process")
    caplog.set_level(logging.ERROR)
    for i in range(MAX_CHAINS_TRIED + 10):
        state.learner.observe(state, rec, "m", [sample(engine, [i, 1, 2, 3])])  # type: ignore[arg-type]
    assert state.config.profile("m") is None
    assert caplog.text.count("no hash profile verified") == 1
    assert not state.learner.wants_samples(state, "m")


def test_a_model_named_without_algo_is_learned() -> None:
    m = parse_model_spec("m", "7")
    assert (m.profile, m.seed) == (None, "7")
    assert parse_model_spec("m,seed=3", None).seed == "3"
    with pytest.raises(ConfigError, match="'block_size' needs 'algo'"):
        parse_model_spec("m,block_size=16", None)
