"""Disaggregated prefill and decode: the pools and the rule that decides whether a request needs a
remote prefill, one for ``kvcoord route`` (:mod:`kvcoord.gateway.route_pd`), ``kvcoord epp`` and
``kvcoord simulate``.

The pools are the flags' (``--prefill-node``/``--decode-node``) when given, else the roles the nodes
declared (their agents' ``--role``, ``/register``'s ``role``), as llm-d's ``llm-d.ai/role`` label reads:
a ``prefill`` node is in the prefill pool; every other node of the model (``decode``, ``both``, none
declared) is in the decode pool, as llm-d's decode filter keeps pods without the label. A model without
a ``prefill`` node, or with only ``prefill`` nodes, is served one engine per request.

The rule is Dynamo's conditional disaggregation (``DisaggregatedRouter::prefill_remote``): a remote
prefill iff the prompt tokens the decode node lacks exceed ``max_local_prefill_length`` (default 1000);
llm-d's prefix-based P/D decider (``pdThreshold`` on the uncached tokens) is the same rule.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvcoord.roles import PREFILL

__all__ = ["DEFAULT_MAX_LOCAL_PREFILL", "PREFILLER_HEADER", "PdConfig", "pools_of", "prefill_remote"]

DEFAULT_MAX_LOCAL_PREFILL = 1000
"""Dynamo's ``max_local_prefill_length`` default (tokens)."""

PREFILLER_HEADER = "x-prefiller-host-port"
"""llm-d's request header naming the prefill endpoint (``ip:port``) for the decode pod's P/D sidecar."""


@dataclass(frozen=True, slots=True)
class PdConfig:
    """The two pools (node ids) and the conditional-disaggregation threshold. Empty pools: none given by
    flags, the nodes' roles decide (:func:`pools_of`)."""

    prefill: frozenset[str] = frozenset()
    decode: frozenset[str] = frozenset()
    max_local_prefill_tokens: int = DEFAULT_MAX_LOCAL_PREFILL

    @property
    def declared(self) -> bool:
        """Pools given by flags: they win over the nodes' roles."""
        return bool(self.prefill or self.decode)


def pools_of(config: PdConfig, roles: Iterable[tuple[str, str]]) -> PdConfig | None:
    """The pools of one model's requests: ``config``'s when declared, else from ``roles`` ((node id, role)
    of the model's nodes): ``prefill`` nodes prefill, all others decode. None: one engine per request
    (no ``prefill`` node, or nothing else)."""
    if config.declared:
        return config
    prefill: set[str] = set()
    decode: set[str] = set()
    for node_id, role in roles:
        (prefill if role == PREFILL else decode).add(node_id)
    if not prefill or not decode:
        return None
    return PdConfig(frozenset(prefill), frozenset(decode), config.max_local_prefill_tokens)


def prefill_remote(config: PdConfig, uncached_tokens: int, prefix_aware: bool) -> bool:
    """Whether a prefill node should prefill for the decode node that lacks ``uncached_tokens`` of the
    prompt. Without the index (``prefix_aware`` False) the hit is unknown: always, as vLLM's proxy does."""
    return not prefix_aware or uncached_tokens > config.max_local_prefill_tokens
