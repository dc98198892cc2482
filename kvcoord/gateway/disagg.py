"""Disaggregated prefill and decode: the pools and the rule that decides whether a request needs a
remote prefill, one for ``kvcoord route`` (:mod:`kvcoord.gateway.route_pd`) and ``kvcoord epp``.

The rule is Dynamo's conditional disaggregation (``DisaggregatedRouter::prefill_remote``): a remote
prefill iff the prompt tokens the decode node lacks exceed ``max_local_prefill_length`` (default 1000);
llm-d's prefix-based P/D decider (``pdThreshold`` on the uncached tokens) is the same rule.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DEFAULT_MAX_LOCAL_PREFILL", "PREFILLER_HEADER", "PdConfig", "prefill_remote"]

DEFAULT_MAX_LOCAL_PREFILL = 1000
"""Dynamo's ``max_local_prefill_length`` default (tokens)."""

PREFILLER_HEADER = "x-prefiller-host-port"
"""llm-d's request header naming the prefill endpoint (``ip:port``) for the decode pod's P/D sidecar."""


@dataclass(frozen=True, slots=True)
class PdConfig:
    """The two pools (node ids) and the conditional-disaggregation threshold."""

    prefill: frozenset[str]
    decode: frozenset[str]
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL


def prefill_remote(config: PdConfig, uncached_tokens: int, prefix_aware: bool) -> bool:
    """Whether a prefill node should prefill for the decode node that lacks ``uncached_tokens`` of the
    prompt. Without the index (``prefix_aware`` False) the hit is unknown: always, as vLLM's proxy does."""
    return not prefix_aware or uncached_tokens > config.max_local_prefill_tokens
