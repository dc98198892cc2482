"""Relay throughput in block-events/s against plain msgspec decoding, measured in the same run.

Baseline: ``msgspec.msgpack.Decoder`` into vLLM's own struct definitions (what any consumer pays
at minimum). Then our codec (typed decode + conversion to the event model), then the relay's
whole per-batch path (decode, validate, mirror update, forward to a sink), and the same over
real ZMQ (publisher thread -> PUB/SUB over tcp -> relay), which includes encoding.

Then a node's snapshot (it runs inside the agent's event loop, so it is how long the loop stalls):
the former bitmask mirror's per-entry loop (baseline) against the mirror's table columns (it runs on
the memory index's core), each with what the reporter does to the entries.

    .venv/bin/python benchmarks/bench_relay.py [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvcoord.agent.reporter import Reporter
from kvcoord.engine.mirror import BlockMirror
from kvcoord.engine.relay import Relay
from kvcoord.engine.zmq_wire import ZmqEventPublisher
from kvcoord.events import BlockRemoved, BlockStored, KVEvent, KVEventBatch, Tier, encode_vllm_batch
from kvcoord.hashing import to_block_hash64
from kvcoord.wire import snapshot_to_proto
from tests.procs import free_port


# vLLM 0.33's structs, as a consumer would copy them (the baseline decoder).
class _Ev(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _Stored(_Ev, tag="BlockStored"):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _Removed(_Ev, tag="BlockRemoved"):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None


class _Cleared(_Ev, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class CountingSink:
    def __init__(self) -> None:
        self.events = 0

    def submit(self, dp_rank: int, events: Sequence[KVEvent], ts: float | None = None,
               ops: Sequence[Any] | None = None, spans: Sequence[int] | None = None) -> None:
        self.events += len(events)

    def history_lost(self, dp_rank: int, reason: str) -> None:
        pass


def make_payloads(n: int, blocks_per_store: int, block_size: int, seed: int = 0) -> tuple[list[bytes], int]:
    rng = random.Random(seed)
    payloads, block_events = [], 0
    held: list[int] = []
    for i in range(n):
        hashes = tuple(rng.randrange(2**64) for _ in range(blocks_per_store))
        tokens = tuple(rng.randrange(150_000) for _ in range(blocks_per_store * block_size))
        events: list[KVEvent] = [BlockStored(hashes, held[-1] if held else None, tokens, block_size, None,
                                             "GPU", None, (None,) * blocks_per_store, 0, "full_attention")]
        held.extend(hashes)
        block_events += len(hashes)
        if len(held) > 4 * blocks_per_store:
            gone = tuple(held[:blocks_per_store])
            del held[:blocks_per_store]
            events.append(BlockRemoved(gone, "GPU", 0))
            block_events += len(gone)
        payloads.append(encode_vllm_batch(KVEventBatch(1.7e9 + i, tuple(events), 0)))
    return payloads, block_events


def best_rate(fn: Callable[[], None], block_events: int, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return block_events / statistics.median(times)


async def zmq_rate(payload_batches: list[KVEventBatch], block_events: int) -> float:
    port = free_port()
    pub = ZmqEventPublisher(0, f"tcp://*:{port}", None)
    sink = CountingSink()
    relay = Relay(f"tcp://127.0.0.1:{port}", sink, idle_probe=3600)
    stop = asyncio.Event()
    task = asyncio.create_task(relay.run(stop))
    try:
        await relay.ready.wait()
        # Warm the subscription up: publish until the first batch arrives.
        warm = KVEventBatch(0.0, (), 0)
        while relay.expected_seq == 0:
            pub.publish(warm)
            await asyncio.sleep(0.01)
        await asyncio.to_thread(pub.flush)
        start_seq = pub.next_seq
        target = start_seq + len(payload_batches)
        while relay.expected_seq < start_seq:
            await asyncio.sleep(0.001)
        lost_before = relay.stats.lost_batches  # warm-up frames before the subscription joined
        t0 = time.perf_counter()
        for b in payload_batches:
            pub.publish(b)
        while relay.expected_seq < target:
            await asyncio.sleep(0.0005)
        elapsed = time.perf_counter() - t0
        assert relay.stats.lost_batches == lost_before, "frames dropped during the measurement"
        return block_events / elapsed
    finally:
        stop.set()
        await task
        pub.shutdown()


def _bitmask_entries(blocks: dict[int, int]) -> list[tuple[int, Tier]]:
    """The mirror's former snapshot (``{hash: tier bitmask}``, a Python step per entry and tier)."""
    entries: list[tuple[int, Tier]] = []
    for h, mask in blocks.items():
        for tier in Tier:
            if mask & (1 << tier):
                entries.append((h, tier))
    return entries


