"""Shared pools: named tier instances several nodes can load blocks from (LMCache's remote backend,
Mooncake's store, SGLang HiCache L3), and the peer-pull hints of a lookup answer.

The index keeps a pool's blocks under its publisher's location, as any node's: the node id ``pool:<name>``
(a reserved prefix: the agent's ``--pool-publisher NAME``), or an engine registered over HTTP with
``pool_publisher``. The Index protocol, its backends and the C walk are unchanged. Lookups expand the pool
here, at answer assembly: a node that reaches a pool (``[pools]``, its Hello's ``pools``, ``/register``'s
``pools``) is credited with the pool's blocks past its own run, as tier ``pool``, at the pool tier's weight.
Publishers never appear in answers. docs/semantics.md says what a pool block means for a node.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple
from urllib.parse import urlsplit

from kvcoord.events import Tier
from kvcoord.hashing import BlockHash64
from kvcoord.index.base import NodeKey, NodeMatch

__all__ = ["POOL_PREFIX", "PoolConfig", "Pools", "PullHint", "host_port", "parse_pools"]

log = logging.getLogger("kvcoord.coordinator")

POOL_PREFIX = "pool:"
"""Node ids starting with it are pool publishers' locations, never routable nodes."""

MAX_CONTINUATIONS = 8
"""Index walks a lookup may add to follow pools past nodes' own runs (beyond them a node is credited
with the pool's run from block 0 only)."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """``[pools.NAME]``: the tier whose weight the pool's blocks score at, and the nodes that reach it."""

    name: str
    tier: Tier = Tier.STORAGE
    nodes: frozenset[str] = frozenset()


def check_pool_name(name: object, where: str) -> str:
    """A pool name as a node id's rule has it (it becomes ``pool:<name>``); ``ValueError`` otherwise."""
    from kvcoord.validate import InvalidEvent, check_node_id

    try:
        return check_node_id(name, where)
    except InvalidEvent as exc:
        raise ValueError(str(exc).replace("node id", "pool name")) from None


def check_pool_hello(node_id: str, publisher: str, pools: Sequence[str]) -> None:
    """A Hello's (or registration's) pool fields: a publisher is ``pool:<its pool>`` (when its id is one)
    and reaches no pool; a ``pool:`` id is only a publisher's. ``ValueError`` in one line."""
    if publisher:
        check_pool_name(publisher, "pool_publisher")
        if node_id.startswith(POOL_PREFIX) and node_id != POOL_PREFIX + publisher:
            raise ValueError(f"a publisher of pool {publisher!r} has node id {POOL_PREFIX}{publisher}")
        if pools:
            raise ValueError("a pool publisher reaches no pools (pools must be empty)")
    elif node_id.startswith(POOL_PREFIX):
        raise ValueError(f"node ids starting with {POOL_PREFIX!r} are reserved for pool publishers "
                         "(set pool_publisher: the agent's --pool-publisher)")
    if len(pools) > 64:
        raise ValueError("more than 64 pools")
    for name in pools:
        check_pool_name(name, "pools")


def parse_pools(table: Mapping[str, object], where: str = "pools") -> dict[str, PoolConfig]:
    """``[pools.NAME] tier = "STORAGE", nodes = [...]`` as configuration; ``ValueError`` in one line."""
    out: dict[str, PoolConfig] = {}
    for name, raw in table.items():
        check_pool_name(name, f"{where}: the name")
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where}.{name}: expected a table (tier, nodes)")
        bad = set(raw) - {"tier", "nodes"}
        if bad:
            raise ValueError(f"{where}.{name}: unknown key {sorted(bad)[0]!r} (known: tier, nodes)")
        tier = raw.get("tier", "STORAGE")
        if not isinstance(tier, str) or tier.strip().upper() not in Tier.__members__:
            raise ValueError(f"{where}.{name}.tier: one of {', '.join(Tier.__members__)}, not {tier!r}")
        nodes = raw.get("nodes", [])
        if not isinstance(nodes, list) or not all(isinstance(n, str) and n for n in nodes):
            raise ValueError(f"{where}.{name}.nodes: expected a list of node ids")
        if any(n.startswith(POOL_PREFIX) for n in nodes):
            raise ValueError(f"{where}.{name}.nodes: {POOL_PREFIX!r} ids are pools, not nodes")
        out[name] = PoolConfig(name, Tier[tier.strip().upper()], frozenset(nodes))
    return out


class PullHint(NamedTuple):
    """A live peer holding a longer prefix than the node it is given for."""

    node_id: str
    host_port: str
    tier: str
    blocks: int


