"""The Redis index's figures: entries, bytes and nodes per bucket, and distinct blocks over buckets."""

from __future__ import annotations

import functools

import redis.asyncio as aredis
from redis.asyncio.cluster import RedisCluster

from kvcoord.events import Tier
from kvcoord.index.base import IndexStats
from kvcoord.index.redis import scripts as lua
from kvcoord.index.redis.client import RedisConnection
from kvcoord.index.redis.keys import _parse_loc_name

_DISTINCT_LIMIT = 2_000_000
"""Summed entries past which the exact distinct-block count gives up and reports the sum (a bound)."""


async def read_stats(conn: RedisConnection, client: aredis.Redis | RedisCluster, tags: list[str], *,
                     exact: bool) -> IndexStats:
    """The index's figures (see ``RedisIndex.stats``): one script call per bucket, and with ``exact`` the
    distinct blocks of models spread over several buckets."""
    res = await conn.eval_many(lua.STATS, [(tag, [""]) for tag in tags])
    entries = 0
    nbytes = 0
    nodes: set[str] = set()
    by_model_tier: dict[tuple[str, Tier], int] = {}
    per_bucket: dict[str, dict[str, int]] = {}
    for tag, (locs, model_blocks, b) in zip(tags, res, strict=True):
        nbytes += int(b)
        for i in range(0, len(locs), 4):
            model, node_id, _ = _parse_loc_name(locs[i])
            counts = [int(x) for x in locs[i + 1 : i + 4]]
            if sum(counts):
                nodes.add(node_id)
            for t in Tier:
                if counts[t]:
                    by_model_tier[(model, t)] = by_model_tier.get((model, t), 0) + counts[t]
                    entries += counts[t]
        for i in range(0, len(model_blocks), 2):
            per_bucket.setdefault(model_blocks[i].decode(), {})[tag] = int(model_blocks[i + 1])
    if exact:
        blocks_by_model = await distinct_blocks(conn, client, per_bucket)
        bound = any(
            sum(c.values()) > _DISTINCT_LIMIT and sum(1 for n in c.values() if n) > 1
            for c in per_bucket.values()
        )
    else:
        blocks_by_model = {m: sum(c.values()) for m, c in per_bucket.items() if any(c.values())}
        bound = any(sum(1 for n in c.values() if n) > 1 for c in per_bucket.values())
    return IndexStats(
        entries=entries,
        blocks=sum(blocks_by_model.values()),
        nodes=len(nodes),
        bytes=nbytes,
        entries_by_model_tier=by_model_tier,
        blocks_by_model=blocks_by_model,
        blocks_upper_bound=bound,
    )

async def distinct_blocks(
    conn: RedisConnection, client: aredis.Redis | RedisCluster, per_bucket: dict[str, dict[str, int]],
    limit: int = _DISTINCT_LIMIT,
) -> dict[str, int]:
    """Distinct blocks per model over buckets (a block held in two buckets counts once).

    ``per_bucket`` is model -> tag -> that bucket's block count. Exact (HSCAN of the inverted
    hashes of the buckets that have the model) up to ``limit`` summed entries; past that the sum,
    an upper bound, so that stats never pulls a huge index to the client.
    """
    out: dict[str, int] = {}
    for model, counts in per_bucket.items():
        tags = [tag for tag, n in counts.items() if n]
        total = sum(counts.values())
        if not tags:
            continue
        if len(tags) == 1 or total > limit:
            out[model] = total
            continue
        seen: set[bytes] = set()
        for tag in tags:
            await conn.round_trip(functools.partial(_scan_fields, client, f"{tag}:inv:{model}", seen))
        out[model] = len(seen)
    return out

async def _scan_fields(client: aredis.Redis | RedisCluster, key: str, into: set[bytes]) -> None:
    async for h, _ in client.hscan_iter(key, count=10_000):
        into.add(h)
