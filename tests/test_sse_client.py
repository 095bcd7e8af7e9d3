"""The client-side SSE parser (producer.sse): pure, against the relay's own framing."""

from __future__ import annotations

from itertools import pairwise

from hypothesis import given
from hypothesis import strategies as st

from producer import SSEEvent, SSEParser
from relay.sse import sse_comment, sse_event


def parse(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    return [event for chunk in chunks for event in parser.feed(chunk)]


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({0, len(data), *(c % (len(data) + 1) for c in cuts)})
    return [data[a:b] for a, b in pairwise(points)]


_events = st.lists(st.tuples(st.sampled_from(["tokens", "done", "gap", "error"]),
                             st.text(min_size=0, max_size=40).filter(lambda t: "\r" not in t),
                             st.one_of(st.none(), st.integers(0, 10**6))), max_size=8)


@given(_events, st.lists(st.integers(0, 10_000), max_size=20), st.booleans())
def test_any_chunking_of_the_relays_events_parses_to_the_same_events(
        events: list[tuple[str, str, int | None]], cuts: list[int], crlf: bool) -> None:
    wire = b"".join(sse_event(data, event=name, id=eid) + sse_comment() for name, data, eid in events)
    if crlf:
        wire = wire.replace(b"\n", b"\r\n")
    expected = [SSEEvent(name, data, None if eid is None else str(eid)) for name, data, eid in events]
    assert parse(split(wire, cuts)) == expected


def test_json_data_multiline_data_and_defaults() -> None:
    wire = sse_event({"seq": 3, "text": "é"}, event="tokens", id=3) + b"data: a\ndata:b\n\n" + b"event: x\n\n"
    first, second = parse([wire])
    assert first.json() == {"seq": 3, "text": "é"} and first.id == "3"
    assert second == SSEEvent("message", "a\nb", None)  # no event name; an event without data is dropped


def test_a_utf8_character_split_between_chunks_is_decoded_whole() -> None:
    wire = "data: «ok»\n\n".encode()
    cut = wire.index("«".encode()) + 1
    assert parse([wire[:cut], wire[cut:]]) == [SSEEvent("message", "«ok»")]


def test_cr_at_the_end_of_a_chunk_then_lf_is_one_line_end() -> None:
    assert parse([b"data: a\r", b"\n\r", b"\n"]) == [SSEEvent("message", "a")]


def test_last_event_id_and_retry_are_kept_across_events() -> None:
    parser = SSEParser()
    assert parser.feed(b"retry: 1500\nid: 7\ndata: x\n\ndata: y\n\n") == [SSEEvent("message", "x", "7"),
                                                                      SSEEvent("message", "y", None)]
    assert parser.last_event_id == "7" and parser.retry_ms == 1500


def test_feed_line_takes_lines_without_their_ends() -> None:
    parser = SSEParser()
    got = [parser.feed_line(line) for line in ("event: done", 'data: {"finish": "length"}', ": ping", "")]
    assert got[:3] == [None, None, None]
    assert got[3] == SSEEvent("done", '{"finish": "length"}') and got[3].json() == {"finish": "length"}
