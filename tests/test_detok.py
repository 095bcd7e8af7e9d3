"""Incremental detokenization on multi-byte text, and stop-string hold-back."""

from __future__ import annotations

import pytest

from generator.engine.detok import IncrementalDetokenizer, StopMatcher
from generator.model.loader import LoadedModel

TEXTS = [
    "Hello, world! 😀🎉 family: 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "东京は日本の首都です。北京是中国的首都。서울은 한국의 수도입니다.",
    "mixed: naïve café — ½ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 and 🧑🏽‍🚀 done",
]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_never_breaks_a_character(tiny_model: LoadedModel, text: str) -> None:
    tok = tiny_model.tokenizer
    ids = tok.encode(text, add_special_tokens=False)
    # The byte-level BPE splits these characters over several tokens; make sure the test means something.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, tok.encode("Prompt:", add_special_tokens=False))
    pieces = [detok.push(i) for i in ids] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text


def test_truncated_character_at_end_matches_full_decode(tiny_model: LoadedModel) -> None:
    tok = tiny_model.tokenizer
    ids = tok.encode("ok 😀", add_special_tokens=False)
    cut = ids[:-1]  # the emoji's last byte-token is missing
    detok = IncrementalDetokenizer(tok)
    text = "".join(detok.push(i) for i in cut) + detok.flush()
    assert text == tok.decode(cut)


def test_stop_string_split_across_pieces_is_held_then_cut() -> None:
    m = StopMatcher(["<END>"])
    assert m.feed("hello <") == ("hello ", False)
    assert m.feed("EN") == ("", False)
    assert m.feed("D> trailing") == ("", True)


def test_stop_false_alarm_releases_held_text() -> None:
    m = StopMatcher(["<END>"])
    assert m.feed("a <E") == ("a ", False)
    assert m.feed("X") == ("<EX", False)
    assert m.flush() == ""


def test_earliest_of_several_stops_wins() -> None:
    m = StopMatcher(["world", "lo w"])
    assert m.feed("hello world") == ("hel", True)


def test_no_stops_passes_through() -> None:
    m = StopMatcher([])
    assert m.feed("abc") == ("abc", False)
