"""Media and tiers: which tier (:class:`kvcoord.events.Tier`) each ``medium`` name an engine publishes lands
on, as configuration, and the tally of the names nobody mapped.

An event of an unknown medium is skipped, never refused: its blocks are not indexed (they score 0, as
llm-d#2809 scores an unknown tier), the rest of its batch applies, and the name is counted
(:data:`UNKNOWN_MEDIA`) and logged once. docs/semantics.md lists the names each project publishes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvcoord.events import FULL_ATTENTION_KINDS, Tier

_log = logging.getLogger(__name__)

DEFAULT_MEDIA: dict[str, Tier] = {
    # Every name the engines and caches publish (docs/semantics.md lists who publishes which), matched
    # case-insensitively: vLLM (GPU, CPU, Disk), SGLang (GPU, CPU, CPU_PINNED, DISK, EXTERNAL), LMCache
    # (cpu, CXL), Mooncake's store (cpu, disk), llm-d's filesystem and object backends (SHARED_STORAGE,
    # OBJECT_STORE), and every name Dynamo's KV router maps, so an event either indexer takes lands on the
    # same tier here.
    "": Tier.GPU,
    "GPU": Tier.GPU,
    "CUDA": Tier.GPU,
    "DEVICE": Tier.GPU,
    "HBM": Tier.GPU,
    "CPU": Tier.CPU,
    "CPU_PINNED": Tier.CPU,
    "CPU_TIER1": Tier.CPU,
    "HOST": Tier.CPU,
    "HOST_PINNED": Tier.CPU,
    "DRAM": Tier.CPU,
    "CXL": Tier.CPU,
    "STORAGE": Tier.STORAGE,
    "CPU_TIER2": Tier.STORAGE,
    "DISK": Tier.STORAGE,
    "NVME": Tier.STORAGE,
    "SSD": Tier.STORAGE,
    "LOCAL_FILE": Tier.STORAGE,
    "FILE": Tier.STORAGE,
    "EXTERNAL": Tier.STORAGE,
    "NETWORK": Tier.STORAGE,
    "REMOTE": Tier.STORAGE,
    "SHARED": Tier.STORAGE,
    "SHARED_STORAGE": Tier.STORAGE,
    "OBJECT_STORE": Tier.STORAGE,
}
"""The medium names every process knows, and their tiers: ``[media]`` of the coordinator's config and the
agent's ``--media`` add names or move them (:func:`configure_media`)."""

_media: dict[str, Tier] = dict(DEFAULT_MEDIA)
"""The map in force: the defaults and this process's configuration."""

MEDIUM_TIERS: dict[str | None, int] = {None: 0}
"""Exact medium strings seen, and their tier values: the validator's fast lookup
(:func:`kvcoord.validate.tier`), emptied when the map changes. Unknown names are never in it."""


def medium_key(name: str) -> str:
    """A medium name as the map keys it: case and surrounding blanks do not matter."""
    return name.strip().upper()


def parse_media(table: Mapping[str, object], where: str) -> dict[str, Tier]:
    """A ``NAME = "TIER"`` table (the coordinator's ``[media]``, the agent's ``--media``) as a map; raises
    ``ValueError`` in one line naming the first bad entry."""
    out: dict[str, Tier] = {}
    for name, tier in table.items():
        if not isinstance(tier, str) or medium_key(tier) not in Tier.__members__:
            raise ValueError(f"{where}.{name}: the tier must be one of {', '.join(Tier.__members__)}, "
                             f"not {tier!r}")
        if len(name) > 64:
            raise ValueError(f"{where}: a medium name is at most 64 characters, not {len(name)}")
        out[medium_key(name)] = Tier[medium_key(tier)]
    return out


def configure_media(media: Mapping[str, Tier] | None) -> None:
    """Put this process's map in force: the defaults, with ``media`` added over them (None: the defaults
    only). Every decoder of the process reads it."""
    _media.clear()
    _media.update(DEFAULT_MEDIA)
    for name, tier in (media or {}).items():
        _media[medium_key(name)] = Tier(tier)
    MEDIUM_TIERS.clear()
    MEDIUM_TIERS[None] = 0


def media_map() -> dict[str, Tier]:
    """The map in force (a copy)."""
    return dict(_media)


def normalize_medium(medium: str | None) -> Tier | None:
    """Map an engine's ``medium`` string to a tier; a missing medium means GPU, a medium the map does not
    know None (its blocks are not indexed: they score nothing, see :class:`MediaTally`)."""
    if medium is None:
        return Tier.GPU
    return _media.get(medium_key(medium))


OTHER_MEDIUM = "other"
"""The label of the names past a tally's cap."""


_UNKNOWN_MEDIUM = ("events of unknown medium %.64r are skipped (not indexed; map it to a tier with [media] "
                   "or --media)")


class MediaTally:
    """Skipped events (of unknown media; :data:`MISFIT_STORES`: of sparse groups), counted per name: at most
    ``cap`` names, the rest as ``other``, so a publisher inventing names cannot grow a metric's label set. A
    name is logged once, when first seen.

    ``total`` is what this process counted or was told (the coordinator's metric); ``fresh`` what it
    counted itself since :meth:`take` (an agent reports it in its heartbeats)."""

    __slots__ = ("cap", "fresh", "skipped", "total")

    def __init__(self, cap: int = 32, skipped: str = _UNKNOWN_MEDIUM) -> None:
        self.cap = cap
        self.skipped = skipped
        """What the log says of a name's events (``%.64r``: the name): why they are skipped, and the fix."""
        self.total: dict[str, int] = {}
        self.fresh: dict[str, int] = {}

    def add(self, name: str, n: int = 1, *, fresh: bool = True, where: str = "") -> None:
        """Count ``n`` events of medium ``name``; ``fresh``: counted here (False: reported by an agent)."""
        label = name if name in self.total or len(self.total) < self.cap else OTHER_MEDIUM
        if label not in self.total:
            self.total[label] = 0
            _log.warning(self.skipped + "%s%s", name, f" (from {where})" if where else "",
                         "" if label == name else f"; counted as {OTHER_MEDIUM!r} past {self.cap} names")
        self.total[label] += n
        if fresh:
            self.fresh[label] = self.fresh.get(label, 0) + n

    def take(self) -> dict[str, int]:
        """The fresh counts since the last take, cleared."""
        out, self.fresh = self.fresh, {}
        return out


UNKNOWN_MEDIA = MediaTally()
"""This process's tally of unknown media (the coordinator's ``kvcoord_unknown_medium_events_total``)."""
UNSPECIFIED_KIND = "unspecified"
"""The ``group_kind`` label of a store that names no ``kv_cache_spec_kind``."""
INDEXED_GROUP_KINDS = (UNSPECIFIED_KIND, *sorted(FULL_ATTENTION_KINDS))
"""The group kinds whose stores are indexed: a misfit of theirs is a broken publisher or a block size the
engine and the model's profile disagree on (alerted), not a sparse group's by-design skip."""
MISFIT_STORES = MediaTally(skipped=(
    "BlockStored events of group kind %.64r whose token ids are not block_size per block hash are skipped "
    "(not indexed: a sparse group's blocks, or a broken publisher)"))
"""BlockStored events skipped because their token count is not ``block_size`` times their hashes (a sparse
group of a hybrid model), per ``kv_cache_spec_kind`` (the coordinator's
``kvcoord_misfit_stored_events_total``; agents report theirs in heartbeats); never a bad batch."""
