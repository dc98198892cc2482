"""``kvcoord sim-engine``: a stand-in vLLM engine for demos, load tests and end-to-end tests.

A real :class:`kvcoord.agent.pool.BlockPool` serves a seeded synthetic workload (prompts that
share a few long prefixes, plus unique suffixes and generated tokens) and every engine step's
KV events leave through :class:`kvcoord.agent.zmq_wire.ZmqEventPublisher`, exactly as vLLM
publishes them: PUB + ROUTER replay, ``buffer_steps``, DP-rank port offsets. A relay cannot tell
it from vLLM. ``--state-file`` exposes the pool's contents so a test can compare an index with it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import threading
import time
from collections import deque
from pathlib import Path
from types import FrameType
from typing import Any

from kvcoord.agent.pool import BlockPool
from kvcoord.agent.zmq_wire import ZmqEventPublisher
from kvcoord.events import KVEventBatch
from kvcoord.hashing import HashProfile

log = logging.getLogger(__name__)


class Workload:
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
    """Admits requests into the pool, finishes the oldest beyond ``concurrency``, publishes per step."""

    def __init__(self, pool: BlockPool, publisher: ZmqEventPublisher, workload: Workload, *,
                 concurrency: int) -> None:
        self.pool = pool
        self.publisher = publisher
        self.workload = workload
        self.concurrency = concurrency
        self.running: deque[str] = deque()
        self.requests_done = 0
        self.hit_tokens = 0
        self.prompt_tokens = 0
        self._next_id = 0

    def step(self) -> None:
        """One request through the engine: admit (evicting as needed), decode, publish the events."""
        rid = f"req-{self._next_id}"
        self._next_id += 1
        prompt = self.workload.prompt()
        while True:
            adm = self.pool.admit(rid, prompt)
            if adm is not None:
                break
            if not self.running:
                log.warning("prompt of %d tokens does not fit in the pool; skipped", len(prompt))
                self._publish()
                return
            self.pool.finish(self.running.popleft())
        self.prompt_tokens += adm.num_tokens
        self.hit_tokens += adm.num_cached_tokens
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
        return {
            "blocks": {str(dp): [[int(h), int(t)] for h, t in entries] for dp, entries in snap.items()},
            "next_seq": self.publisher.next_seq,
            "pid": os.getpid(),
            "requests_done": self.requests_done,
            "prompt_tokens": self.prompt_tokens,
            "hit_tokens": self.hit_tokens,
        }


def write_state(path: Path, state: dict[str, Any]) -> None:
    """Atomically replace ``path`` (readers never see a half-written file)."""
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def _serve(engine: SimEngine, args: argparse.Namespace, interval: float, target: int, stop: threading.Event,
           state_file: Path | None) -> None:
    """Serve requests at ``interval`` until ``target`` are done (0: until ``stop``)."""
    next_at = time.monotonic()
    last_state = 0.0
    while not stop.is_set() and (target == 0 or engine.requests_done < target):
        engine.step()
        now = time.monotonic()
        if state_file is not None and now - last_state >= args.state_interval:
            engine.publisher.flush(1.0)
            write_state(state_file, {**engine.state(), "target": target, "finished": False})
            last_state = now
        next_at += interval
        delay = next_at - time.monotonic()
        if delay > 0:
            stop.wait(delay)
        else:
            next_at = time.monotonic()


def run_sim_engine(args: argparse.Namespace) -> int:
    """Body of ``kvcoord sim-engine``."""
    for name in ("block_size", "num_blocks", "concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.rate < 0 or args.requests < 0:
        raise ValueError("--rate and --requests must be >= 0")
    profile = HashProfile(algo=args.algo, block_size=args.block_size, seed=args.hash_seed)
    pool = BlockPool(args.num_blocks, profile, hash_form=args.hash_form, medium=args.medium,
                     dp_rank=args.dp_rank, removal_events=args.removal_events)
    publisher = ZmqEventPublisher(args.dp_rank, args.zmq_bind, args.replay_bind,
                                  buffer_steps=args.buffer_steps, hwm=args.hwm, topic=args.topic,
                                  form=args.form)
    workload = Workload(args.seed, prefixes=args.prefixes, prefix_len=args.prefix_len,
                        suffix_len=args.suffix_len, output_len=args.output_len)
    engine = SimEngine(pool, publisher, workload, concurrency=args.concurrency)
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
    state_file = Path(args.state_file) if args.state_file else None
    log.info("sim-engine %s: publishing on %s (replay %s), dp rank %d", args.model, publisher.endpoint,
             publisher.replay_endpoint, args.dp_rank)
    interval = 1.0 / args.rate if args.rate > 0 else 0.0
    target = args.requests
    try:
        while True:
            _serve(engine, args, interval, target, stop, state_file)
            publisher.flush(1.0)
            if state_file is not None:
                write_state(state_file, {**engine.state(), "target": target,
                                         "finished": engine.requests_done >= target > 0})
            # After --requests, keep serving replay requests (a real engine stays up) until signalled;
            # SIGUSR1 asks for another --requests requests (load tests drive bursts this way).
            while not stop.is_set() and args.linger and bursts[0] == 0:
                wake.wait(0.5)
                wake.clear()
            if stop.is_set() or bursts[0] == 0 or args.requests == 0:
                break
            target += bursts[0] * args.requests
            bursts[0] = 0
            log.info("sim-engine: SIGUSR1, serving up to request %d", target)
    finally:
        publisher.shutdown()
    log.info("sim-engine: %d requests, %.1f%% prompt tokens from cache", engine.requests_done,
             100.0 * engine.hit_tokens / max(1, engine.prompt_tokens))
    return 0
