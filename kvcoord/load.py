"""A node's load: one type from the engine's metrics through the agent, the coordinator and the client
to the placement policy, named as vLLM's metrics and the wire name its fields. Also the names of a
node's trust, which travels the same way from the coordinator to the policies."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["APPROXIMATE", "DEGRADED", "EXACT", "HASH_MISMATCH", "HISTORY_LOST", "RESYNCING", "TRUSTS",
           "TRUST_CAUSES", "NodeLoad"]

EXACT = "exact"
RESYNCING = "resyncing"
DEGRADED = "degraded"
APPROXIMATE = "approximate"
TRUSTS = (EXACT, RESYNCING, DEGRADED, APPROXIMATE)
"""A node's trust (the wire's ``trust``): how far lookups vouch for its entries. The coordinator
computes it (``kvcoord.coordinator.registry.trust_state``), the placement policies weigh it.
``approximate``: a node whose engine publishes no KV events (``kvcoord agent --no-kv-events``)."""

HASH_MISMATCH = "hash_mismatch"
HISTORY_LOST = "history_lost"
TRUST_CAUSES = (HASH_MISMATCH, HISTORY_LOST)
"""Why a node is ``degraded`` (the wire's ``trust_cause``; empty for any other trust): its hashes failed
verification, so its entries may be wrong, or its relay lost batches, so entries are missing but every
one the index holds is real. A policy weighs the two differently."""


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What is known of one node's current work."""

    running_requests: int = 0
    """Requests admitted, prefilling or decoding (vLLM's ``vllm:num_requests_running``)."""
    waiting_requests: int = 0
    """Requests queued on the node, not yet admitted (``vllm:num_requests_waiting``)."""
    kv_usage: float = 0.0
    """Fraction of the node's KV blocks in use, 0..1 (``vllm:kv_cache_usage_perc``)."""
    prefill_tokens: int = 0
    """Prompt tokens the node still has to prefill before a new request's prefill can start: a router's
    (or the simulator's) own estimate; 0 when unknown."""

    @property
    def in_flight(self) -> int:
        return self.running_requests + self.waiting_requests

    def to_json(self) -> dict[str, int | float]:
        return {"running_requests": self.running_requests, "waiting_requests": self.waiting_requests,
                "kv_usage": self.kv_usage}
