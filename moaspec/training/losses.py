"""The distillation loss of the paper (DESIGN-FACTS §2), on response positions only.

``0.1 · KL(target ‖ drafter)`` over next-token distributions plus ``1.0 · SmoothL1``
between the drafter's predicted features and the target's. With Target Layer
Inference (N > 0) the feature term averages the loss on the final hidden state and
on the layer-(L−N) prediction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KL_WEIGHT = 0.1
FEATURE_WEIGHT = 1.0


@dataclass
class LossParts:
    total: torch.Tensor
    kl: torch.Tensor
    feature: torch.Tensor


def kl_target_to_draft(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """Mean over positions of KL(p_target ‖ p_draft), rows of ``[N, V]`` logits."""
    t = F.log_softmax(target_logits.float(), dim=-1)
    d = F.log_softmax(draft_logits.float(), dim=-1)
    return F.kl_div(d, t, log_target=True, reduction="batchmean")


def distillation_loss(
    target_logits: torch.Tensor,
    draft_logits: torch.Tensor,
    target_features: Sequence[torch.Tensor],
    draft_features: Sequence[torch.Tensor],
    kl_weight: float = KL_WEIGHT,
    feature_weight: float = FEATURE_WEIGHT,
) -> LossParts:
    """All tensors hold only the positions that carry loss (rows ``[N, ...]``).

    ``target_features``/``draft_features`` pair up: ``[final]`` for N = 0,
    ``[final, layer L−N]`` for N > 0; their SmoothL1 losses are averaged.
    """
    if len(target_features) != len(draft_features) or not target_features:
        raise ValueError("need one draft feature per target feature")
    kl = kl_target_to_draft(target_logits, draft_logits)
    feature = torch.stack([
        F.smooth_l1_loss(d.float(), t.float()) for t, d in zip(target_features, draft_features)
    ]).mean()
    return LossParts(total=kl_weight * kl + feature_weight * feature, kl=kl, feature=feature)
