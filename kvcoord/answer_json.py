"""The nested objects of a lookup answer's ``nodes`` entries in the HTTP API's JSON, one definition for the
coordinator that encodes them (:mod:`kvcoord.coordinator.answers`) and the router that decodes them
(:mod:`kvcoord.router.http_lookup`)."""

from __future__ import annotations

import msgspec

__all__ = ["NodeJson", "PullJson", "ReservedJson", "TiersJson"]


class TiersJson(msgspec.Struct, omit_defaults=True):
    """Matched blocks per tier (they add up to ``matched_blocks``)."""

    GPU: int
    CPU: int
    STORAGE: int
    POOL: int = 0
    """Blocks past the node's own run that a shared pool it reaches holds (omitted when none)."""


class PullJson(msgspec.Struct):
    """A peer holding a longer prefix (kvcoord.coordinator.pools.PullHint)."""

    node_id: str
    host_port: str
    tier: str
    blocks: int


class ReservedJson(msgspec.Struct):
    """Routers' reservations on a node for this query (kvcoord.coordinator.reservations.Reserved)."""

    blocks: int
    """Leading query blocks past the index's best routed here, not yet reported by events."""
    requests: int
    """Other routers' requests in flight here."""
    prefill_tokens: int
    """Their prefill not yet done."""


class NodeJson(msgspec.Struct, omit_defaults=True):
    """One entry of the answer's ``nodes``: kvcoord's view of a live (node, dp rank), best first."""

    node_id: str
    dp_rank: int
    matched_blocks: int
    tiers: TiersJson
    load: msgspec.Raw
    trust: str
    serving_url: str | None = None
    trust_cause: str = ""
    """Why degraded (``hash_mismatch`` or ``history_lost``); omitted when exact."""
    pool: str = ""
    """The shared pool ``tiers.POOL`` counts; omitted when none."""
    pool_tier: str = ""
    """That pool's tier (its blocks score at its weight); omitted when none."""
    pull: PullJson | None = None
    """A peer-pull hint; omitted when no live peer holds a longer prefix."""
    reserved: ReservedJson | None = None
    """Routers' reservations here (the general path only); omitted when none."""
