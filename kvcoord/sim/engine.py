"""The sim-engine: a stand-in vLLM engine for demos, load tests and end-to-end tests.

A real :class:`kvcoord.agent.pool.BlockPool` (its requests run by
:class:`kvcoord.agent.kv_cache_manager.KVCacheManager`) serves a seeded synthetic workload (prompts that
share a few long prefixes, plus unique suffixes and generated tokens) and every engine step's
KV events leave through :class:`kvcoord.engine.zmq_wire.ZmqEventPublisher`, exactly as vLLM
publishes them: PUB + ROUTER replay, ``buffer_steps``, DP-rank port offsets. A relay cannot tell
it from vLLM. ``--state-file`` exposes the pool's contents so a test can compare an index with it.

With ``--http-listen`` it also serves vLLM's OpenAI-compatible API (:mod:`kvcoord.sim.http`): those
requests go through the same pool, one generated token per ``--token-interval``, and publish their KV
events the same way. Everything runs on one asyncio loop, which alone owns the pool (it is not
thread-safe): workload steps and HTTP requests interleave, never race.

With ``--lookup-coordinator`` the engine also acts as its own router (:mod:`kvcoord.sim.lookups`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import random
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from kvcoord.agent.blocks import PoolExhausted
from kvcoord.agent.kv_cache_manager import KVCacheManager
from kvcoord.agent.pool import BlockPool
from kvcoord.agent.requests import Admission
from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import KVEventBatch
from kvcoord.extra_keys import RequestKeys
from kvcoord.hashing import HashProfile, check_algo
from kvcoord.sim.lookups import LookupProbe, open_lookups
from kvcoord.sim.timing import StepClock, StepCosts
from kvcoord.waits import wait_event

if TYPE_CHECKING:
    from kvcoord.transport import ChannelSecurity

log = logging.getLogger(__name__)

__all__ = ["PromptSource", "SimEngine", "SimEngineConfig", "run_sim_engine", "workload_enabled",
           "write_state"]


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
    http_listen: str | None = None
    """``HOST:PORT`` of the OpenAI-compatible HTTP server (None: no HTTP)."""
    token_interval: float = 0.002
    """Seconds per generated token of an HTTP request (streams get one chunk per token)."""
    max_num_seqs: int = 256
    """HTTP requests running at once; more wait in the queue (``vllm:num_requests_waiting``)."""
    pull_us_per_block: float | None = None
    """Honour llm-d's ``x-kv-cache-source-host-port``: copy blocks from the named peer at this cost each
    (kvcoord.sim.pull); None: the header is ignored."""
    kv_role: str | None = None
    """vLLM's ``kv_role`` for disaggregated prefill/decode over HTTP (:mod:`kvcoord.sim.pd`); None: off."""
    prefill_us_per_token: float = 0.0
    """Compute per uncached prompt token of an HTTP request, serial per engine (:mod:`kvcoord.sim.timing`)."""
    decode_ms_per_token: float = 0.0
    """One decode step, shared by the running batch (0: ``token_interval`` per token, as before)."""
    max_batch_tokens: int = 0
    """Tokens per engine step (chunked prefill's budget; 0: one whole prompt per prefill step)."""
    image_tokens: int = 576
    """Placeholder tokens per image of an HTTP chat (:mod:`kvcoord.tokenize.media`; ``<image>`` each)."""
    lookup_coordinator: str | None = None
    lookup_model: str | None = None
    lookup_node_id: str | None = None
    lookup_security: ChannelSecurity | None = None
    lookup_timeout: float = 0.5
    lookup_queue: int = 64


def workload_enabled(config: SimEngineConfig) -> bool:
    """The synthetic workload runs unless HTTP is on and ``--rate 0 --requests 0`` (serve HTTP only).
    Without HTTP, rate 0 keeps its meaning: as fast as possible."""
    return not (config.http_listen is not None and config.rate == 0 and config.requests == 0)


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


