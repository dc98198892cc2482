"""Handing memory back to the OS after snapshot staging (issue 15 item 2: memory returns to within 10% of its
baseline after a flood of hostile snapshots). glibc-specific steps are skipped elsewhere."""

from __future__ import annotations

import asyncio
import ctypes
import gc
import os
from collections.abc import Callable

RECLAIM_DELAY = 0.25
"""Seconds from the end of a staged snapshot to the reclaim: by then the ended stream's own objects are
garbage."""
M_ARENA_MAX = -8
"""glibc's ``mallopt`` parameter for the number of malloc arenas."""
ARENAS = 2


def _libc(name: str) -> Callable[[int], int] | None:
    try:
        fn: Callable[[int], int] = getattr(ctypes.CDLL(None), name)
    except (OSError, AttributeError):  # not glibc
        return None
    return fn


_TRIM = _libc("malloc_trim")
_reclaim: tuple[asyncio.AbstractEventLoop, asyncio.TimerHandle] | None = None


def release_memory() -> None:
    """Soon (once for every call within ``RECLAIM_DELAY``), collect cyclic garbage, then return freed heap
    to the OS. An ended ingest RPC is a reference cycle in grpc (its state, the AbortError or
    CancelledError traceback, our frames holding its last message), and its core call keeps the stream's
    receive buffers: left to the rare full collections, each wave of refused floods stayed in the RSS
    (+10 MB a wave). glibc keeps freed heap in its arenas; the trim runs in a thread, off the loop."""
    global _reclaim
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        _collect(None)
        return
    if _reclaim is None or _reclaim[0] is not loop or _reclaim[1].cancelled():
        _reclaim = (loop, loop.call_later(RECLAIM_DELAY, _collect, loop))


def _collect(loop: asyncio.AbstractEventLoop | None) -> None:
    global _reclaim
    _reclaim = None
    gc.collect()  # ~3.5 ms with the coordinator's ~41k tracked objects
    if _TRIM is not None:
        if loop is None:
            _TRIM(0)
        else:
            loop.run_in_executor(None, _TRIM, 0)


def limit_arenas() -> bool:
    """At most ``ARENAS`` glibc malloc arenas (unless ``MALLOC_ARENA_MAX`` is set), for a process about to
    start gRPC: its threads each get an arena of their own, where freed receive buffers stay in the RSS
    (after a snapshot flood, 1.16-1.21x the baseline with one arena a thread). False where not glibc."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if _TRIM is not None else None
    if mallopt is None:
        return False
    return bool(mallopt(M_ARENA_MAX, ARENAS))
