"""kvcoord: a global prefix-cache index for LLM serving fleets.

Engines report the KV blocks each node holds; routers ask which node already holds the longest
prefix of a prompt. See DESIGN.md for the data flow and the module boundaries.
"""

__version__ = "0.1.0"