def snapshot_figures(n_blocks: int, repeat: int) -> None:
    """A node's snapshot runs inside the agent's event loop: the mirror read and the reporter's messages."""
    rng = random.Random(7)
    hashes = [rng.getrandbits(64) for _ in range(n_blocks)]
    mirror = BlockMirror()
    for i in range(0, n_blocks, 1024):
        mirror.apply(0, [BlockStored(tuple(hashes[i:i + 1024]), None, (), 16, None, "GPU", None)])
    cpu = hashes[: n_blocks // 10]  # a tenth also offloaded to CPU
    mirror.apply(0, [BlockStored(tuple(cpu), None, (), 16, None, "CPU", None)])
    bitmask = dict.fromkeys(hashes, 1)
    for h in cpu:
        bitmask[h] |= 2
    chunk = 65536

    def to_proto(hs: Sequence[int], ts: Sequence[int]) -> None:
        for s in range(0, len(hs), chunk):
            snapshot_to_proto(1, 1, 0, hs[s:s + chunk], ts[s:s + chunk], False)

    def old_path() -> None:  # former mirror + the reporter's per-entry conversion
        hs: list[int] = []
        ts: list[int] = []
        for h, t in _bitmask_entries(bitmask):
            hs.append(to_block_hash64(h))
            ts.append(int(Tier(t)))
        to_proto(hs, ts)

    def columns_path() -> None:  # the mirror's validated columns straight into the messages
        to_proto(*mirror.rank_entries(0).columns())

    rep = Reporter(["127.0.0.1:1"], node_id="bench", model="bench", snapshot=mirror.rank_entries)
    entries = n_blocks + len(cpu)
    rows = [("former: bitmask mirror + per-entry reporter loop", old_path),
            ("  its mirror read alone (per entry and tier)", lambda: _bitmask_entries(bitmask) and None),
            ("now: mirror.rank_entries (the table's columns)", lambda: mirror.rank_entries(0) and None),
            ("now: reporter._take_snapshot (iterates pairs)", lambda: rep._take_snapshot() and None),
            ("columns straight into protos (reporter fast path)", columns_path)]
    print(f"\nsnapshot of {entries:,} (hash, tier) entries, best of {repeat}: the agent's event loop "
          "is blocked this long")
    print(f"{'path':<52}{'time':>12}{'vs former':>11}")
    base = 0.0
    for name, fn in rows:
        best = min(_timed(fn) for _ in range(repeat))
        base = base or best
        print(f"{name:<52}{best * 1000:>9.1f} ms{base / best:>10.1f}x")


def _timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--blocks-per-store", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--snapshot-blocks", type=int, default=None,
                    help="blocks in the snapshot measurement (default 500000, 50000 with --quick)")
    args = ap.parse_args()
    n = 300 if args.quick else 3000
    repeat = 3 if args.quick else 7
    payloads, block_events = make_payloads(n, args.blocks_per_store, args.block_size)
    print(f"{n} batches, {block_events} block events, {sum(map(len, payloads)) / n:.0f} bytes/batch "
          f"({args.blocks_per_store} blocks x {args.block_size} tokens per store)")

    dec = msgspec.msgpack.Decoder(_Batch)
    base = best_rate(lambda: [dec.decode(p) for p in payloads] and None, block_events, repeat)

    from kvcoord.events import decode_vllm_batch

    ours = best_rate(lambda: [decode_vllm_batch(p) for p in payloads] and None, block_events, repeat)

    def relay_path() -> None:
        relay = Relay("tcp://127.0.0.1:1", CountingSink())
        for seq, p in enumerate(payloads):
            relay.handle_payload(seq, p)

    relay = best_rate(relay_path, block_events, repeat)
    batches = [decode_vllm_batch(p) for p in payloads]
    over_zmq = asyncio.run(zmq_rate(batches, block_events))

    print(f"{'path':<44}{'block-events/s':>16}{'vs msgspec':>12}")
    for name, rate in (("msgspec decode into vLLM structs (baseline)", base),
                       ("decode_vllm_batch (typed decode + model)", ours),
                       ("relay: decode+validate+mirror+forward", relay),
                       ("relay over ZMQ tcp (incl. publisher encode)", over_zmq)):
        print(f"{name:<44}{rate:>16,.0f}{rate / base:>11.2f}x")
    snapshot_figures(args.snapshot_blocks or (50_000 if args.quick else 500_000), repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
