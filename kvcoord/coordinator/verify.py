"""Engine hash verification: recompute a sample of BlockStored chains with the model's profile.

A wrong seed, algorithm, block size or extra-key style does not make an engine's events invalid;
it makes every token lookup silently miss. So the coordinator recomputes what it can of the samples
the agents send (a chain head, a chain whose parent digest it computed recently, or a digest-form
event that carries its parent digest) and reports a mismatch loudly, naming the likely cause.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from kvcoord.coordinator.config import VerifyConfig, env_seed
from kvcoord.coordinator.registry import AnnouncedProfile, NodeRecord
from kvcoord.hashing import (
    HASH_ALGOS,
    SGLANG,
    UINT64_MASK,
    BlockDigest,
    HashProfile,
    hash_block_tokens,
    to_block_hash64,
)
from kvcoord.validate import shown
from kvcoord.wire import Sample

log = logging.getLogger("kvcoord.coordinator.verify")
_ALGOS = HASH_ALGOS
_RELEASE_DEFAULT_SEED = "vllm-none-hash"


def _same(profile: HashProfile, published: int | bytes, digest: bytes) -> bool:
    if isinstance(published, bytes | bytearray):
        return bytes(published) == digest
    if profile.algo == SGLANG:  # SGLang's int64 (signed, or its uint64 form) is the digest's first 8 bytes
        return published & UINT64_MASK == int.from_bytes(digest[:8], "big")
    return bool(to_block_hash64(digest) == published)


class ChainCheck(NamedTuple):
    """What recomputing a sample's chain with one profile found (:func:`recompute_chain`)."""

    digests: list[BlockDigest]
    """The digests of the blocks that verified, in order (from the first)."""
    mismatch: int | None
    """The index of the first block whose digest differs from the published hash; None: none did (the
    blocks past ``digests`` had keys that cannot be recovered, see :func:`block_extra`)."""


def block_extra(profile: HashProfile, sample: Sample, i: int) -> tuple[bool, Any]:
    """(usable, extra_keys) for block ``i`` as the engine hashed it, when that is recoverable."""
    if profile.algo == SGLANG:
        # SGLang's request namespace (salt, LoRA id) is not in its events' keys: a chain is recomputable
        # only when the sample shows no LoRA and no extra keys (a salted chain then just fails to verify).
        plain = sample.lora_name is None and (sample.extra_keys is None or not any(sample.extra_keys))
        return plain, None
    if sample.extra_keys is None:
        # Not published (older releases, or an agent that drops them): the block may have been
        # hashed with LoRA, cache_salt or multimodal keys that cannot be known here, and guessing
        # "none" would report a false mismatch. Skipped (counted), not verified.
        return False, None
    if i >= len(sample.extra_keys):
        return False, None
    ek = sample.extra_keys[i]
    if ek is None:
        return True, None
    if profile.style != "untagged":
        return False, None  # published untagged, hashed tagged: LoRA path is not published
    return True, ek


def recompute_chain(profile: HashProfile, sample: Sample, parent: BlockDigest | None,
                    limit: int | None = None) -> ChainCheck:
    """Recompute a sample's blocks (the first ``limit``) under ``profile`` from ``parent``: the one chain
    check, of the verifier and of the profile learner alike."""
    bs = sample.block_size
    digests: list[BlockDigest] = []
    for i, published in enumerate(sample.block_hashes[:limit]):
        usable, extra = block_extra(profile, sample, i)
        if not usable:
            break
        digest = hash_block_tokens(profile, parent, sample.token_ids[i * bs : (i + 1) * bs], extra)
        if not _same(profile, published, digest):
            return ChainCheck(digests, i)
        digests.append(digest)
        parent = digest
    return ChainCheck(digests, None)


def compare_announced(announced: AnnouncedProfile, profile: HashProfile) -> str | None:
    """The likely cause of a mismatch, from the profile an agent announced in its Hello (None: agrees)."""
    try:
        ours = profile.fingerprint()
    except ValueError:
        ours = ""
    theirs = announced.none_hash_fingerprint
    if theirs and ours and theirs != ours:
        return (
            f"seed: the engine's NONE_HASH fingerprint {shown(theirs[:12], quote=False)}… differs from the "
            f"coordinator's {ours[:12]}… (set the model's seed, or PYTHONHASHSEED, to the engine's)"
        )
    if announced.algo and announced.algo != profile.algo:
        return (f"algorithm: the engine hashes with {shown(announced.algo, quote=False)}, the profile says "
                f"{profile.algo}")
    if announced.block_size and announced.block_size != profile.block_size:
        return (
            f"block size: the engine uses {announced.block_size}-token blocks, the profile says "
            f"{profile.block_size}"
        )
    if announced.style and announced.style != profile.style:
        return (f"extra-key style: the engine uses {shown(announced.style, quote=False)}, the profile says "
                f"{profile.style}")
    return None


