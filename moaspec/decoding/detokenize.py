"""Incremental detokenization with stop strings, for streaming.

A token can end inside a multi-byte character, and a stop string can span several
tokens; a streamer must therefore hold text back until it is final. This follows the
prefix/read-offset scheme of vLLM and text-generation-inference: only a short window
of recent tokens is re-decoded per step.

Stop strings are matched as the text grows, each by a Knuth–Morris–Pratt automaton
(:class:`StopMatcher`): every new character costs amortised O(1) per stop string, however
long the stop strings are. Testing every prefix of every stop string against the text's end
after each piece, as this did before, cost O(length²) per piece: sixteen 65,000-character
stop strings made a 1,200-token answer twice as slow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class StopMatcher:
    """How much of ``stop`` the text seen so far ends with, and where it first occurs whole.

    Knuth–Morris–Pratt: ``_border[k]`` is the length of the longest proper prefix of
    ``stop[:k]`` that is also its suffix, so a mismatch falls back without rereading text.
    """

    def __init__(self, stop: str) -> None:
        self.stop = stop
        border = [0] * (len(stop) + 1)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = border[k]
            k += stop[i] == stop[k]
            border[i + 1] = k
        self._border = border
        self.matched = 0  # the longest prefix of ``stop`` that the text ends with

    def feed(self, text: str) -> int | None:
        """Read ``text`` on from where the last call ended; the index in ``text`` where the first whole
        occurrence of ``stop`` ends, or None (then ``matched`` says how much of it the text ends with)."""
        stop, border, k = self.stop, self._border, self.matched
        for i, ch in enumerate(text):
            while k and ch != stop[k]:
                k = border[k]
            k += ch == stop[k]
            if k == len(stop):
                self.matched = k
                return i + 1
        self.matched = k
        return None


class Detokenizer:
    """Accumulates generated token ids and yields text that is safe to show."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self._matchers = [StopMatcher(s) for s in self.stop]
        self._matched_to = 0  # characters of ``text`` the matchers have read
        self.tokens: list[int] = []
        self.text = ""  # all final text so far (stop string excluded)
        self.emitted = 0  # characters of ``text`` already handed out
        self._prefix_offset = 0
        self._read_offset = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token_ids: Sequence[int]) -> str:
        """Add tokens; return the newly final text (possibly empty). Sets ``stopped`` on a stop string."""
        if self.stopped:
            return ""
        self.tokens.extend(token_ids)
        self._advance(final=False)
        return self._release()

    def _advance(self, final: bool) -> None:
        """Decode the recent window; text ending in an incomplete character waits, unless generation is over."""
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.tokens)

    def _release(self) -> str:
        new, start = self.text[self._matched_to :], self._matched_to
        self._matched_to = len(self.text)
        # the stop string that begins first ends the text there
        cut = min((start + end - len(m.stop) for m in self._matchers if (end := m.feed(new)) is not None), default=None)
        if cut is not None:
            self.text = self.text[:cut]
            self.stopped = True
        # hold back a tail that could still grow into a stop string
        safe = len(self.text) if self.stopped else len(self.text) - max((m.matched for m in self._matchers), default=0)
        out = self.text[self.emitted : safe]
        self.emitted = max(self.emitted, safe)
        return out

    def flush(self) -> str:
        """At the end of generation: decode what is left (even an incomplete character) and release it."""
        out = ""
        if not self.stopped:
            self._advance(final=True)
            out = self._release()
        out += self.text[self.emitted :]
        self.emitted = len(self.text)
        return out
