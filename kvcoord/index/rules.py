"""The index's rules for one location's validated ops, stated once: the memory index and the relay's
mirror of a node (:mod:`kvcoord.engine.relay`) both apply them, through :mod:`kvcoord.index.table`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvcoord.events import REMOVE, STORE
from kvcoord.index.base import ApplyResult, NodeKey
from kvcoord.validate import Op

if TYPE_CHECKING:
    from kvcoord.index.table import PyTable


def apply_ops(mi: PyTable, key: NodeKey, ops: Sequence[Op], res: ApplyResult) -> int:
    """Apply one location's validated ops to ``mi`` in order, counting into ``res``; returns the hashes
    touched (the sweep budget they earn). The index's rules, stated once (the relay's mirror runs them
    too): stores are idempotent; a store of a group that is not prefix-indexable is only counted, and
    its ``group_idx`` remembered for ``key``, so the group's removals are skipped from then on (in hybrid
    models several groups publish the same hash); a removal of a block not held is a counted no-op;
    ``AllBlocksCleared`` retires ``key``'s slot (the groups stay remembered)."""
    work = 0
    slot_of, skip = mi.slot_of, mi.skip_groups
    for kind, tier, hashes, group, indexable in ops:
        if kind == STORE:
            if not indexable:
                res.skipped_group += len(hashes)
                if group is not None:
                    skip.setdefault(key, set()).add(group)
            elif hashes:
                slot = slot_of.get(key)
                res.stored += mi.store(mi.slot_for_store(key) if slot is None else slot, tier, hashes)
                work += len(hashes)
        elif kind == REMOVE:
            if group is not None and skip and group in skip.get(key, ()):
                res.skipped_group += len(hashes)
                continue
            slot = slot_of.get(key)
            if slot is None:
                res.removed_unknown += len(hashes)
                continue
            done = mi.remove(slot, tier, hashes)
            res.removed += done
            res.removed_unknown += len(hashes) - done
            work += len(hashes)
        else:
            slot = slot_of.get(key)
            if slot is not None:
                res.cleared += mi.retire(slot)
    return work
