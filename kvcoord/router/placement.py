"""What a placement takes and gives, and the service-time model the cost-based policies
(:mod:`kvcoord.router.policy`) and the simulator share: the request being placed, the decision, and
:class:`LatencyModel` (one H100 serving an 8B model by default)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey
from kvcoord.load import NodeLoad
from kvcoord.router.answer import Candidate

DEFAULT_WORK_WEIGHT = 12.0
"""How many times a placement's cost counts the prefill it causes (the prefix-aware policy's ``k``)."""
DEFAULT_CACHE_THRESHOLD = 0.1
"""The share of a prompt some node must hold for ``work_weight`` to apply (the prefix-aware policy)."""


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """The request being placed."""

    num_tokens: int
    block_size: int
    block_hashes: Sequence[BlockHash64] = ()
    """Full-block hashes of the prompt (needed by :class:`~kvcoord.router.policy.ApproximatePolicy`)."""
    now: float = 0.0
    """Router clock in seconds (simulation time in the simulator); drives TTLs."""
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where to send a request, and why."""

    node_id: str
    dp_rank: int
    why: str
    matched_blocks: int = 0
    cost: float | None = None
    """The policy's cost for the chosen node (seconds for the prefix-aware policies)."""
    pull: str = ""
    """Where the chosen engine should pull a longer prefix from (``host:port``, llm-d's
    ``x-kv-cache-source-host-port``): set when the pull costs less than the prefill it saves."""
    pull_blocks: int = 0
    """Blocks the pull brings beyond what the chosen node holds."""

    @property
    def key(self) -> NodeKey:
        return (self.node_id, self.dp_rank)


@dataclass(frozen=True, slots=True)
class LatencyModel:
    """The service-time estimate a cost-based policy uses, and the simulator's default hardware.

    Defaults describe one H100-80GB serving a dense ~8B model (Llama-3.1-8B, bf16) with vLLM:

    - ``prefill_s_per_token`` 50 µs: about 20k prompt tokens/s of prefill; 16 GFLOP/token of dense
      matmuls plus attention at ~12k context is ~19 GFLOP/token, at ~40% of the 989 TFLOP/s bf16
      peak that is ~21k tokens/s, in line with published vLLM prefill throughput for 8B on H100.
    - ``decode_s_per_token`` 15 ms: inter-token latency of a batch of a few dozen long-context
      sequences (weights 16 GB plus ~0.1 MB of KV per context token read every step, at 3.35 TB/s).
    - ``max_running`` 32: ~400k tokens of KV fit next to the weights (128 KiB/token), i.e. about 32
      requests of Mooncake's ~12k-token prompts.
    """

    prefill_s_per_token: float = 50e-6
    decode_s_per_token: float = 15e-3
    max_running: int = 32
    mean_output_tokens: float = 350.0
    """Expected decode length of a running request, for the wait-for-a-slot estimate."""
    pull_s_per_block: float | None = None
    """Seconds to pull one block from a peer (transfer, not prefill); None: no peer-pull hints."""
    work_weight: float = DEFAULT_WORK_WEIGHT
    """The policy's (the simulator's clock ignores it): times it counts a request's prefill (its ``k``)."""
    cache_threshold: float = DEFAULT_CACHE_THRESHOLD
    """The policy's: below this share of the prompt held anywhere, a miss (its prefill counted once)."""

    @classmethod
    def from_flags(cls, *, prefill_us_per_token: float, decode_ms_per_token: float, max_running: int,
                   mean_output_tokens: float, pull_us_per_block: float | None = None,
                   work_weight: float = DEFAULT_WORK_WEIGHT,
                   cache_threshold: float = DEFAULT_CACHE_THRESHOLD) -> LatencyModel:
        """From the units the command-line flags use (µs and ms), as ``simulate``, ``route`` and ``epp``
        take them."""
        return cls(prefill_s_per_token=prefill_us_per_token / 1e6,
                   decode_s_per_token=decode_ms_per_token / 1e3, max_running=max_running,
                   mean_output_tokens=mean_output_tokens,
                   pull_s_per_block=None if pull_us_per_block is None else pull_us_per_block / 1e6,
                   work_weight=work_weight, cache_threshold=cache_threshold)

    def flags(self) -> dict[str, float]:
        """The model in the flags' units (the inverse of :meth:`from_flags`)."""
        out = {"max_running": self.max_running, "prefill_us_per_token": self.prefill_s_per_token * 1e6,
               "decode_ms_per_token": self.decode_s_per_token * 1e3,
               "mean_output_tokens": self.mean_output_tokens, "work_weight": self.work_weight,
               "cache_threshold": self.cache_threshold}
        if self.pull_s_per_block is not None:
            out["pull_us_per_block"] = self.pull_s_per_block * 1e6
        return out

    def pull(self, request: RouteRequest, c: Candidate) -> tuple[str, int]:
        """``(host:port, blocks)`` of the peer pull worth doing for ``c``: the blocks its hint brings past
        what ``c`` holds, when pulling them costs less than prefilling them; ``("", 0)`` otherwise."""
        hint = c.pull
        if hint is None or self.pull_s_per_block is None:
            return "", 0
        extra = min(hint.blocks, request.num_tokens // request.block_size) - c.matched_blocks
        prefill = request.block_size * self.prefill_s_per_token
        if extra <= 0 or self.pull_s_per_block >= prefill:
            return "", 0
        return hint.host_port, extra

    def __post_init__(self) -> None:
        if self.prefill_s_per_token < 0 or self.decode_s_per_token < 0:
            raise ValueError("latency model times must be >= 0")
        if self.max_running < 1:
            raise ValueError("max_running must be >= 1")
        if self.mean_output_tokens < 0:
            raise ValueError("mean_output_tokens must be >= 0")
        if self.pull_s_per_block is not None and self.pull_s_per_block < 0:
            raise ValueError("pull_s_per_block must be >= 0")
        if self.work_weight < 1.0:
            raise ValueError("work_weight must be >= 1")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("cache_threshold must be in [0, 1]")

    def queue_seconds(self, load: NodeLoad) -> float:
        """Expected wait before a new request's prefill can start on a node with ``load``.

        ``t_p * prefill_tokens`` for the prefill work ahead of it, plus, when every slot is taken, the
        time for enough running requests to finish: slots free up about every
        ``mean_output_tokens * t_d / max_running`` seconds.
        """
        over = load.in_flight + 1 - self.max_running
        slot_wait = (
            over * self.mean_output_tokens * self.decode_s_per_token / self.max_running if over > 0 else 0.0
        )
        return self.prefill_s_per_token * load.prefill_tokens + slot_wait
