"""Log-probability entries in the shapes of OpenAI's two APIs, with each token's exact bytes.

The server's routes and ``moaspec generate --json --logprobs`` write them.

A token may hold part of a character (byte-level BPE splits UTF-8 sequences), so its
decoded text alone cannot rebuild the answer; OpenAI's chat format carries each
token's ``bytes`` for that, and names a token that is not whole text ``bytes:\\xNN...``.
The bytes come from the tokenizer's own vocabulary: byte-level vocabularies (GPT-2,
Llama 3, Qwen, SmolLM) map each byte to one printable character, SentencePiece ones
write a byte as ``<0xNN>`` and a space as ``▁``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

from moaspec.decoding.generation import TokenLogprob

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenBytes:
    """The bytes each token id stands for, read from ``tokenizer``'s vocabulary (cached per id)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self.byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        if token not in self._cache:
            self._cache[token] = self._read(token)
        return self._cache[token]

    def _read(self, token: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if token in getattr(self.tokenizer, "all_special_ids", ()):
            return str(piece).encode()
        if self.byte_level:
            table = _byte_level_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if m := _BYTE_PIECE.fullmatch(piece):
            return bytes([int(m.group(1), 16)])
        if "▁" in piece:  # SentencePiece's space
            return piece.replace("▁", " ").encode()
        return str(self.tokenizer.decode([token], clean_up_tokenization_spaces=False)).encode()

    def text(self, token: int) -> str:
        """The token as text; ``bytes:\\xNN...`` when its bytes are not whole UTF-8 characters (OpenAI's naming)."""
        raw = self(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class LogprobFormat:
    """Entries in the shape of one API: chat's ``content`` list, or the completions API's parallel lists
    (whose ``top_logprobs`` also holds the chosen token, as OpenAI's does). One per response: the
    completions API's ``text_offset`` counts on from the entries already formatted."""

    def __init__(self, token_bytes: TokenBytes, chat: bool) -> None:
        self.bytes = token_bytes
        self.chat = chat
        self._seen = b""  # completions: the bytes of the tokens formatted so far

    def _chat_entry(self, token: int, logprob: float) -> dict[str, Any]:
        return {"token": self.bytes.text(token), "logprob": logprob, "bytes": list(self.bytes(token))}

    def __call__(self, entries: Sequence[TokenLogprob]) -> dict[str, Any] | None:
        if not entries:
            return None
        if self.chat:
            return {"content": [{**self._chat_entry(e.token, e.logprob),
                                 "top_logprobs": [self._chat_entry(t, lp) for t, lp in e.top]} for e in entries],
                    "refusal": None}
        tokens = [self.bytes.text(e.token) for e in entries]
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries],
                "top_logprobs": [{**{self.bytes.text(t): lp for t, lp in e.top}, text: e.logprob}
                                 for e, text in zip(entries, tokens)],
                "text_offset": self._offsets([e.token for e in entries])}

    def _offsets(self, tokens: Sequence[int]) -> list[int]:
        """Where each token's text begins in the completion: the characters completed before it."""
        offsets = []
        for token in tokens:
            offsets.append(len(self._seen.decode("utf-8", errors="ignore")))
            self._seen += self.bytes(token)
        return offsets

    def prompt(self, ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> dict[str, Any]:
        """The completions API's entries of an echoed prompt: ``entries`` as the prompt's own log-probabilities
        give them, the first token with none (nothing before it); formatted before the answer's."""
        tokens = [self.bytes.text(t) for t in ids]
        return {"tokens": tokens, "token_logprobs": [e.logprob if e else None for e in entries],
                "top_logprobs": [{**{self.bytes.text(t): lp for t, lp in e.top}, text: e.logprob} if e else None
                                 for e, text in zip(entries, tokens)],
                "text_offset": self._offsets(ids)}

    @staticmethod
    def joined(first: dict[str, Any] | None, then: dict[str, Any] | None) -> dict[str, Any] | None:
        """Two runs of completions-API entries as one (either may be None: no entries)."""
        if first is None or then is None:
            return first or then
        return {key: first[key] + then[key] for key in first}
