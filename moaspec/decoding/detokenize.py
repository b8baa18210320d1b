"""Incremental detokenization with stop strings, for streaming.

A token can end inside a multi-byte character, and a stop string can span several
tokens; a streamer must therefore hold text back until it is final. This follows the
prefix/read-offset scheme of vLLM and text-generation-inference: only a short window
of recent tokens is re-decoded per step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Detokenizer:
    """Accumulates generated token ids and yields text that is safe to show."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
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
        for s in self.stop:
            idx = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if idx != -1:
                self.text = self.text[:idx]
                self.stopped = True
        safe = len(self.text)
        if not self.stopped:
            # hold back a tail that could still grow into a stop string
            for s in self.stop:
                for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                    if self.text.endswith(s[:k]):
                        safe = min(safe, len(self.text) - k)
                        break
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
