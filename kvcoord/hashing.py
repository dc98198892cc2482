"""vLLM-exact prefix-cache block hashing.

A block hash is ``H((parent_digest or NONE_HASH, tuple(block_token_ids), extra_keys or None))``
chained over full blocks, where ``H`` is one of vLLM's four functions (``sha256`` = SHA-256 of
pickle protocol 5, ``sha256_cbor`` = SHA-256 of canonical CBOR, ``xxhash`` / ``xxhash_cbor`` =
XXH3-128 of the same) and ``NONE_HASH = H(seed)``. Everything here reproduces the bytes vLLM
hashes, including its pitfalls: the parent is the raw digest, an empty key set is ``None``, the
seed is hashed as a string, and pickle's memo makes object identity part of the input (so the
repeated ``"mm"`` tag of the tagged style is one shared literal, as in vLLM).

Two implementations compute the same digests. The *reference* (:func:`_chain_reference`) builds
vLLM's tuples and calls ``cbor2``/``pickle`` plus ``hashlib``/``xxhash``: it is the definition, the
fallback when native code is not built or is switched off (``KVCOORD_NATIVE=0``, see
:mod:`kvcoord.native`), and the oracle of the tests. The *native* chains (``cbor_chain``,
``pickle_chain``) write each block's serialised bytes in C and hash them with the same
``hashlib``/``xxhash`` functions. ``fast=False`` forces the reference for one call; property tests and
the real-engine fixtures prove both bit-identical.

SGLang's radix cache hashes differently (``algo="sglang"``, see :mod:`kvcoord.sglang_hash` and
docs/semantics.md "Hash profiles"): a SHA-256 chain over raw page bytes, published as the digest's first 8
bytes (signed int64), optionally rehashed into a LoRA/cache-salt namespace. Its native twin is
``native.sglang_chain``; tests/test_hashing_sglang.py proves both bit-identical to SGLang's own code.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, NewType, TypeAlias, TypeVar, cast, get_args

import cbor2
import xxhash as _xxhash

from kvcoord import sglang_hash
from kvcoord.extra_keys import (
    ExtraKeyStyle,
    RequestKeys,
    extra_keys_range,
)
from kvcoord.native import native
from kvcoord.vllm_hash import HASH_FUNCTIONS

BlockDigest = NewType("BlockDigest", bytes)
"""A full block digest as the engine computes it: 32 bytes (sha256*) or 16 bytes (xxh3-128)."""

BlockHash64 = NewType("BlockHash64", int)
"""vLLM's ``ExternalBlockHash`` in int form: the digest's last 8 bytes, big-endian, unsigned."""

UINT64_MASK = (1 << 64) - 1

VllmAlgo: TypeAlias = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HashAlgo: TypeAlias = Literal[VllmAlgo, "sglang"]
ExternalForm: TypeAlias = Literal["int", "bytes"]
HASH_ALGOS: Final[tuple[VllmAlgo, ...]] = get_args(VllmAlgo)
"""vLLM's four algorithms (see :data:`PROFILE_ALGOS` for every profile's)."""
PROFILE_ALGOS: Final[tuple[HashAlgo, ...]] = (*HASH_ALGOS, "sglang")
EXTRA_KEY_STYLES: Final[tuple[ExtraKeyStyle, ...]] = get_args(ExtraKeyStyle)
EXTERNAL_FORMS: Final[tuple[ExternalForm, ...]] = get_args(ExternalForm)

SGLANG: Final = "sglang"
"""The SGLang radix cache's page-hash chain (not a vLLM algorithm: no NONE_HASH, no extra-key tuples)."""
_VLLM_STYLES: Final = ("untagged", "tagged")
_SGLANG_STYLES: Final = ("untagged", "dynamo")
"""SGLang's event formats: ``untagged`` its own (default), ``dynamo`` its ``--kv-events-config`` format
``"dynamo"`` (the namespace covers cache_salt and every extra key)."""
DEFAULT_NONE_HASH_SEED: Final = "vllm-none-hash"
"""The seed vLLM >= 0.29 uses for sha256/sha256_cbor when ``PYTHONHASHSEED`` is unset."""

