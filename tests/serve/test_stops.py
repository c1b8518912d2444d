"""Stop strings over streamed pieces: whatever way the text is cut into pieces, what reaches the
client is the text up to the first stop string, and nothing past it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from ntx_serve.stops import StopMatcher

ALPHABET = "ab, \n✓"


def _cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """The oracle: the earliest position where any stop string starts."""
    hits = [text.find(s) for s in stops if s and s in text]
    return (text[:min(hits)], True) if hits else (text, False)


@settings(max_examples=500, deadline=None)
@given(text=st.text(ALPHABET, max_size=40), stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=4),
       cuts=st.lists(st.integers(0, 40), max_size=10))
def test_streamed_text_is_cut_at_the_first_stop(text, stops, cuts):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    m, sent, hit = StopMatcher(stops), [], False
    for a, b in zip(bounds, bounds[1:]):
        out, hit = m.push(text[a:b])
        sent.append(out)
        if hit:
            break
    if not hit:
        tail, hit = m.flush()
        sent.append(tail)
    assert ("".join(sent), hit) == _cut(text, stops)


def test_text_that_might_start_a_stop_is_held_back():
    m = StopMatcher(["</s>"])
    assert m.push("hello <") == ("hello ", False)
    assert m.push("/") == ("", False)
    assert m.push("x") == ("</x", False)
    assert m.push("</s> tail") == ("", True)


def test_an_earlier_stop_that_is_still_open_wins():
    # "b" is complete at 1, but "abc" may still begin at 0: wait, then cut where the earliest begins
    m = StopMatcher(["abc", "b"])
    assert m.push("ab") == ("", False)
    assert m.push("c") == ("", True)
    m = StopMatcher(["abc", "b"])
    assert m.push("ab") == ("", False)
    assert m.push("x") == ("a", True)
    m = StopMatcher(["abc", "b"])
    assert m.push("ab") == ("", False)
    assert m.flush() == ("a", True)  # generation ended: the complete "b" cuts
