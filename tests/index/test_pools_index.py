"""Pool expansion (:meth:`kvcoord.coordinator.pools.Pools.expand`) over every index backend: the pool's
locations are ordinary index locations, so the expansion and its continuation walk (the pool's run from
where a node's own run stops: a match of the query's tail restricted to the publishers) must answer alike on
the memory (C and Python), Redis, Redis Cluster, mirrored and Sentinel backends."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvcoord.coordinator.pools import PoolConfig, Pools, parse_pools
from kvcoord.events import BlockStored, Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import Index, NodeKey, NodeMatch
from kvcoord.validate import ops_of

M = "m"
Q = [BlockHash64(x) for x in range(101, 113)]  # a 12-block query


def stored(hashes: Sequence[int], medium: str | None = None) -> BlockStored:
    return BlockStored(block_hashes=tuple(hashes), parent_block_hash=None, token_ids=(), block_size=16,
                       medium=medium)


async def test_expand_credits_reaching_nodes_on_every_backend(index: Index) -> None:
    await index.apply(M, "pool:remote", 0, ops_of([stored(Q[:8], "CPU")]))  # from block 0: 8 blocks
    await index.apply(M, "pool:tail", 0, ops_of([stored(Q[4:11])]))  # blocks 4..10 only
    await index.apply(M, "a", 0, ops_of([stored(Q[:2])]))
    await index.apply(M, "b", 0, ops_of([stored(Q[:4])]))
    await index.apply(M, "c", 0, ops_of([stored(Q[:9])]))
    pools = Pools(parse_pools({"remote": {"tier": "CPU", "nodes": ["a", "b"]},
                               "tail": {"nodes": ["b", "c"]}}))
    assert pools.configured["remote"] == PoolConfig("remote", Tier.CPU, frozenset({"a", "b"}))
    pools.announce("d", ["remote"])
    pools.publisher("pool:remote", "remote")
    pools.publisher("pool:tail", "tail")
    walks: list[tuple[int, list[NodeKey]]] = []

    async def cont(rest: Sequence[BlockHash64], keys: Collection[NodeKey]) -> list[NodeMatch]:
        walks.append((len(rest), sorted(keys)))
        return list(await index.match(M, rest, keys))

    rows = await index.match(M, Q)
    got = await pools.expand(Q, rows, lambda node: True, lambda node: (0,) if node == "d" else (), None, cont)
    by_node = {r[0]: r[2:] for r in got}
    assert not any(n.startswith("pool:") for n in by_node)  # publishers never answer
    assert by_node == {
        "a": (8, (2, 0, 0, 6), "remote"),  # the pool's run from block 0 covers a's
        "b": (11, (4, 0, 0, 7), "tail"),  # own 4, then tail's blocks 4..10 (remote gives 8 only)
        "c": (11, (9, 0, 0, 2), "tail"),  # own 9, then tail's blocks 9 and 10
        "d": (8, (0, 0, 0, 8), "remote"),  # holds nothing itself: the pool's run from block 0
    }
    # Continuation walks: tail from b's 4 (and from c's 9); each (pool, offset) walked once.
    assert sorted(walks) == [(3, [("pool:tail", 0)]), (8, [("pool:tail", 0)])]