_DEFAULT_SEED_SINCE: Final = (0, 29)
_TAGGED_SINCE: Final = (0, 31)
_SEEDED_BY_DEFAULT: Final[frozenset[str]] = frozenset({"sha256", "sha256_cbor"})


T = TypeVar("T")


def to_block_hash64(value: int | bytes) -> BlockHash64:
    """Reduce an engine-published hash (int or raw digest) to the uint64 key, exactly as vLLM does: the one
    hash rule. ``TypeError`` for a non-hash (a bool too), ``ValueError`` for an int outside uint64 or an
    empty digest, which no engine emits (:data:`kvcoord.events.u64_ok` checks a sequence at once)."""
    if isinstance(value, bytes | bytearray | memoryview):
        if not value:
            raise ValueError("block hash is an empty digest")
        return BlockHash64(int.from_bytes(value, "big") & UINT64_MASK)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"block hash must be int or bytes, not {type(value).__name__}")
    if value < 0 or value > UINT64_MASK:
        raise ValueError(f"block hash {value} is outside uint64")
    return BlockHash64(value)


def check_algo(algo: str) -> HashAlgo:
    """Return ``algo`` as a :data:`HashAlgo`, or raise ``ValueError`` naming the valid ones."""
    if algo not in PROFILE_ALGOS:
        raise ValueError(f"unknown hash algorithm {algo!r} (expected one of {', '.join(PROFILE_ALGOS)})")
    return algo


def get_hash_fn(algo: str) -> Callable[[object], bytes]:
    """The reference hash function named ``algo`` (vLLM's ``get_hash_fn_by_name``)."""
    if check_algo(algo) == SGLANG:
        raise ValueError("sglang hashes pages, not serialised objects: it has no object hash function")
    return HASH_FUNCTIONS[algo]


def parse_release(release: str) -> tuple[int, int]:
    """``"0.31"``, ``"v0.33.1"``, ``"0.31.0rc1"`` → ``(major, minor)``; ``ValueError`` otherwise."""
    m = re.match(r"^v?(\d+)\.(\d+)(?:[.+\-a-z0-9]*)$", release.strip())
    if m is None:
        raise ValueError(f"bad engine release {release!r} (expected e.g. 0.31 or 0.33.1)")
    return int(m.group(1)), int(m.group(2))


@functools.lru_cache(maxsize=64)
def _none_hash(algo: str, seed: str) -> bytes:
    # vLLM's init_none_hash: NONE_HASH = hash_fn(seed), the seed as a *string*, same H as blocks.
    # SGLang has none: a request's first page hashes its bytes alone (the empty parent).
    return b"" if algo == SGLANG else HASH_FUNCTIONS[algo](seed)


