"""Write fencing on Redis: the index's ``fencing`` capability (see :class:`kvcoord.index.base.Fencing`).

A replica that claims a node gets a token higher than any before at its next write for the node; a write
carrying an older token is refused by the scripts, so a paused or cut-off replica cannot write on top of
the node's new owner."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvcoord.index.base import FencedWrite
from kvcoord.index.redis import scripts as lua

if TYPE_CHECKING:
    from kvcoord.index.redis.index import RedisIndex


class RedisFencing:
    """The fencing tokens one :class:`~kvcoord.index.redis.index.RedisIndex` client holds."""

    def __init__(self, index: RedisIndex) -> None:
        self.index = index
        self._tokens: dict[str, int | None] = {}
        """Per claimed node, the fencing token this client holds (None: claimed, token not issued yet)."""

    async def claim(self, node_id: str) -> None:
        """Lazily: the token is issued by the node's next write (inside the caller's retries, so a
        Hello never waits for Redis). Writes in between carry the old token, and a write issued by a
        stale owner after the new owner's first write is refused."""
        self._tokens[node_id] = None

    def fence_token(self, node_id: str) -> int:
        return self._tokens.get(node_id) or 0

    async def token(self, node_id: str) -> str:
        """The token this client's writes for ``node_id`` carry ('0': it never claimed the node)."""
        if node_id not in self._tokens:
            return "0"
        tok = self._tokens[node_id]
        if tok is None:
            ix = self.index
            await ix._check_layout()
            tok = int(await ix._epochs.eval(lua.CLAIM, ix.tag_of(node_id), "claim", node_id))
            # concurrent first writes may each issue one: keep the highest, or we would fence ourselves
            tok = max(tok, self._tokens.get(node_id) or 0)
            self._tokens[node_id] = tok
        return str(tok)

    def fenced(self, node_id: str, what: str) -> FencedWrite:
        """A refused write (the stale token is kept: later writes are refused too, until a claim)."""
        return FencedWrite(
            node_id, f"{what} refused by Redis: another replica claimed the node since (this one's fencing "
            f"token {self._tokens.get(node_id)} is stale)"
        )

    async def reclaim_node(self, node_id: str, token: int) -> bool:
        """Retire a dead owner's node unless it was claimed since (its token moved past ``token``). False
        also when there was nothing left to retire (the owner had removed the node itself)."""
        if token <= 0:
            return False
        ix = self.index
        tag = ix.tag_of(node_id)
        await ix._check_layout()
        res = int(await ix._epochs.eval(lua.REMOVE_NODE, tag, "reclaim_node", node_id, str(token), "1"))
        if res <= 0:
            return False
        ix.metrics.reclaimed_nodes += 1
        ix._wake_reclaimer()
        await ix._mirror_sync(tag)
        return True
