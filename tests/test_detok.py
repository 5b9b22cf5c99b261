"""Incremental detokenizer and stop-string matcher (`specchat.detok`)."""

from __future__ import annotations

import pytest

from fakes import E_ACUTE, byte_vocab, split_char_vocab
from specchat.detok import Detokenizer, StopMatcher


def detok_for(pieces):
    return Detokenizer(lambda t: pieces[t])


def test_multibyte_char_split_across_two_tokens():
    pieces = split_char_vocab(8, 5, 6)  # 5 + 6 = 'é'
    d = detok_for(pieces)
    assert [d.push(t) for t in (0, 5, 6, 1)] == ["a", "", "é", "b"]
    assert d.flush() == ""


def test_four_byte_char_split_across_four_tokens():
    emoji = "🙂".encode()
    pieces = byte_vocab(8, {i + 2: emoji[i : i + 1] for i in range(4)})
    d = detok_for(pieces)
    assert [d.push(t) for t in (0, 2, 3, 4, 5, 1)] == ["a", "", "", "", "🙂", "b"]


def test_char_split_inside_multi_char_pieces():
    pieces = [b"ab" + E_ACUTE[:1], E_ACUTE[1:] + b"cd", b"x"]
    d = detok_for(pieces)
    assert d.push(0) == "ab"
    assert d.push(1) == "écd"


def test_unfinished_char_at_the_end_is_dropped():
    pieces = split_char_vocab(8, 5, 6)
    d = detok_for(pieces)
    assert d.push(0) == "a"
    assert d.push(5) == ""
    assert d.flush() == ""  # not U+FFFD: the character was never finished
    assert d.push(5) == "" and d.push(6) == "é"  # and nothing of it lingers into later text


def test_invalid_bytes_become_replacement_chars():
    d = detok_for([b"\xff", b"a", E_ACUTE[1:]])
    assert d.push(0) == "\ufffd"
    assert d.push(2) == "\ufffd"  # a continuation byte with no start
    assert d.push(1) == "a"


def test_empty_pieces():
    d = detok_for([b"", b"a"])
    assert [d.push(0), d.push(1), d.push(0)] == ["", "a", ""]


# ---------------------------------------------------------------------------------------------------------
# StopMatcher


def feed_all(m: StopMatcher, parts):
    return [m.feed(p) for p in parts]


def test_no_stops_passes_text_through():
    m = StopMatcher([])
    assert feed_all(m, ["ab", "c"]) == [("ab", False), ("c", False)]
    assert m.flush() == ""
    assert StopMatcher([""]).feed("abc") == ("abc", False)  # empty stop strings are ignored


def test_holdback_then_release():
    m = StopMatcher(["END"])
    assert m.feed("hello E") == ("hello ", False)
    assert m.feed("N") == ("", False)
    assert m.held == "EN"
    assert m.feed("o") == ("ENo", False)  # it was not the stop string after all
    assert m.held == ""


def test_stop_found_in_one_feed():
    m = StopMatcher(["END"])
    assert m.feed("abc END def") == ("abc ", True)


def test_stop_spanning_three_feeds():
    m = StopMatcher(["<|end|>"])
    shown = []
    for part in ["text <|", "en", "d|> more"]:
        text, hit = m.feed(part)
        shown.append(text)
        if hit:
            break
    assert shown == ["text ", "", ""] and hit
    assert "".join(shown) == "text "


def test_overlapping_prefix_aab():
    # "aa" is held; "aaa" releases one 'a' and keeps "aa" (still a prefix); then 'b' completes "aab"
    m = StopMatcher(["aab"])
    assert m.feed("aa") == ("", False)
    assert m.feed("a") == ("a", False)
    assert m.held == "aa"
    assert m.feed("b") == ("", True)


def test_overlapping_prefix_abab():
    m = StopMatcher(["abac"])
    assert m.feed("ab") == ("", False)
    assert m.feed("ab") == ("ab", False)  # "abab": the stop could now start at the second 'a'
    assert m.held == "ab"
    assert m.feed("ac") == ("", True)


def test_several_stops_hold_the_longest_possible_prefix():
    m = StopMatcher(["xyz", "yzzz"])
    assert m.feed("ay") == ("a", False)  # 'y' starts "yzzz"
    assert m.feed("z") == ("", False)  # "yz" starts "yzzz"
    assert m.feed("zq") == ("yzzq", False)


def test_earliest_stop_wins():
    m = StopMatcher(["cd", "b"])
    assert m.feed("abcd") == ("a", True)
    m = StopMatcher(["zz", "bc"])
    assert m.feed("ab") == ("a", False)
    assert m.feed("c") == ("", True)


def test_stop_inside_held_plus_new_text():
    m = StopMatcher(["\n\n"])
    assert m.feed("line\n") == ("line", False)
    assert m.feed("\nnext") == ("", True)


def test_flush_returns_held_text_once():
    m = StopMatcher(["STOP"])
    assert m.feed("go ST") == ("go ", False)
    assert m.flush() == "ST"
    assert m.flush() == ""


@pytest.mark.parametrize("stop", ["ab", "abc", "aXa", "é!"])
def test_stream_never_shows_a_stop_string(stop):
    """Char-by-char feeding of a text containing the stop: shown text == text before the first stop."""
    text = "xxaXaXab é!abc yy"
    m = StopMatcher([stop])
    shown = ""
    for ch in text:
        out, hit = m.feed(ch)
        shown += out
        assert stop not in shown
        if hit:
            break
    assert hit and shown == text[: text.index(stop)]
