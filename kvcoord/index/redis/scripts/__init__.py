"""The backend's Lua scripts, one ``.lua`` file each beside this module (package data).

Most scripts start with the shared prelude ``common.lua`` (bucket tag, holder records, change feed,
retire), prepended here, after the script's ``#!lua`` line if it has one. Their ARGV[2] is the bucket's
``T:epoch`` as the client last accepted it (the prelude takes it out; the ARGV listed below follow the
tag): the write scripts (write, begin, commit, clear, remove_node, claim, remove_pending) refuse the
whole call with :data:`EPOCH_CHANGED` when the bucket's marker differs or is gone; reclaim and stats
ignore it (they are passed ``''``). A script's SHA1 (Redis's script
cache) is that of the whole text, so a change to the prelude changes every such script's: EVALSHA then
misses once per server and falls back to EVAL, which caches the new one.
"""

from __future__ import annotations

from importlib.resources import files

from kvcoord.index.base import IndexReset
from kvcoord.index.redis.client import _Script
from kvcoord.index.redis.keys import FEED_MAX_ENTRIES

EPOCH_CHANGED = -2
"""What an epoch-checking script returns, having done nothing, when the bucket's ``T:epoch`` is not the
one the client accepted: Redis lost the bucket's data since (see ``RedisIndex`` and ``IndexReset``)."""


def epoch_changed(reply: object) -> bool:
    """Whether a script's reply is the epoch refusal (an integer; normal replies of the scripts that
    can refuse are lists, counts >= -1, or fencing tokens)."""
    return type(reply) is int and reply == EPOCH_CHANGED


def index_reset(tags: list[str], what: str) -> IndexReset:
    """The exception for an epoch refusal of ``what`` (a lookup, a write) on the buckets ``tags``."""
    return IndexReset(tags, f"redis lost the data of bucket(s) {', '.join(tags)} since this client last read "
                            f"its generation (the epoch marker changed or is gone): {what} refused, nothing "
                            "answered or applied")


def read_script(name: str) -> str:
    """The text of one ``.lua`` file of this package."""
    return (files(__name__) / name).read_text(encoding="utf-8")


_COMMON = read_script("common.lua").replace("FEED_MAX", str(FEED_MAX_ENTRIES))


def _load(name: str, *, prelude: bool = True) -> _Script:
    src = read_script(name)
    if prelude:
        head = ""
        if src.startswith("#!"):
            head, _, src = src.partition("\n")
            head += "\n"
        src = f"{head}\n{_COMMON}\n{src}"
    return _Script(src)


WRITE = _load("write.lua")
"""ARGV: tag, then one or more batches, each: location name, node, mode ('A' apply to the live location,
or a pending id to fill), the node's fencing token ('0': unfenced), op count, then (op, blob) pairs:
'S<tier>' store, 'R<tier>' or 'R<tier>:<group>' remove (blob = packed 8-byte hashes), 'G<group>'
remember a non-indexable group of this location, 'C' AllBlocksCleared. Batches apply in order; returns
6 counts per batch (the first -1: fenced, nothing of the batch applied), then the feed seq of the
call's changes (0: none) while the feed is on."""
BEGIN = _load("begin.lua")
"""ARGV: tag, location name, node, fencing token. Starts a pending (invisible) location for replace_node;
returns its id (-1: fenced)."""
COMMIT = _load("commit.lua")
"""ARGV: tag, location name, node, pending id, fencing token. Swaps the pending location in, retiring the
old one (-1: fenced)."""
CLEAR = _load("clear.lua")
"""ARGV: tag, location name, node, fencing token. AllBlocksCleared for one location: returns the entries
it dropped (-1: fenced)."""
REMOVE_NODE = _load("remove_node.lua")
"""ARGV: tag, node, fencing token, '1' for a reclaim. Retires every location (all models, ranks, pending
fills) of one node (-1: fenced; a reclaim: the token is no longer exactly the one given)."""
CLAIM = _load("claim.lua")
"""ARGV: tag, node. A new fencing token for the node, higher than any before (see common.lua)."""
REMOVE_PENDING = _load("remove_pending.lua")
"""ARGV: tag, location name, node, pending id: abandons a replace_node fill that failed midway."""
RECLAIM = _load("reclaim.lua")
"""ARGV: tag, count. Reclaims up to ~count entries of the oldest retired location; returns {done, left}."""
STATS = _load("stats.lua")
"""ARGV: tag. Live locations with per-tier entry counts, models' block counts, and the bucket's bytes."""
NAMES = _load("names.lua", prelude=False)
"""ARGV: tag, the client's cached ``T:ver``, its accepted epoch: -2 if the epoch differs, 0 if the
version is unchanged, else ``{ver, T:name as a flat list}``."""
EPOCH = _load("epoch.lua", prelude=False)
"""ARGV: tag, a fresh random marker: the bucket's marker ``T:epoch`` (set to the fresh one when
missing: the first client to notice a loss sets the new lifetime, the others adopt it)."""
