"""The sim-engine: a stand-in vLLM engine for demos, load tests and end-to-end tests.

A real :class:`kvcoord.agent.pool.BlockPool` serves a seeded synthetic workload (prompts that
share a few long prefixes, plus unique suffixes and generated tokens) and every engine step's
KV events leave through :class:`kvcoord.engine.zmq_wire.ZmqEventPublisher`, exactly as vLLM
publishes them: PUB + ROUTER replay, ``buffer_steps``, DP-rank port offsets. A relay cannot tell
it from vLLM. ``--state-file`` exposes the pool's contents so a test can compare an index with it.

With ``--lookup-coordinator`` the engine also acts as its own router: before admitting a request it
asks the coordinator (a real gRPC Lookup, off the hot loop) how much of the prompt each node holds,
so a demo shows live lookups and hit rates with nothing but ``kvcoord`` commands.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, Literal

from kvcoord.agent.pool import BlockPool
from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import KVEventBatch
from kvcoord.hashing import HashProfile, RequestKeys, check_algo

if TYPE_CHECKING:
    from kvcoord.router.client import CoordinatorClient
    from kvcoord.transport import ChannelSecurity

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SimEngineConfig:
    """One stand-in engine: its pool, hash profile, publisher and workload (``kvcoord sim-engine --help``)."""

    zmq_bind: str = "tcp://*:5557"
    replay_bind: str | None = None
    topic: str = ""
    model: str = "sim-model"
    dp_rank: int = 0
    block_size: int = 16
    num_blocks: int = 2048
    algo: str = "sha256_cbor"
    hash_seed: str | None = None
    hash_form: Literal["int", "bytes"] = "int"
    medium: str = "GPU"
    seed: int = 0
    rate: float = 20.0
    requests: int = 0
    linger: bool = False
    concurrency: int = 8
    prefixes: int = 8
    prefix_len: int = 256
    suffix_len: int = 64
    output_len: int = 32
    buffer_steps: int = 10_000
    hwm: int = 100_000
    form: Literal["map", "array"] = "map"
    removal_events: Literal["vllm", "last_copy"] = "vllm"
    state_file: str | None = None
    state_interval: float = 0.2
    prompt_file: str | None = None
    """Where the last prompt served is written (a JSON list of token ids, what ``kvcoord lookup
    --tokens-file`` and ``kvcoord hash`` read), every ``state_interval``."""
    cache_salt: str | None = None
    lookup_coordinator: str | None = None
    lookup_model: str | None = None
    lookup_node_id: str | None = None
    lookup_security: ChannelSecurity | None = None
    lookup_timeout: float = 0.5
    lookup_queue: int = 64


class PromptSource:
    """Seeded shared-prefix prompts: ``prefixes`` system prompts, Zipf-popular, plus unique suffixes."""

    __slots__ = ("_prefixes", "_rng", "_weights", "output_len", "suffix_len", "vocab")

    def __init__(self, seed: int, *, prefixes: int, prefix_len: int, suffix_len: int, output_len: int,
                 vocab: int = 32_000) -> None:
        self._rng = random.Random(seed)
        self.vocab = vocab
        self.suffix_len = suffix_len
        self.output_len = output_len
        self._prefixes = [[self._rng.randrange(vocab) for _ in range(prefix_len)] for _ in range(prefixes)]
        self._weights = [1.0 / (i + 1) for i in range(prefixes)]

    def prompt(self) -> list[int]:
        rng = self._rng
        prefix = rng.choices(self._prefixes, self._weights)[0] if self._prefixes else []
        return prefix + [rng.randrange(self.vocab) for _ in range(rng.randint(1, max(1, self.suffix_len)))]

    def output(self) -> list[int]:
        return [self._rng.randrange(self.vocab) for _ in range(self.output_len)]


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


class SimEngine:
    """Admits requests into the pool, finishes the oldest beyond ``concurrency``, publishes per step."""

    def __init__(self, pool: BlockPool, publisher: ZmqEventPublisher, workload: PromptSource, *,
                 concurrency: int, keys: RequestKeys | None = None,
                 lookups: LookupProbe | None = None) -> None:
        self.pool = pool
        self.publisher = publisher
        self.workload = workload
        self.concurrency = concurrency
        self.keys = keys
        self.lookups = lookups
        self.running: deque[str] = deque()
        self.requests_done = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self.last_prompt: list[int] = []
        self._next_id = 0

    def step(self) -> None:
        """One request through the engine: admit (evicting as needed), decode, publish the events."""
        rid = f"req-{self._next_id}"
        self._next_id += 1
        prompt = self.workload.prompt()
        if self.lookups is not None:  # a router asks before the request lands anywhere
            local = self.pool.count_cached_blocks(self.pool.hash_prompt(prompt, self.keys))
            self.lookups.submit(prompt, self.keys, local)
        while True:
            adm = self.pool.admit(rid, prompt, self.keys)
            if adm is not None:
                break
            if not self.running:
                log.warning("prompt of %d tokens does not fit in the pool; skipped", len(prompt))
                self._publish()
                return
            self.pool.finish(self.running.popleft())
        self.prompt_tokens += adm.num_tokens
        self.hit_tokens += adm.num_cached_tokens
        self.last_prompt = prompt
        self.running.append(rid)
        out = self.workload.output()
        if out:
            try:
                self.pool.extend(rid, out)
            except Exception:  # PoolExhausted: the request stops generating, as a preempted one would
                log.debug("pool full while decoding %s", rid)
        while len(self.running) > self.concurrency:
            self.pool.finish(self.running.popleft())
        self.requests_done += 1
        self._publish()

    def _publish(self) -> None:
        events = self.pool.take_events()
        if events:
            self.publisher.publish(KVEventBatch(time.time(), tuple(events), None))

    def state(self) -> dict[str, Any]:
        snap = self.pool.snapshot()
        out = {
            "blocks": {str(dp): [[int(h), int(t)] for h, t in entries] for dp, entries in snap.items()},
            "next_seq": self.publisher.next_seq,
            "pid": os.getpid(),
            "requests_done": self.requests_done,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
        }
        if self.lookups is not None:
            out["lookup"] = self.lookups.snapshot()
        return out


def write_state(path: Path, state: Any) -> None:
    """Atomically replace ``path`` with ``state`` as JSON (readers never see a half-written file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _serve(engine: SimEngine, config: SimEngineConfig, interval: float, target: int, stop: threading.Event,
           state_file: Path | None) -> None:
    """Serve requests at ``interval`` until ``target`` are done (0: until ``stop``)."""
    next_at = time.monotonic()
    last_state = 0.0
    prompt_file = Path(config.prompt_file) if config.prompt_file else None
    while not stop.is_set() and (target == 0 or engine.requests_done < target):
        engine.step()
        now = time.monotonic()
        if now - last_state >= config.state_interval:
            if state_file is not None or prompt_file is not None:
                engine.publisher.flush(1.0)
            if state_file is not None:
                write_state(state_file, {**engine.state(), "target": target, "finished": False})
            if prompt_file is not None and engine.last_prompt:
                write_state(prompt_file, engine.last_prompt)
            last_state = now
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()


def _open_lookups(config: SimEngineConfig) -> LookupProbe | None:
    """The router-style lookups, as a started probe (None without a coordinator)."""
    if config.lookup_coordinator is None:
        return None
    from kvcoord.router.client import CoordinatorClient

    client = CoordinatorClient(config.lookup_coordinator, security=config.lookup_security,
                               timeout=config.lookup_timeout)
    return LookupProbe(client, config.lookup_model or config.model, node_id=config.lookup_node_id,
                       dp_rank=config.dp_rank, queue_size=config.lookup_queue)


def run_sim_engine(config: SimEngineConfig) -> None:
    """Serve until SIGTERM/SIGINT (or ``requests`` are done, unless ``linger``)."""
    profile = HashProfile(algo=check_algo(config.algo), block_size=config.block_size, seed=config.hash_seed)
    profile.resolved_seed()  # an unresolvable seed is a usage error now, not a crash at the first request
    keys = RequestKeys(cache_salt=config.cache_salt) if config.cache_salt is not None else None
    pool = BlockPool(config.num_blocks, profile, hash_form=config.hash_form, medium=config.medium,
                     dp_rank=config.dp_rank, removal_events=config.removal_events)
    lookups = _open_lookups(config)
    try:
        publisher = ZmqEventPublisher(config.dp_rank, config.zmq_bind, config.replay_bind,
                                      buffer_steps=config.buffer_steps, hwm=config.hwm, topic=config.topic,
                                      form=config.form, bind=True)
    except BaseException:
        if lookups is not None:
            lookups.close()
        raise
    workload = PromptSource(config.seed, prefixes=config.prefixes, prefix_len=config.prefix_len,
                            suffix_len=config.suffix_len, output_len=config.output_len)
    engine = SimEngine(pool, publisher, workload, concurrency=config.concurrency, keys=keys, lookups=lookups)
    stop = threading.Event()
    wake = threading.Event()
    bursts = [0]

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()
        wake.set()

    def on_more(signum: int, frame: FrameType | None) -> None:
        bursts[0] += 1
        wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGUSR1, on_more)
    state_file = Path(config.state_file) if config.state_file else None
    log.info("sim-engine %s: publishing on %s (replay %s), dp rank %d", config.model, publisher.endpoint,
             publisher.replay_endpoint, config.dp_rank)
    if lookups is not None:
        log.info("sim-engine: looking up each prompt on %s (model %s)", config.lookup_coordinator,
                 lookups.model)
    interval = 1.0 / config.rate if config.rate > 0 else 0.0
    target = config.requests
    try:
        while True:
            _serve(engine, config, interval, target, stop, state_file)
            if not stop.is_set():  # on SIGTERM, shutdown() below sends what it can in its own bound
                publisher.flush(1.0)
            if state_file is not None:
                write_state(state_file, {**engine.state(), "target": target,
                                         "finished": engine.requests_done >= target > 0})
            if config.prompt_file and engine.last_prompt:
                write_state(Path(config.prompt_file), engine.last_prompt)
            # After --requests, keep serving replay requests (a real engine stays up) until signalled;
            # SIGUSR1 asks for another --requests requests (load tests drive bursts this way).
            while not stop.is_set() and config.linger and bursts[0] == 0:
                wake.wait(0.5)
                wake.clear()
                if state_file is not None and lookups is not None:  # answers still arriving
                    write_state(state_file, {**engine.state(), "target": target,
                                             "finished": engine.requests_done >= target > 0})
            if stop.is_set() or bursts[0] == 0 or config.requests == 0:
                break
            target += bursts[0] * config.requests
            bursts[0] = 0
            log.info("sim-engine: SIGUSR1, serving up to request %d", target)
    finally:
        if lookups is not None:
            lookups.begin_close()  # its worker winds down while the publisher drains
        publisher.shutdown()
        if lookups is not None:
            lookups.close()
    log.info("sim-engine: %d requests, %.1f%% prompt tokens from cache", engine.requests_done,
             100.0 * engine.hit_tokens / max(1, engine.prompt_tokens))
    if lookups is not None:
        st = lookups.snapshot()
        log.info("sim-engine: %d lookups (%d hits), %d errors, %d dropped", st["lookups"], st["hits"],
                 st["errors"], st["dropped"])
