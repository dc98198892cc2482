"""Disaggregated prefill and decode in ``kvcoord simulate`` (``--prefill-nodes``).

The first N nodes form the prefill pool, the others the decode pool. Each request is placed as ``kvcoord
route`` places it (:mod:`kvcoord.gateway.route_pd`): the policy picks the decode node among the decode
pool; :func:`kvcoord.gateway.disagg.prefill_remote` (Dynamo's conditional disaggregation) decides whether
a prefill node prefills first, and the policy picks that node among the prefill pool.

Costs (:mod:`kvcoord.sim.cluster` runs them): a remote prefill runs on the prefill node's prefill lane
like any request's (its cached blocks are hits); when it ends, the decode node gets the request and
pulls the prompt's blocks it lacks at ``transfer_s`` per block (NIXL's read), then computes the rest
(the last, partial block) and decodes. TTFT counts all of it from the request's arrival. A decode-only
request is an ordinary one on the decode node.

What a policy knows of the decode node's prefix decides the threshold: the index (prefix-aware) or its
own routing memory (approximate, as Dynamo's approximate mode feeds its overlap to the same rule).
Policies that know no prefix (least-loaded, round-robin, random) always prefill remotely, as vLLM's
proxy does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcoord.gateway.disagg import DEFAULT_MAX_LOCAL_PREFILL, PdConfig, prefill_remote
from kvcoord.gateway.route_metrics import predicted_tokens
from kvcoord.router.answer import Candidate
from kvcoord.router.placement import Decision, RouteRequest
from kvcoord.router.policy import Policy

__all__ = ["PdSimConfig", "place", "pools"]

KNOWS_PREFIX = frozenset({"prefix-aware", "approximate"})
"""Policies whose decisions carry a prefix estimate (``Decision.matched_blocks``)."""


@dataclass(frozen=True, slots=True)
class PdSimConfig:
    """``kvcoord simulate --prefill-nodes`` and friends."""

    prefill_nodes: int = 0
    """The first N nodes prefill, the others decode (0: no disaggregation)."""
    transfer_s: float = 100e-6
    """Seconds to move one block from the prefill node to the decode node (2 MiB over ~20 GB/s RDMA)."""
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL

    def __post_init__(self) -> None:
        if self.prefill_nodes < 0 or self.transfer_s < 0 or self.max_local_prefill_tokens < 0:
            raise ValueError("P/D sizes and costs must be >= 0")

    @property
    def active(self) -> bool:
        return self.prefill_nodes > 0


def pools(config: PdSimConfig, node_ids: Sequence[str]) -> PdConfig | None:
    """The two pools over ``node_ids`` (None: not disaggregated); ValueError when a pool would be empty."""
    if not config.active:
        return None
    if config.prefill_nodes >= len(node_ids):
        raise ValueError(f"--prefill-nodes {config.prefill_nodes} leaves no decode node of "
                         f"{len(node_ids)} (--nodes)")
    k = config.prefill_nodes
    return PdConfig(frozenset(node_ids[:k]), frozenset(node_ids[k:]), config.max_local_prefill_tokens)


def place(pd: PdConfig, policy: Policy, request: RouteRequest,
          candidates: Sequence[Candidate]) -> tuple[Decision, Decision | None]:
    """The decode pick, and the prefill pick when a remote prefill is due (None: the decode node
    prefills alone)."""
    decode = policy.choose(request, [c for c in candidates if c.node_id in pd.decode])
    n = request.num_tokens
    uncached = n - predicted_tokens(decode.matched_blocks, request.block_size, n)
    if not prefill_remote(pd, uncached, policy.name in KNOWS_PREFIX):
        return decode, None
    return decode, policy.choose(request, [c for c in candidates if c.node_id in pd.prefill])
