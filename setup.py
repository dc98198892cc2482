"""Build hook for the optional C extensions; all metadata lives in pyproject.toml.

Without a compiler the install still succeeds and every hot path runs its pure-Python implementation
(identical results, slower). ``KVCOORD_REQUIRE_SPEEDUPS=1`` makes a failed C build fail the install
instead, so CI and the container image never run the slow paths unnoticed.
"""

import os

from setuptools import Extension, setup

REQUIRED = os.environ.get("KVCOORD_REQUIRE_SPEEDUPS", "") not in ("", "0")

setup(
    ext_modules=[
        Extension(f"kvcoord.{name}", [f"kvcoord/{name}.c"], optional=not REQUIRED)
        for name in ("_speedups", "_indexcore", "_wirescan")
    ]
)
