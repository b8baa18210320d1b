"""What every decoder takes and returns, so that vanilla and speculative runs compare directly."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from moaspec.decoding.detokenize import Detokenizer
from moaspec.decoding.sampling import SamplingParams
from moaspec.errors import MoaspecError
from moaspec.validation import whole_number

TextCallback = Callable[[str], None]
PieceCallback = Callable[[str, bool], None]  # (text, whether it came from accepted drafts)


@dataclass(frozen=True)
class GenerationConfig:
    """When to stop and how to pick tokens."""

    max_new_tokens: int = 256
    sampling: SamplingParams = field(default_factory=SamplingParams)
    stop: Sequence[str] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not (whole_number(self.max_new_tokens) and self.max_new_tokens >= 1):
            raise MoaspecError(f"max_new_tokens must be a whole number >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.stop, list | tuple) or not all(isinstance(s, str) for s in self.stop):
            raise MoaspecError(f"stop must be a list or tuple of strings, got {self.stop!r}")


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

    @property
    def new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else 0.0

    def accepted_histogram(self) -> dict[int, int]:
        """How many target calls added 1, 2, 3, ... tokens."""
        hist: dict[int, int] = {}
        for n in self.accepted_lengths:
            hist[n] = hist.get(n, 0) + 1
        return dict(sorted(hist.items()))

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
    """

    def __init__(self, tokenizer: object, config: GenerationConfig, eos: set[int], budget: int,
                 on_text: TextCallback | None, on_piece: PieceCallback | None = None) -> None:
        self.eos = set() if config.ignore_eos else eos
        self.budget = budget
        self.detok = Detokenizer(tokenizer, config.stop)
        self.on_text = on_text
        self.on_piece = on_piece
        self.tokens: list[int] = []
        self.finish: str | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    def _emit(self, text: str, drafted: bool) -> None:
        if text and self.on_piece:
            self.on_piece(text, drafted)
        elif text and self.on_text:
            self.on_text(text)

    def push(self, new: Sequence[int], drafted: int = 0) -> bool:
        """Append tokens until one stops generation; return True once generation is over.

        The first ``drafted`` of ``new`` are accepted drafts (for ``on_piece``'s colouring).
        """
        for i, tok in enumerate(new):
            if tok in self.eos:
                self.finish = "eos"
                break
            self.tokens.append(tok)
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
