"""What every decoder takes and returns, so that vanilla and speculative runs compare directly."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch

from moaspec.decoding.detokenize import Detokenizer
from moaspec.decoding.sampling import SamplingParams
from moaspec.errors import MoaspecError
from moaspec.validation import whole_number

TextCallback = Callable[[str], None]
PieceCallback = Callable[[str, bool], None]  # (text, whether it came from accepted drafts)
MAX_TOP_LOGPROBS = 20  # alternatives reported per token at most (OpenAI's limit)


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and the ``top`` most likely tokens at its position.

    The target's own distribution (log-softmax of its logits, before penalties, logit bias, temperature,
    top-k or top-p), so it is the same whichever drafter proposed the token, and the same as plain
    decoding reports.
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, log-probability), most likely first


LogprobCallback = Callable[[Sequence[TokenLogprob]], None]  # the entries of the text about to be emitted


def length_histogram(lengths: Iterable[int]) -> dict[int, int]:
    """How many target calls added 1, 2, 3, ... tokens, given each call's count."""
    return dict(sorted(Counter(lengths).items()))


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Entries for ``tokens`` from the logits ``[len(tokens), V]`` that scored them, with the ``top`` likeliest."""
    logp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    chosen = logp.gather(-1, torch.tensor(list(tokens), device=logp.device)[:, None])[:, 0].tolist()
    if top:
        values, ids = logp.topk(top, dim=-1)
        tops = [tuple(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    else:
        tops = [()] * len(tokens)
    return [TokenLogprob(t, lp, best) for t, lp, best in zip(tokens, chosen, tops)]


def prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], prompt_ids: Sequence[int], hidden: torch.Tensor,
                    top: int, rows: int = 256) -> list[TokenLogprob | None]:
    """Each prompt token's log-probability given the tokens before it (None for the first), from the prefill's final
    states ``hidden`` ``[T, d]``: ``lm_head`` over ``rows`` positions at a time, so a long prompt never holds
    ``[T, V]`` logits at once."""
    entries: list[TokenLogprob | None] = [None]
    for a in range(0, len(prompt_ids) - 1, rows):
        b = min(a + rows, len(prompt_ids) - 1)
        entries += token_logprobs(lm_head(hidden[a:b]), prompt_ids[a + 1 : b + 1], top)
    return entries


@dataclass(frozen=True)
class GenerationConfig:
    """When to stop and how to pick tokens."""

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; k: each token's log-probability and the k most likely tokens
    prompt_logprobs: int | None = None  # the same for the prompt's tokens (a completions API's echo)

    def __post_init__(self) -> None:
        if not (whole_number(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise MoaspecError(f"max_new_tokens must be a whole number >= 1, got {self.max_new_tokens!r}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not (whole_number(value) and 0 <= value <= MAX_TOP_LOGPROBS):
                raise MoaspecError(f"{name} must be a whole number in 0..{MAX_TOP_LOGPROBS} (alternatives per token) "
                                   f"or None, got {value!r}")
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
            raise MoaspecError(f"stop must be a list or tuple of strings, got {self.stop!r}")
        if any(not s for s in self.stop):
            raise MoaspecError("a stop string must not be empty")


@dataclass
class GenerationResult:
    """Tokens, text and timings of one generation (one assistant turn)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "eos", "stop" or "length"
    prompt_tokens: int
    prefill_s: float
    total_s: float
    target_calls: int  # target forwards after prefill
    accepted_lengths: list[int] = field(default_factory=list)  # tokens added per target call
    draft_s: float = 0.0  # time in the drafter (speculative decoders): proposing, and taking in verified tokens
    reused_prompt_tokens: int = 0  # leading prompt tokens whose K/V came from a PromptCache instead of a forward
    logprobs: list[TokenLogprob] | None = None  # one per token of token_ids, when the config asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (None for the first), when asked

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def accepted_histogram(self) -> dict[int, int]:
        """How many target calls added 1, 2, 3, ... tokens."""
        return length_histogram(self.accepted_lengths)

    @property
    def tau(self) -> float:
        """Mean tokens added per target forward (1.0 for vanilla decoding)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "text": self.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "reused_prompt_tokens": self.reused_prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_calls": self.target_calls,
            "tau": round(self.tau, 4),
            "prefill_s": round(self.prefill_s, 4),
            "total_s": round(self.total_s, 4),
            "draft_s": round(self.draft_s, 4),
            "verify_s": round(max(0.0, self.total_s - self.prefill_s - self.draft_s), 4),
            "accepted_histogram": self.accepted_histogram(),
            "tokens_per_s": round(self.tokens_per_s, 3),
        }


class TokenSink:
    """Where every decoder puts its new tokens: EOS, stop strings, the token budget, streaming.

    Speculative decoders add several tokens per step; the sink keeps only those before
    the first stop condition, so every decoder ends exactly where vanilla decoding would.
    When the config asks for log-probabilities, each push brings the target's logits
    for the pushed tokens, and the sink keeps an entry for each token it keeps.
    """

    def __init__(self, tokenizer: object, config: GenerationConfig, eos: set[int], budget: int,
                 on_text: TextCallback | None, on_piece: PieceCallback | None = None,
                 on_logprobs: LogprobCallback | None = None) -> None:
        """``on_logprobs`` receives, just before each piece of text, the entries of the tokens it came from."""
        self.eos = set() if config.ignore_eos else eos
        self.budget = budget
        self.detok = Detokenizer(tokenizer, config.stop)
        self.on_text = on_text
        self.on_piece = on_piece
        self.on_logprobs = on_logprobs
        self.top = config.logprobs
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = None if config.logprobs is None else []
        self._told = 0  # entries handed to on_logprobs so far
        self.finish: str | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def finish_reason(self) -> str:
        """Why the answer ended: "eos", "stop" or "length" (every decoder pushes until one holds)."""
        assert self.finish is not None, "the answer has not ended"
        return self.finish

    def _emit(self, text: str, drafted: bool) -> None:
        if text and self.on_logprobs and self.logprobs is not None:
            self.on_logprobs(self.logprobs[self._told:])
            self._told = len(self.logprobs)
        if text and self.on_piece:
            self.on_piece(text, drafted)
        elif text and self.on_text:
            self.on_text(text)

    def _entries(self, new: Sequence[int], scores: torch.Tensor | None,
                 entries: Sequence[TokenLogprob] | None) -> Sequence[TokenLogprob]:
        """Log-probability entries for ``new`` as given, or from ``scores`` (logits ``[len(new), V]``), or none
        when not asked."""
        if self.top is None:
            return []
        if entries is not None:
            return entries
        if scores is None or scores.shape[0] < len(new):
            raise ValueError("log-probabilities were asked for, and this decoder did not give the logits of its tokens")
        return token_logprobs(scores, new, self.top)

    def push(self, new: Sequence[int], drafted: int = 0, scores: torch.Tensor | None = None,
             entries: Sequence[TokenLogprob] | None = None) -> bool:
        """Append tokens until one stops generation; return True once generation is over.

        The first ``drafted`` of ``new`` are accepted drafts (for ``on_piece``'s colouring);
        row ``i`` of ``scores`` holds the target's logits at the position of ``new[i]``, or
        ``entries`` their log-probability entries already made (a remote target's; either is
        needed only when the config asks for log-probabilities).
        """
        entries = self._entries(new, scores, entries)
        for i, tok in enumerate(new):
            if tok in self.eos:
                self.finish = "eos"
                break
            self.tokens.append(tok)
            if self.logprobs is not None:
                self.logprobs.append(entries[i])
            self._emit(self.detok.push([tok]), i < drafted)
            if self.detok.stopped:
                self.finish = "stop"
                break
            if len(self.tokens) >= self.budget:
                self.finish = "length"
                break
        return self.done

    def close(self) -> str:
        self._emit(self.detok.flush(), False)
        return self.detok.text
