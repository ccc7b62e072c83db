"""Stop strings across token boundaries."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from dpu_frontend.text.stop import StopMatcher


def run(chunks: list[str], stops: list[str], include: bool = False) -> tuple[str, str | None]:
    matcher = StopMatcher(stops, include=include)
    out = "".join(matcher.feed(c) for c in chunks)
    return out + matcher.flush(), matcher.matched


def test_stop_spanning_chunks_is_never_emitted() -> None:
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("hello </") == "hello "
    assert matcher.feed("en") == ""
    assert matcher.feed("d> tail") == ""
    assert matcher.matched == "</end>"


def test_held_text_is_released_when_it_stops_being_a_prefix() -> None:
    matcher = StopMatcher(["STOP"])
    assert matcher.feed("ST") == ""
    assert matcher.feed("AR") == "STAR"
    assert matcher.flush() == ""


def test_include_stop_str_in_output() -> None:
    assert run(["a", "b", "c", "d"], ["bc"], include=True) == ("abc", "bc")


def test_the_stop_that_ends_first_wins() -> None:
    assert run(["xxBBxxAA"], ["AA", "BB"]) == ("xx", "BB")
    assert run(["xaab"], ["aab", "a"]) == ("x", "a")


def test_no_stops_passes_through() -> None:
    assert run(["a", "b"], []) == ("ab", None)


@given(st.text(alphabet="abc", max_size=30), st.lists(st.integers(1, 5), max_size=30),
       st.lists(st.text(alphabet="abc", min_size=1, max_size=4), min_size=1, max_size=3),
       st.booleans())
def test_equals_cutting_the_whole_text(text: str, cuts: list[int], stops: list[str],
                                       include: bool) -> None:
    chunks, i = [], 0
    for c in cuts:
        chunks.append(text[i:i + c])
        i += c
    chunks.append(text[i:])
    hits = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    expected: tuple[str, str | None]
    if hits:
        _, at, stop = min(hits)
        expected = (text[:at] + (stop if include else ""), stop)
    else:
        expected = (text, None)
    assert run(chunks, stops, include) == expected
