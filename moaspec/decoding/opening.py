"""What every decoder does before its first new token: check the prompt, size the budget and the cache, read
the prompt, score it when asked.

Plain decoding and the speculative loops (chain and tree) open a generation the same way and differ only in
how many positions past the token budget a verification may write (``room``), so one function does it for all.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from moaspec.chat import check_fits
from moaspec.decoding.generation import (
    GenerationConfig,
    LogprobCallback,
    PieceCallback,
    TextCallback,
    TokenLogprob,
    TokenSink,
    prompt_logprobs,
)
from moaspec.decoding.prefill import Prefill
from moaspec.decoding.sampling import answer_counts
from moaspec.models.kv_cache import KVCache
from moaspec.models.transformer import Transformer


def stop_token_ids(model: Transformer, tokenizer: Any) -> set[int]:
    """EOS ids from the model config, its generation config and the tokenizer (chat models often end turns with
    their own)."""
    ids = set(model.cfg.eos_token_ids) | set(model.cfg.generation_eos_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


@dataclass
class Opening:
    """A generation whose prompt has been read: what its decoding loop starts from."""

    cache: KVCache  # the prompt's K/V, with room for the budget (and a verification's ``room``)
    sink: TokenSink
    generator: torch.Generator
    budget: int  # new tokens allowed: ``max_new_tokens``, or fewer where the context window ends
    t0: float  # when reading began (``perf_counter``)
    prefill_s: float  # reading and scoring the prompt
    logits: torch.Tensor  # the prompt's last position: the first new token's distribution
    hidden: torch.Tensor  # final states of the positions read
    reused: int  # leading prompt tokens whose K/V came from a prompt cache
    scored: list[TokenLogprob | None] | None  # the prompt tokens' log-probabilities, when asked
    counts: torch.Tensor | None  # how often each token occurs in the answer, kept for the penalties only


def open_generation(model: Transformer, tokenizer: Any, prompt_ids: Sequence[int], config: GenerationConfig,
                    prefill: Prefill = Prefill(), room: int = 0, on_text: TextCallback | None = None,
                    on_piece: PieceCallback | None = None, on_logprobs: LogprobCallback | None = None) -> Opening:
    """Refuse a prompt that does not fit or a bias outside the vocabulary, then read ``prompt_ids`` as ``prefill``
    says into a new cache of ``room`` positions more than the prompt and the budget (at most the context)."""
    context = model.cfg.max_position_embeddings
    check_fits(len(prompt_ids), context)
    config.sampling.check_vocabulary(model.cfg.vocab_size)
    budget = min(config.max_new_tokens, context - len(prompt_ids))
    cache = model.new_cache(min(len(prompt_ids) + budget + room, context))
    sink = TokenSink(tokenizer, config, stop_token_ids(model, tokenizer), budget, on_text, on_piece, on_logprobs)
    generator = config.sampling.generator(model.device)
    t0 = time.perf_counter()
    logits, hidden, reused = prefill(model, prompt_ids, cache)
    scored = None if config.prompt_logprobs is None else prompt_logprobs(model.lm_head, prompt_ids, hidden,
                                                                          config.prompt_logprobs)
    counts = answer_counts(config.sampling, model.cfg.vocab_size, logits.device)
    return Opening(cache, sink, generator, budget, t0, time.perf_counter() - t0, logits, hidden, reused, scored, counts)
