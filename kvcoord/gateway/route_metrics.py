"""``kvcoord route``'s Prometheus metrics (``kvcoord_route_*``), including the decision-quality ones.

Decision quality, per routed request: the hit the policy *predicted* on the node it chose (blocks and
tokens, from the coordinator's answer), the *best* hit any node had, and the hit the engine *achieved*
(``usage.prompt_tokens_details.cached_tokens``; Anthropic's ``usage.cache_read_input_tokens``, Responses'
``usage.input_tokens_details.cached_tokens``). Predicted tokens are capped the way vLLM caps a hit (at
least the prompt's last token is computed, in whole blocks), so on a healthy fleet achieved == predicted.
Achieved well below predicted means the hashes, the tokenizer or the events are wrong; chosen below best
means load or the anti-hot-spot rule overrode the cache, which is fine in moderation.

With disaggregated prefill and decode the judged pick is the one that prefilled: the prefill node when a
remote prefill ran (its answer's usage), else the decode node (the decode engine of a remote prefill
counts the transferred blocks as cached, which no index predicts). ``kvcoord_route_pd_total`` counts the
paths, ``kvcoord_route_prefill_placements_total`` the prefill picks.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .apis import chat_usage

__all__ = ["DecisionMetrics", "RouteMetrics", "predicted_tokens"]

_BLOCKS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_TOKENS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_SECONDS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def predicted_tokens(matched_blocks: int, block_size: int, num_tokens: int) -> int:
    """Tokens a hit of ``matched_blocks`` saves: vLLM computes at least the last prompt token, so the hit
    is capped at ``(num_tokens - 1) // block_size`` whole blocks."""
    if num_tokens <= 0 or block_size <= 0:
        return 0
    return min(matched_blocks, (num_tokens - 1) // block_size) * block_size


class DecisionMetrics:
    """The decision-quality families, named ``<prefix>_*``: ``kvcoord route``'s and ``kvcoord epp``'s
    (which reads the served endpoint's usage from the response the data plane passes it)."""

    def __init__(self, r: CollectorRegistry, prefix: str) -> None:
        self.predicted_blocks = Histogram(f"{prefix}_predicted_hit_blocks", "Leading prompt blocks the "
                                          "chosen node holds, per the index.", buckets=_BLOCKS, registry=r)
        self.predicted_tok = Histogram(f"{prefix}_predicted_hit_tokens", "Prompt tokens the chosen "
                                       "node should serve from cache (capped as vLLM caps a hit).",
                                       buckets=_TOKENS, registry=r)
        self.best_blocks = Histogram(f"{prefix}_best_hit_blocks", "Leading prompt blocks the best node "
                                     "holds.", buckets=_BLOCKS, registry=r)
        self.achieved_tok = Histogram(f"{prefix}_achieved_hit_tokens", "Prompt tokens the engine served "
                                      "from cache (usage.prompt_tokens_details.cached_tokens).",
                                      buckets=_TOKENS, registry=r)
        self.prompt_tok = Counter(f"{prefix}_prompt_tokens", "Prompt tokens of placed requests "
                                  "(the engine's usage when known, else the lookup's count).", registry=r)
        self.predicted_total = Counter(f"{prefix}_predicted_tokens", "Sum of predicted hit tokens.",
                                       registry=r)
        self.best_total = Counter(f"{prefix}_best_tokens", "Sum of the best node's hit tokens.",
                                  registry=r)
        self.achieved_total = Counter(f"{prefix}_achieved_tokens", "Sum of achieved hit tokens (requests "
                                      "whose usage was seen).", registry=r)
        self.outcomes = Counter(f"{prefix}_hit_outcomes", "Achieved vs predicted per request: match, "
                                "above (the engine held more than the index knew), below (it held less: "
                                "check hashes, tokenizer, events), unknown (no usage in the response).",
                                ["outcome"], registry=r)
        self.below_best = Counter(f"{prefix}_below_best", "Requests placed on a node holding less than "
                                  "the best node (load or the balance cap decided).", registry=r)
        for outcome in ("match", "above", "below", "unknown"):
            self.outcomes.labels(outcome)

    def predicted(self, chosen_blocks: int, best_blocks: int, block_size: int, num_tokens: int) -> int:
        """Record the prediction of the node that answered a prefix-aware request; returns the predicted
        hit in tokens."""
        tokens = predicted_tokens(chosen_blocks, block_size, num_tokens)
        self.predicted_blocks.observe(chosen_blocks)
        self.predicted_tok.observe(tokens)
        self.best_blocks.observe(best_blocks)
        self.predicted_total.inc(tokens)
        self.best_total.inc(predicted_tokens(best_blocks, block_size, num_tokens))
        if chosen_blocks < best_blocks:
            self.below_best.inc()
        return tokens

    def achieved(self, predicted: int, usage: dict[str, object] | None) -> str:
        """Record the engine's usage against the prediction; returns the outcome label."""
        usage = chat_usage(usage)
        cached = _cached_tokens(usage)
        if cached is None:
            outcome = "unknown"
        else:
            self.achieved_tok.observe(cached)
            self.achieved_total.inc(cached)
            prompt = usage.get("prompt_tokens") if usage else None
            if isinstance(prompt, int):
                self.prompt_tok.inc(prompt)
            outcome = "match" if cached == predicted else "above" if cached > predicted else "below"
        self.outcomes.labels(outcome).inc()
        return outcome


class RouteMetrics(DecisionMetrics):
    """Every ``kvcoord_route_*`` metric, on its own registry (several routers can share a process)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        r = self.registry = registry or CollectorRegistry(auto_describe=True)
        super().__init__(r, "kvcoord_route")
        self.requests = Counter("kvcoord_route_requests", "Requests answered, by endpoint and outcome "
                                "(ok, upstream_error = the engine's own 4xx/5xx, midstream_failure, "
                                "upstream_timeout, no_backend, bad_request, client_gone, not_cached = 412 "
                                "for Prefer: if-available).",
                                ["endpoint", "outcome"], registry=r)
        self.placements = Counter("kvcoord_route_placements", "Placements per node, prefix-aware or not.",
                                  ["node", "prefix_aware"], registry=r)
        self.retries = Counter("kvcoord_route_retries", "Requests re-sent to the next-best node before the "
                               "first byte, by cause (connect, status_5xx).", ["reason"], registry=r)
        self.backend_failures = Counter("kvcoord_route_backend_failures", "Backend failures by node and kind "
                                        "(connect, status_5xx, midstream, timeout).", ["node", "kind"],
                                        registry=r)
        self.suspect = Gauge("kvcoord_route_backend_suspect", "1 while a node is left out after a failure "
                             "(until its /health answers).", ["node"], registry=r)
        self.in_flight = Gauge("kvcoord_route_in_flight", "Requests this router has in flight, per node.",
                               ["node"], registry=r)
        self.degraded = Counter("kvcoord_route_degraded", "Requests placed without the prefix index, by "
                                "cause (coordinator_unavailable, deadline, lookup_error, unsupported_prompt, "
                                "no_routable_node, tokenize_error).",
                                ["reason"], registry=r)
        self.degraded_now = Gauge("kvcoord_route_degraded_mode", "1 while the coordinator is down or slower "
                                  "than --deadline-ms (placement is least-loaded).", registry=r)
        self.coordinator_up = Gauge("kvcoord_route_coordinator_up", "1 when the last lookup was answered in "
                                    "time.", registry=r)
        self.shared_view = Gauge("kvcoord_route_shared_view", "1 while this router's reservation stream to "
                                 "the coordinator is open (routers share one view); 0: it places on its "
                                 "own memory.", registry=r)
        self.ready = Gauge("kvcoord_route_ready", "1 when /health reports ready (the coordinator answered "
                           "this router, accepts its token, and its models' lookups are warm).", registry=r)
        self.lookup_seconds = Histogram("kvcoord_route_lookup_seconds", "Coordinator lookup latency "
                                        "(answered lookups).", buckets=_SECONDS, registry=r)
        self.overhead_seconds = Histogram("kvcoord_route_overhead_seconds", "Router time before the request "
                                          "is sent upstream, lookup excluded.", buckets=_SECONDS, registry=r)
        self.first_byte_seconds = Histogram("kvcoord_route_first_byte_seconds", "Request received to the "
                                            "backend's response headers.", buckets=_SECONDS, registry=r)
        self.request_seconds = Histogram("kvcoord_route_request_seconds", "Request received to last byte.",
                                         ["endpoint"], buckets=_SECONDS, registry=r)
        self._pd(r)
        self.coordinator_up.set(1)
        self.degraded_now.set(0)
        for reason in ("coordinator_unavailable", "deadline", "lookup_error", "unsupported_prompt",
                       "no_routable_node", "tokenize_error"):
            self.degraded.labels(reason)
        for reason in ("connect", "status_5xx"):
            self.retries.labels(reason)

    def _pd(self, r: CollectorRegistry) -> None:
        self.pd = Counter("kvcoord_route_pd", "Disaggregated requests by path: remote_prefill (a prefill "
                          "node prefilled, the decode node pulled), decode_only (the decode node lacked at "
                          "most --max-local-prefill-tokens), prefill_failed (no prefill node answered: the "
                          "decode node prefilled).", ["path"], registry=r)
        self.prefill_placements = Counter("kvcoord_route_prefill_placements", "Remote prefills sent per "
                                          "prefill node (attempts).", ["node"], registry=r)
        self.prefill_seconds = Histogram("kvcoord_route_prefill_seconds", "Remote prefill request to its "
                                         "whole answer.", buckets=_SECONDS, registry=r)
        for path in ("remote_prefill", "decode_only", "prefill_failed"):
            self.pd.labels(path)


def _cached_tokens(usage: dict[str, object] | None) -> int | None:
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        return None
    cached = details.get("cached_tokens")
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None
