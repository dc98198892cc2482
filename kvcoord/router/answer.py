"""The lookup answer: what the client returns and what the placement policies take, one type for both.

``place(client.lookup(model, tokens=..., include_unmatched=True))`` works because the client builds these
from the wire and the policies read nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvcoord.events import Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey
from kvcoord.load import EXACT, NodeLoad

__all__ = ["KV_SOURCE_HEADER", "TIER_NAMES", "Candidate", "LookupResult", "PullSource"]

KV_SOURCE_HEADER = "x-kv-cache-source-host-port"
"""llm-d's request header naming the ``host:port`` the chosen engine pulls cached blocks from
(llm-d-inference-scheduler ``pkg/common``: ``KVCacheSourceHeader``), as ``route`` and ``epp`` set it."""

TIER_NAMES: tuple[str, ...] = tuple(t.name for t in Tier)
"""``("GPU", "CPU", "STORAGE")``: the keys of ``tiers`` in JSON answers."""


@dataclass(frozen=True, slots=True)
class PullSource:
    """A live peer holding a longer prefix than the candidate (the coordinator's peer-pull hint)."""

    node_id: str
    host_port: str
    """llm-d's ``x-kv-cache-source-host-port`` value: where the chosen engine can pull the blocks from."""
    tier: str
    blocks: int

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "host_port": self.host_port, "tier": self.tier,
                "blocks": self.blocks}


@dataclass(frozen=True, slots=True)
class Candidate:
    """One routable ``(node, dp_rank)``: how many leading blocks of the query it holds, and its load."""

    node_id: str
    dp_rank: int = 0
    matched_blocks: int = 0
    tiers: tuple[int, ...] = ()
    """Matched blocks per tier, indexed by ``Tier`` value; empty means all on GPU."""
    load: NodeLoad = field(default_factory=NodeLoad)
    serving_url: str = ""
    """The engine's own URL, as its agent (or registration) announced it; empty when unknown."""
    trust: str = EXACT
    """How far the coordinator vouches for the match: ``exact`` while the node's stream is whole,
    ``degraded`` when its hashes failed verification or its relay lost history (``trust_cause``),
    ``approximate`` when its engine publishes no KV events (a zero means unknown)."""
    trust_cause: str = ""
    """Why degraded: ``hash_mismatch`` (matches may be wrong: the policies' ``degraded`` option
    decides) or ``history_lost`` (blocks are missing, the matches are real); empty otherwise."""
    reserved_blocks: int = 0
    """Leading blocks of the query routers (this one too) routed here that the index does not show yet
    (their reservations, docs/routing.md "Routers that share one view")."""
    reserved: NodeLoad = field(default_factory=NodeLoad)
    """Other routers' requests in flight here (``running_requests``) and their prefill not yet done."""
    pool: str = ""
    """The shared pool holding ``pool_blocks()`` of the match past the node's own run ("" none)."""
    pool_tier: str = "STORAGE"
    """The pool's tier: its blocks save prefill at that tier's weight."""
    pull: PullSource | None = None
    """A peer holding a longer prefix, for a peer pull (None: none)."""

    @property
    def key(self) -> NodeKey:
        return (self.node_id, self.dp_rank)

    def tier_counts(self) -> tuple[int, int, int]:
        """``(gpu, cpu, storage)`` matched blocks; an empty ``tiers`` counts every block as GPU."""
        if not self.tiers:
            return (self.matched_blocks, 0, 0)
        t = (*self.tiers, 0, 0, 0)
        return (t[Tier.GPU], t[Tier.CPU], t[Tier.STORAGE])

    def pool_blocks(self) -> int:
        """Matched blocks a shared pool the node reaches holds past its own run (the fourth ``tiers``)."""
        return self.tiers[3] if len(self.tiers) > 3 else 0

    def tiers_by_name(self) -> dict[str, int]:
        out = dict(zip(TIER_NAMES, self.tier_counts(), strict=True))
        if self.pool_blocks():
            out["POOL"] = self.pool_blocks()
        return out

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"node_id": self.node_id, "dp_rank": self.dp_rank,
                               "matched_blocks": self.matched_blocks, "tiers": self.tiers_by_name(),
                               "load": self.load.to_json(), "trust": self.trust}
        if self.serving_url:
            out["serving_url"] = self.serving_url
        if self.trust_cause:
            out["trust_cause"] = self.trust_cause
        if self.reserved_blocks or self.reserved.in_flight or self.reserved.prefill_tokens:
            out["reserved"] = {"blocks": self.reserved_blocks, "requests": self.reserved.in_flight,
                               "prefill_tokens": self.reserved.prefill_tokens}
        if self.pool:
            out["pool"] = self.pool
        if self.pull is not None:
            out["pull"] = self.pull.to_json()
        return out


@dataclass(frozen=True, slots=True)
class LookupResult:
    """The coordinator's answer: the query's size and the live nodes holding a prefix of it, best first
    (with ``include_unmatched``, every live node of the model, those holding nothing last)."""

    model: str
    block_size: int
    num_blocks: int
    nodes: list[Candidate]
    num_tokens: int = 0
    """Tokens the query had (0 for a query by hashes)."""
    block_hashes: tuple[BlockHash64, ...] = ()
    """The query's block hashes, when asked for (``want_block_hashes``): what a router keys its own
    memories on when the coordinator tokenized the prompt."""

    @property
    def best(self) -> Candidate | None:
        return self.nodes[0] if self.nodes and self.nodes[0].matched_blocks else None

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "block_size": self.block_size, "num_blocks": self.num_blocks,
                "num_tokens": self.num_tokens, "nodes": [n.to_json() for n in self.nodes]}