class HashVerifier:
    """Samples BlockStored chains and recomputes them; remembers recently verified digests by uint64."""

    def __init__(self, cfg: VerifyConfig, on_result: Callable[[str], None] | None = None) -> None:
        self.cfg = cfg
        self.on_result = on_result
        """Called once per sampled chain: ``ok``, ``mismatch`` or ``skipped`` (not recomputable)."""
        self._lru: OrderedDict[tuple[str, int], BlockDigest] = OrderedDict()
        self.verified = 0
        self.skipped = 0

    def _remember(self, model: str, h64: int, digest: BlockDigest) -> None:
        key = (model, h64)
        self._lru[key] = digest
        self._lru.move_to_end(key)
        while len(self._lru) > self.cfg.lru_size:
            self._lru.popitem(last=False)

    def _parent_digest(self, model: str, parent: int | bytes | None) -> tuple[bool, BlockDigest | None]:
        """(known, digest) of a sample's parent: a chain head has parent None; a digest-form parent is
        itself; a uint64 parent is known when verified recently."""
        if parent is None:
            return True, None
        if isinstance(parent, bytes):
            return True, BlockDigest(parent)
        key = (model, parent)
        digest = self._lru.get(key)
        if digest is None:
            return False, None
        self._lru.move_to_end(key)
        return True, digest

    def check(
        self, rec: NodeRecord, model: str, profile: HashProfile, samples: Sequence[Sample]
    ) -> str | None:
        """Verify a batch's samples (the agent chose them, see :class:`kvcoord.wire.TokenSampler`); returns
        a mismatch reason (with the likely cause) or None. Samples are taken in order, so a chain verified
        earlier in the batch makes its continuation verifiable."""
        if not self.cfg.enabled:
            return None
        for sample in samples:
            if sample.block_size != profile.block_size:
                return (
                    f"block size: the engine publishes blocks of {sample.block_size} tokens, the model's "
                    f"profile says {profile.block_size}"
                )
            n = len(sample.block_hashes)
            if not n or len(sample.token_ids) != n * sample.block_size:
                continue
            known, parent = self._parent_digest(model, sample.parent)
            if not known:
                self.skipped += 1
                self._result("skipped")
                continue
            rec.verify_seen += 1
            before = self.verified
            try:
                reason = self._verify_chain(rec, model, profile, sample, parent)
            except Exception:  # verification is advisory: never let it break ingest
                log.warning("hash verification of a BlockStored from %s failed", rec.node_id, exc_info=True)
                self.skipped += 1
                self._result("skipped")
                continue
            if reason is not None:
                self._result("mismatch")
                return reason
            self._result("ok" if self.verified > before else "skipped")
        return None

    def _result(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    def _verify_chain(
        self, rec: NodeRecord, model: str, profile: HashProfile, sample: Sample, parent: BlockDigest | None
    ) -> str | None:
        if profile.algo == SGLANG:
            return None  # a salted SGLang chain is not recognisable as one here: never a false mismatch
        found = recompute_chain(profile, sample, parent)
        for digest in found.digests:
            self.verified += 1
            self._remember(model, to_block_hash64(digest), digest)
        i = found.mismatch
        if i is None:
            return None
        bs = sample.block_size
        _, extra = block_extra(profile, sample, i)
        return self._diagnose(rec.announced, profile, found.digests[-1] if found.digests else parent,
                              sample.parent, sample.token_ids[i * bs : (i + 1) * bs], extra,
                              sample.block_hashes[i], i)

    def _diagnose(
        self,
        announced: AnnouncedProfile | None,
        profile: HashProfile,
        parent: BlockDigest | None,
        published_parent: object,
        tokens: Sequence[int],
        extra: Any,
        published: int | bytes,
        index: int,
    ) -> str:
        if announced is not None:
            reason = compare_announced(announced, profile)
            if reason is not None:
                return reason
        if index > 0 or (parent is not None and not isinstance(published_parent, bytes | bytearray)):
            return (
                f"token ids or extra keys: block {index} of a chain whose parent verified does not; the "
                "event's token ids or extra keys (LoRA, multimodal, cache_salt) differ from what the engine "
                "hashed"
            )
        # Only a chain head (or a digest-form parent) can be recomputed under other profiles.
        if parent is None or isinstance(published_parent, bytes | bytearray):
            for algo in _ALGOS:
                if algo == profile.algo:
                    continue
                alt = self._try(profile, {"algo": algo}, parent, tokens, extra, published)
                if alt:
                    return f"algorithm: the engine's hashes match {algo}, the profile says {profile.algo}"
            if parent is None:
                seeds = {
                    _RELEASE_DEFAULT_SEED: "the vLLM >= 0.29 default seed",
                    env_seed() or "": "this coordinator's PYTHONHASHSEED",
                }
                for seed, label in seeds.items():
                    if (
                        seed
                        and seed != profile.seed
                        and self._try(profile, {"seed": seed}, None, tokens, extra, published)
                    ):
                        return f"seed: the engine's hashes match {label}, not the model's configured seed"
        where = "chain head" if parent is None else f"block {index} of a chain"
        return (
            f"seed (most likely): the {where} does not hash to the engine's value with algo={profile.algo}, "
            f"block_size={profile.block_size}, style={profile.style}; an engine started without "
            "PYTHONHASHSEED uses a random seed"
        )

    @staticmethod
    def _try(
        profile: HashProfile,
        change: dict[str, Any],
        parent: BlockDigest | None,
        tokens: Sequence[int],
        extra: Any,
        published: int | bytes,
    ) -> bool:
        try:
            alt = dataclasses.replace(profile, **change)
            return _same(alt, published, hash_block_tokens(alt, parent, tokens, extra))
        except (TypeError, ValueError):
            return False
