"""The sim-engine's side of a peer pull: llm-d's ``x-kv-cache-source-host-port`` request header (which
``kvcoord route`` and ``kvcoord epp`` set) makes the engine copy the prompt's cached blocks from the named
peer before prefill, at ``--pull-us-per-block`` each, as a P2P connector would load them. A peer tells how
many leading blocks of a prompt it holds on ``POST /kv/cached_blocks``; the copied blocks are stored in the
engine's pool and published as KV events, so the request's ``cached_tokens`` and the index both show the
pull. Any failure of the peer is logged once and the request prefills as if there were no hint."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from kvcoord.extra_keys import RequestKeys

if TYPE_CHECKING:
    from kvcoord.sim.engine import SimEngine

__all__ = ["PEER_PATH", "PeerPuller", "cached_blocks", "peer_handler"]

log = logging.getLogger("kvcoord.sim")

PEER_PATH = "/kv/cached_blocks"


def cached_blocks(engine: SimEngine, prompt: list[int], keys: RequestKeys | None) -> int:
    """Leading blocks of ``prompt`` this engine's pool holds."""
    return engine.pool.count_cached_blocks(engine.pool.hash_prompt(prompt, keys))


class PeerPuller:
    """Copies a prompt's leading blocks from the peer a request names, at a transfer cost per block."""

    def __init__(self, engine: SimEngine, s_per_block: float) -> None:
        self.engine = engine
        self.s_per_block = s_per_block
        self.pulled_blocks = 0
        self._warned: set[str] = set()

    async def pull(self, source: str, prompt: list[int], keys: RequestKeys | None) -> int:
        """Blocks copied from ``source`` (``host:port``) for ``prompt``: those it holds past this engine's."""
        local = cached_blocks(self.engine, prompt, keys)
        try:
            held = await self._peer_blocks(source, prompt, keys)
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            if source not in self._warned and len(self._warned) < 64:
                self._warned.add(source)
                log.warning("peer pull from %.64s failed (%s: %s); prefilling instead", source,
                            type(exc).__name__, exc)
            return 0
        if held <= local:
            return 0
        await asyncio.sleep((held - local) * self.s_per_block)
        copied = self.engine.copy_prefix(prompt[:held * self.engine.pool.block_size], keys)
        self.pulled_blocks += copied
        return copied

    async def _peer_blocks(self, source: str, prompt: list[int], keys: RequestKeys | None) -> int:
        body: dict[str, Any] = {"prompt": prompt}
        if keys is not None and keys.cache_salt is not None:
            body["cache_salt"] = keys.cache_salt
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session, session.post(
                f"http://{source}{PEER_PATH}", json=body) as resp:
            if resp.status != 200:
                raise ValueError(f"HTTP {resp.status}")
            answer = await resp.json()
        blocks = answer["blocks"]
        if not isinstance(blocks, int) or blocks < 0:
            raise ValueError(f"bad blocks {blocks!r}")
        return min(blocks, len(prompt) // self.engine.pool.block_size)


async def peer_handler(engine: SimEngine, request: web.Request) -> web.Response:
    """``POST /kv/cached_blocks {"prompt": [ids], "cache_salt"?}`` -> ``{"blocks": n}``."""
    try:
        body = await request.json()
        prompt = body["prompt"]
        if not isinstance(prompt, list) or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError("prompt must be a list of token ids")
        salt = body.get("cache_salt")
        keys = RequestKeys(cache_salt=salt) if isinstance(salt, str) and salt else engine.keys
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        return web.json_response({"error": f"bad request: {exc}"}, status=400)
    return web.json_response({"blocks": cached_blocks(engine, prompt, keys)})
