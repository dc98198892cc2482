"""Hash profiles learned from the events, for models configured without one.

A wrong ``algo``, ``block_size``, ``seed`` or ``style`` makes every token lookup of a model miss, so a model
may be named without a profile (or not named at all): then the coordinator asks the agents for verification
samples (BlockStored events with their token ids) and recomputes each sampled chain head under every
candidate: vLLM's four algorithms with each seed an engine could use (vLLM's default seed, the model's or
the global configured seed, this coordinator's ``PYTHONHASHSEED``), and SGLang's chain. The block size is the
events' own (``block_size``, checked against the token count). The first candidate that verifies
:data:`LEARN_CHAINS` whole chains is adopted: put in force for lookups, logged, counted
(``kvcoord_hash_profile_learned_total``) and shown by ``ListNodes`` and ``/workers``. The chains kept
from each engine are then verified under it by the one verifier (``HashVerifier``), so an engine of the
model that disagrees is flagged as a mismatch, as with a configured profile.

The search is bounded: chain heads only, their first :data:`LEARN_BLOCKS` blocks, at most
:data:`MAX_CHAINS_TRIED` chains per model, none after adoption. An engine whose seed is random
(``PYTHONHASHSEED`` unset for xxhash, or vLLM < 0.29) verifies under no candidate: the search gives up, says
why once, and the model keeps answering lookups by block hashes only.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from kvcoord.coordinator.config import env_seed
from kvcoord.coordinator.registry import CHANGES, AnnouncedProfile, NodeRecord
from kvcoord.coordinator.verify import recompute_chain
from kvcoord.extra_keys import ExtraKeyStyle
from kvcoord.hashing import DEFAULT_NONE_HASH_SEED, HASH_ALGOS, SGLANG, HashProfile, parse_release
from kvcoord.validate import shown
from kvcoord.wire import Sample

if TYPE_CHECKING:
    from kvcoord.coordinator.core import CoordinatorState

log = logging.getLogger("kvcoord.coordinator.learn")

LEARN_CHAINS = 3
"""Whole chains a candidate must verify (none failing) to be adopted."""
LEARN_BLOCKS = 8
"""Blocks of a chain recomputed per candidate (a chain's head fixes algorithm, seed and block size)."""
MAX_CHAINS_TRIED = 64
"""Chains tried per model before the search gives up (the CPU it may take)."""
KEPT_PER_NODE = 4
"""Samples kept per engine, verified under the adopted profile (so a disagreeing engine is flagged)."""
LEARN_FIRST = 8
"""Samples an agent sends first while its model is being learned (``VerifySample.first``)."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One profile the search tries, and how to name its seed without showing it."""

    profile: HashProfile
    seed_label: str


@dataclass(slots=True)
class _Search:
    """One model's search: chains each candidate verified, by chain head, and the samples kept per engine."""

    tried: int = 0
    wins: dict[Candidate, set[int]] = field(default_factory=dict)
    extra_keyed: set[Candidate] = field(default_factory=set)
    """Candidates that verified a chain carrying extra keys (which only the untagged style can)."""
    kept: dict[str, list[Sample]] = field(default_factory=dict)
    gave_up: bool = False


def candidates(block_size: int, seeds: Sequence[tuple[str, str]], fingerprint: str = "") -> list[Candidate]:
    """Every profile to try for blocks of ``block_size``: each vLLM algorithm with each ``(seed, label)``
    (only seeds whose NONE_HASH fingerprint is ``fingerprint``, when the engine's agent announced one), then
    SGLang's chain (no seed)."""
    out: list[Candidate] = []
    for seed, label in dict((s, lbl) for s, lbl in seeds if s).items():
        for algo in HASH_ALGOS:
            profile = HashProfile(algo, block_size, seed=seed)
            if fingerprint and hashlib.sha256(profile.none_hash()).hexdigest() != fingerprint:
                continue
            out.append(Candidate(profile, label))
    out.append(Candidate(HashProfile(SGLANG, block_size), "none"))
    return out


def verifies(profile: HashProfile, sample: Sample) -> bool:
    """Whether a chain head's first :data:`LEARN_BLOCKS` blocks all recompute under ``profile`` (blocks
    whose keys cannot be recovered make it no evidence, either way)."""
    want = min(len(sample.block_hashes), LEARN_BLOCKS)
    found = recompute_chain(profile, sample, None, LEARN_BLOCKS)
    return found.mismatch is None and len(found.digests) == want


def _style(c: Candidate, extra_keyed: bool, announced: AnnouncedProfile | None) -> HashProfile:
    """The adopted profile: the candidate with its extra-key style. Chains without extra keys hash alike in
    both styles, so the style is untagged when an extra-keyed chain proved it, else the agent's announced
    style (or its release's), else the current engines' default (vLLM tagged, SGLang its own format)."""
    p = c.profile
    if p.algo == SGLANG:
        style = announced.style if announced is not None and announced.style in ("untagged", "dynamo") else ""
        return HashProfile(SGLANG, p.block_size, style=cast(ExtraKeyStyle, style or "untagged"))
    style = "untagged" if extra_keyed else ""
    if not style and announced is not None:
        if announced.style in ("untagged", "tagged"):
            style = announced.style
        elif announced.engine_release:
            try:
                style = "tagged" if parse_release(announced.engine_release) >= (0, 31) else "untagged"
            except ValueError:
                style = ""
    return HashProfile(p.algo, p.block_size, seed=p.seed, style=cast(ExtraKeyStyle, style or "tagged"))


class ProfileLearner:
    """The searches of this coordinator's models without a profile (one event loop: no locks)."""

    def __init__(self) -> None:
        self._searches: dict[str, _Search] = {}

    def wants_samples(self, state: CoordinatorState, model: str) -> bool:
        """Whether agents of ``model`` should send samples for the search (no profile, search not over)."""
        if state.config.profile(model) is not None or not state.config.verify.enabled:
            return False
        search = self._searches.get(model)
        return search is None or not search.gave_up

    def seeds(self, state: CoordinatorState, model: str) -> list[tuple[str, str]]:
        """The seeds an engine of ``model`` could use, each with how to name it."""
        m = state.config.models.get(model)
        out = [(DEFAULT_NONE_HASH_SEED, "vLLM's default seed")]
        if m is not None and m.seed:
            out.insert(0, (m.seed, "the configured seed"))
        env = env_seed()
        if env:
            out.append((env, "this coordinator's PYTHONHASHSEED"))
        return out

    def observe(self, state: CoordinatorState, rec: NodeRecord, model: str,
                samples: Sequence[Sample]) -> None:
        """Try the candidates on an applied batch's samples; adopt one once it has verified enough chains."""
        if state.config.profile(model) is not None:
            return
        search = self._searches.setdefault(model, _Search())
        if search.gave_up:
            return
        fingerprint = rec.announced.none_hash_fingerprint if rec.announced is not None else ""
        for sample in samples:
            n = len(sample.block_hashes)
            if sample.parent is not None or not n or not sample.block_size \
                    or len(sample.token_ids) != n * sample.block_size:
                continue  # only a chain head can be recomputed without knowing its parent's digest
            kept = search.kept.setdefault(rec.node_id, [])
            if len(kept) < KEPT_PER_NODE:
                kept.append(sample)
            search.tried += 1
            head = hash(sample.block_hashes[0])
            keyed = any(sample.extra_keys or ())
            for c in candidates(sample.block_size, self.seeds(state, model), fingerprint):
                if verifies(c.profile, sample):
                    search.wins.setdefault(c, set()).add(head)
                    if keyed:
                        search.extra_keyed.add(c)
            best = max(search.wins.items(), key=lambda kv: len(kv[1]), default=None)
            if best is not None and len(best[1]) >= LEARN_CHAINS:
                self._adopt(state, rec, model, search, best[0])
                return
            if search.tried >= MAX_CHAINS_TRIED:
                self._give_up(state, model, search, fingerprint)
                return

    def _adopt(self, state: CoordinatorState, rec: NodeRecord, model: str, search: _Search,
               c: Candidate) -> None:
        profile = _style(c, c in search.extra_keyed, rec.announced)
        chains = len(search.wins[c])
        state.config.learned[model] = profile
        how = (f"algo={profile.algo} block_size={profile.block_size} style={profile.style} "
               f"seed={c.seed_label}, from {chains} chains")
        del self._searches[model]
        CHANGES.bump()  # lookups' views of the model now hash with it
        state.metrics.profiles_learned.labels(model, profile.algo).inc()
        log.warning("model %s: hash profile learned from the events: %s (configure it to skip learning)",
                    shown(model), how)
        for node_id, samples in search.kept.items():
            other = state.registry.get(node_id)
            if other is None or other.model != model or other.hash_mismatch:
                continue
            reason = state.verifier.check(other, model, profile, samples)
            if reason is not None:
                state.mark_hash_mismatch(other, f"engines of model {model} disagree: {reason}")

    def _give_up(self, state: CoordinatorState, model: str, search: _Search, fingerprint: str) -> None:
        search.gave_up = True
        search.kept.clear()
        search.wins.clear()
        why = ("the engine's NONE_HASH fingerprint matches none of the seeds tried" if fingerprint else
               "the engines' seed is likely random (PYTHONHASHSEED unset)")
        state.log_once(f"learn-failed:{model}", logging.ERROR,
                       "model %s: no hash profile verified %d of %d chains tried (%s); token lookups of it "
                       "fail until its profile is configured (algo, block_size, seed)", shown(model),
                       LEARN_CHAINS, MAX_CHAINS_TRIED, why)


__all__ = ["LEARN_BLOCKS", "LEARN_CHAINS", "LEARN_FIRST", "MAX_CHAINS_TRIED", "Candidate", "ProfileLearner",
           "candidates", "verifies"]