class SimEngine:
    """The pool's only owner: workload steps and HTTP requests (admit, one token at a time, finish).

    Workload requests finish at once and stay "running" (holding blocks) until more than ``concurrency``
    of them are; the oldest is finished first whenever a request needs its blocks. HTTP requests are
    admitted in arrival order while fewer than ``max_num_seqs`` run and the pool can hold them (after
    finishing every workload request if need be); the others wait. Not thread-safe: one event loop.
    """

    def __init__(self, cache: KVCacheManager, publisher: ZmqEventPublisher, workload: PromptSource, *,
                 concurrency: int, keys: RequestKeys | None = None,
                 lookups: LookupProbe | None = None, max_num_seqs: int = 256,
                 costs: StepCosts | None = None) -> None:
        self.cache = cache
        self.pool = cache.pool
        self.publisher = publisher
        self.workload = workload
        self.concurrency = concurrency
        self.keys = keys
        self.lookups = lookups
        self.max_num_seqs = max_num_seqs
        self.clock = StepClock(costs or StepCosts())
        """Prefill and decode time of HTTP requests (free by default)."""
        self.running: deque[str] = deque()
        """Workload requests holding blocks, oldest first."""
        self.requests_done = 0
        self.hit_tokens = 0
        """Prompt tokens served from the cache (every request: vLLM's ``prefix_cache_hits``)."""
        self.prompt_tokens = 0
        """Prompt tokens admitted (``prefix_cache_queries``, ``prompt_tokens``)."""
        self.generation_tokens = 0
        self.skipped = 0
        """Workload prompts dropped because HTTP requests held the pool."""
        self.last_prompt: list[int] = []
        self.http_running = 0
        self.http_done = 0
        self.closing = False
        """Set at shutdown: HTTP requests stop generating."""
        self._waiting: deque[tuple[asyncio.Future[Admission], str, list[int], RequestKeys | None]] = deque()
        self._ids = itertools.count()

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output the pool can ever hold (every block but the null one)."""
        return (self.pool.num_blocks - 1) * self.pool.block_size

    @property
    def num_waiting(self) -> int:
        """Requests not yet computing: waiting for room in the pool, or in line for prefill."""
        return sum(1 for fut, *_ in self._waiting if not fut.done()) + self.clock.queued

    @property
    def num_running(self) -> int:
        """Requests holding blocks and computing (prefilling or decoding), as vLLM counts them."""
        return self.cache.num_running - self.clock.queued

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def _admit_now(self, rid: str, prompt: list[int], keys: RequestKeys | None) -> Admission | None:
        """Admit, finishing workload requests (oldest first) until the prompt fits; None if it cannot.
        The caller publishes (one batch per engine step, as vLLM)."""
        while True:
            adm = self.cache.admit(rid, prompt, keys)
            if adm is not None:
                break
            if not self.running:
                return None
            self.cache.finish(self.running.popleft())
        self.prompt_tokens += adm.num_tokens
        self.hit_tokens += adm.num_cached_tokens
        self.last_prompt = prompt
        return adm

    def step(self) -> None:
        """One workload request through the engine: admit (evicting as needed), decode, publish."""
        rid = self.new_request_id()
        prompt = self.workload.prompt()
        if self.lookups is not None:  # a router asks before the request lands anywhere
            local = self.pool.count_cached_blocks(self.pool.hash_prompt(prompt, self.keys))
            self.lookups.submit(prompt, self.keys, local)
        adm = self._admit_now(rid, prompt, self.keys)
        if adm is None:
            if not self.skipped and not self.http_running:
                log.warning("prompt of %d tokens does not fit in the pool; skipped", len(prompt))
            self.skipped += 1
            self._publish()
            return
        self.running.append(rid)
        out = self.workload.output()
        if out:
            try:
                self.cache.extend(rid, out)
                self.generation_tokens += len(out)
            except PoolExhausted:  # the request stops generating, as a preempted one would
                log.debug("pool full while decoding %s", rid)
        while len(self.running) > self.concurrency:
            self.cache.finish(self.running.popleft())
        self.requests_done += 1
        self._publish()

    # --------------------------------------------------------------- HTTP requests

    async def admit(self, rid: str, prompt: Sequence[int], keys: RequestKeys | None) -> Admission:
        """Admit an HTTP request now, or wait in line (FIFO) until it fits. The prompt (plus its output)
        must fit in ``max_model_len``, which the caller checks."""
        tokens = list(prompt)
        if not self._waiting and self.http_running < self.max_num_seqs:
            adm = self._admit_now(rid, tokens, keys)
            if adm is not None:
                self.http_running += 1
                self._publish()  # the prefill's step: its stored (and evicted) blocks
                return adm
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        entry = (fut, rid, tokens, keys)
        self._waiting.append(entry)
        self._drain()  # in line behind nobody who could not start: start now
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # admitted just as the caller gave up
                self.finish(rid)
            else:
                with contextlib.suppress(ValueError):
                    self._waiting.remove(entry)
            raise

    def copy_prefix(self, tokens: list[int], keys: RequestKeys | None) -> int:
        """Store ``tokens``' full blocks as a peer pull would (their KV events published): admitted and
        finished at once, so they stay cached; not counted as a request. Returns the blocks newly stored."""
        adm = self._admit_now(self.new_request_id("pull"), tokens, keys)
        if adm is None:
            return 0
        self.prompt_tokens -= adm.num_tokens
        self.hit_tokens -= adm.num_cached_tokens
        self.cache.finish(adm.request_id)
        self._publish()
        return (adm.num_tokens - adm.num_cached_tokens) // self.pool.block_size

    def extend_one(self, rid: str, token: int) -> bool:
        """Append one generated token (finishing workload requests for room); False when the pool is full
        of other HTTP requests (the request then stops, as vLLM's would at its length limit)."""
        while True:
            try:
                self.cache.extend(rid, [token])
                break
            except PoolExhausted:
                if not self.running:
                    return False
                self.cache.finish(self.running.popleft())
        self.generation_tokens += 1
        self._publish()
        return True

    def finish(self, rid: str) -> None:
        """End an HTTP request and admit whoever now fits."""
        self.cache.finish(rid)
        self.http_running -= 1
        self.http_done += 1
        self._drain()

    def _drain(self) -> None:
        while self._waiting and self.http_running < self.max_num_seqs:
            fut, rid, prompt, keys = self._waiting[0]
            if fut.done():  # its caller went away
                self._waiting.popleft()
                continue
            adm = self._admit_now(rid, prompt, keys)
            if adm is None:
                return
            self._waiting.popleft()
            self.http_running += 1
            self._publish()
            fut.set_result(adm)

    def _publish(self) -> None:
        events = self.pool.take_events()
        if events:
            self.publisher.publish(KVEventBatch(time.time(), tuple(events), None))

    def state(self) -> dict[str, Any]:
        snap = self.pool.snapshot()
        out = {
            "blocks": {str(dp): [[int(h), int(t)] for h, t in entries] for dp, entries in snap.items()},
            "next_seq": self.publisher.queued_seq,  # the blocks listed are in the batches before it
            "pid": os.getpid(),
            "requests_done": self.requests_done,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
            "generation_tokens": self.generation_tokens,
            "skipped": self.skipped,
            "http": {"running": self.http_running - self.clock.queued, "waiting": self.num_waiting,
                     "done": self.http_done, "prefilled_tokens": self.clock.prefilled},
        }
        if self.lookups is not None:
            out["lookup"] = self.lookups.snapshot()
        return out


def write_state(path: Path, state: Any) -> None:
    """Atomically replace ``path`` with ``state`` as JSON (readers never see a half-written file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


class _Driver:
    """The workload loop, its state-file writes and its SIGUSR1 bursts, on the engine's event loop."""

    def __init__(self, engine: SimEngine, config: SimEngineConfig) -> None:
        self.engine = engine
        self.config = config
        self.stop = asyncio.Event()
        self.wake = asyncio.Event()
        self.bursts = 0
        self.target = config.requests
        self.state_file = Path(config.state_file) if config.state_file else None
        self.prompt_file = Path(config.prompt_file) if config.prompt_file else None

    def on_stop(self) -> None:
        self.stop.set()
        self.wake.set()

    def on_more(self) -> None:
        self.bursts += 1
        self.wake.set()

    def write_files(self, *, flush: bool, finished: bool = False) -> None:
        """State and prompt files. ``flush`` first waits (bounded) for queued batches to leave, so a reader
        that queries the coordinator next finds them; the loop is blocked that long, on purpose. The
        state's ``next_seq`` counts queued batches, so it covers the blocks it lists even when the wait
        ran out."""
        engine = self.engine
        if flush and (self.state_file is not None or self.prompt_file is not None):
            engine.publisher.flush(1.0)
        if self.state_file is not None:
            write_state(self.state_file, {**engine.state(), "target": self.target, "finished": finished})
        if self.prompt_file is not None and engine.last_prompt:
            write_state(self.prompt_file, engine.last_prompt)

    async def serve(self, interval: float) -> None:
        """Serve workload requests at ``interval`` until ``target`` are done (0: until ``stop``)."""
        engine = self.engine
        next_at = time.monotonic()
        last_state = 0.0
        while not self.stop.is_set() and (self.target == 0 or engine.requests_done < self.target):
            engine.step()
            now = time.monotonic()
            if now - last_state >= self.config.state_interval:
                self.write_files(flush=True)
                last_state = now
            next_at += interval
            delay = next_at - time.monotonic()
            if delay > 0:
                await wait_event(self.stop, delay)
            else:  # as fast as possible, but HTTP requests and signals still get their turn
                next_at = time.monotonic()
                await asyncio.sleep(0)

    def _finished(self) -> bool:
        return self.engine.requests_done >= self.target > 0

    async def run(self) -> None:
        """The workload (unless HTTP-only), then lingering (replay, HTTP) until SIGTERM or SIGUSR1."""
        config = self.config
        interval = 1.0 / config.rate if config.rate > 0 else 0.0
        workload = workload_enabled(config)
        linger = config.linger or config.http_listen is not None
        refresh = config.state_interval if config.http_listen is not None else 0.5
        while True:
            if workload:
                await self.serve(interval)
            if not self.stop.is_set():  # on SIGTERM, shutdown() sends what it can in its own bound
                self.engine.publisher.flush(1.0)
            self.write_files(flush=False, finished=self._finished())
            # After --requests, keep serving replay requests (a real engine stays up) until signalled;
            # SIGUSR1 asks for another --requests requests (load tests drive bursts this way).
            bursts_apply = workload and config.requests > 0
            while not self.stop.is_set() and linger and not (bursts_apply and self.bursts):
                if not bursts_apply:  # HTTP only, or an endless workload: nothing to add
                    self.bursts = 0
                await wait_event(self.wake, refresh)
                self.wake.clear()
                if self.state_file is not None and (self.engine.lookups is not None or config.http_listen):
                    self.write_files(flush=config.http_listen is not None, finished=self._finished())
            if self.stop.is_set() or self.bursts == 0 or config.requests == 0:
                break
            self.target += self.bursts * config.requests
            self.bursts = 0
            log.info("sim-engine: SIGUSR1, serving up to request %d", self.target)


def _build(config: SimEngineConfig) -> SimEngine:
    """Pool, lookups and a bound publisher; nothing is left open when one of them fails."""
    profile = HashProfile(algo=check_algo(config.algo), block_size=config.block_size, seed=config.hash_seed)
    profile.resolved_seed()  # an unresolvable seed is a usage error now, not a crash at the first request
    if config.http_listen is not None:
        from kvcoord.transport import check_bindable

        check_bindable(config.http_listen)  # port in use: one line, before anything is published
    keys = RequestKeys(cache_salt=config.cache_salt) if config.cache_salt is not None else None
    pool = BlockPool(config.num_blocks, profile, hash_form=config.hash_form, medium=config.medium,
                     dp_rank=config.dp_rank, removal_events=config.removal_events)
    lookups = open_lookups(config)
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
    costs = StepCosts(config.prefill_us_per_token * 1e-6, config.decode_ms_per_token * 1e-3,
                      config.max_batch_tokens)
    return SimEngine(KVCacheManager(pool), publisher, workload, concurrency=config.concurrency, keys=keys,
                     lookups=lookups, max_num_seqs=config.max_num_seqs, costs=costs)


async def _main(engine: SimEngine, config: SimEngineConfig) -> None:
    driver = _Driver(engine, config)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, driver.on_stop)
    loop.add_signal_handler(signal.SIGUSR1, driver.on_more)
    server = None
    try:
        if config.http_listen is not None:
            from kvcoord.sim.http import SimHttpServer

            server = SimHttpServer(engine, model=config.model, token_interval=config.token_interval,
                                   default_max_tokens=config.output_len, dp_rank=config.dp_rank,
                                   pull_us_per_block=config.pull_us_per_block, kv_role=config.kv_role,
                                   image_tokens=config.image_tokens)
            await server.start(config.http_listen)
        await driver.run()
    finally:
        engine.closing = True
        if server is not None:
            await server.close()
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            loop.remove_signal_handler(sig)


