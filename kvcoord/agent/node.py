"""What an agent says about its node, whether over gRPC or in process: the checks a node must pass, its
hash profile as the Hello carries it, and snapshots of the blocks it holds."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

from kvcoord.events import Tier
from kvcoord.hashing import to_block_hash64
from kvcoord.load import NodeLoad
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.wire import snapshot_to_proto

SnapshotProvider = Callable[[int], Iterable[tuple[int, Tier]]]
"""dp_rank -> every (block hash, tier) the node holds on that rank. Called in the event loop; must
describe the state after every event submitted so far (the pool or relay mirror, read synchronously)."""

LoadProvider = Callable[[], NodeLoad | None]


class ProfileLike(Protocol):
    @property
    def algo(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def style(self) -> str: ...
    @property
    def engine_release(self) -> str | None: ...
    def fingerprint(self) -> str: ...


def hash_profile_to_proto(profile: ProfileLike) -> pb.HashProfile:
    """A :class:`kvcoord.hashing.HashProfile` as the Hello carries it (fingerprint, never the seed)."""
    return pb.HashProfile(algo=profile.algo, block_size=profile.block_size, style=profile.style,
                          none_hash_fingerprint=profile.fingerprint(),
                          engine_release=profile.engine_release or "")


def check_node(node_id: str, model: str, dp_ranks: Sequence[int]) -> None:
    """What a reporter (or the in-process feed) refuses to start with: ``ValueError``."""
    if not node_id or not model:
        raise ValueError("node_id and model must be non-empty")
    if not dp_ranks or any(r < 0 for r in dp_ranks) or len(set(dp_ranks)) != len(dp_ranks):
        raise ValueError(f"dp_ranks must be distinct non-negative ints, got {list(dp_ranks)}")


def snapshot_chunks(provide: SnapshotProvider, ranks: Sequence[int], epoch: int, seq: int,
                    chunk: int, lost: Mapping[int, str] | None = None) -> list[pb.Snapshot]:
    """The node's whole state at ``seq`` as snapshot chunks (``final`` on the last), read synchronously
    from ``provide`` (so atomic in the event loop); ``lost``: ranks whose history is incomplete (their
    first chunk carries ``history_lost``)."""
    out: list[pb.Snapshot] = []
    for rank in ranks:
        entries = provide(rank)
        columns = getattr(entries, "columns", None)
        hashes: Sequence[int]
        tiers: Sequence[int]
        if columns is not None:
            # The relay's RankSnapshot: already validated uint64 ints and Tier members, handed over
            # whole; read-only, only sliced here.
            hashes, tiers = columns()
        else:
            hashes, tiers = [], []
            for h, tier in entries:
                hashes.append(to_block_hash64(h))
                tiers.append(int(Tier(tier)))
        start, first = 0, len(out)
        while True:
            out.append(snapshot_to_proto(epoch, seq, rank, hashes[start:start + chunk],
                                         tiers[start:start + chunk], False))
            start += chunk
            if start >= len(hashes):
                break
        if lost and rank in lost:
            out[first].history_lost = lost[rank]
    out[-1].final = True
    return out


def snapshot_from_mapping(state: Mapping[int, Iterable[tuple[int, Tier]]]) -> SnapshotProvider:
    """A snapshot provider over a live ``{dp_rank: entries}`` mapping (handy for mirrors and tests)."""

    def provide(rank: int) -> Iterable[tuple[int, Tier]]:
        return list(state.get(rank, ()))

    return provide
