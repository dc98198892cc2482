"""The sim-engine's side of vLLM's disaggregated prefill and decode (``--kv-role``).

vLLM's protocol, as its ``examples/online_serving/disaggregated_serving`` proxies and llm-d's P/D sidecar
drive it with the NIXL connector: the proxy sends the prompt to a prefill engine with ``max_tokens=1`` and
``kv_transfer_params={"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}``; the
prefill engine's answer carries ``kv_transfer_params`` naming its blocks (``do_remote_prefill: true``,
``remote_block_ids``, ``remote_engine_id``, ``remote_request_id``, ``remote_host``, ``remote_port``,
``tp_size``); the proxy hands those to the decode engine with the original request, and the decode
engine pulls the blocks it lacks and decodes.

Here the pull is the pool's own admission: the decode engine holds the prompt's tokens, so the blocks
beyond its local hit are allocated and cached as the transfer would leave them, and its KV events
publish them (``BlockStored``). No bytes move and the prefill engine's blocks are not checked; the
sim's only cost is that ``usage.prompt_tokens_details.cached_tokens`` then counts the transferred tokens
too, as vLLM's decode does (every prompt token but the last, which the decode engine computes).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

__all__ = ["KV_ROLES", "KvConnector", "Transfer"]

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
"""vLLM's ``kv_transfer_config.kv_role`` values: prefill only, decode only, either."""


@dataclass(frozen=True, slots=True)
class Transfer:
    """A request's ``kv_transfer_params``, validated: prefill for a remote decode, or decode what a
    remote engine prefilled (``remote_blocks`` of them)."""

    remote_decode: bool
    remote_prefill: bool
    remote_blocks: int = 0
    remote_engine_id: str = ""


def _block_count(value: Any) -> int:
    """``remote_block_ids``: a list of ids, or (vLLM's hybrid-allocator form) one list per KV group."""
    if not isinstance(value, list):
        raise ValueError("kv_transfer_params.remote_block_ids must be a list of block ids")
    groups = value if value and all(isinstance(g, list) for g in value) else [value]
    for g in groups:
        if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in g):
            raise ValueError("kv_transfer_params.remote_block_ids must hold non-negative integers")
    return len(groups[0]) if groups else 0


class KvConnector:
    """One engine's connector: its role, its engine id, where a decode engine would pull from."""

    def __init__(self, role: str, host: str = "127.0.0.1", port: int = 0) -> None:
        if role not in KV_ROLES:
            raise ValueError(f"kv role {role!r} is not one of {', '.join(KV_ROLES)}")
        self.role = role
        self.engine_id = str(uuid.uuid4())
        self.host = host
        self.port = port

    def parse(self, body: dict[str, Any]) -> Transfer | None:
        """The request's ``kv_transfer_params`` (None when absent or null); ValueError when malformed or
        asking for a transfer this role does not make."""
        params = body.get("kv_transfer_params")
        if params is None:
            return None
        if not isinstance(params, dict):
            raise ValueError("kv_transfer_params must be an object")
        flags = {k: params.get(k, False) for k in ("do_remote_decode", "do_remote_prefill")}
        for name, flag in flags.items():
            if not isinstance(flag, bool):
                raise ValueError(f"kv_transfer_params.{name} must be a boolean")
        decode, prefill = flags["do_remote_decode"], flags["do_remote_prefill"]
        if decode and prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive")
        if decode and self.role == "kv_consumer":
            raise ValueError("this engine is a kv_consumer: it cannot prefill for a remote decode")
        if not prefill:
            return Transfer(decode, False)
        if self.role == "kv_producer":
            raise ValueError("this engine is a kv_producer: it cannot decode a remote prefill")
        engine = params.get("remote_engine_id")
        if not isinstance(engine, str) or not engine:
            raise ValueError("kv_transfer_params.remote_engine_id must be a non-empty string")
        return Transfer(False, True, _block_count(params.get("remote_block_ids")), engine)

    def answer(self, transfer: Transfer | None, request_id: str, block_ids: tuple[int, ...],
               num_tokens: int, block_size: int) -> dict[str, Any] | None:
        """The response's ``kv_transfer_params``: for a prefill done for a remote decode, where its prompt
        blocks are (NIXL's fields); else None (vLLM's null)."""
        if transfer is None or not transfer.remote_decode:
            return None
        prompt_blocks = -(-num_tokens // block_size)
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_block_ids": list(block_ids[:prompt_blocks]), "remote_engine_id": self.engine_id,
                "remote_request_id": request_id, "remote_host": self.host, "remote_port": self.port,
                "tp_size": 1}


def cached_tokens(transfer: Transfer | None, local: int, num_tokens: int, block_size: int) -> int:
    """Prompt tokens a request did not compute: its local hit, or on a decode of a remote prefill every
    transferred token (vLLM computes the prompt's last token on the decode side)."""
    if transfer is None or not transfer.remote_prefill:
        return local
    return max(local, min(num_tokens - 1, transfer.remote_blocks * block_size))
