"""``kvcoord sim-engine``: a stand-in engine (a real BlockPool) publishing vLLM-exact KV events."""

from __future__ import annotations

import argparse
import dataclasses

from kvcoord.cli.common import (
    HOSTPORT,
    LISTEN,
    NONNEG_FLOAT,
    NONNEG_INT,
    POSITIVE_FLOAT,
    POSITIVE_INT,
    ZMQ_ENDPOINT,
    Subparsers,
    add_block_hashing,
    add_tls_client,
    security,
)


def add(sub: Subparsers) -> None:
    p = sub.add_parser("sim-engine", help="a stand-in engine publishing vLLM-exact KV events")
    p.add_argument("--zmq-bind", default="tcp://*:5557", type=ZMQ_ENDPOINT,
                   help="PUB endpoint, always bound (rank 0; rank r uses port + r); agents connect to it")
    p.add_argument("--replay-bind", default=None, type=ZMQ_ENDPOINT,
                   help="ROUTER replay endpoint, always bound, e.g. tcp://*:5558")
    p.add_argument("--topic", default="", help="ZMQ topic of the published KV events")
    p.add_argument("--model", default="sim-model", help="model name served and published")
    p.add_argument("--dp-rank", type=NONNEG_INT, default=0, help="data-parallel rank of this engine")
    p.add_argument("--num-blocks", type=POSITIVE_INT, default=2048, help="KV cache size in blocks")
    add_block_hashing(p, algo_flag="--algo", algo_default="sha256_cbor", seed_default=None)
    p.add_argument("--hash-form", choices=["int", "bytes"], default="int", help="how events carry hashes")
    p.add_argument("--medium", default="GPU", help="storage medium named in the events (GPU, CPU, ...)")
    p.add_argument("--seed", type=int, default=0, help="workload RNG seed")
    p.add_argument("--rate", type=NONNEG_FLOAT, default=20.0,
                   help="synthetic requests per second (0: as fast as possible; with --http-listen, "
                        "--rate 0 --requests 0 means no synthetic workload: serve HTTP only)")
    p.add_argument("--requests", type=NONNEG_INT, default=0,
                   help="stop after N requests (0: run until SIGTERM); SIGUSR1 serves N more")
    p.add_argument("--linger", action="store_true",
                   help="after --requests, serve replay until SIGTERM (always so with --http-listen)")
    p.add_argument("--concurrency", type=POSITIVE_INT, default=8,
                   help="requests kept running (holding blocks)")
    p.add_argument("--prefixes", type=NONNEG_INT, default=8, help="distinct shared prompt prefixes")
    p.add_argument("--prefix-len", type=NONNEG_INT, default=256,
                   help="tokens of the shared prefix of synthetic requests")
    p.add_argument("--suffix-len", type=NONNEG_INT, default=64,
                   help="tokens after the prefix, unique per synthetic request")
    p.add_argument("--output-len", type=NONNEG_INT, default=32,
                   help="tokens each synthetic request generates; also HTTP requests' default max_tokens")
    p.add_argument("--buffer-steps", type=POSITIVE_INT, default=10_000, help="batches kept for replay")
    p.add_argument("--hwm", type=POSITIVE_INT, default=100_000, help="PUB high-water mark")
    p.add_argument("--form", choices=["map", "array"], default="map",
                   help="event encoding: map (vLLM >= 0.24) or array (<= 0.23)")
    p.add_argument("--removal-events", choices=["vllm", "last_copy"], default="vllm",
                   help="BlockRemoved per evicted block (vllm) or only when a hash's last copy goes")
    p.add_argument("--state-file", default=None,
                   help="write JSON {blocks: {dp_rank: [[hash, tier]..]}, next_seq, ..} here periodically")
    p.add_argument("--state-interval", type=POSITIVE_FLOAT, default=0.2,
                   help="seconds between state-file (and prompt-file) writes")
    p.add_argument("--prompt-file", default=None,
                   help="write the last prompt served here (a JSON list of token ids, as `kvcoord lookup "
                        "--tokens-file` and `kvcoord hash` read it)")
    p.add_argument("--cache-salt", default=None,
                   help="every request's cache_salt (an extra key of its block hashes)")
    _add_http(p)
    g = p.add_argument_group(
        "router-style lookups",
        "Before admitting each request, ask a coordinator how much of the prompt each node holds, as a "
        "router would (off the engine loop; errors are counted, never fatal). Counters go to --state-file "
        "under 'lookup'; the coordinator's metrics show the lookups and hit rates.")
    g.add_argument("--lookup-coordinator", default=None, type=HOSTPORT, metavar="HOST:PORT",
                   help="the coordinator to ask")
    g.add_argument("--lookup-model", default=None, help="model to look up (default: --model)")
    g.add_argument("--lookup-node-id", default=None,
                   help="this engine's node id (its agent's --node-id), to count what the coordinator "
                        "says it holds")
    g.add_argument("--lookup-token", default=None, help="router token for the coordinator")
    add_tls_client(g, prefix="lookup-")
    g.add_argument("--lookup-timeout", type=POSITIVE_FLOAT, default=0.5,
                   help="seconds per lookup (default 0.5)")
    g.add_argument("--lookup-queue", type=POSITIVE_INT, default=64,
                   help="lookups waiting to be sent; more are dropped and counted (default 64)")
    p.set_defaults(func=run)


