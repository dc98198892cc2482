"""Waiting with a timeout without losing a cancellation.

On Python 3.11 ``asyncio.wait_for`` returns the inner result when its task is cancelled just as the
inner awaitable completes: the ``cancel()`` is lost, and a ``while`` loop around it runs on, so a
shutdown that cancels the loop's task hangs. ``asyncio.timeout`` (3.11) keeps the cancellation, so
every wait in kvcoord that a loop repeats, or whose task is cancelled to stop it, uses it
(``scripts/check_structure.py`` fails on ``asyncio.wait_for`` inside a loop).
"""

from __future__ import annotations

import asyncio

__all__ = ["wait_event"]


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds; True when it was set, False on timeout.
    A cancellation of the waiting task always propagates, even one that lands as the event is set."""
    try:
        async with asyncio.timeout(timeout):
            return await event.wait()
    except TimeoutError:
        return False
