"""Which event loop a kvcoord server runs: uvloop where it is installed (the ``uvloop`` extra), else asyncio.

uvloop's loop costs a request ~5 µs against asyncio's ~20 (``benchmarks/bench_loop_floor.py``): on a server
answering lookups in tens of microseconds, that is most of the difference to Dynamo's indexer. Every
long-running server (``serve``, its lookup workers, ``route``) asks here, so one variable switches them all.
"""

from __future__ import annotations

import asyncio
import os

__all__ = ["UVLOOP_ENV", "loop_name", "use_uvloop"]

UVLOOP_ENV = "KVCOORD_UVLOOP"
"""``1``/``0`` (also on/off, yes/no, true/false): overrides a command's default."""


def use_uvloop(default: bool = True) -> bool:
    """Install uvloop's event loop policy unless ``KVCOORD_UVLOOP`` says no (or ``default`` is False and it
    says nothing). True if uvloop runs; False when it is not installed (it is optional)."""
    value = os.environ.get(UVLOOP_ENV, "").strip().lower()
    if not (value not in ("0", "off", "no", "false") if value else default):
        return False
    try:
        import uvloop
    except ImportError:  # optional
        return False
    uvloop.install()
    return True


def loop_name() -> str:
    """The running event loop: ``uvloop`` or ``asyncio``."""
    return "uvloop" if type(asyncio.get_running_loop()).__module__.startswith("uvloop") else "asyncio"
