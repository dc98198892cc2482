"""Engine hash verification: recompute a sample of BlockStored chains with the model's profile.

A wrong seed, algorithm, block size or extra-key style does not make an engine's events invalid;
it makes every token lookup silently miss. So the coordinator recomputes what it can (a chain
head, or a chain whose parent digest it computed recently, or digest-form events that carry their
parent digest) and reports a mismatch loudly, naming the likely cause.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

from kvcoord.coordinator.config import VerifyConfig, env_seed
from kvcoord.coordinator.registry import AnnouncedProfile, NodeRecord
from kvcoord.events import FULL_ATTENTION_KINDS, BlockStored
from kvcoord.events_proto import event_from_proto, tupleize
from kvcoord.hashing import BlockDigest, HashProfile, hash_block_tokens, to_block_hash64
from kvcoord.proto.v1 import kvcoord_pb2 as pb

log = logging.getLogger("kvcoord.coordinator.verify")
_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
_RELEASE_DEFAULT_SEED = "vllm-none-hash"


def _same(published: int | bytes, digest: bytes) -> bool:
    if isinstance(published, bytes | bytearray):
        return bytes(published) == digest
    return bool(to_block_hash64(digest) == published)


def compare_announced(announced: AnnouncedProfile, profile: HashProfile) -> str | None:
    """The likely cause of a mismatch, from the profile an agent announced in its Hello (None: agrees)."""
    try:
        ours = profile.fingerprint()
    except ValueError:
        ours = ""
    theirs = announced.none_hash_fingerprint
    if theirs and ours and theirs != ours:
        return (
            f"seed: the engine's NONE_HASH fingerprint {theirs[:12]}… differs from the coordinator's "
            f"{ours[:12]}… (set the model's seed, or PYTHONHASHSEED, to the engine's)"
        )
    if announced.algo and announced.algo != profile.algo:
        return f"algorithm: the engine hashes with {announced.algo}, the profile says {profile.algo}"
    if announced.block_size and announced.block_size != profile.block_size:
        return (
            f"block size: the engine uses {announced.block_size}-token blocks, the profile says "
            f"{profile.block_size}"
        )
    if announced.style and announced.style != profile.style:
        return f"extra-key style: the engine uses {announced.style}, the profile says {profile.style}"
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

    def _parent_digest(self, model: str, s: pb.BlockStored) -> tuple[bool, BlockDigest | None]:
        """(known, digest) of a stored event's parent, read from the message: a chain head has parent
        None; a digest-form parent is itself; a uint64 parent is known when verified recently."""
        if s.HasField("parent_block_digest"):
            return True, BlockDigest(bytes(s.parent_block_digest))
        if not s.HasField("parent_block_hash"):
            return True, None
        key = (model, s.parent_block_hash)
        digest = self._lru.get(key)
        if digest is None:
            return False, None
        self._lru.move_to_end(key)
        return True, digest

    def _block_extra(self, profile: HashProfile, ev: BlockStored, i: int) -> tuple[bool, Any]:
        """(usable, extra_keys) for block ``i`` as the engine hashed it, when that is recoverable."""
        if ev.extra_keys is None:
            # Not published (older releases, or an agent that drops them): the block may have been
            # hashed with LoRA, cache_salt or multimodal keys that cannot be known here, and guessing
            # "none" would report a false mismatch. Skipped (counted), not verified.
            return False, None
        if i >= len(ev.extra_keys):
            return False, None
        ek = ev.extra_keys[i]
        if ek is None:
            return True, None
        if profile.style != "untagged":
            return False, None  # published untagged, hashed tagged: LoRA path is not published
        return True, tupleize(ek)

    def may_act(
        self,
        model: str,
        profile: HashProfile,
        stored: Sequence[tuple[int, int, int, int | bytes | None, str | None]],
    ) -> bool:
        """Whether ``check`` could sample, verify or report anything for a batch whose BlockStored
        events are ``(n_hashes, n_tokens, block_size, parent, kv_cache_spec_kind)`` (the wire
        scanner's summary; parent None, uint64 or digest). When not, ``check`` would change nothing,
        so the batch need not be parsed at all. Mirrors ``check``'s per-event tests in order."""
        if not self.cfg.enabled:
            return False
        for n, n_tokens, block_size, parent, kind in stored:
            if not n or (kind is not None and kind not in FULL_ATTENTION_KINDS):
                continue
            if block_size != profile.block_size:
                return True
            if n_tokens != n * block_size:
                continue
            if parent is None or isinstance(parent, bytes) or (model, parent) in self._lru:
                return True
        return False

    def check(
        self,
        rec: NodeRecord,
        model: str,
        profile: HashProfile,
        msgs: Sequence[pb.KVEvent],
    ) -> str | None:
        """Verify a sample of a batch's events (already validated whole); returns a mismatch reason
        (with the likely cause) or None.

        Sampling is decided from the protobuf messages, and only sampled events are decoded (token
        ids as Python ints): the first ``first`` verifiable chains of a node, then one in
        ``sample_every``. Events are taken in order, so a chain verified earlier in the batch makes its
        continuation verifiable.
        """
        if not self.cfg.enabled:
            return None
        for m in msgs:
            if m.WhichOneof("event") != "stored":
                continue
            s = m.stored
            n = len(s.block_hashes) or len(s.block_digests)
            if not n:
                continue
            if s.HasField("kv_cache_spec_kind") and s.kv_cache_spec_kind not in FULL_ATTENTION_KINDS:
                continue
            if s.block_size != profile.block_size:
                return (
                    f"block size: the engine publishes blocks of {s.block_size} tokens, the model's "
                    f"profile says {profile.block_size}"
                )
            if len(s.token_ids) != n * s.block_size:
                continue
            known, parent = self._parent_digest(model, s)
            if not known:
                continue
            rec.verify_seen += 1
            if rec.verify_seen > self.cfg.first and rec.verify_seen % self.cfg.sample_every:
                self.skipped += 1
                continue  # not sampled: not a verification
            ev = event_from_proto(m)
            assert isinstance(ev, BlockStored)
            before = self.verified
            try:
                reason = self._verify_chain(rec, model, profile, ev, parent)
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
        self, rec: NodeRecord, model: str, profile: HashProfile, ev: BlockStored, parent: BlockDigest | None
    ) -> str | None:
        bs = ev.block_size
        for i, published in enumerate(ev.block_hashes):
            usable, extra = self._block_extra(profile, ev, i)
            if not usable:
                return None
            tokens = ev.token_ids[i * bs : (i + 1) * bs]
            digest = hash_block_tokens(profile, parent, tokens, extra)
            if not _same(published, digest):
                return self._diagnose(
                    rec.announced, profile, parent, ev.parent_block_hash, tokens, extra, published, i
                )
            self.verified += 1
            self._remember(model, to_block_hash64(digest), digest)
            parent = digest
        return None

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
            return _same(published, hash_block_tokens(alt, parent, tokens, extra))
        except (TypeError, ValueError):
            return False