def run_sim_engine(config: SimEngineConfig) -> None:
    """Serve until SIGTERM/SIGINT (or ``requests`` are done, unless ``linger`` or HTTP)."""
    engine = _build(config)
    publisher, lookups = engine.publisher, engine.lookups
    log.info("sim-engine %s: publishing on %s (replay %s), dp rank %d", config.model, publisher.endpoint,
             publisher.replay_endpoint, config.dp_rank)
    if lookups is not None:
        log.info("sim-engine: looking up each prompt on %s (model %s)", config.lookup_coordinator,
                 lookups.model)
    try:
        asyncio.run(_main(engine, config))
    finally:
        if lookups is not None:
            lookups.begin_close()  # its worker winds down while the publisher drains
        publisher.shutdown()
        if lookups is not None:
            lookups.close()
    log.info("sim-engine: %d requests, %.1f%% prompt tokens from cache", engine.requests_done,
             100.0 * engine.hit_tokens / max(1, engine.prompt_tokens))
    if engine.http_done:
        log.info("sim-engine: %d HTTP requests served", engine.http_done)
    if lookups is not None:
        st = lookups.snapshot()
        log.info("sim-engine: %d lookups (%d hits), %d errors, %d dropped", st["lookups"], st["hits"],
                 st["errors"], st["dropped"])
