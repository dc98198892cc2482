"""The coordinator's reservations (:mod:`kvcoord.coordinator.reservations`) on a driven clock: what a
lookup sees, when each part ends, the hold on a new prefix, and bad operations refused without a trace
in the state. The real-process tests are in tests/gateway/test_route_shared.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvcoord.coordinator.reservations import (
    BLOCK_HOLD,
    HOLD_SECONDS,
    Reservations,
    Reserved,
    apply_op,
    take_stream,
)
from kvcoord.proto.v2 import kvcoord_pb2 as pb
from kvcoord.validate import pack_u64

PROMPT = list(range(100, 116))
"""16 block hashes: a new prompt no index holds."""


def _res() -> tuple[Reservations, list[float]]:
    now = [100.0]
    return Reservations(clock=lambda: now[0]), now


def test_others_see_blocks_and_load_the_router_itself_only_blocks() -> None:
    res, _ = _res()
    assert res.reserve("r1", "a", "m", ("n1", 0), 0, PROMPT, 500, 60) == ""
    assert res.overlay("m", PROMPT, 0, "r2") == {("n1", 0): Reserved(16, 1, 500)}
    assert res.overlay("m", PROMPT, 0, "r1") == {("n1", 0): Reserved(16, 0, 0)}
    assert res.overlay("m", [*PROMPT[:10], 999], 0, "r2") == {("n1", 0): Reserved(8, 1, 500)}  # every 4th
    assert res.overlay("other-model", PROMPT, 0, "r2") == {}


def test_first_byte_ends_the_prefill_completion_the_request_then_the_blocks() -> None:
    res, now = _res()
    res.reserve("r1", "a", "m", ("n1", 0), 0, PROMPT, 500, 60)
    res.release("r1", "a", first_byte=True)
    assert res.overlay("m", PROMPT, 0, "r2") == {("n1", 0): Reserved(16, 1, 0)}
    res.release("r1", "a", first_byte=False)
    res.release("r1", "a", first_byte=False)  # twice: a no-op
    res.release("r1", "unknown", first_byte=False)
    assert res.overlay("m", PROMPT, 0, "r2") == {("n1", 0): Reserved(16, 0, 0)}
    assert res.totals() == (0, 0, 1)
    now[0] += BLOCK_HOLD + 0.5
    assert res.overlay("m", PROMPT, 0, "r2") == {}
    assert res.totals() == (0, 0, 0)
    assert res._load == {} and res._blocks == {"m": {}}  # nothing left behind


def test_the_ttl_and_the_streams_end_drop_everything() -> None:
    res, now = _res()
    res.reserve("r1", "a", "m", ("n1", 0), 0, PROMPT, 500, 2.0)
    res.reserve("r2", "b", "m", ("n2", 0), 0, PROMPT[:8], 100, 60)
    now[0] += 2.5
    assert res.overlay("m", PROMPT, 0, "x") == {("n2", 0): Reserved(8, 1, 100)}
    assert res.counts["expired"] == 1
    assert res.drop_router("r2") == 1
    assert res.overlay("m", PROMPT, 0, "x") == {} and res.totals() == (0, 0, 0)


def test_operations_replayed_at_their_own_time_keep_what_was_in_force() -> None:
    """A catch-up replays other replicas' operations at the time each was made: the ttl runs from the
    reservation, a late release's blocks go BLOCK_HOLD after it, and a reservation whose ttl has passed
    replaces the request's earlier one without being kept."""
    res, now = _res()
    assert res.reserve("r1", "a", "m", ("n1", 0), 0, PROMPT, 500, 10.0, at=now[0] - 8) == ""
    assert res.reserve("r1", "b", "m", ("n2", 0), 0, list(range(200, 208)), 100, 60, at=now[0] - 8) == ""
    res.release("r1", "b", first_byte=False, at=now[0] - BLOCK_HOLD - 1)  # its blocks' hold is over too
    assert res.overlay("m", PROMPT, 0, "x") == {("n1", 0): Reserved(16, 1, 500)}
    now[0] += 2.5
    assert res.overlay("m", PROMPT, 0, "x") == {} and res.counts["expired"] == 1
    res.reserve("r1", "c", "m", ("n1", 0), 0, PROMPT, 500, 60)
    assert res.reserve("r1", "c", "m", ("n1", 0), 0, PROMPT, 500, 5.0, at=now[0] - 6) == ""
    assert res.overlay("m", PROMPT, 0, "x") == {} and res.totals() == (0, 0, 0)
    assert res.reserve("r1", "d", "m", ("n1", 0), 0, PROMPT, 500, 5.0, at=now[0] + 9) == ""  # never ahead
    assert res.totals() == (1, 500, 1) and res._entries[("r1", "d")].expires == now[0] + 5.0


