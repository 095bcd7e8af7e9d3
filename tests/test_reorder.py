"""The reorder/gap buffer on its own: any arrival order, duplicates and holes give the same output."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from tokenpipe.reorder import EXPIRED, LOST, Gap, Reorder
from tokenpipe.wire import TokenBatch

WAIT = 15.0
SID = "s1"


def batch(seq: int, final: bool = False) -> TokenBatch:
    return TokenBatch(id=SID, seq=seq, index=seq, token_ids=(seq,), text=f"t{seq}",
                      finish="stop" if final else None)


def stream(n: int) -> list[TokenBatch]:
    """Batches 0..n, the last one final."""
    return [batch(s, final=s == n) for s in range(n + 1)]


def expected_output(n: int, stored: set[int], after: int) -> list[TokenBatch | Gap]:
    """What a reader must see of stream 0..n when only ``stored`` ever arrives and it has read
    everything stored (so a hole before the oldest stored batch is retention's, the rest lost)."""
    if n in stored and n <= after:
        return [TokenBatch(id=SID, seq=n, index=n, finish="stop")]  # the end, without its tokens
    present = sorted(s for s in stored if s > after)
    out: list[TokenBatch | Gap] = []
    cursor = after + 1
    if present and min(stored) > cursor:
        out.append(Gap(cursor, min(stored) - 1, EXPIRED))
        cursor = min(stored)
    for seq in present:
        if seq > cursor:
            out.append(Gap(cursor, seq - 1, LOST))
        out.append(batch(seq, final=seq == n))
        cursor = seq + 1
    return out


@st.composite
def deliveries(draw: st.DrawFn) -> tuple[int, set[int], int, list[int]]:
    """A stream length, the batches that were stored, a resume point, and an arrival order of
    the stored batches with duplicates."""
    n = draw(st.integers(0, 12))
    stored = draw(st.sets(st.integers(0, n), min_size=1))
    after = draw(st.integers(-1, n + 1))
    arrivals = draw(st.lists(st.sampled_from(sorted(stored)), max_size=3 * len(stored)))
    order = draw(st.permutations(sorted(stored) + arrivals))
    return n, stored, after, list(order)


@given(deliveries(), st.lists(st.floats(0, WAIT - 0.001), min_size=1))
def test_any_arrival_order_with_duplicates_and_holes_gives_the_same_output(
        case: tuple[int, set[int], int, list[int]], times: list[float]) -> None:
    n, stored, after, order = case
    buf = Reorder(after, wait=WAIT)
    out: list[TokenBatch | Gap] = []
    times = sorted(times)
    for i, seq in enumerate(order):
        now = times[min(i, len(times) - 1)]
        buf.feed(batch(seq, final=seq == n), now=now)
        assert not buf.expire(now)  # no hole has waited its full time yet
        out += buf.ready()
    buf.caught_up(min(stored), now=times[-1])
    out += buf.ready()
    now = WAIT
    while buf.holding:  # let every remaining hole's wait run out
        assert buf.deadline is not None and buf.deadline <= now + WAIT
        now += WAIT
        assert buf.expire(now)
        out += buf.ready()
    assert out == expected_output(n, stored, after)
    assert buf.done == (n in stored)
    assert buf.ready() == []


@given(st.integers(0, 12), st.data())
def test_a_complete_stream_arrives_whole_in_order_whatever_the_order_it_came_in(n: int, data: st.DataObject) -> None:
    order = data.draw(st.permutations(stream(n) + data.draw(st.lists(st.sampled_from(stream(n))))))
    buf = Reorder()
    out: list[TokenBatch | Gap] = []
    for b in order:
        buf.feed(b, now=0.0)
        out += buf.ready()
    assert out == stream(n)
    assert buf.done and not buf.holding and buf.deadline is None


def test_resume_after_the_final_batch_still_tells_the_end() -> None:
    buf = Reorder(after=2)
    for b in stream(2):
        buf.feed(b, now=0.0)
    out = buf.ready()
    assert out == [TokenBatch(id=SID, seq=2, index=2, finish="stop")]
    assert buf.done


def test_resume_point_before_the_end_skips_what_was_seen() -> None:
    buf = Reorder(after=1)
    for b in reversed(stream(3)):
        buf.feed(b, now=0.0)
    assert [b.seq for b in buf.ready() if isinstance(b, TokenBatch)] == [2, 3]


def test_history_expired_from_the_start_is_a_retention_gap() -> None:
    buf = Reorder()
    buf.feed(batch(4), now=0.0)
    buf.feed(batch(5), now=0.0)
    assert buf.ready() == []  # 0..3 may still come: nothing says they are gone
    buf.caught_up(4, now=0.0)
    assert buf.ready() == [Gap(0, 3, EXPIRED), batch(4), batch(5)]
    assert not buf.holding


def test_caught_up_with_the_next_batch_stored_is_no_gap() -> None:
    buf = Reorder(after=3)
    buf.caught_up(0, now=0.0)
    buf.caught_up(4, now=0.0)
    assert buf.ready() == []


def test_missing_batch_is_waited_for_then_declared_lost() -> None:
    buf = Reorder(wait=WAIT)
    assert buf.deadline is None
    buf.feed(batch(0), now=0.0)
    buf.feed(batch(2), now=1.0)
    assert buf.ready() == [batch(0)]
    assert buf.holding and buf.hole_since == 1.0 and buf.deadline == 1.0 + WAIT
    assert not buf.expire(WAIT)
    assert buf.expire(1.0 + WAIT)
    assert buf.ready() == [Gap(1, 1, LOST), batch(2)]
    buf.feed(batch(1), now=20.0)  # too late: the reader was told it is missing
    assert buf.ready() == []


def test_hole_clock_runs_on_through_a_partial_fill_and_restarts_after_a_lost_gap() -> None:
    buf = Reorder(wait=WAIT)
    for seq in (2, 4):
        buf.feed(batch(seq), now=0.0)
    buf.feed(batch(0), now=5.0)
    buf.feed(batch(1), now=10.0)  # 0..2 out, 3 still missing: the clock keeps its start
    assert [b.seq for b in buf.ready() if isinstance(b, TokenBatch)] == [0, 1, 2]
    assert buf.deadline == WAIT
    buf.feed(batch(6, final=True), now=12.0)
    assert buf.expire(WAIT)
    assert buf.ready() == [Gap(3, 3, LOST), batch(4)]
    assert buf.deadline == 2 * WAIT  # the hole at 5 gets a wait of its own
    assert not buf.expire(2 * WAIT - 0.1)
    assert buf.expire(2 * WAIT)
    assert buf.ready() == [Gap(5, 5, LOST), batch(6, final=True)]
    assert buf.done and buf.deadline is None


def test_nothing_is_handed_out_after_the_final_batch() -> None:
    buf = Reorder()
    buf.feed(batch(0, final=True), now=0.0)
    buf.feed(batch(1), now=0.0)
    buf.caught_up(5, now=0.0)
    assert buf.ready() == [batch(0, final=True)]
    assert not buf.holding


def test_trace_context_comes_from_the_first_batch_that_carries_one() -> None:
    first = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    sink: dict[str, str] = {}
    buf = Reorder(after=0, trace_headers=sink)
    buf.feed(batch(1), {"Nats-Msg-Id": "x"}, now=0.0)  # no trace context here
    # Before the resume point, but its context is still the generation's.
    buf.feed(batch(0), {"traceparent": first, "Nats-Msg-Id": "y"}, now=0.0)
    buf.feed(batch(2), {"traceparent": "00-ffffffffffffffffffffffffffffffff-ffffffffffffffff-01"}, now=0.0)
    assert sink == {"traceparent": first} and buf.trace_headers is sink