@functools.lru_cache(maxsize=4096)
def host_port(url: str) -> str:
    """``host:port`` of a serving URL (llm-d's ``x-kv-cache-source-host-port`` form); "" if it has none."""
    try:
        parts = urlsplit(url if "//" in url else f"//{url}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return ""
    host = parts.hostname or ""
    if not host:
        return ""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


Row = tuple[str, int, int, tuple[int, ...], str]
"""A node's answer row after expansion: node id, dp rank, matched blocks, tiers (GPU, CPU, STORAGE, pool
blocks), and the pool the pool blocks are in ("" none)."""

ContinueMatch = Callable[[Sequence[BlockHash64], Collection[NodeKey]], Awaitable[list[NodeMatch]]]


class Pools:
    """Which nodes reach which pool, and which publishers feed which pool."""

    __slots__ = ("_reached", "_warned", "configured", "publishers", "reach", "unknown")

    def __init__(self, configured: Mapping[str, PoolConfig]) -> None:
        self.configured = dict(configured)
        self.reach: dict[str, frozenset[str]] = {}
        """Node id -> pools its Hello or registration named."""
        self.publishers: dict[str, str] = {}
        """Publisher node id -> its pool (``pool:<name>`` publishers are known by their id as well)."""
        self.unknown = 0
        """Pool names announced that neither ``[pools]`` nor any publisher declared (at announcement)."""
        self._warned: set[str] = set()
        self._reached: dict[str, tuple[str, ...]] = {}
        """Node id -> the pools it reaches, sorted (:meth:`reached`), until reach changes."""

    @property
    def active(self) -> bool:
        """Whether lookups need the expansion at all (the HTTP fast path answers only without pools)."""
        return bool(self.configured or self.publishers)

    def known(self, name: str) -> bool:
        return name in self.configured or name in self.publishers.values()

    def announce(self, node_id: str, names: Iterable[str]) -> list[str]:
        """Record the pools ``node_id`` reaches (a new Hello or registration replaces the last); returns the
        names not known yet (counted; a publisher may still come)."""
        wanted = frozenset(names)
        for name in wanted:
            check_pool_name(name, "pool")
        self.publishers.pop(node_id, None)  # a routable node now (a new Hello or registration)
        self._reached.clear()
        if wanted:
            self.reach[node_id] = wanted
        else:
            self.reach.pop(node_id, None)
        fresh = sorted(n for n in wanted if not self.known(n))
        self.unknown += len(fresh)
        for name in fresh:
            if name not in self._warned and len(self._warned) < 1024:
                self._warned.add(name)
                log.warning("node %s reaches pool %r, which no [pools] entry or publisher declares (yet)",
                            node_id, name)
        return fresh

    def shared(self, node_id: str, names: Iterable[str], publisher: str = "") -> None:
        """What another replica's record says of ``node_id`` (its Hello went there): the pools it reaches,
        as :meth:`announce` without counting or warning (that replica did), or the pool it publishes for.
        Names that are not pool names are skipped (a record is not trusted input)."""
        if publisher:
            with contextlib.suppress(ValueError):
                if self.publishers.get(node_id) != publisher:
                    self.publisher(node_id, publisher)
            return
        wanted = set()
        for name in names:
            try:
                wanted.add(check_pool_name(name, "pool"))
            except ValueError:
                continue
        if node_id not in self.publishers and self.reach.get(node_id, frozenset()) == wanted:
            return
        self.publishers.pop(node_id, None)  # routable now, as its Hello there said
        self._reached.clear()
        if wanted:
            self.reach[node_id] = frozenset(wanted)
        else:
            self.reach.pop(node_id, None)

    def publisher(self, node_id: str, pool: str) -> None:
        """``node_id`` publishes the blocks of ``pool``."""
        check_pool_name(pool, "pool_publisher")
        self.publishers[node_id] = pool
        self.reach.pop(node_id, None)
        self._reached.clear()

    def load(self, reach: Mapping[str, frozenset[str]], publishers: Mapping[str, str]) -> None:
        """Hold another process's reach and publishers (a lookup worker's copy of the main process's)."""
        self.reach, self.publishers = dict(reach), dict(publishers)
        self._reached.clear()

    def publisher_keys(self) -> set[NodeKey]:
        """The publishers' index locations: added to a lookup's candidates, so pools expand for them too."""
        return {(node_id, 0) for node_id in self.publishers}

    def pool_of(self, node_id: str) -> str | None:
        """The pool ``node_id`` publishes for, None for a routable node."""
        if node_id.startswith(POOL_PREFIX):
            return node_id[len(POOL_PREFIX):]
        return self.publishers.get(node_id)

    def reached(self, node_id: str) -> tuple[str, ...]:
        """The pools ``node_id`` reaches, sorted (remembered: asked per node per lookup)."""
        got = self._reached.get(node_id)
        if got is None:
            names = set(self.reach.get(node_id, ()))
            names.update(p.name for p in self.configured.values() if node_id in p.nodes)
            if len(self._reached) >= 65536:
                self._reached.clear()
            got = self._reached[node_id] = tuple(sorted(names))
        return got

    def tier(self, pool: str) -> Tier:
        cfg = self.configured.get(pool)
        return cfg.tier if cfg is not None else Tier.STORAGE

    def reaching(self, pool: str) -> set[str]:
        """Nodes that reach ``pool``."""
        out = {n for n, names in self.reach.items() if pool in names}
        cfg = self.configured.get(pool)
        if cfg is not None:
            out |= cfg.nodes
        return out

    async def expand(self, hashes: Sequence[BlockHash64], rows: Iterable[NodeMatch],
                     publisher_live: Callable[[str], bool], node_ranks: Callable[[str], Sequence[int]],
                     candidates: Collection[NodeKey] | None, cont: ContinueMatch) -> list[Row]:
        """The index's rows with pools expanded: publishers' rows out, each node reaching a pool credited with
        ``max(own run, pool's run from block 0, own run + the pool's run from where the own run stops)``
        over its pools. A node holding nothing itself but reaching a pool gets a row of its dp ranks."""
        walk = _Walk(self, hashes, cont)
        own: list[NodeMatch] = []
        for row in rows:
            pool = self.pool_of(row[0])
            if pool is None:
                own.append(row)
            elif publisher_live(row[0]):
                run, keys = walk.runs.get(pool, (0, []))
                keys.append((row[0], row[1]))
                walk.runs[pool] = (max(run, row[2]), keys)
        walk.live = publisher_live
        out: list[Row] = []
        seen: set[NodeKey] = set()
        for node_id, rank, matched, tiers in own:
            seen.add((node_id, rank))
            names = self.reached(node_id)
            extra, pool = await walk.best(names, matched) if names else (0, "")
            out.append((node_id, rank, matched + extra, (*(*tiers, 0, 0, 0)[:3], extra), pool))
        for pool in list(walk.runs):
            for node_id in self.reaching(pool):
                for rank in node_ranks(node_id):
                    key = (node_id, rank)
                    if key in seen or (candidates and key not in candidates):
                        continue
                    extra, best_pool = await walk.best(self.reached(node_id), 0)
                    if extra:
                        seen.add(key)
                        out.append((node_id, rank, extra, (0, 0, 0, extra), best_pool))
        return out


class _Walk:
    """One lookup's pool expansion: the pools' runs from block 0, the continuation walks done, and each
    node's pools (looked up once)."""

    __slots__ = ("budget", "cont", "continued", "hashes", "live", "pools", "runs")

    def __init__(self, pools: Pools, hashes: Sequence[BlockHash64], cont: ContinueMatch) -> None:
        self.pools, self.hashes, self.cont = pools, hashes, cont
        self.runs: dict[str, tuple[int, list[NodeKey]]] = {}
        """Pool -> its longest publisher's run from block 0, and the publishers' locations that hold one."""
        self.continued: dict[tuple[str, int], int] = {}
        self.budget = MAX_CONTINUATIONS
        self.live: Callable[[str], bool] = lambda node_id: True

    async def best(self, names: Sequence[str], matched: int) -> tuple[int, str]:
        """Blocks past ``matched`` the best of pools ``names`` (a node's) adds, and that pool."""
        best, best_pool = 0, ""
        for pool in names:
            run, keys = self.runs.get(pool, (0, []))
            extra = run - matched
            if run < matched < len(self.hashes):
                # The pool may hold the blocks after the node's own run without holding the first ones
                # (the node stored them there itself): follow it from where the node stops.
                extra = await self._continue(pool, matched, keys)
            if extra > best:
                best, best_pool = extra, pool
        return best, best_pool

    async def _continue(self, pool: str, matched: int, keys: list[NodeKey]) -> int:
        got = self.continued.get((pool, matched))
        if got is None:
            got = 0
            if self.budget > 0:
                self.budget -= 1
                if not keys:
                    pubs = [k for k, p in self.pools.publishers.items() if p == pool and self.live(k)]
                    keys = [(k, 0) for k in dict.fromkeys([*pubs, POOL_PREFIX + pool])]
                got = max((m[2] for m in await self.cont(self.hashes[matched:], keys)), default=0)
            self.continued[(pool, matched)] = got
        return got


_TIER_NAMES = tuple(t.name for t in Tier)


def pull_hints(rows: Sequence[tuple[str, int, tuple[int, ...], str]]) -> list[PullHint | None]:
    """Per row (node id, matched blocks, tiers with the pool count last, source URL or ""): the peer (another
    node with a URL) whose own blocks make the longest prefix, when longer than the row's match; the first
    in answer order among equals. Linear: the best source and the best of another node are all it needs."""
    best = other = -1
    owns = [matched - (tiers[3] if len(tiers) > 3 else 0) if url else -1 for _, matched, tiers, url in rows]
    for i, own in enumerate(owns):
        if own <= 0:
            continue
        if best < 0 or own > owns[best]:
            if best >= 0 and rows[best][0] != rows[i][0]:
                other = best
            best = i
        elif rows[i][0] != rows[best][0] and (other < 0 or own > owns[other]):
            other = i
    made: dict[int, PullHint | None] = {}
    out: list[PullHint | None] = []
    for node_id, matched, _, _ in rows:
        src = best if best >= 0 and rows[best][0] != node_id else other
        if src < 0 or owns[src] <= matched:
            out.append(None)
            continue
        if src not in made:
            peer, _, tiers, url = rows[src]
            hp = host_port(url)
            slowest = next((t for t in (2, 1) if len(tiers) > t and tiers[t]), 0)
            made[src] = PullHint(peer, hp, _TIER_NAMES[slowest], owns[src]) if hp else None
        out.append(made[src])
    return out
