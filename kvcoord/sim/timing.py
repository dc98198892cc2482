"""The sim-engine's compute clock: what prefill and decode cost, so TTFT depends on the cached prefix.

A real engine's scheduler runs steps. Each step serves one token for every decoding request, plus as
much prefill as the step's token budget leaves (vLLM's chunked prefill, ``--max-num-batched-tokens``).
:class:`StepClock` models exactly that, one step at a time on the engine's event loop:

- a step costs ``decode_s`` when any request decodes in it (a decode step reads the weights once for
  the whole batch, so its time is shared, not per request), plus ``prefill_s_per_token`` per prefill
  token in it;
- prefills wait in one FIFO: the budget (``max_batch_tokens`` minus the step's decodes) goes to the
  head, then the next. Without a budget (0) a step prefills exactly one whole prompt. Either way
  prompts finish their prefill one after another, in arrival order, as compute allows;
- a request's first token comes at the end of the step that completes its prefill; only the
  *uncached* tokens are prefilled, so a cached prefix shortens TTFT, and a queue lengthens it.

Steps are timed against the monotonic clock: each ends at ``previous end + its cost`` (the event loop
sleeps until then), so Python's overhead is absorbed rather than added, and the engine's throughput
is the model's. After a stall the clock restarts from now (no burst of catch-up steps).

Queued prefills (not yet in a step) count as *waiting* (``vllm:num_requests_waiting``): that is where
a real engine's queue shows, and how a router sees it.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["StepClock", "StepCosts"]

_SLACK = 0.05
"""Seconds a step may start late and still end on the model's schedule (loop wake-ups, handlers)."""


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What one step costs (``kvcoord sim-engine --prefill-us-per-token`` and friends); 0 = free."""

    prefill_s_per_token: float = 0.0
    decode_s: float = 0.0
    """One decode step, whatever the batch size (0: decode timing stays ``--token-interval``'s)."""
    max_batch_tokens: int = 0
    """Tokens per step, decodes first (0: no chunking: one whole prompt per step)."""

    @property
    def enabled(self) -> bool:
        return self.prefill_s_per_token > 0 or self.decode_s > 0


class _Prefill:
    __slots__ = ("done", "remaining", "started")

    def __init__(self, tokens: int, done: asyncio.Future[None]) -> None:
        self.remaining = tokens
        self.done = done
        self.started = False


class StepClock:
    """The engine's step loop: a task that runs while there is work, idle otherwise. One event loop."""

    def __init__(self, costs: StepCosts) -> None:
        self.costs = costs
        self._prefills: deque[_Prefill] = deque()
        self._decoders: list[asyncio.Future[None]] = []
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._next_at = 0.0
        self.steps = 0
        self.prefilled = 0
        """Prompt tokens prefilled (uncached ones only)."""

    @property
    def queued(self) -> int:
        """Prefills not yet started: waiting requests, in vLLM's terms."""
        return sum(1 for p in self._prefills if not p.started and not p.done.done())

    async def prefill(self, tokens: int) -> None:
        """Return when ``tokens`` uncached prompt tokens are prefilled (at once when prefill is free)."""
        if self.costs.prefill_s_per_token <= 0:
            return
        item = _Prefill(max(1, tokens), asyncio.get_running_loop().create_future())
        self._prefills.append(item)
        self._kick()
        try:
            await item.done
        finally:
            if not item.done.done():  # the caller went away: its tokens leave the queue
                with contextlib.suppress(ValueError):
                    self._prefills.remove(item)

    async def decode(self, fallback: float) -> None:
        """Wait for this request's next token: the next decode step, or ``fallback`` seconds when decode
        is free in this model (the engine's ``--token-interval``)."""
        if self.costs.decode_s <= 0:
            await asyncio.sleep(fallback)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._decoders.append(fut)
        self._kick()
        await fut

    def _kick(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="sim-step-clock")

    def _plan(self) -> tuple[list[asyncio.Future[None]], list[tuple[_Prefill, int]], float]:
        """This step's decodes and prefill chunks, and its cost in seconds."""
        c = self.costs
        decoders = [f for f in self._decoders if not f.done()]
        self._decoders = []
        while self._prefills and self._prefills[0].done.done():
            self._prefills.popleft()
        budget = c.max_batch_tokens - len(decoders) if c.max_batch_tokens > 0 else math.inf
        chunks: list[tuple[_Prefill, int]] = []
        for item in self._prefills:
            if budget <= 0 or (c.max_batch_tokens <= 0 and chunks):
                break
            if item.done.done():
                continue
            n = int(min(item.remaining, budget))
            chunks.append((item, n))
            budget -= n
        cost = (c.decode_s if decoders else 0.0) + c.prefill_s_per_token * sum(n for _, n in chunks)
        return decoders, chunks, cost

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            decoders, chunks, cost = self._plan()
            if not decoders and not chunks:
                self._wake.clear()
                self._next_at = 0.0  # idle time is not compute: the next step starts when work comes
                if not self._decoders and not self._prefills:
                    return  # idle: the next request starts a new task
                await self._wake.wait()
                continue
            for item, _ in chunks:
                item.started = True
            now = time.monotonic()
            start = self._next_at if now - self._next_at < _SLACK else now  # overhead absorbed, stalls not
            self._next_at = start + cost
            delay = self._next_at - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.steps += 1
            for item, n in chunks:
                item.remaining -= n
                self.prefilled += n
                if item.remaining <= 0:
                    with contextlib.suppress(ValueError):
                        self._prefills.remove(item)
                    if not item.done.done():
                        item.done.set_result(None)
            for fut in decoders:
                if not fut.done():
                    fut.set_result(None)
            await asyncio.sleep(0)  # the requests just served ask for their next token in the next step
