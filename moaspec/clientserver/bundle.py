"""What a client device needs, and nothing more: the client bundle.

A MoA client (N = 0) runs SA and CA and reads the target's embeddings and, for the
draft vocabulary, its ``lm_head``; it never runs a target layer. The bundle holds the
embedding table (and ``lm_head`` only when the target does not tie it to the
embeddings), the drafter checkpoint, the tokenizer with its chat template, and the
target's config and weight fingerprint — for SmolLM2-135M about 75 MB in fp16,
instead of the whole target. EAGLE and independent drafters need the same two ends and
travel the same way. ``moaspec export-client`` writes one atomically;
``moaspec client --bundle DIR`` runs from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from moaspec.drafters.checkpoint import KINDS, read_meta
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_dir
from moaspec.models.config import ModelConfig
from moaspec.models.loading import LoadedModel, load_tokenizer
from moaspec.models.transformer import TokenEnds

FORMAT = "moaspec-client-bundle/1"


class ClientTarget(TokenEnds):
    """The target as a client sees it: embeddings and ``lm_head`` only, with the target's config and identity."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, lm_head: torch.Tensor | None, fingerprint: str) -> None:
        super().__init__(cfg, device="meta")
        self.embed.weight = nn.Parameter(embed, requires_grad=False)
        self.lm_head.weight = self.embed.weight if lm_head is None else nn.Parameter(lm_head, requires_grad=False)
        self.fingerprint = fingerprint


def export_bundle(target: LoadedModel, drafter_path: Path, output: Path) -> Path:
    """Write the client bundle for ``target`` and the drafter at ``drafter_path`` to ``output``."""
    meta = read_meta(drafter_path)
    if meta.get("kind") not in KINDS or meta.get("config", {}).get("tli_layers", 0):
        raise MoaspecError("a client bundle holds a drafter that runs no target layer: MoA without Target Layer "
                           "Inference (N = 0), EAGLE, or an independent drafter")
    if meta.get("target", {}).get("fingerprint") != target.fingerprint:
        raise MoaspecError(f"{drafter_path} was trained for another target")
    model = target.model
    tensors = {"embed": model.embed.weight.detach().to(torch.float16).cpu().contiguous()}
    if not target.cfg.tie_word_embeddings:
        tensors["lm_head"] = model.lm_head.weight.detach().to(torch.float16).cpu().contiguous()

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "target.safetensors"))
        shutil.copytree(drafter_path, tmp / "drafter")
        target.tokenizer.save_pretrained(str(tmp / "tokenizer"))  # type: ignore[attr-defined]
        info = {"format": FORMAT, "config": target.cfg.to_dict(), "fingerprint": target.fingerprint,
                "source": target.path.name}
        (tmp / "bundle.json").write_text(json.dumps(info, indent=2) + "\n")

    atomic_write_dir(output, write)
    return output


def load_bundle(path: str | Path, device: str | None = None) -> LoadedModel:
    """The client's view of the target from a bundle, usable wherever a :class:`LoadedModel` is."""
    path = Path(path)
    try:
        info: dict[str, Any] = json.loads((path / "bundle.json").read_text())
    except (OSError, ValueError):
        raise MoaspecError(f"{path} is not a client bundle (no readable bundle.json); make one with "
                           "`moaspec export-client`") from None
    if info.get("format") != FORMAT:
        raise MoaspecError(f"{path} holds a client bundle of format {info.get('format')!r}; this moaspec reads {FORMAT}")
    raw = dict(info["config"])
    raw["eos_token_ids"] = tuple(raw.get("eos_token_ids", ()))
    cfg = ModelConfig(**raw)
    try:
        tensors = load_file(str(path / "target.safetensors"))
    except (OSError, ValueError) as exc:
        raise MoaspecError(f"cannot read {path / 'target.safetensors'}: {exc}") from None
    dev = torch.device(device or "cpu")
    embed = tensors["embed"].to(dev, torch.float32)
    head = tensors["lm_head"].to(dev, torch.float32) if "lm_head" in tensors else None
    stub = ClientTarget(cfg, embed, head, info["fingerprint"]).eval()
    return LoadedModel(model=stub, tokenizer=load_tokenizer(path / "tokenizer"), cfg=cfg, path=path)  # type: ignore[arg-type]


def bundle_drafter(path: str | Path) -> Path:
    return Path(path) / "drafter"
