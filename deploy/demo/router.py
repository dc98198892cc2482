"""Demo router for docker-compose.yml: asks the coordinator where each prompt's prefix is cached.

It replays the same seeded workloads as the demo's ``kvcoord sim-engine`` nodes (same ``--seed``
and prefix settings), so its prompts share prefixes with what the engines hold, and every answer
shows up on the dashboard as a lookup with a real hit rate. A production router does the same with
:class:`kvcoord.router.client.CoordinatorClient`: look up, then send the request to the best node.
Prints one JSON line per lookup on stdout.
"""

from __future__ import annotations

import argparse
import itertools
import json
import signal
import sys
import threading
from collections.abc import Sequence
from types import FrameType

from kvcoord.agent.sim_engine import Workload
from kvcoord.router.client import CoordinatorClient, CoordinatorError


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--coordinator", required=True, help="HOST:PORT")
    p.add_argument("--model", required=True)
    p.add_argument("--seed", type=int, action="append", required=True,
                   help="an engine's workload seed (repeat once per engine)")
    p.add_argument("--prefixes", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=256)
    p.add_argument("--suffix-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rate", type=float, default=10.0, help="lookups per second")
    p.add_argument("--requests", type=int, default=0, help="stop after N lookups (0: until SIGTERM)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rate <= 0:
        print("router: --rate must be > 0", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    workloads = [Workload(seed, prefixes=args.prefixes, prefix_len=args.prefix_len,
                          suffix_len=args.suffix_len, output_len=args.output_len) for seed in args.seed]
    done = 0
    with CoordinatorClient(args.coordinator, timeout=5.0) as client:
        for workload in itertools.cycle(workloads):
            if stop.is_set() or (args.requests and done >= args.requests):
                break
            tokens = workload.prompt()
            workload.output()  # keep the RNG in step with the engine's
            try:
                result = client.lookup(args.model, tokens=tokens)
            except CoordinatorError as exc:  # coordinator restarting: keep going, say why
                print(json.dumps({"error": str(exc)}), flush=True)
            else:
                best = result.nodes[0] if result.nodes else None
                print(json.dumps({
                    "blocks": result.num_blocks,
                    "best_node": best.node_id if best else None,
                    "matched_blocks": best.matched_blocks if best else 0,
                }), flush=True)  # fmt: skip
            done += 1
            stop.wait(1.0 / args.rate)
    return 0


if __name__ == "__main__":
    sys.exit(main())
