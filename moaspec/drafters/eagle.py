"""The EAGLE drafter (Li et al., 2024), the baseline MoA is measured against.

One decoder layer over ``fc([target feature of position j−1 ; embedding of token j])``
predicts the target's feature at position j (its final hidden state, the input of
``lm_head``), from which ``lm_head`` gives the draft for token j+1. At inference the
features of verified positions are the target's own; while drafting, the drafter
feeds its own predictions back. Trained with the same distillation loss as MoA
(feature regression plus a soft cross-entropy, whose gradient equals the KL term's),
with uniform noise on the input features as EAGLE does, and optionally on the input
token embeddings too, as the MoA authors' EAGLE does (``embedding_noise``); the
targets stay clean.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moaspec.drafters.base import Drafter, DrafterConfig
from moaspec.drafters.layers import DecoderLayer, check_widths
from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.packed_linear import Linear


@dataclass(frozen=True)
class EagleConfig(DrafterConfig):
    mlp: int = 1536
    feature_noise: float = 0.1  # training inputs get U(−a, a) noise (EAGLE's data augmentation)

    @classmethod
    def for_target(cls, cfg: ModelConfig, **sizes: Any) -> EagleConfig:
        """One decoder layer shaped like the target's own."""
        check_widths(sizes, "mlp")
        defaults: dict[str, Any] = {"mlp": cfg.intermediate_size}
        defaults.update({k: v for k, v in sizes.items() if v is not None})
        return cls(**{**cls.target_fields(cfg), **defaults})


class EagleDrafter(Drafter):
    cfg: EagleConfig

    def __init__(self, cfg: EagleConfig) -> None:
        super().__init__(cfg)
        d = cfg.hidden_size
        self.fc = Linear(2 * d, d, bias=False)
        self.layer = DecoderLayer(d, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.mlp, cfg.rms_norm_eps)
        # training only, set by the trainer (``--embedding-noise``): U(−a, a) on the input embeddings
        self.embedding_noise = 0.0

    def inputs(self, tokens: torch.Tensor, prev_features: torch.Tensor, embedding_noise: float = 0.0) -> torch.Tensor:
        """``fc([feature of the previous position ; embedding of this token])``, the embedding with
        U(−``embedding_noise``, ``embedding_noise``) added."""
        emb = self.target.embed(tokens).to(self.weight_dtype)
        if embedding_noise:
            emb = emb + (torch.rand_like(emb) * 2 - 1) * embedding_noise
        return self.fc(torch.cat([prev_features.to(self.weight_dtype), emb], dim=-1))

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Teacher-forced pass: predicted features ``[B, S, d]`` from the target's true ones (shifted by one);
        in training mode its inputs carry the noise (``features`` themselves, the targets, are left clean)."""
        prev = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
        if self.training and self.cfg.feature_noise:
            prev = prev + (torch.rand_like(prev) * 2 - 1) * self.cfg.feature_noise
        S = tokens.shape[1]
        cos, sin = self.rope(torch.arange(S, device=tokens.device))
        if mask is None:
            mask = torch.ones(S, S, dtype=torch.bool, device=tokens.device).tril()
        noise = self.embedding_noise if self.training else 0.0
        return self.layer.self_attention(self.inputs(tokens, prev, noise), cos, sin, mask)

    @torch.no_grad()
    def unrolled(self, tokens: torch.Tensor, features: torch.Tensor, depth: int) -> list[torch.Tensor]:
        """Chain drafting from every position at once: ``depth`` passes of predicted features ``[B, S, d]``.

        Pass ``k`` at position ``q`` is the ``k``-th drafting step of the cycle that starts
        at ``q − k``, fed the true token ``q`` (along the target's greedy output a step's
        input is the true token until the first miss). As at inference
        (:class:`~moaspec.drafters.proposers.EagleProposer`), that step reads the
        prediction of the step before it, and attends to entries made from the target's
        true features up to the cycle's start plus the entries of its own earlier
        steps. Key block ``j`` of the buffer holds pass ``j``'s entries, so the query at
        ``q`` of pass ``k`` sees block 0 up to ``q − k`` and, in block ``j``, position
        ``q − k + j``. Positions ``q < k`` have no cycle; they see key 0 only.
        """
        B, S = tokens.shape
        dev = tokens.device
        cos, sin = self.rope(torch.arange(S, device=dev))
        keys = torch.zeros(B, self.cfg.kv_heads, depth * S, self.cfg.head_dim, dtype=self.weight_dtype, device=dev)
        values = torch.zeros_like(keys)
        q = torch.arange(S, device=dev)[:, None]
        i = torch.arange(S, device=dev)[None, :]
        prev = features
        passes: list[torch.Tensor] = []
        for k in range(depth):
            mask = [i <= q - k] + [i == q - k + j for j in range(1, k + 1)]
            mask[0] = mask[0] | ((q < k) & (i == 0))
            shifted = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)  # step k−1 of the same cycle
            prev = self.layer.self_attention(self.inputs(tokens, shifted), cos, sin, torch.cat(mask, dim=1),
                                             cache=(keys, values, k * S))
            passes.append(prev)
        return passes

    # --- inference ----------------------------------------------------------------------

    def new_cache(self, capacity: int) -> KVCache:
        p = next(self.parameters())
        return KVCache(1, self.cfg.kv_heads, self.cfg.head_dim, capacity, 1, self.cache_dtype, p.device)

    @torch.inference_mode()
    def step(self, cache: KVCache, tokens: torch.Tensor, prev_features: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None, outputs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed ``tokens`` ``[1, T]`` paired with ``prev_features`` ``[1, T, d]``; return logits and features of the last ``outputs``."""
        start = cache.length
        T = tokens.shape[1]
        cos, sin = self.rope(positions)
        f = self.layer.self_attention(self.inputs(tokens, prev_features), cos, sin, mask,
                                      cache=(cache.keys[0], cache.values[0], start))
        cache.length = start + T
        f = f[:, T - outputs :]
        return self.head(f), f
