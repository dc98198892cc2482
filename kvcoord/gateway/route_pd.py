"""Disaggregated prefill and decode in ``kvcoord route``: pools by ``--prefill-node`` / ``--decode-node``,
else by the roles ListNodes shows (:func:`~kvcoord.gateway.disagg.pools_of`, per request, so a node that
joins, leaves or changes role counts from the next ListNodes on).

Per request, after the lookup: the decode node is picked first, among the decode pool, by the policy
(load, and its own prefix). When the prompt tokens it lacks are at most ``--max-local-prefill-tokens``
the request goes to it alone and it prefills locally (:func:`~kvcoord.gateway.disagg.prefill_remote`,
Dynamo's conditional disaggregation). Otherwise a prefill node is picked among the prefill pool by
the same policy (prefix and load) and sent the prompt as vLLM's disaggregated proxies send it
(``examples/online_serving/disaggregated_serving``, llm-d's P/D sidecar): ``max_tokens=1``, not streamed,
``kv_transfer_params={"do_remote_decode": true, ...}``. Its answer's ``kv_transfer_params`` go into the
original request, which the decode node answers (streaming as asked). Both requests carry one
``X-Request-Id``.

A prefill node that fails (connect, 5xx) is left out as any node is and the next one is tried; when none
answers the decode node prefills locally (``kvcoord_route_pd_total{path="prefill_failed"}``). A prefill
answer of 4xx is the request's own fault and goes back to the client as it is.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from aiohttp import web

from kvcoord.router.http_pool import HttpPools

from .disagg import PdConfig, pools_of, prefill_remote
from .route_backends import Backends
from .route_metrics import RouteMetrics, predicted_tokens
from .route_place import Placer, Plan, node_label

__all__ = ["PdRouter", "prefill_body"]

_REMOTE_DECODE = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's disaggregated proxy asks the prefill engine for."""


def prefill_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The prefill request vLLM's proxy sends: one token, not streamed, asking for a remote decode."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(kv_transfer_params=dict(_REMOTE_DECODE), stream=False, max_tokens=1)
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


