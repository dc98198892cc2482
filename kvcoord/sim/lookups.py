"""The sim-engine's router-style lookups (``--lookup-coordinator``): before admitting a request the
engine asks a coordinator, as a router would, how much of the prompt each node holds, off its loop."""

from __future__ import annotations

import logging
import queue
import threading
from typing import TYPE_CHECKING, Any

from kvcoord.extra_keys import RequestKeys

if TYPE_CHECKING:
    from kvcoord.router.client import CoordinatorClient
    from kvcoord.sim.engine import SimEngineConfig

log = logging.getLogger(__name__)

__all__ = ["LookupProbe", "LookupStats", "open_lookups"]


class LookupStats:
    """Counters of the engine's router-style lookups (written under ``lookup`` in the state file)."""

    __slots__ = ("best_is_self", "best_matched_blocks", "dropped", "errors", "hits", "last_error",
                 "local_cached_blocks", "lookups", "query_blocks", "self_matched_blocks")

    def __init__(self) -> None:
        self.lookups = 0
        """Lookups answered."""
        self.errors = 0
        """Lookups that failed (coordinator down, timeout, refused)."""
        self.dropped = 0
        """Lookups never sent because the queue was full (the coordinator is slow or down)."""
        self.hits = 0
        """Answered lookups where some node held at least one block."""
        self.query_blocks = 0
        self.best_matched_blocks = 0
        """Sum over answered lookups of the best node's matched blocks."""
        self.best_is_self = 0
        """Answered hits where this engine was (one of) the best node(s)."""
        self.self_matched_blocks = 0
        """What the coordinator says this engine holds (``--lookup-node-id`` at this dp rank)..."""
        self.local_cached_blocks = 0
        """...and what its pool actually held when the request was queued (same answered lookups)."""
        self.last_error = ""


class _PendingLookup:
    __slots__ = ("keys", "local_cached_blocks", "tokens")

    def __init__(self, tokens: list[int], keys: RequestKeys | None, local_cached_blocks: int) -> None:
        self.tokens = tokens
        self.keys = keys
        self.local_cached_blocks = local_cached_blocks


def _key_query(keys: RequestKeys | None) -> dict[str, Any]:
    """The request's extra keys as :meth:`CoordinatorClient.lookup` keywords."""
    if keys is None:
        return {}
    return {"lora_name": keys.lora_name, "lora_path": keys.lora_path, "cache_salt": keys.cache_salt,
            "mm_items": keys.mm_items, "prompt_embeds_digests": keys.prompt_embeds_digests}


class LookupProbe:
    """Asks the coordinator, as a router would, how much of each prompt the nodes hold.

    The engine's loop only enqueues (never waits): one worker thread makes the real gRPC Lookup with a
    short timeout, and a full queue drops the query and counts it. Coordinator errors are counted and
    logged once per outage, so the engine keeps serving while the coordinator is down.
    """

    def __init__(self, client: CoordinatorClient, model: str, *, node_id: str | None, dp_rank: int,
                 queue_size: int = 64) -> None:
        self.client = client
        self.model = model
        self.node_id = node_id
        self.dp_rank = dp_rank
        self._queue: queue.Queue[_PendingLookup] = queue.Queue(queue_size)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._failing = False
        self.stats = LookupStats()
        self._thread = threading.Thread(target=self._run, name="sim-engine-lookups", daemon=True)
        self._thread.start()

    def submit(self, tokens: list[int], keys: RequestKeys | None, local_cached_blocks: int) -> bool:
        """Queue one lookup; False (and counted as dropped) when the worker is behind."""
        try:
            self._queue.put_nowait(_PendingLookup(tokens, keys, local_cached_blocks))
        except queue.Full:
            with self._lock:
                self.stats.dropped += 1
            return False
        return True

    def _run(self) -> None:
        while not self._closing.is_set():
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if self._closing.is_set():
                break
            self._lookup(item)

    def _lookup(self, item: _PendingLookup) -> None:
        try:
            result = self.client.lookup(self.model, tokens=item.tokens, **_key_query(item.keys))
        except Exception as exc:  # CoordinatorError, or a channel closed under us at shutdown
            with self._lock:
                self.stats.errors += 1
                self.stats.last_error = str(exc)
            if not self._failing and not self._closing.is_set():
                log.warning("sim-engine: lookups failing (counted in the state file; logged once per "
                            "outage): %s", exc)
            self._failing = True
            return
        if self._failing:
            log.info("sim-engine: lookups answered again after %d errors", self.stats.errors)
            self._failing = False
        best = result.nodes[0].matched_blocks if result.nodes else 0
        mine = next((n.matched_blocks for n in result.nodes
                     if n.node_id == self.node_id and n.dp_rank == self.dp_rank), 0)
        with self._lock:
            s = self.stats
            s.lookups += 1
            s.hits += best > 0
            s.query_blocks += result.num_blocks
            s.best_matched_blocks += best
            s.best_is_self += bool(best) and mine == best
            s.self_matched_blocks += mine
            s.local_cached_blocks += item.local_cached_blocks

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            out = {name: getattr(self.stats, name) for name in LookupStats.__slots__}
        out["pending"] = self._queue.qsize()
        return out

    def begin_close(self) -> None:
        """Tell the worker to stop after the RPC in flight (``close`` waits for it)."""
        self._closing.set()

    def close(self, timeout: float = 1.0) -> None:
        """Stop the worker (an RPC in flight ends within its timeout), then close the channel."""
        self._closing.set()
        self._thread.join(timeout)
        self.client.close()


def open_lookups(config: SimEngineConfig) -> LookupProbe | None:
    """The router-style lookups, as a started probe (None without a coordinator)."""
    if config.lookup_coordinator is None:
        return None
    from kvcoord.router.client import CoordinatorClient

    client = CoordinatorClient(config.lookup_coordinator, security=config.lookup_security,
                               timeout=config.lookup_timeout)
    return LookupProbe(client, config.lookup_model or config.model, node_id=config.lookup_node_id,
                       dp_rank=config.dp_rank, queue_size=config.lookup_queue)
