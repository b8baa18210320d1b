"""Streaming text: multi-byte characters, stop strings across token boundaries."""

from __future__ import annotations

import pytest

from moaspec.decoding.detokenize import Detokenizer


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    from tiny import make_tokenizer

    return make_tokenizer(320)


def stream(tok, text: str, stop=()):  # type: ignore[no-untyped-def]
    d = Detokenizer(tok, stop)
    pieces = []
    for t in tok(text, add_special_tokens=False)["input_ids"]:
        pieces.append(d.push([t]))
        if d.stopped:
            break
    pieces.append(d.flush())
    return d, pieces


def test_streamed_pieces_concatenate_to_the_text(tok) -> None:  # type: ignore[no-untyped-def]
    text = "Café ☕ 日本語 🙂 the quick brown fox"
    d, pieces = stream(tok, text)
    assert "".join(pieces) == text == d.text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_cut_and_never_shown(tok) -> None:  # type: ignore[no-untyped-def]
    d, pieces = stream(tok, "def add(a, b):\n    return a + b\n", stop=["return"])
    assert d.stopped
    assert d.text == "def add(a, b):\n    "
    assert "".join(pieces) == d.text
    assert not any("ret" in p for p in pieces)


def test_partial_stop_prefix_is_released_at_the_end(tok) -> None:  # type: ignore[no-untyped-def]
    d, pieces = stream(tok, "the quick brown fox", stop=["fox jumps"])
    assert not d.stopped
    assert "".join(pieces) == "the quick brown fox"


def test_many_tokens_at_once(tok) -> None:  # type: ignore[no-untyped-def]
    ids = tok("Paris is the capital of France.", add_special_tokens=False)["input_ids"]
    d = Detokenizer(tok, stop=["capital"])
    out = d.push(ids) + d.flush()
    assert out == "Paris is the " and d.stopped


def test_flush_decodes_a_trailing_incomplete_character(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Generation can stop in the middle of a multi-byte character: the text still holds every token."""
    from moaspec.decoding.detokenize import Detokenizer

    tok = tiny_llama.tokenizer
    ids = tok("ok 🌊🍕", add_special_tokens=False)["input_ids"]  # emoji unseen in training: several byte tokens

    def decode(x: list[int]) -> str:
        return tok.decode(x, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    partial = next(ids[:k] for k in range(len(ids), 0, -1) if decode(ids[:k]).endswith("\ufffd"))
    whole = decode(partial)  # ends inside an emoji's bytes
    for step in (1, len(partial)):  # streamed token by token, or all at once
        d = Detokenizer(tok)
        streamed = "".join(d.push(partial[i : i + step]) for i in range(0, len(partial), step)) + d.flush()
        assert streamed == d.text == whole


class Chars:
    """A tokenizer whose token ids are Unicode code points: any text, one character a token."""

    @staticmethod
    def decode(ids: list[int], **_: object) -> str:
        return "".join(map(chr, ids))


def test_stop_strings_match_as_a_naive_search_would() -> None:
    """Text streamed a character at a time ends where the first stop string to be completed begins, and
    nothing shown before then is the beginning of a stop string."""
    import random

    rng = random.Random(7)
    for _ in range(300):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 40)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 6))) for _ in range(rng.randrange(1, 4))]
        ends = (min(e - len(s) for s in stops if text[:e].endswith(s)) for e in range(1, len(text) + 1)
                if any(text[:e].endswith(s) for s in stops))
        first = next(ends, None)
        d, shown = Detokenizer(Chars(), stops), ""
        for c in text:
            shown += d.push([ord(c)])
            assert first is None or len(shown) <= first, (text, stops, shown)
            if d.stopped:
                break
        shown += d.flush()
        assert shown == (text if first is None else text[:first]), (text, stops, shown)
        assert d.stopped == (first is not None)


def test_long_stop_strings_cost_time_linear_in_the_text() -> None:
    """Sixteen 5,000-character stop strings, and text whose end is always the beginning of each: every new
    character is read once per stop string (testing each prefix of each stop string against the text's end
    took O(length²) per piece: over a minute for these 1,200 pieces)."""
    import time

    stops = [str(i % 10) * 4999 + "!" for i in range(16)]
    d = Detokenizer(Chars(), stops)
    began = time.perf_counter()
    shown = "".join(d.push([ord(c) for c in "x01"]) for _ in range(1200))
    assert time.perf_counter() - began < 3
    assert shown == "x01" * 1199 + "x0"  # the last "1" could still begin a stop string
    assert d.flush() == "1"
