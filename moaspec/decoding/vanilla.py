"""Vanilla autoregressive decoding: one target forward per token.

The baseline every speedup is measured against, on the same runtime the speculative
decoders use, so a ratio between them measures speculation and nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from moaspec.decoding.generation import GenerationConfig, GenerationResult, LogprobCallback, TextCallback
from moaspec.decoding.opening import open_generation
from moaspec.decoding.prefill import Prefill
from moaspec.decoding.sampling import adjust, select_token
from moaspec.models.transformer import Transformer


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
    o = open_generation(model, tokenizer, prompt_ids, config, prefill, on_text=on_text, on_logprobs=on_logprobs)
    sink, cache, logits, counts = o.sink, o.cache, o.logits, o.counts
    calls, states = 0, [o.hidden]
    while True:
        token = select_token(adjust(logits, config.sampling, counts), config.sampling, o.generator)
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
        token_ids=sink.tokens, text=text, finish_reason=sink.finish_reason, prompt_tokens=len(prompt_ids),
        prefill_s=o.prefill_s, total_s=time.perf_counter() - o.t0, target_calls=calls,
        accepted_lengths=[1] * calls, reused_prompt_tokens=o.reused, logprobs=sink.logprobs, prompt_logprobs=o.scored,
    )
