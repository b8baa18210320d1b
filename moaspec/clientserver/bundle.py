"""What a client device needs, and nothing more: the client bundle.

A MoA client runs SA and CA and reads the target's embeddings and, for the draft
vocabulary, its ``lm_head``; with Target Layer Inference (N > 0) it also runs the
target's last N layers and final norm on its predictions. The bundle holds exactly
those: the embedding table (and ``lm_head`` only when the target does not tie it to the
embeddings), the final norm, the last N blocks, the drafter checkpoint, the tokenizer
with its chat template, and the target's config and weight fingerprint — for
SmolLM2-135M about 75 MB in fp16 at N = 0 and 7 MB more per layer, instead of the
whole target. EAGLE and independent drafters need the same two ends and travel the
same way. ``moaspec export-client`` writes one atomically; ``moaspec client --bundle
DIR`` runs from it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moaspec.drafters.checkpoint import load_drafter, read_meta
from moaspec.errors import MoaspecError, ModelLoadError
from moaspec.fileio import atomic_write_dir
from moaspec.models.config import ModelConfig
from moaspec.models.loading import BLOCK_NAME, LoadedModel, assemble, load_tokenizer, usable_device

FORMAT = "moaspec-client-bundle/2"  # /1 held no norm nor blocks, under other names


def export_bundle(target: LoadedModel, drafter_path: Path, output: Path) -> Path:
    """Write the client bundle for ``target`` and the drafter at ``drafter_path`` to ``output``."""
    # the whole checkpoint checked before it is copied: a kind this moaspec knows, trained for this target, its
    # weights readable
    load_drafter(drafter_path, target, dtype=target.model.dtype)
    layers = int(read_meta(drafter_path).get("config", {}).get("tli_layers", 0))
    model, L = target.model, target.cfg.num_layers
    wanted = {"embed.weight", "norm"} | ({"lm_head.weight"} if not target.cfg.tie_word_embeddings else set())
    tensors = {name: t.detach().to(torch.float16).cpu().contiguous() for name, t in model.state_dict().items()
               if name in wanted or ((m := BLOCK_NAME.fullmatch(name)) and int(m[1]) >= L - layers)}

    def write(tmp: Path) -> None:
        save_file(tensors, str(tmp / "target.safetensors"))
        shutil.copytree(drafter_path, tmp / "drafter")
        target.tokenizer.save_pretrained(str(tmp / "tokenizer"))
        info = {"format": FORMAT, "config": target.cfg.to_dict(), "fingerprint": target.fingerprint,
                "source": target.path.name, "target_layers": layers}
        (tmp / "bundle.json").write_text(json.dumps(info, indent=2) + "\n")

    atomic_write_dir(output, write, marker="bundle.json")
    return output


def _damaged(file: Path, why: object) -> MoaspecError:
    """The error for a bundle file that is there but cannot be used: the fix is always a new export."""
    return MoaspecError(f"{file} is damaged ({why}): export the client bundle again with `moaspec export-client`")


def load_bundle(path: str | Path, device: str | None = None) -> LoadedModel:
    """The client's view of the target from a bundle, usable wherever a :class:`LoadedModel` is."""
    path = Path(path)
    try:
        info: dict[str, Any] = json.loads((path / "bundle.json").read_text())
    except (OSError, ValueError):
        raise MoaspecError(f"{path} is not a client bundle (no readable bundle.json); make one with "
                           "`moaspec export-client`") from None
    if not isinstance(info, dict):
        raise _damaged(path / "bundle.json", f"it holds a JSON {type(info).__name__}, not an object")
    if info.get("format") != FORMAT:
        raise MoaspecError(f"{path} holds a client bundle of format {info.get('format')!r}; this moaspec reads {FORMAT}: "
                           "export it again with `moaspec export-client`")
    try:  # a bundle of the right format whose fields are missing or mistyped was edited or cut short
        cfg = ModelConfig.from_dict(info["config"])
        layers, fingerprint = int(info.get("target_layers", 0)), str(info["fingerprint"])
    except (KeyError, TypeError, ValueError) as exc:
        raise _damaged(path / "bundle.json", f"{type(exc).__name__}: {exc}") from None
    try:
        tensors = load_file(str(path / "target.safetensors"))
    except (OSError, ValueError) as exc:
        raise MoaspecError(f"cannot read {path / 'target.safetensors'}: {exc}") from None
    except SafetensorError as exc:
        raise _damaged(path / "target.safetensors", exc) from None
    if not 0 <= layers < cfg.num_layers:
        raise MoaspecError(f"{path}: target_layers must be in 0..{cfg.num_layers - 1}, got {layers}")
    try:
        model = assemble(cfg, tensors, usable_device(device or "cpu"), torch.float32, fingerprint,
                         first_block=cfg.num_layers - layers)
    except ModelLoadError as exc:
        raise MoaspecError(f"{path}: the bundle's target weights do not fit it: {exc}") from None
    return LoadedModel(model=model, tokenizer=load_tokenizer(path / "tokenizer"), cfg=cfg, path=path)


def bundle_drafter(path: str | Path) -> Path:
    return Path(path) / "drafter"
