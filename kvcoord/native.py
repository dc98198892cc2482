"""The one switch for kvcoord's native (C) hot paths.

Each hot path has exactly two implementations: the native one, in the C extension ``kvcoord._native``
(sources in ``kvcoord/_native/``), and a pure-Python one, which is both the fallback (an install without
a compiler) and the oracle the tests compare the native one against. ``KVCOORD_NATIVE=0`` turns every
native path off at once (for debugging, or to measure the fallback); ``kvcoord serve`` names the paths in
use at start-up and in the ``kvcoord_build_info`` metric.

Callers use :data:`native` (never the extension itself) and take their Python path when it is None.
"""

from __future__ import annotations

import os

ENV = "KVCOORD_NATIVE"
enabled = os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "no", "false")
"""False when ``KVCOORD_NATIVE`` is ``0``, ``off``, ``no`` or ``false`` (read once, at import)."""

if enabled:
    try:
        from kvcoord import _native as native
    except ImportError:  # installed without a C compiler: every hot path runs in Python
        native = None  # type: ignore[assignment]
    else:
        if not hasattr(native, "Table"):  # not built: the source folder kvcoord/_native/ imported as a
            native = None  # type: ignore[assignment]  # namespace package
else:
    native = None  # type: ignore[assignment]
# ``native``: the extension module, or None when it is not built or ``KVCOORD_NATIVE=0``.

PATHS = ("hash", "index", "walk", "json")
"""Hot paths with a native implementation: hash chains, the memory index's table (its matches, and the
packed rows the HTTP API's fast path answers from), the Redis holder walk, the HTTP API's integer arrays."""


def native_paths() -> tuple[str, ...]:
    """The hot paths running natively in this process (empty: all pure Python); ``hash`` names the digests
    hashed in C too, e.g. ``hash(sha256+xxh3_128)`` (``sha256`` needs OpenSSL at build time)."""
    if native is None:
        return ()
    digests = "+".join(sorted(native.C_DIGESTS))
    return tuple(f"hash({digests})" if p == "hash" else p for p in PATHS)


__all__ = ["ENV", "PATHS", "enabled", "native", "native_paths"]