class PdRouter:
    """Picks the decode node, decides on a remote prefill, and runs it."""

    def __init__(self, config: PdConfig, placer: Placer, backends: Backends, metrics: RouteMetrics,
                 *, upstreams: HttpPools, max_attempts: int, fail: Callable[[str, str, str], None]) -> None:
        self.config = config
        """The flags' pools (empty: by roles) and threshold."""
        self.placer = placer
        self.backends = backends
        self.metrics = metrics
        self.max_attempts = max_attempts
        self.fail = fail
        """The router's "leave this node out" (node, kind, detail)."""
        self.upstreams = upstreams
        """The engines' connections (the router's)."""

    def pools(self, model: str) -> PdConfig | None:
        """The pools of ``model``'s requests now; None: one engine per request."""
        return pools_of(self.config, self.backends.table.roles(model))

    async def stage(self, pools: PdConfig, plan: Plan, body: dict[str, Any], path: str,
                    headers: Mapping[str, str], *, remote: bool = True) -> dict[str, Any] | web.Response:
        """Pick the decode node of ``pools`` into ``plan`` and run the prefill if one is due; returns the
        body the decode node gets, or the prefill node's 4xx answer for the client. ``headers`` are those
        the router forwards; ``remote`` False: an API without the protocol, decoded whole."""
        prefill = [c for c in plan.candidates if c.node_id in pools.prefill]
        plan.candidates = [c for c in plan.candidates if c.node_id in pools.decode]
        rid = next((v for k, v in headers.items() if k.lower() == "x-request-id"), "") or uuid.uuid4().hex
        plan.send_headers["X-Request-Id"] = rid
        plan.first = self.placer.choose(plan)
        if plan.first is None:
            return body  # no decode node: the attempts answer 503
        r = plan.request
        hit = predicted_tokens(plan.first[1].matched_blocks, r.block_size, r.num_tokens)
        uncached = r.num_tokens - hit
        if not remote:
            self._path(plan, "decode_only", "decode-only: this API has no disaggregated protocol")
            return body
        limit = pools.max_local_prefill_tokens
        if not prefill_remote(pools, uncached, plan.prefix_aware):
            self._path(plan, "decode_only", f"decode-only: {uncached} uncached tokens <= {limit}")
            return body
        pplan = replace(plan, candidates=prefill, tried=set(), first=None, send_headers={},
                        answer_headers={}, reserve_id="")
        sent = prefill_body(body)
        for _ in range(self.max_attempts):
            answer = await self._prefill(pplan, sent, path, {**headers, "X-Request-Id": rid})
            if answer is None:
                continue
            if isinstance(answer, web.Response):
                return answer
            params = answer.get("kv_transfer_params")
            plan.remote_prefill = True
            plan.answer_headers.update(pplan.answer_headers)
            self._path(plan, "remote_prefill", f"remote prefill: {uncached} uncached tokens on the decode "
                       f"node > {limit}" if plan.prefix_aware
                       else "remote prefill (no lookup)")
            return {**body, "kv_transfer_params": params} if isinstance(params, dict) and params else body
        self._path(plan, "prefill_failed", "decode-only: no prefill node answered")
        return body

    def _path(self, plan: Plan, path: str, why: str) -> None:
        self.metrics.pd.labels(path).inc()
        plan.answer_headers["x-kvcoord-pd"] = why

    async def _prefill(self, plan: Plan, sent: dict[str, Any], path: str,
                       headers: Mapping[str, str]) -> dict[str, Any] | web.Response | None:
        """One prefill attempt on the next-best prefill node: its JSON answer, the 4xx to hand back, or
        None to try the next node (nothing left: ``stage`` runs out of attempts)."""
        picked = self.placer.choose(plan)
        if picked is None:
            return None
        decision, chosen = picked
        r = plan.request
        predicted = predicted_tokens(chosen.matched_blocks, r.block_size, r.num_tokens)
        queued = self.backends.begin(decision.key, max(0, r.num_tokens - predicted))
        self.metrics.prefill_placements.labels(node_label(decision.key)).inc()
        t0 = time.perf_counter()
        try:
            conn = await self.upstreams.request(chosen.serving_url, path, json.dumps(sent).encode(), headers)
            try:
                data, status = await conn.read(), conn.status
            finally:
                conn.release()
        except (TimeoutError, OSError) as exc:
            self.fail(decision.node_id, "connect", f"{type(exc).__name__}: {exc}")
            self.metrics.retries.labels("connect").inc()
            return None
        finally:
            queued.done()
            self.backends.end(decision.key)
        self.metrics.prefill_seconds.observe(time.perf_counter() - t0)
        if status >= 500:
            self.fail(decision.node_id, "status_5xx", f"HTTP {status}")
            self.metrics.retries.labels("status_5xx").inc()
            return None
        if status >= 400:
            return web.Response(body=data, status=status, content_type="application/json",
                                headers={"x-kvcoord-prefill-node": node_label(decision.key)})
        obj: Any = None
        with contextlib.suppress(ValueError, UnicodeDecodeError):
            obj = json.loads(data)
        if not isinstance(obj, dict):
            self.fail(decision.node_id, "status_5xx", "prefill answer is not a JSON object")
            return None
        usage = obj.get("usage")
        if plan.prefix_aware:
            self.metrics.predicted(chosen.matched_blocks, plan.best_blocks, r.block_size, r.num_tokens)
            self.metrics.achieved(predicted, usage if isinstance(usage, dict) else None)
        cached = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
        self._headers(plan, obj, node_label(decision.key), chosen.matched_blocks, predicted, cached)
        return obj

    def _headers(self, plan: Plan, obj: dict[str, Any], node: str, blocks: int, predicted: int,
                 details: Any) -> None:
        """The prefill pick, its prediction and its engine's cached tokens, on the decode answer."""
        out = {"x-kvcoord-prefill-node": node}
        if plan.prefix_aware:
            out.update({"x-kvcoord-prefill-matched-blocks": str(blocks),
                        "x-kvcoord-prefill-predicted-cached-tokens": str(predicted)})
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            out["x-kvcoord-prefill-cached-tokens"] = str(cached)
        plan.answer_headers.update(out)
