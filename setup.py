"""Build hook for the optional C accelerator; all metadata lives in pyproject.toml.

``optional=True``: without a compiler the install still succeeds and kvcoord.hashing uses its
pure-Python fast path (identical output, slower), and kvcoord.index.memory its pure-Python core.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension("kvcoord._speedups", ["kvcoord/_speedups.c"], optional=True),
        Extension("kvcoord._indexcore", ["kvcoord/_indexcore.c"], optional=True),
        Extension("kvcoord._wirescan", ["kvcoord/_wirescan.c"], optional=True),
    ]
)
