"""Build hook for the optional C extensions; all metadata lives in pyproject.toml.

``kvcoord._native`` (sources in ``kvcoord/_native/``) holds every hot path's C implementation; the
switch that uses or ignores it is ``kvcoord/native.py`` (``KVCOORD_NATIVE=0``).

Without a compiler the install still succeeds and every hot path runs its pure-Python implementation
(identical results, slower). ``KVCOORD_REQUIRE_SPEEDUPS=1`` makes a failed C build fail the install
instead, so CI and the container image never run the slow paths unnoticed.

SHA-256 chains are hashed in C with OpenSSL's libcrypto when its headers are found (Debian:
``libssl-dev``); without them the C chain calls ``hashlib`` per block, as before. XXH3 is vendored.
"""

import os
import sys
import tempfile
from glob import glob

from setuptools import Extension, setup

REQUIRED = os.environ.get("KVCOORD_REQUIRE_SPEEDUPS", "") not in ("", "0")
NATIVE = "kvcoord/_native"


def _has_libcrypto() -> bool:
    """Whether a program using OpenSSL's SHA256 compiles and links here."""
    from setuptools._distutils.ccompiler import new_compiler
    from setuptools._distutils.errors import CompileError, LinkError
    from setuptools._distutils.sysconfig import customize_compiler

    cc = new_compiler()
    customize_compiler(cc)
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        with open(src, "w") as fh:
            fh.write("#include <openssl/sha.h>\nint main(void){unsigned char d[32];"
                     "SHA256((const unsigned char*)\"\", 0, d);return d[0] & 0;}\n")
        try:
            objs = cc.compile([src], output_dir=tmp)
            # linked as the extension will be (LDSHARED carries LDFLAGS, e.g. the sanitizers' runtime)
            cc.link_shared_object(objs, os.path.join(tmp, "probe.so"), libraries=["crypto"])
        except (CompileError, LinkError, OSError):
            return False
    return True


openssl = os.environ.get("KVCOORD_OPENSSL", "auto") != "0" and _has_libcrypto()
if not openssl:
    if REQUIRED:
        sys.exit("kvcoord: KVCOORD_REQUIRE_SPEEDUPS is set but OpenSSL's libcrypto headers are missing "
                 "(Debian: apt-get install libssl-dev)")
    print("kvcoord: OpenSSL (libcrypto) not found; SHA-256 chains call hashlib per block", file=sys.stderr)

setup(
    ext_modules=[
        Extension(
            "kvcoord._native",
            sorted(glob(f"{NATIVE}/*.c")),
            depends=sorted(glob(f"{NATIVE}/*.h") + glob(f"{NATIVE}/vendor/*.h")),
            define_macros=[("KVN_HAVE_OPENSSL", "1")] if openssl else [],
            libraries=["crypto"] if openssl else [],
            optional=not REQUIRED,
        ),
    ]
)
