"""The frozen target's features for training sequences: computed once, cached on disk as fp16.

Per example the drafter needs every layer's K/V for every token (the LSA input,
``L · 2 · n_kv · head_dim`` values: 23.6 KiB per token in fp16 for SmolLM2), the
final hidden states and, with Target Layer Inference, the states after layer L−N.
Measured on this CPU (BENCHMARKS.md): computing them costs a target forward,
~670 tokens/s; reading them back from the cache runs at 33,000–50,000 tokens/s. So
every epoch after the first skips the target entirely. Features are always rounded
through fp16, cached or not, so a run's numbers do not depend on what was cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moaspec.fileio import atomic_write
from moaspec.models.transformer import Transformer


@dataclass
class TargetOut:
    token_kv: torch.Tensor  # [B, S, L, kv_width]
    final: torch.Tensor  # [B, S, d], after the final norm
    layer: torch.Tensor | None  # [B, S, d] after layer L−N (N > 0)


def target_pass(target: Transformer, tokens: torch.Tensor, tli_layers: int) -> TargetOut:
    """Run the frozen target once over right-padded sequences (padding sits after every real token)."""
    B, S = tokens.shape
    cache = target.new_cache(S, B)
    split = target.cfg.num_layers - tli_layers
    out = target(tokens, cache, logits_at=slice(0, 0), hidden_after=(split,) if tli_layers else ())
    with torch.no_grad():  # outside inference mode: plain tensors that autograd may save
        def fp16(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.float16).to(torch.float32)

        layer = fp16(out.layer_hidden[split]) if tli_layers else None
        return TargetOut(fp16(cache.token_kv(0, S)), fp16(out.hidden), layer)


class FeatureStore:
    """The target's features for a batch, each row cached in its own file (``None``: compute, keep nothing).

    The caller names the files, so examples from several data directories each keep
    their cache beside their own data.
    """

    def __init__(self, target: Transformer, tli_layers: int) -> None:
        self.target, self.tli_layers = target, tli_layers

    def _load(self, path: Path | None, length: int) -> dict[str, torch.Tensor] | None:
        if path is None or not path.is_file():
            return None
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError):
            return None  # unreadable: recompute and overwrite
        if t["kv"].shape[0] != length or (self.tli_layers and "layer" not in t):
            return None
        return t

    def features(self, tokens: torch.Tensor, lengths: torch.Tensor, files: Sequence[Path | None]) -> TargetOut:
        """Features for a right-padded batch; rows not in their cache file are computed together and stored."""
        B, S = tokens.shape
        device = self.target.device
        cached = [self._load(f, int(n)) for f, n in zip(files, lengths)]
        missing = [b for b, c in enumerate(cached) if c is None]
        if missing:
            fresh = target_pass(self.target, tokens[missing].to(device), self.tli_layers)
            for j, b in enumerate(missing):
                n = int(lengths[b])
                row = {"kv": fresh.token_kv[j, :n].half(), "final": fresh.final[j, :n].half()}
                if fresh.layer is not None:
                    row["layer"] = fresh.layer[j, :n].half()
                cached[b] = row
                path = files[b]
                if path is not None:  # atomic_write makes the directory
                    atomic_write(path, lambda p, r=row: save_file({k: v.contiguous().cpu() for k, v in r.items()}, str(p)))
        L, W = self.target.cfg.num_layers, 2 * self.target.cfg.kv_dim
        d = self.target.cfg.hidden_size
        kv = torch.zeros(B, S, L, W, device=device)
        final = torch.zeros(B, S, d, device=device)
        layer = torch.zeros(B, S, d, device=device) if self.tli_layers else None
        for b, row in enumerate(cached):
            assert row is not None
            n = row["kv"].shape[0]
            kv[b, :n] = row["kv"].to(device, torch.float32)
            final[b, :n] = row["final"].to(device, torch.float32)
            if layer is not None:
                layer[b, :n] = row["layer"].to(device, torch.float32)
        return TargetOut(kv, final, layer)