def test_live_ops_rebuild_a_routers_reservations_in_force_elsewhere() -> None:
    """What a replica writes again when the others may have dropped its routers' reservations: applied
    to another view later, they give the same lookups, with the same deadlines (the remaining ttl, the
    rest of a completed request's blocks' hold), and none of what was released past its hold, expired, or
    is another router's."""
    res, now = _res()
    res.reserve("r1", "a", "m", ("n1", 1), 0, PROMPT, 500, 10.0)
    res.reserve("r1", "b", "m", ("n2", 0), 2, list(range(702, 712)), 300, 60)  # from query position 2
    res.release("r1", "b", first_byte=True)
    res.reserve("r1", "c", "m", ("n3", 0), 0, list(range(300, 316)), 50, 60)
    res.reserve("r1", "d", "m", ("n3", 0), 0, list(range(400, 416)), 50, 60)
    res.reserve("r1", "e", "m", ("n3", 0), 0, list(range(500, 503)), 50, 1.0)  # no checkpoint; expires
    res.reserve("r2", "f", "m", ("n1", 1), 0, list(range(600, 616)), 70, 60)  # another router's
    res.release("r1", "c", first_byte=False)
    now[0] += BLOCK_HOLD + 0.5
    res.release("r1", "d", first_byte=False)
    ops = res.live_ops({"r1"})
    assert [(r, op.request_id, op.WhichOneof("op")) for r, op in ops] == [
        ("r1", "a", "reserve"), ("r1", "b", "reserve"), ("r1", "d", "reserve"), ("r1", "d", "release")]
    other, later = _res()
    later[0] = now[0] + 1.0
    for router, op in ops:
        assert apply_op(other, f"x/{router}", op) == ""
    for view in (res, other):
        # r2's is the asker's own load on the first view: the same load as the other's
        assert view.overlay("m", PROMPT, 0, "r2") == {("n1", 1): Reserved(16, 1, 500),
                                                      ("n2", 0): Reserved(0, 1, 0)}
        assert view.overlay("m", list(range(700, 712)), 0, "r2")[("n2", 0)] == Reserved(12, 1, 0)
        assert view.overlay("m", list(range(300, 316)), 0, "r2") == {("n1", 1): Reserved(0, 1, 500),
                                                                      ("n2", 0): Reserved(0, 1, 0)}
        assert view.overlay("m", list(range(400, 416)), 0, "r2")[("n3", 0)] == Reserved(16)
    res_a, other_a = res._entries[("r1", "a")], other._entries[("x/r1", "a")]
    assert other_a.expires == res_a.expires + 1.0  # 7 s left, from when the other applied them
    assert other._entries[("x/r1", "d")].blocks_expire == res._entries[("r1", "d")].blocks_expire + 1.0
    assert res.live_ops({"r9"}) == []


def test_bad_operations_are_refused_and_change_nothing() -> None:
    res, _ = _res()
    assert "ttl_seconds" in res.reserve("r1", "a", "m", ("n1", 0), 0, PROMPT, 5, 0.0)
    assert "needs" in res.reserve("r1", "a", "m", ("", 0), 0, PROMPT, 5, 10)
    assert res.totals() == (0, 0, 0)

    async def batches() -> AsyncIterator[object]:
        good = pb.ReserveBatch(router_id="r1")
        good.ops.add(request_id="x").reserve.CopyFrom(pb.Reservation(
            model="m", node_id="n1", block_hashes=b"\x01\x02\x03", ttl_seconds=5))  # not whole uint64s
        good.ops.add(request_id="y")  # no op
        yield good
        yield "not a batch"
        yield pb.ReserveBatch(router_id="r2")  # another router on r1's stream
        ok = pb.ReserveBatch(router_id="r1")
        ok.ops.add(request_id="z").reserve.CopyFrom(pb.Reservation(
            model="m", node_id="n1", block_hashes=pack_u64(PROMPT), ttl_seconds=5))
        yield ok
        assert res.totals() == (1, 0, 1)

    logged: list[str] = []
    n = asyncio.run(take_stream(res, batches(), lambda key, level, msg, *a: logged.append(msg % a)))
    assert n == 3 and res.counts["rejected"] == 4  # bad hashes, no op, not a batch, a second router
    assert len(logged) == 4 and all(line.startswith("Reserve: ") for line in logged)
    assert res.totals() == (0, 0, 0)  # the stream's end dropped r1's one reservation


def test_a_hold_makes_another_lookup_of_the_new_prefix_wait_for_the_pick() -> None:
    async def run() -> list[str]:
        res = Reservations()
        order: list[str] = []
        await res.hold("r1", "a", "m", PROMPT, 0, 1.0)  # r1 looked up, will reserve as "a"

        async def second() -> None:
            await res.hold("r2", "b", "m", PROMPT, 0, 1.0)
            order.append(f"r2 sees {res.overlay('m', PROMPT, 0, 'r2')}")

        task = asyncio.create_task(second())
        await asyncio.sleep(0.01)
        order.append("r1 reserves")
        res.reserve("r1", "a", "m", ("n1", 0), 0, PROMPT, 9, 60)
        await task
        await res.hold("r3", "c", "m", [7, 8, 9], 0, 1.0)  # no shared new prefix: no wait
        assert res.counts["waited"] == 1 and res.counts["held"] == 3
        return order

    assert asyncio.run(run()) == ["r1 reserves", f"r2 sees {({('n1', 0): Reserved(16, 1, 9)})}"]
    assert HOLD_SECONDS < 1.0
