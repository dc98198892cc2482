"""Build hook for the optional C extensions; all metadata lives in pyproject.toml.

``kvcoord._native`` (sources in ``kvcoord/_native/``) holds every hot path's C implementation; the
switch that uses or ignores it is ``kvcoord/native.py`` (``KVCOORD_NATIVE=0``).

Without a compiler the install still succeeds and every hot path runs its pure-Python implementation
(identical results, slower). ``KVCOORD_REQUIRE_SPEEDUPS=1`` makes a failed C build fail the install
instead, so CI and the container image never run the slow paths unnoticed.
"""

import os
from glob import glob

from setuptools import Extension, setup

REQUIRED = os.environ.get("KVCOORD_REQUIRE_SPEEDUPS", "") not in ("", "0")
NATIVE = "kvcoord/_native"

setup(
    ext_modules=[
        Extension(
            "kvcoord._native",
            sorted(glob(f"{NATIVE}/*.c")),
            depends=sorted(glob(f"{NATIVE}/*.h")),
            optional=not REQUIRED,
        ),
    ]
)