# --- profiles ------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class HashProfile:
    """Everything that decides an engine's block hashes (DESIGN.md "Hash profiles").

    ``seed`` None means: ``PYTHONHASHSEED`` at hashing time, else the default of
    ``engine_release`` (vLLM >= 0.29, sha256 family), else an error. ``external`` is the form the
    engine publishes (``int``: uint64, SGLang's signed int64; ``bytes``: raw digest). ``algo="sglang"``
    takes no seed, and ``style`` is its event format (``untagged``: SGLang's own, ``dynamo``).
    """

    algo: HashAlgo
    block_size: int
    seed: str | None = None
    style: ExtraKeyStyle = "untagged"
    external: ExternalForm = "int"
    engine_release: str | None = None

    def __post_init__(self) -> None:
        check_algo(self.algo)
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block size must be a positive integer, not {self.block_size!r}")
        if self.seed is not None and not isinstance(self.seed, str):
            raise ValueError(f"seed must be a string (it is hashed as one), not {type(self.seed).__name__}")
        if self.algo == SGLANG:
            if self.seed is not None:
                raise ValueError("sglang's chain has no seed (a request's cache_salt seeds it): drop seed")
            if self.style not in _SGLANG_STYLES:
                raise ValueError(f"sglang's event format {self.style!r} is not untagged or dynamo")
        elif self.style not in _VLLM_STYLES:
            raise ValueError(f"unknown extra-key style {self.style!r} (expected untagged or tagged)")
        if self.external not in EXTERNAL_FORMS:
            raise ValueError(f"unknown external hash form {self.external!r} (expected int or bytes)")
        if self.engine_release is not None:
            parse_release(self.engine_release)

    @classmethod
    def for_release(
        cls,
        release: str,
        algo: HashAlgo,
        block_size: int,
        seed: str | None = None,
        external: ExternalForm = "int",
    ) -> HashProfile:
        """The profile of a vLLM release: tagged extra keys from 0.31, default seed from 0.29."""
        style: ExtraKeyStyle = "tagged" if parse_release(release) >= _TAGGED_SINCE else "untagged"
        return cls(algo, block_size, seed, style, external, release)

    @property
    def digest_size(self) -> int:
        """32 for the sha256 family, 16 for xxh3-128."""
        return 32 if self.algo.startswith("sha256") else 16

    def resolved_seed(self) -> str:
        """The seed NONE_HASH derives from; ``ValueError`` with the fix when it cannot be known."""
        if self.seed is not None:
            return self.seed
        if self.algo == SGLANG:
            return ""  # unused: SGLang's chain has no seed
        env = os.environ.get("PYTHONHASHSEED")
        if env is not None:
            return env
        how = ("pass the engine's PYTHONHASHSEED as the seed (--hash-seed S on the command line, seed=S in "
               "a model's profile) or set PYTHONHASHSEED")
        if self.engine_release is None:
            raise ValueError(
                f"no NONE_HASH seed: {how}, or name the engine release (vLLM >= 0.29 uses "
                f"{DEFAULT_NONE_HASH_SEED!r} for sha256/sha256_cbor)"
            )
        if parse_release(self.engine_release) < _DEFAULT_SEED_SINCE:
            raise ValueError(
                f"vLLM {self.engine_release} seeds NONE_HASH randomly when PYTHONHASHSEED is unset, so its "
                f"hashes cannot be reproduced: start the engine with PYTHONHASHSEED set and {how}"
            )
        if self.algo not in _SEEDED_BY_DEFAULT:
            raise ValueError(
                f"vLLM seeds {self.algo} randomly when PYTHONHASHSEED is unset, so its hashes cannot be "
                f"reproduced: start the engine with PYTHONHASHSEED set and {how}"
            )
        return DEFAULT_NONE_HASH_SEED

    def none_hash(self) -> BlockDigest:
        """NONE_HASH = H(seed): the parent of every request's first block."""
        return BlockDigest(_none_hash(self.algo, self.resolved_seed()))

    def fingerprint(self) -> str:
        """Hex SHA-256 of NONE_HASH: lets peers compare seeds without revealing them."""
        return hashlib.sha256(self.none_hash()).hexdigest()

    def external_hash(self, digest: bytes) -> int | bytes:
        """A digest in the form this engine publishes (uint64 int, SGLang's signed int64 of a request
        without namespace, or the raw digest)."""
        if self.external == "bytes":
            return bytes(digest)
        if self.algo == SGLANG:
            return int.from_bytes(digest[:8], "big", signed=True)
        return to_block_hash64(digest)


# --- token validation and the two chains ---------------------------------------------------------
def _as_tokens(token_ids: Iterable[int]) -> array[int]:
    """Validate token ids in C before any hashing: the same ids as a uint64 array.

    Non-integers raise ``ValueError``, as do ids outside 0..2**64-1 (no tokenizer has them).
    """
    if isinstance(token_ids, array) and token_ids.typecode in ("Q", "I"):
        return token_ids  # uint32 ids (the HTTP API's, the wire's) need no widening
    if isinstance(token_ids, memoryview) and token_ids.format in ("Q", "I") and token_ids.c_contiguous:
        # packed ids (the HTTP API's JSON parser, the gRPC wire): read in place, like an array
        return cast("array[int]", token_ids)
    if isinstance(token_ids, str | bytes | bytearray):
        raise ValueError("token ids must be a sequence of integers")
    try:
        return array("Q", token_ids)
    except OverflowError:
        raise ValueError("token ids must be integers in 0..2**64-1") from None
    except TypeError:
        raise ValueError("token ids must be integers") from None