def _add_http(p: argparse.ArgumentParser) -> None:
    h = p.add_argument_group(
        "OpenAI-compatible HTTP",
        "vLLM's API on the same pool: /v1/completions, /v1/chat/completions (streaming), /tokenize (the "
        "toy tokenizer of kvcoord.tokenize.toktok; serve and route open it in-process as sim:toktok), "
        "/v1/models, /health, /metrics (vLLM's names). The engine then stays up until SIGTERM.")
    h.add_argument("--http-listen", default=None, type=LISTEN, metavar="HOST:PORT",
                   help="serve HTTP here, e.g. 127.0.0.1:8000 (default: off)")
    h.add_argument("--token-interval", type=NONNEG_FLOAT, default=0.002,
                   help="seconds per generated token of an HTTP request (default 0.002)")
    h.add_argument("--max-num-seqs", type=POSITIVE_INT, default=256,
                   help="HTTP requests running at once; more wait (vllm:num_requests_waiting)")
    h.add_argument("--pull-us-per-block", type=NONNEG_FLOAT, default=None, metavar="US",
                   help="honour llm-d's x-kv-cache-source-host-port request header: copy the prompt's blocks "
                        "the named peer sim-engine holds, at this transfer time per block (default: ignored)")
    h.add_argument("--kv-role", default=None, choices=("kv_producer", "kv_consumer", "kv_both"),
                   help="speak vLLM's disaggregated prefill/decode protocol (kv_transfer_params, as with "
                        "the NIXL connector): kv_producer prefills, kv_consumer decodes, kv_both does "
                        "either (default: off, kv_transfer_params ignored)")
    h.add_argument("--prefill-us-per-token", type=NONNEG_FLOAT, default=0.0,
                   help="compute per uncached prompt token, serial per engine: TTFT then depends on the "
                        "cached prefix and the queue (default 0: prefill is free)")
    h.add_argument("--decode-ms-per-token", type=NONNEG_FLOAT, default=0.0,
                   help="one decode step, shared by the running batch; replaces --token-interval "
                        "(default 0: off)")
    h.add_argument("--image-tokens", type=POSITIVE_INT, default=576,
                   help="placeholder tokens per image part of a chat: each image renders as one <image> "
                        "token before its message's text, expanded to this many (default 576, LLaVA-1.5's)")
    h.add_argument("--max-batch-tokens", type=NONNEG_INT, default=0,
                   help="tokens per engine step, decodes first, the rest chunks prefills (vLLM's "
                        "--max-num-batched-tokens; default 0: one whole prompt per prefill step)")


def run(args: argparse.Namespace) -> int:
    from kvcoord.cli.common import CliError
    from kvcoord.sim.engine import SimEngineConfig, run_sim_engine

    if args.lookup_coordinator is None:
        given = [f for f in ("lookup_model", "lookup_node_id", "lookup_token", "lookup_tls_ca")
                 if getattr(args, f) is not None]
        if given:
            raise CliError(f"--{given[0].replace('_', '-')} needs --lookup-coordinator")
    fields = {f.name for f in dataclasses.fields(SimEngineConfig)} - {"lookup_security"}
    config = SimEngineConfig(
        **{name: getattr(args, name) for name in fields},
        lookup_security=security(args, prefix="lookup-") if args.lookup_coordinator else None,
    )
    run_sim_engine(config)
    return 0
