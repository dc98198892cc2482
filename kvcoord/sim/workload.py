"""Workloads for the simulator: Mooncake traces and a synthetic shared-prefix generator.

Both produce :class:`SimRequest` objects carrying real token ids and the real block hashes of a
:class:`~kvcoord.hashing.HashProfile`, so the simulated pools, the index and the router all work
on exactly what an engine would hash.

Mooncake traces give, per request, ``hash_ids``: ids of 512-token blocks where equal ids mean an
equal prefix. Each id is expanded into 512 deterministic token ids (the same id always gives the
same tokens, different ids different ones), i.e. 32 blocks of 16 tokens at block size 16; the last
id of a request may be cut short, because ``input_length`` is exact.
"""

from __future__ import annotations

import json
import math
import random
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from kvcoord.hashing import (
    BlockDigest,
    BlockHash64,
    HashProfile,
    RequestBlockHasher,
    hash_request_tokens,
    to_block_hash64,
)

TRACE_BLOCK_TOKENS = 512
"""Tokens per Mooncake ``hash_id``."""

VOCAB = 1 << 17
"""Token ids are drawn below this (the size of a Llama-3-class vocabulary)."""

_MIX = 0x9E3779B97F4A7C15
_MASK64 = (1 << 64) - 1


class SimRequest:
    """One request of a workload: when it arrives, its prompt (tokens and block hashes), its output."""

    __slots__ = ("arrival", "digests", "hashes", "num_tokens", "output_tokens", "request_id", "tokens")

    def __init__(
        self,
        request_id: str,
        arrival: float,
        tokens: Sequence[int],
        output_tokens: int,
        digests: Sequence[BlockDigest],
        hashes: Sequence[BlockHash64],
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival
        self.tokens = tokens
        self.num_tokens = len(tokens)
        self.output_tokens = output_tokens
        self.digests = digests
        self.hashes = hashes


@dataclass(frozen=True, slots=True)
class Workload:
    """A named list of requests, sorted by arrival."""

    name: str
    requests: list[SimRequest]
    block_size: int

    @property
    def duration(self) -> float:
        return self.requests[-1].arrival - self.requests[0].arrival if self.requests else 0.0


class _TokenBook:
    """The deterministic 512 tokens of each trace hash id, built once and shared by all requests."""

    __slots__ = ("_tokens",)

    def __init__(self) -> None:
        self._tokens: dict[int, array[int]] = {}

    def tokens(self, hash_id: int) -> array[int]:
        got = self._tokens.get(hash_id)
        if got is None:
            base = hash_id * TRACE_BLOCK_TOKENS
            got = array(
                "l", [(((base + k) * _MIX) & _MASK64) >> 47 for k in range(TRACE_BLOCK_TOKENS)]
            )
            self._tokens[hash_id] = got
        return got


class TraceTokens(Sequence[int]):
    """A request's prompt tokens, materialised from its hash ids only when read (slices are cheap)."""

    __slots__ = ("_book", "_ids", "_n")

    def __init__(self, book: _TokenBook, hash_ids: Sequence[int], num_tokens: int) -> None:
        self._book = book
        self._ids = tuple(hash_ids)
        self._n = num_tokens

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step != 1:
                return [self[i] for i in range(start, stop, step)]
            out: list[int] = []
            pos = start
            while pos < stop:
                i, k = divmod(pos, TRACE_BLOCK_TOKENS)
                take = min(stop - pos, TRACE_BLOCK_TOKENS - k)
                out.extend(self._book.tokens(self._ids[i])[k : k + take])
                pos += take
            return out
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError(index)
        i, k = divmod(index, TRACE_BLOCK_TOKENS)
        return self._book.tokens(self._ids[i])[k]

    def __iter__(self) -> Iterator[int]:
        return iter(self[0 : self._n])


def load_mooncake(
    path: str | Path,
    profile: HashProfile,
    *,
    limit: int | None = None,
    time_scale: float = 1.0,
) -> Workload:
    """Read a Mooncake JSONL trace: the first ``limit`` requests, arrivals multiplied by ``time_scale``.

    Raises ``ValueError`` naming the line for malformed records, and when 512 is not a multiple of
    the profile's block size (a hash id must expand into whole blocks).
    """
    bs = profile.block_size
    if TRACE_BLOCK_TOKENS % bs:
        raise ValueError(f"block size {bs} does not divide the trace's {TRACE_BLOCK_TOKENS}-token blocks")
    if time_scale <= 0:
        raise ValueError("time scale must be > 0")
    if limit is not None and limit < 1:
        raise ValueError("limit must be >= 1")
    per_id = TRACE_BLOCK_TOKENS // bs
    book = _TokenBook()
    digests_of: dict[int, tuple[BlockDigest, ...]] = {}
    h64_of: dict[int, tuple[BlockHash64, ...]] = {}
    requests: list[SimRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                ts = float(rec["timestamp"])
                n = int(rec["input_length"])
                out = int(rec["output_length"])
                ids = [int(x) for x in rec["hash_ids"]]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a Mooncake record ({exc})") from None
            if n < 1 or out < 0 or not ids or not (len(ids) - 1) * TRACE_BLOCK_TOKENS < n <= len(ids) * 512:
                raise ValueError(f"{path}:{lineno}: input_length {n} does not fit {len(ids)} hash ids")
            if any(hid not in digests_of for hid in ids):
                # New ids only ever extend a known prefix (an id always has the same parent), so one
                # chained pass over the whole request (every id in full) hashes them all.
                tokens: list[int] = []
                for hid in ids:
                    tokens.extend(book.tokens(hid))
                chain = hash_request_tokens(profile, tokens)
                for i, hid in enumerate(ids):
                    if hid not in digests_of:
                        got = tuple(chain[i * per_id : (i + 1) * per_id])
                        digests_of[hid] = got
                        h64_of[hid] = tuple(to_block_hash64(d) for d in got)
            full = n // bs
            digests = [d for hid in ids for d in digests_of[hid]][:full]
            hashes = [h for hid in ids for h in h64_of[hid]][:full]
            requests.append(
                SimRequest(f"r{len(requests)}", ts / 1000.0 * time_scale, TraceTokens(book, ids, n), out,
                           digests, hashes)
            )
    if not requests:
        raise ValueError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival)
    t0 = requests[0].arrival
    for r in requests:
        r.arrival -= t0
    return Workload(Path(path).stem, requests, bs)


@dataclass(frozen=True, slots=True)
class SyntheticSpec:
    """Parameters of the synthetic shared-prefix workload.

    ``groups`` system prompts (e.g. apps or tenants), each with ``prompts_per_group`` conversations;
    a request picks a group by Zipf popularity (exponent ``zipf``) and a conversation uniformly. The
    first turn is the system prompt plus a question; each later turn appends the previous answer and a
    new question, up to ``turns`` turns, after which the conversation starts over. Arrivals are
    Poisson at ``rate`` requests per second.
    """

    requests: int = 2000
    groups: int = 16
    prompts_per_group: int = 32
    system_tokens: int = 2048
    question_tokens: int = 128
    output_tokens: int = 256
    turns: int = 4
    zipf: float = 1.1
    rate: float = 10.0

    def __post_init__(self) -> None:
        for name in ("requests", "groups", "prompts_per_group", "turns"):
            if getattr(self, name) < 1:
                raise ValueError(f"synthetic {name} must be >= 1")
        for name in ("system_tokens", "question_tokens", "output_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"synthetic {name} must be >= 0")
        if self.system_tokens + self.question_tokens < 1:
            raise ValueError("synthetic prompts need at least one token")
        if self.zipf < 0 or self.rate <= 0:
            raise ValueError("synthetic zipf must be >= 0 and rate > 0")


class _Conversation:
    __slots__ = ("hasher", "tokens", "turn")

    def __init__(self, profile: HashProfile, system: list[int]) -> None:
        self.tokens: list[int] = list(system)
        self.hasher = RequestBlockHasher(profile)
        self.hasher.append(list(system))
        self.turn = 0


def synthetic(spec: SyntheticSpec, profile: HashProfile, seed: int = 0) -> Workload:
    """Generate ``spec.requests`` requests deterministically from ``seed``."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(spec.system_tokens)] for _ in range(spec.groups)]
    weights = [1.0 / math.pow(g + 1, spec.zipf) for g in range(spec.groups)]
    cum: list[float] = []
    acc = 0.0
    for w in weights:
        acc += w
        cum.append(acc)
    convs: dict[tuple[int, int], _Conversation] = {}
    requests: list[SimRequest] = []
    t = 0.0
    for i in range(spec.requests):
        t += rng.expovariate(spec.rate)
        g = rng.choices(range(spec.groups), cum_weights=cum)[0]
        p = rng.randrange(spec.prompts_per_group)
        conv = convs.get((g, p))
        if conv is None or conv.turn >= spec.turns:
            conv = _Conversation(profile, systems[g])
            convs[(g, p)] = conv
        question = [rng.randrange(VOCAB) for _ in range(spec.question_tokens)]
        conv.tokens.extend(question)
        conv.hasher.append(question)
        prompt = list(conv.tokens)
        digests = list(conv.hasher.digests)
        requests.append(
            SimRequest(f"s{i}", t, prompt, spec.output_tokens, digests, [to_block_hash64(d) for d in digests])
        )
        answer = [rng.randrange(VOCAB) for _ in range(spec.output_tokens)]
        conv.tokens.extend(answer)
        conv.hasher.append(answer)
        conv.turn += 1
    return Workload("synthetic", requests, profile.block_size)