def _chain(
    algo: HashAlgo,
    none_hash: bytes,
    parent: bytes | None,
    arr: array[int],
    block_size: int,
    extras: Sequence[tuple[Any, ...] | None],
    fast: bool = True,
) -> list[BlockDigest]:
    """Hash ``len(extras)`` full blocks of the tokens chained from ``parent`` (None: NONE_HASH): natively
    where native code runs and covers the chain, else (and always when not ``fast``) by the reference."""
    prev: bytes = parent or none_hash
    if not extras:
        return []
    if fast and native is not None:
        digests = _chain_native(algo, prev, arr, block_size, extras)
        if digests is not None:
            return cast(list[BlockDigest], digests)  # BlockDigest is bytes at runtime
    return _chain_reference(algo, prev, arr, block_size, extras)


_PICKLE_C_MAX_BLOCK = 4096
"""Largest block the C pickler writes (a larger one's pickle could span several pickle frames)."""


def _chain_keys(
    algo: HashAlgo,
    none_hash: bytes,
    arr: array[int],
    block_size: int,
    extras: Sequence[tuple[Any, ...] | None],
) -> list[BlockHash64]:
    """The uint64 keys of ``len(extras)`` full blocks from the root: from the C chain's packed keys where it
    runs (no digest objects at all), else each digest reduced by :func:`to_block_hash64`."""
    if extras and native is not None:
        keys = _chain_native(algo, none_hash, arr, block_size, extras, keys_only=True)
        if keys is not None:
            return cast(list[BlockHash64], memoryview(keys).cast("Q").tolist())
    return [to_block_hash64(d) for d in _chain(algo, none_hash, None, arr, block_size, extras)]


def _chain_native(
    algo: HashAlgo,
    prev: bytes,
    arr: array[int],
    block_size: int,
    extras: Sequence[tuple[Any, ...] | None],
    *,
    keys_only: bool = False,
) -> Any:
    """The chain in C, hashed by the reference's own ``hashlib``/``xxhash`` functions; None where only
    the reference applies (pickle chains with extra keys, blocks past 4096 tokens, parents of 256+ bytes:
    pickle's memo makes the identity of extra-key objects part of the input, so those are not rewritten).

    CBOR is compositional, so a block's message is the array head, the parent, the tokens and the extra
    keys' own canonical CBOR (``cbor2.dumps`` of them: the definition). Equal extra keys of consecutive
    blocks share one encoding: they hold only str, int and bytes (:class:`RequestKeys` checks), whose
    equal values encode alike.
    """
    assert native is not None
    count = len(extras)
    sha = algo.startswith("sha256")
    # The digest in C where this build has it (no Python call per block), else the reference's own.
    code = _c_digest(algo, prev)
    ctor: Callable[[bytes], object] | int = code if code is not None else (
        hashlib.sha256 if sha else _xxhash.xxh3_128_digest)
    if algo.endswith("_cbor"):
        tails: bytes | list[bytes] = b"\xf6"  # CBOR null: no extra keys in any block
        if extras.count(None) != count:
            tails = []
            last: tuple[Any, ...] | None = None
            last_tail = b"\xf6"
            for e in extras:
                if e is not last and e != last:
                    last, last_tail = e, cbor2.dumps(e, canonical=True)
                tails.append(last_tail)
        return native.cbor_chain(ctor, sha, prev, arr, block_size, count, tails, keys_only)
    if block_size <= _PICKLE_C_MAX_BLOCK and len(prev) < 256 and extras.count(None) == count:
        return native.pickle_chain(ctor, sha, prev, arr, block_size, count, keys_only)
    return None


def _c_digest(algo: HashAlgo, prev: bytes) -> int | None:
    """The C digest code the native chain hashes ``algo`` with from ``prev``; None where this build has
    none (then it calls the reference's own digest per block)."""
    if native is None or len(prev) >= 256:
        return None
    return native.C_DIGESTS.get("sha256" if algo.startswith("sha256") else "xxh3_128")


