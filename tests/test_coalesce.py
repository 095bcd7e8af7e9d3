"""Coalescing windows, driven by an explicit clock (no sleeps)."""

from __future__ import annotations

from generator.service.coalesce import Coalescer
from tokenpipe.wire import Usage

MS = 1_000_000


def make(max_tokens: int = 4, max_delay_ms: float = 20) -> Coalescer:
    return Coalescer("s", max_tokens=max_tokens, max_delay_ns=int(max_delay_ms * MS), first_timings={"created": 1})


def test_first_token_is_released_immediately() -> None:
    c = make()
    b = c.add([10], "a", 0)
    assert b is not None and b.seq == 0 and b.index == 0 and b.token_ids == (10,)
    assert b.timings["created"] == 1


def test_count_window_releases_at_max_tokens() -> None:
    c = make(max_tokens=3)
    c.add([1], "a", 0)
    assert c.add([2], "b", 1) is None
    assert c.add([3], "c", 2) is None
    b = c.add([4], "d", 3)
    assert b is not None and b.token_ids == (2, 3, 4) and b.text == "bcd" and b.index == 1 and b.seq == 1


def test_time_window_releases_on_due_and_on_add() -> None:
    c = make(max_tokens=100, max_delay_ms=20)
    c.add([1], "a", 0)
    assert c.add([2], "b", 5 * MS) is None
    assert c.add([3], "c", 15 * MS) is None
    assert c.deadline() == 25 * MS
    assert c.due(24 * MS) is None
    b = c.due(25 * MS)
    assert b is not None and b.token_ids == (2, 3)
    assert c.deadline() is None and c.due(10**12) is None
    assert c.add([4], "d", 30 * MS) is None
    assert c.add([5], "e", 45 * MS) is None
    b = c.add([6], "f", 50 * MS)  # 20 ms since the first pending token
    assert b is not None and b.token_ids == (4, 5, 6)


def test_regression_a_stream_slower_than_the_window_is_not_held() -> None:
    """SmolLM2 at 32 streams on a CPU steps every ~45 ms: with a 20 ms window every token sat
    in the coalescer for the whole window (and a timer per token) before going out alone anyway."""
    c = make(max_tokens=8, max_delay_ms=20)
    assert c.add([1], "a", 0) is not None
    for i, t in enumerate(range(45, 450, 45), start=2):
        b = c.add([i], "x", t * MS)
        assert b is not None and b.token_ids == (i,) and b.timings["emitted"] == t * MS
    assert c.deadline() is None
    # decoding faster than the window again (a GPU-like step): the windows apply
    assert c.add([100], "y", 410 * MS) is None
    assert c.add([101], "z", 415 * MS) is None
    assert c.deadline() == 430 * MS


def test_final_batch_is_immediate_and_carries_usage() -> None:
    c = make(max_tokens=100)
    c.add([1], "a", 0)
    c.add([2], "b", 1)
    b = c.add([3], "c", 2, finish="length", usage=Usage(4, 3))
    assert b is not None and b.finish == "length" and b.token_ids == (2, 3) and b.usage == Usage(4, 3)
    assert c.done


def test_zero_windows_mean_every_token() -> None:
    for c in (make(max_tokens=0), make(max_delay_ms=0)):
        batches = [c.add([i], str(i), i) for i in range(5)]
        assert all(b is not None for b in batches)
        assert [b.index for b in batches if b] == [0, 1, 2, 3, 4]


def test_indices_are_contiguous_across_mixed_flushes() -> None:
    c = make(max_tokens=3, max_delay_ms=10)
    out = []
    t = 0
    for i in range(40):
        t += (i % 7) * MS
        for b in (c.due(t), c.add([i], "x", t)):
            if b is not None:
                out.append(b)
    final = c.add([], "", t + 1, finish="stop")
    assert final is not None
    out.append(final)
    assert [b.seq for b in out] == list(range(len(out)))
    expected = 0
    for b in out:
        assert b.index == expected
        expected += len(b.token_ids)
    assert expected == 40


def test_resumed_coalescer_continues_numbering() -> None:
    c = Coalescer("s", max_tokens=4, max_delay_ns=MS, start_seq=5, start_index=17)
    b = c.add([9], "z", 0)
    assert b is not None and (b.seq, b.index) == (5, 17)
