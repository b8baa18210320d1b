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

import errno
import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moaspec.fileio import atomic_write
from moaspec.models.config import ModelConfig
from moaspec.models.transformer import Transformer

# free space the cache never takes: checkpoints and logs are still to be written
DISK_RESERVE = 2 * 2**30


def bytes_per_token(cfg: ModelConfig, tli_layers: int) -> int:
    """What one token's cached features take on disk (fp16): every layer's K/V, the final state
    and, with Target Layer Inference, the state after layer L−N. 23.6 KiB on SmolLM2; a large
    target's many layers and wide K/V make it several times that (Llama-3.1-8B: 136 KiB)."""
    return 2 * (cfg.num_layers * 2 * cfg.kv_dim + cfg.hidden_size * (2 if tli_layers else 1))


def free_bytes(path: Path) -> int:
    """Free space on the file system that holds (or will hold) ``path``."""
    for where in (path, *path.parents):
        if where.exists():
            return shutil.disk_usage(where).free
    return shutil.disk_usage(Path.cwd()).free


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def room_warning(directory: Path, tokens: int, cfg: ModelConfig, tli_layers: int, reserve: int = DISK_RESERVE) -> str | None:
    """What to tell a user before training when caching ``tokens`` more tokens' features under
    ``directory`` would leave less than ``reserve`` free; ``None`` when they fit."""
    need, free = tokens * bytes_per_token(cfg, tli_layers), free_bytes(directory)
    if need <= free - reserve:
        return None
    return (f"caching the target's features for this data takes about {gib(need)} more "
            f"({bytes_per_token(cfg, tli_layers) / 1024:.1f} KiB a token) and {directory} has {gib(free)} free: "
            f"the cache will stop {gib(reserve)} short of full, and features past that point are computed "
            "each time they are needed (slower); free space, or pass --no-feature-cache")


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

    def __init__(self, target: Transformer, tli_layers: int, reserve: int = DISK_RESERVE) -> None:
        self.target, self.tli_layers, self.reserve = target, tli_layers, reserve
        self.caching = True  # until the disk runs short: then what is cached is still read, nothing added

    def _keep(self, path: Path, row: dict[str, torch.Tensor]) -> None:
        """Write one row's cache file, unless the disk would keep less than the reserve; a disk that
        fills anyway (other writers) stops the caching too, never the run."""
        need = sum(t.numel() * t.element_size() for t in row.values())
        free = free_bytes(path.parent)
        if free - need < self.reserve:
            return self._stop(path.parent, f"{gib(free)} free, {gib(self.reserve)} kept for checkpoints")
        try:
            atomic_write(path, lambda p: save_file({k: v.contiguous().cpu() for k, v in row.items()}, str(p)))
        except OSError as exc:
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            self._stop(path.parent, f"the disk is full: {exc.strerror}")

    def _stop(self, directory: Path, why: str) -> None:
        self.caching = False
        print(f"moaspec train: the feature cache in {directory} stops growing ({why}); features not cached yet "
              "are computed each time they are needed, which is slower", file=sys.stderr)

    def _load(self, path: Path | None, length: int) -> dict[str, torch.Tensor] | None:
        if path is None or not path.is_file():
            return None
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError):
            return None  # unreadable: recompute and overwrite
        cfg = self.target.cfg
        want = {"kv": (length, cfg.num_layers, 2 * cfg.kv_dim), "final": (length, cfg.hidden_size)}
        if self.tli_layers:
            want["layer"] = (length, cfg.hidden_size)
        if any(name not in t or tuple(t[name].shape) != shape for name, shape in want.items()):
            return None  # stale or damaged (another length, a tensor missing or of another shape): recompute
        return t

    def features(self, tokens: torch.Tensor, lengths: torch.Tensor, files: Sequence[Path | None]) -> TargetOut:
        """Features for a right-padded batch; rows not in their cache file are computed together and stored."""
        B, S = tokens.shape
        device = self.target.device
        if all(f is None for f in files):  # nothing cached or to cache: the pass itself, padding zeroed
            fresh = target_pass(self.target, tokens.to(device), self.tli_layers)
            real = (torch.arange(S) < lengths[:, None]).to(device, non_blocking=True)

            def unpadded(t: torch.Tensor) -> torch.Tensor:
                return torch.where(real.view(B, S, *[1] * (t.dim() - 2)), t, 0.0)
            return TargetOut(unpadded(fresh.token_kv), unpadded(fresh.final),
                             None if fresh.layer is None else unpadded(fresh.layer))
        cached = [self._load(f, int(n)) for f, n in zip(files, lengths)]
        missing = [b for b, c in enumerate(cached) if c is None]
        if missing:
            fresh = target_pass(self.target, tokens[missing].to(device), self.tli_layers)
            for j, b in enumerate(missing):
                n = int(lengths[b])
                made = {"kv": fresh.token_kv[j, :n].half(), "final": fresh.final[j, :n].half()}
                if fresh.layer is not None:
                    made["layer"] = fresh.layer[j, :n].half()
                cached[b] = made
                path = files[b]
                if path is not None and self.caching:  # atomic_write makes the directory
                    self._keep(path, made)
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