def native_keys_plan(profile: HashProfile) -> tuple[str, int, bytes, int] | None:
    """``(kind, digest code, NONE_HASH, block_size)``: how :func:`block_hashes64` runs for a request
    without extra keys when it runs wholly in C (``native.cbor_chain`` or ``pickle_chain`` with a C
    digest, those arguments, ``keys_only``); None where it would not. The HTTP API's native answers hash
    with exactly this call, so their keys are this function's."""
    if profile.algo == SGLANG:
        return None  # the Python call (block_hashes64, natively chained) answers SGLang models
    prev = profile.none_hash()
    code = _c_digest(profile.algo, prev)
    if code is None:
        return None
    if profile.algo.endswith("_cbor"):
        return "cbor", code, prev, profile.block_size
    if profile.block_size <= _PICKLE_C_MAX_BLOCK:
        return "pickle", code, prev, profile.block_size
    return None


def _chain_reference(
    algo: HashAlgo,
    prev: bytes,
    arr: array[int],
    block_size: int,
    extras: Sequence[tuple[Any, ...] | None],
) -> list[BlockDigest]:
    """The straightforward chain, vLLM's own: its tuple, serialised by cbor2/pickle, then hashed."""
    fn = HASH_FUNCTIONS[algo]
    tokens = arr[: len(extras) * block_size].tolist()  # plain ints, created once
    out: list[bytes] = []
    for i, extra in enumerate(extras):
        block = tuple(tokens[i * block_size : (i + 1) * block_size])
        prev = fn((prev, block, extra))
        out.append(prev)
    return cast(list[BlockDigest], out)  # BlockDigest is bytes at runtime


def _sglang_seeds(profile: HashProfile, keys: RequestKeys | None) -> tuple[bytes, bytes]:
    """A request's ``(parent, namespace)`` in SGLang's chain (:func:`kvcoord.sglang_hash.request_seeds`)."""
    if keys is None:
        return b"", b""
    if keys.mm_items or keys.prompt_embeds_digests is not None:
        raise ValueError("the sglang profile hashes token ids only: no multimodal items or prompt embeds")
    dynamo = profile.style == "dynamo"
    return sglang_hash.request_seeds(dynamo, keys.cache_salt, keys.lora_name, keys.lora_path)


# --- public hashing API -------------------------------------------------------------------------
def hash_block_tokens(
    profile: HashProfile,
    parent: bytes | None,
    token_ids: Iterable[int],
    extra_keys: tuple[Any, ...] | None = None,
    *,
    fast: bool = True,
) -> BlockDigest:
    """One block's digest: ``H((parent or NONE_HASH, tuple(token_ids), extra_keys or None))``.

    ``parent`` is the previous block's raw digest (never its uint64 form). An empty
    ``extra_keys`` is hashed as None, as vLLM's key generator returns it. ``fast=False`` computes it
    with the pure-Python reference even where native code runs (the tests' oracle).
    """
    arr = _as_tokens(token_ids)
    if parent is not None and type(parent) is not bytes:
        parent = bytes(parent)
    if profile.algo == SGLANG:
        if extra_keys:
            raise ValueError("sglang pages have no extra keys (a request's keys seed its chain)")
        if parent is not None and len(parent) != 32:
            raise ValueError("an sglang parent is a 32-byte SHA-256 digest")
        return BlockDigest(sglang_hash.chain(parent or b"", arr, len(arr), 1, fast)[0])
    extras = [extra_keys or None]
    return _chain(profile.algo, profile.none_hash(), parent, arr, len(arr), extras, fast)[0]


def hash_request_tokens(
    profile: HashProfile,
    token_ids: Iterable[int],
    keys: RequestKeys | None = None,
    *,
    fast: bool = True,
) -> list[BlockDigest]:
    """Digests of every *full* block of a request, as vLLM hashes a prompt in one call (``fast=False``:
    by the pure-Python reference even where native code runs)."""
    arr = _as_tokens(token_ids)
    count = len(arr) // profile.block_size
    if profile.algo == SGLANG:  # chain digests: a namespace (LoRA) applies to the published keys only
        digests = sglang_hash.chain(_sglang_seeds(profile, keys)[0], arr, profile.block_size, count, fast)
        return cast(list[BlockDigest], digests)
    extras = extra_keys_range(keys, profile.style, profile.block_size, 0, count, 0)
    return _chain(profile.algo, profile.none_hash(), None, arr, profile.block_size, extras, fast)


