"""The one switch for kvcoord's native (C) hot paths.

Each hot path has exactly two implementations: the native one and a pure-Python one, which is both the
fallback (an install without a compiler) and the oracle the tests compare the native one against.
``KVCOORD_NATIVE=0`` turns every native path off at once (for debugging, or to measure the fallback);
``kvcoord serve`` names the paths in use at start-up and in the ``kvcoord_build_info`` metric.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

ENV = "KVCOORD_NATIVE"
enabled = os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "no", "false")


def _load() -> Any:
    if not enabled:
        return None
    try:
        from kvcoord import _indexcore, _speedups, _wirescan
    except ImportError:
        return None
    return SimpleNamespace(
        Table=_indexcore.Table,
        validate_u64_seq=_indexcore.validate_u64_seq,
        u64_view=_indexcore.u64_view,
        cbor_chain=_speedups.cbor_chain,
        pickle_chain=_speedups.pickle_chain,
        mirror_walk=_wirescan.mirror_walk,
    )


native: Any = _load()
"""The native module, or None when it is not built or ``KVCOORD_NATIVE=0``."""

PATHS = ("hash", "index", "walk")
"""Hot paths with a native implementation: hash chains, the memory index's table, the Redis holder walk."""


def native_paths() -> tuple[str, ...]:
    """The hot paths running natively in this process (empty: all pure Python)."""
    return PATHS if native is not None else ()
