"""The roles an engine may declare in disaggregated prefill and decode (its agent's ``--role``, its Hello's
``role``, ``/register``'s ``role``), as llm-d's ``llm-d.ai/role`` pod label names them. ``kvcoord route``
and ``kvcoord epp`` make their P/D pools of them (:func:`kvcoord.gateway.disagg.pools_of`)."""

from __future__ import annotations

from kvcoord.validate import shown

__all__ = ["BOTH", "DECODE", "PREFILL", "ROLES", "check_role"]

PREFILL, DECODE, BOTH = "prefill", "decode", "both"
ROLES = (PREFILL, DECODE, BOTH)
"""llm-d's role values (``both``: a pod that prefills and decodes). "" is none declared."""
_ALIASES = {"prefill-decode": BOTH, "prefill_and_decode": BOTH}
"""Other names of ``both``: llm-d's docs' ``prefill-decode``, Dynamo's aggregated ``prefill_and_decode``."""


def check_role(role: object, where: str = "role", *, publisher: str = "") -> str:
    """A declared role as stored (an alias of ``both`` becomes ``both``, case and spaces dropped; "" stays
    none); ValueError naming the values otherwise, or when a pool's ``publisher`` (never routed to)
    declares one."""
    if not isinstance(role, str):
        raise ValueError(f"{where} must be a string ({', '.join(ROLES)})")
    text = role.strip().lower()
    if text and text not in ROLES:
        text = _ALIASES.get(text, "?")
    if text == "?":
        raise ValueError(f"{where} {shown(role)} is not a role (expected {', '.join(ROLES)})")
    if publisher and text:
        raise ValueError(f"{where}: pool {shown(publisher)}'s publisher is not routable and has no role")
    return text
