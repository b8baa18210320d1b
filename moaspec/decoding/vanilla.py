"""Vanilla autoregressive decoding: one target forward per token.

The baseline every speedup is measured against, on the same runtime the speculative
decoders use, so a ratio between them measures speculation and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from moaspec.chat import check_fits
from moaspec.decoding.generation import (
    GenerationConfig,
    GenerationResult,
    LogprobCallback,
    TextCallback,
    TokenSink,
    prompt_logprobs,
)
from moaspec.decoding.prefill import Prefill
from moaspec.decoding.sampling import adjust, select_token
from moaspec.models.transformer import Transformer


def stop_token_ids(model: Transformer, tokenizer: Any) -> set[int]:
    """EOS ids from the model config, its generation config and the tokenizer (chat models often end turns with
    their own)."""
    ids = set(model.cfg.eos_token_ids) | set(model.cfg.generation_eos_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return ids


def generate(
    model: Transformer,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    on_text: TextCallback | None = None,
    prefill: Prefill = Prefill(),
    on_logprobs: LogprobCallback | None = None,
) -> GenerationResult:
    """Decode greedily or by sampling until EOS, a stop string, or ``max_new_tokens``; ``prefill`` says how
    the prompt is read (told chunk by chunk, reusing a :class:`~moaspec.decoding.prefill.PromptCache`)."""
    context = model.cfg.max_position_embeddings
    check_fits(len(prompt_ids), context)
    config.sampling.check_vocabulary(model.cfg.vocab_size)
    budget = min(config.max_new_tokens, context - len(prompt_ids))
    sink = TokenSink(tokenizer, config, stop_token_ids(model, tokenizer), budget, on_text, on_logprobs=on_logprobs)
    gen = config.sampling.generator(model.device)
    cache = model.new_cache(len(prompt_ids) + budget)
    t0 = time.perf_counter()
    logits, hidden, reused = prefill(model, prompt_ids, cache)
    scored = None if config.prompt_logprobs is None else prompt_logprobs(model.lm_head, prompt_ids, hidden,
                                                                          config.prompt_logprobs)
    prefill_s = time.perf_counter() - t0
    calls, states = 0, [hidden]
    # the answer's tokens, for the penalties only
    counts = torch.zeros(model.cfg.vocab_size, device=logits.device) if config.sampling.penalized else None
    while True:
        token = select_token(adjust(logits, config.sampling, counts), config.sampling, gen)
        if sink.push([token], scores=logits[None]):
            break
        if counts is not None:
            counts[token] += 1
        out = model(torch.tensor([[sink.tokens[-1]]], device=model.device), cache)
        logits = out.logits[0, -1]
        if prefill.reuse is not None:  # kept only for a prompt cache to store
            states.append(out.hidden[0])
        calls += 1
    text = sink.close()
    prefill.keep([*prompt_ids, *sink.tokens][: cache.length], cache, states)
    return GenerationResult(
        token_ids=sink.tokens, text=text, finish_reason=sink.finish, prompt_tokens=len(prompt_ids),
        prefill_s=prefill_s, total_s=time.perf_counter() - t0, target_calls=calls,
        accepted_lengths=[1] * calls, reused_prompt_tokens=reused, logprobs=sink.logprobs, prompt_logprobs=scored,
    )
