"""kvcoord.waits: ``wait_event`` reports the event or the timeout and never loses a cancellation, even
one that lands as the event is set (Python 3.11's ``asyncio.wait_for`` returns then, and a loop around
it runs on after its task was cancelled)."""

from __future__ import annotations

import asyncio

import pytest

from kvcoord.waits import wait_event


async def _waiting(coro_task: asyncio.Task[object]) -> None:
    """Yield until the task has started and is suspended in its wait (one step: no timer involved)."""
    await asyncio.sleep(0)
    assert not coro_task.done()


async def test_wait_event_says_whether_the_event_fired() -> None:
    event = asyncio.Event()
    assert await wait_event(event, 0) is False
    task = asyncio.create_task(wait_event(event, 3600))
    await _waiting(task)
    event.set()
    assert await task is True
    assert await wait_event(event, 0) is True  # already set


async def test_cancel_ends_the_wait_at_once() -> None:
    task = asyncio.create_task(wait_event(asyncio.Event(), 3600))
    await _waiting(task)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_cancel_as_the_event_is_set_stops_a_loop() -> None:
    """Set and cancel in the same loop iteration: the cancellation must reach the loop, which would
    otherwise wait again (an hour here) and hold its owner's shutdown."""
    event = asyncio.Event()
    rounds = 0

    async def loop() -> None:
        nonlocal rounds
        while True:
            await wait_event(event, 3600)
            event.clear()
            rounds += 1

    task = asyncio.create_task(loop())
    await _waiting(task)
    event.set()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and rounds == 0
