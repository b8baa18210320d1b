"""Speculative decoding with a chain of drafts (the paper's Algorithm 1), greedy or sampled.

    prefill the prompt → the target's first token
    repeat: the proposer drafts T tokens → one target forward scores the newest token
            and the T drafts → keep the accepted prefix and the target's own next token →
            roll the target's cache back to the kept tokens → tell the proposer

Greedy output equals the target's greedy output token for token; with sampling the
output follows the target's distribution (see :mod:`moaspec.decoding.verify`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from moaspec.chat import check_fits
from moaspec.decoding.generation import GenerationConfig, GenerationResult, PieceCallback, TextCallback, TokenSink
from moaspec.decoding.proposer import Proposer
from moaspec.decoding.sampling import probabilities, select_token
from moaspec.decoding.vanilla import stop_token_ids
from moaspec.decoding.verify import verify_greedy, verify_sampling
from moaspec.models.transformer import Transformer


def generate_chain(
    model: Transformer,
    tokenizer: Any,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    config: GenerationConfig = GenerationConfig(),
    draft_len: int = 6,
    on_text: TextCallback | None = None,
    on_piece: PieceCallback | None = None,
) -> GenerationResult:
    """Decode with chains of ``draft_len`` drafts per target forward.

    ``on_text`` streams the text; ``on_piece`` instead receives each piece with whether
    it came from accepted drafts (``--show-drafts``).
    """
    context = model.cfg.max_position_embeddings
    check_fits(len(prompt_ids), context)
    budget = min(config.max_new_tokens, context - len(prompt_ids))
    capacity = min(len(prompt_ids) + budget + draft_len + 1, context)
    sink = TokenSink(tokenizer, config, stop_token_ids(model, tokenizer), budget, on_text, on_piece)
    params = config.sampling
    gen = params.generator(model.device)
    cache = model.new_cache(capacity)
    t0 = time.perf_counter()
    out = model(torch.tensor([list(prompt_ids)], device=model.device), cache, logits_at=slice(-1, None))
    tokens = list(prompt_ids) + [select_token(out.logits[0, -1], params, gen)]
    prefill_s = time.perf_counter() - t0
    accepted: list[int] = []
    draft_s = 0.0
    if not sink.push(tokens[-1:]):
        proposer.begin(cache, out.hidden[0])
    while not sink.done:
        # never draft past the context window or far past the token budget
        n = max(0, min(draft_len, context - len(tokens) - 1, budget - len(sink.tokens)))
        t1 = time.perf_counter()
        proposal = proposer.propose(tokens, n, params, gen)
        draft_s += time.perf_counter() - t1
        start = cache.length
        block = torch.tensor([[tokens[-1]] + proposal.tokens.tolist()], device=model.device)
        out = model(block, cache)
        target_logits = out.logits[0]
        if params.greedy:
            verdict = verify_greedy(proposal.tokens, target_logits)
        else:
            verdict = verify_sampling(proposal.tokens, proposal.probs, probabilities(target_logits, params), gen)
        new = proposal.tokens[: verdict.accepted].tolist() + [verdict.next_token]
        cache.truncate(start + 1 + verdict.accepted)
        tokens += new
        accepted.append(len(new))
        if not sink.push(new, drafted=verdict.accepted):
            proposer.commit(cache.length, hidden=out.hidden[0, : len(new)])
    text = sink.close()
    total = time.perf_counter() - t0
    return GenerationResult(
        token_ids=sink.tokens, text=text, finish_reason=sink.finish, prompt_tokens=len(prompt_ids),
        prefill_s=prefill_s, total_s=total, target_calls=len(accepted), accepted_lengths=accepted, draft_s=draft_s,
    )
