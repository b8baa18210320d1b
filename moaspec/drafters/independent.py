"""The independent drafter of classic speculative decoding (Leviathan et al., 2023; Chen et al., 2023).

A small Llama-architecture language model with the target's tokenizer: it reads
tokens only, never the target's states, so it can draft on a device that has no
target at all. Here it is the target cut short — its embedding table and ``lm_head``
(borrowed, like every drafter's) plus ``layers`` decoder blocks of its own, which
start as copies of the target's first blocks and are then distilled from the target
with the same loss and data as the MoA and EAGLE drafters. Starting from the target's
own blocks is what makes a few hundred updates enough: a freshly initialised model
this size would first have to learn language.

It is a real Llama model: :func:`to_hf_llama` turns it into a ``LlamaForCausalLM``,
which transformers' assisted generation takes as ``assistant_model``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from moaspec.drafters.base import Drafter, DrafterConfig
from moaspec.drafters.layers import check_widths
from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.loading import hf_state_dict
from moaspec.models.transformer import Block, Transformer, causal_mask, prefill_chunk, rms_norm


@dataclass(frozen=True)
class IndependentConfig(DrafterConfig):
    layers: int = 2
    mlp: int = 1536

    @classmethod
    def for_target(cls, cfg: ModelConfig, **sizes: Any) -> IndependentConfig:
        check_widths(sizes, "mlp")
        defaults: dict[str, Any] = {"mlp": cfg.intermediate_size}
        defaults.update({k: v for k, v in sizes.items() if v is not None})
        return cls(**{**cls.target_fields(cfg), **defaults})

    def model_config(self) -> ModelConfig:
        """The drafter as a model of its own: the target's shape with ``layers`` blocks and a tied head."""
        return ModelConfig(
            family="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.mlp,
            num_layers=self.layers, num_heads=self.heads, num_kv_heads=self.kv_heads, head_dim=self.head_dim,
            rope_theta=self.rope_theta, rms_norm_eps=self.rms_norm_eps, max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
        )


class IndependentDrafter(Drafter):
    cfg: IndependentConfig

    def __init__(self, cfg: IndependentConfig) -> None:
        super().__init__(cfg)
        if cfg.layers < 1:
            raise ValueError("an independent drafter needs at least one layer")
        mc = cfg.model_config()
        self.blocks = nn.ModuleList(Block(mc) for _ in range(cfg.layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))

    def copy_target_layers(self, target: Transformer) -> None:
        """Start from the target's first ``layers`` blocks and its final norm (the shapes must agree).

        The drafter is Llama-shaped (so that ``export-hf`` writes a model any runtime loads): what
        other families add to a block, Qwen2's q/k/v biases and Qwen3's query/key norms, is left out
        of the copy, a warm start that training then adapts.
        """
        if self.cfg.mlp != target.cfg.intermediate_size:
            raise ValueError(f"the target's blocks have MLP width {target.cfg.intermediate_size}, not {self.cfg.mlp}")
        with torch.no_grad():
            for mine, theirs in zip(self.blocks, target.blocks):
                own = mine.state_dict()
                mine.load_state_dict({k: v.float() for k, v in theirs.state_dict().items() if k in own})
            self.norm.copy_(target.norm.float())

    def new_cache(self, capacity: int, batch_size: int = 1) -> KVCache:
        p = self.norm
        return KVCache(self.cfg.layers, self.cfg.kv_heads, self.cfg.head_dim, capacity, batch_size, self.cache_dtype,
                       p.device)

    def _run(self, tokens: torch.Tensor, cache: KVCache, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Final-normed states ``[B, T, d]`` of ``tokens`` after ``cache.length`` cached ones; advances the cache."""
        start, T = cache.length, tokens.shape[1]
        if mask is None and T > 1:
            mask = causal_mask(start, T, tokens.device)
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        cos, sin = self.rope(positions)
        h = self.target.embed(tokens).to(self.weight_dtype)
        for i, block in enumerate(self.blocks):
            h = block(h, cos, sin, cache.keys[i], cache.values[i], start, mask)
        cache.length = start + T
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass over right-padded sequences: predicted final features ``[B, S, d]``."""
        B, S = tokens.shape
        return self._run(tokens, self.new_cache(S, B), torch.arange(S, device=tokens.device), None)

    @torch.inference_mode()
    def step(self, cache: KVCache, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
             outputs: int) -> torch.Tensor:
        """Feed ``tokens`` ``[1, T]`` after the cached ones; draft logits ``[1, outputs, K]`` of the last ``outputs``.

        ``mask`` is bool ``[T, cache.length + T]`` (``None``: causal), as for tree drafting. A causal
        feed of many tokens (catching up on a prompt) runs a chunk at a time, as the target's prefill does.
        """
        T = tokens.shape[1]
        step = max(T, 1) if mask is not None else prefill_chunk(tokens.device)
        f = [self._run(tokens[:, a : a + step], cache, positions[..., a : a + step], mask) for a in range(0, max(T, 1), step)]
        return self.head(torch.cat(f, dim=1)[:, T - outputs :] if len(f) > 1 else f[0][:, T - outputs :])


def to_hf_llama(drafter: IndependentDrafter) -> Any:
    """The drafter as a transformers ``LlamaForCausalLM`` (fp32, eval mode), with the target's embeddings tied in."""
    from transformers import LlamaConfig, LlamaForCausalLM

    c = drafter.cfg
    hf_cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.mlp, num_hidden_layers=c.layers,
        num_attention_heads=c.heads, num_key_value_heads=c.kv_heads, head_dim=c.head_dim,
        # transformers 4 reads rope_theta as it is, 5 moves it into rope_parameters (its stubs no longer name it)
        rope_theta=c.rope_theta,  # type: ignore[call-arg]
        rms_norm_eps=c.rms_norm_eps, max_position_embeddings=c.max_positions, tie_word_embeddings=True,
    )
    state = {k: v.detach().float() for k, v in drafter.state_dict().items() if k.startswith("blocks.")}
    state["norm"] = drafter.norm.detach().float()
    state["embed.weight"] = drafter.target.embed.weight.detach().float()
    model = LlamaForCausalLM(hf_cfg)
    missing, unexpected = model.load_state_dict(hf_state_dict(state, c.model_config()), strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise RuntimeError(f"HF conversion mismatch: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    return model.eval()