def block_hashes64(
    profile: HashProfile, token_ids: Iterable[int], keys: RequestKeys | None = None, *, fast: bool = True
) -> list[BlockHash64]:
    """The uint64 keys (vLLM's int ``ExternalBlockHash``; SGLang's published int64 & (2**64-1)) of a
    request's full blocks (a lookup's hot path: natively, no digest is ever a Python object)."""
    arr = _as_tokens(token_ids)
    count = len(arr) // profile.block_size
    if profile.algo == SGLANG:
        parent, namespace = _sglang_seeds(profile, keys)
        keys64 = sglang_hash.keys(parent, namespace, arr, profile.block_size, count, fast)
        return cast(list[BlockHash64], keys64)
    extras = extra_keys_range(keys, profile.style, profile.block_size, 0, count, 0)
    return _chain_keys(profile.algo, profile.none_hash(), arr, profile.block_size, extras)


def coarsen(hashes: Sequence[T], factor: int) -> list[T]:
    """The hashes of blocks ``factor`` times larger: each is the hash of its last sub-block.

    Valid because hashes chain over the whole prefix, so the last sub-block's hash already
    identifies everything up to the coarse block's end (vLLM's ``BlockHashListWithBlockSize``).
    """
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 1:
        raise ValueError(f"coarsening factor must be a positive integer, not {factor!r}")
    return list(hashes[factor - 1 :: factor])


class RequestBlockHasher:
    """Incremental hashing of one request: append tokens, get the digests of new full blocks.

    Mirrors vLLM's ``get_request_block_hasher``: each ``append`` is one hashing call, and a call
    that starts after the first block walks multimodal items from the last one, as vLLM does.
    """

    __slots__ = ("_digests", "_keys", "_none", "_pending", "_profile")

    def __init__(self, profile: HashProfile, keys: RequestKeys | None = None) -> None:
        self._profile = profile
        self._keys = keys
        if profile.algo == SGLANG:
            raise ValueError("the request hasher is vLLM's: hash SGLang requests with hash_request_tokens")
        extra_keys_range(keys, profile.style, profile.block_size, 0, 0, 0)  # fail early on bad keys
        self._none = profile.none_hash()
        self._pending: array[int] = array("Q")
        self._digests: list[BlockDigest] = []

    @property
    def digests(self) -> tuple[BlockDigest, ...]:
        """All full-block digests so far."""
        return tuple(self._digests)

    @property
    def num_tokens(self) -> int:
        """Tokens appended so far, including the partial last block."""
        return len(self._digests) * self._profile.block_size + len(self._pending)

    def append(self, token_ids: Iterable[int]) -> list[BlockDigest]:
        """Add tokens; return the digests of the blocks they complete (validated before any change)."""
        tokens = _as_tokens(token_ids)
        bs = self._profile.block_size
        pending = self._pending + tokens
        count = len(pending) // bs
        if count == 0:
            self._pending = pending
            return []
        first = len(self._digests)
        extras = extra_keys_range(self._keys, self._profile.style, bs, first, count, 0 if first == 0 else -1)
        parent = self._digests[-1] if self._digests else None
        new = _chain(self._profile.algo, self._none, parent, pending, bs, extras)
        self._digests.extend(new)
        self._pending = pending[count * bs :]
        return new


__all__ = [
    "DEFAULT_NONE_HASH_SEED",
    "EXTERNAL_FORMS",
    "EXTRA_KEY_STYLES",
    "HASH_ALGOS",
    "PROFILE_ALGOS",
    "SGLANG",
    "UINT64_MASK",
    "BlockDigest",
    "BlockHash64",
    "ExternalForm",
    "HashAlgo",
    "HashProfile",
    "RequestBlockHasher",
    "block_hashes64",
    "check_algo",
    "coarsen",
    "get_hash_fn",
    "hash_block_tokens",
    "hash_request_tokens",
    "native_keys_plan",
    "parse_release",
    "to_block_hash64",
]
