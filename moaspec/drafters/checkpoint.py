"""Drafter checkpoints: ``model.safetensors`` + ``config.json`` in one directory, written atomically.

The JSON holds the drafter's kind and architecture (including N and the draft
vocabulary size; the vocabulary itself is a tensor in the safetensors file), the
identity of the target it was trained for (name, shapes and a fingerprint of its
weights, and the lineage its quantisations share), and a free-form training summary. Loading refuses a
target of another lineage (or, where the drafter names none, of another fingerprint): a drafter is only
useful for the model it learnt from, in whatever quantisation.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from moaspec.drafters.base import Drafter, DrafterConfig
from moaspec.drafters.compiled_layers import blocks_supported
from moaspec.drafters.eagle import EagleConfig, EagleDrafter
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.errors import MoaspecError, brief
from moaspec.fileio import atomic_write_dir
from moaspec.models.block_kernel import kernel
from moaspec.models.loading import FLOAT_DTYPES, LoadedModel
from moaspec.models.packed_linear import INT8_ACTIVATIONS, bf16_kernels, int8_kernels
from moaspec.models.sources import model_name

FORMAT = "moaspec-drafter"
VERSION = 1
KINDS: dict[str, tuple[type[DrafterConfig], type[Drafter]]] = {
    "moa": (MoAConfig, MoADrafter),
    "eagle": (EagleConfig, EagleDrafter),
    "independent": (IndependentConfig, IndependentDrafter),
}


def kind_of(drafter: Drafter) -> str:
    return next(k for k, (_, cls) in KINDS.items() if type(drafter) is cls)


class DrafterError(MoaspecError):
    """A drafter checkpoint is missing, malformed, or made for another target."""


def target_identity(target: LoadedModel) -> dict[str, Any]:
    cfg = target.cfg
    return {
        "name": target.path.name, "fingerprint": target.fingerprint, "lineage": target.lineage, "family": cfg.family,
        "num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
    }


def serves(want: dict[str, Any], target: LoadedModel) -> bool:
    """Whether a drafter made for ``want`` (its config's "target") serves ``target``: the same weights, or the
    same model in another quantisation (the same lineage, :mod:`moaspec.models.lineage`)."""
    if want.get("fingerprint") == target.fingerprint:
        return True
    return want.get("lineage") is not None and want.get("lineage") == target.lineage


def save_drafter(drafter: Drafter, path: str | Path, target: dict[str, Any], training: dict[str, Any] | None = None,
                 dtype: torch.dtype = torch.float16) -> Path:
    """Write the drafter's own weights (cast to ``dtype``) and its JSON description to ``path``.

    The directory appears complete or not at all: it is assembled beside ``path`` and
    renamed into place, replacing an older checkpoint.
    """
    path = Path(path)

    def write(tmp: Path) -> None:
        state = {k: (v.to(dtype) if v.is_floating_point() else v).detach().cpu().contiguous()
                 for k, v in drafter.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"))
        meta = {"format": FORMAT, "version": VERSION, "kind": kind_of(drafter), "config": drafter.cfg.to_dict(),
                "target": target, "training": training or {}}
        (tmp / "config.json").write_text(json.dumps(meta, indent=1))

    atomic_write_dir(path, write, marker="config.json")
    return path


def read_meta(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.exists():
        raise DrafterError(f"drafter {path} does not exist")
    if not path.is_dir() or not cfg_file.is_file():
        hint = f"; {path / 'drafter'} is the drafter this training run exported" if (path / "drafter" / "config.json").is_file() else ""
        raise DrafterError(f"{path} is not a drafter checkpoint (no config.json){hint}")
    try:
        meta = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise DrafterError(f"{cfg_file} is not valid JSON ({exc.msg})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise DrafterError(f"{path} is not a moaspec drafter checkpoint")
    if meta.get("version") != VERSION:
        raise DrafterError(f"{path} has checkpoint version {meta.get('version')}; this moaspec reads version {VERSION}")
    return meta


def check_target(meta: dict[str, Any], target: LoadedModel, path: Path) -> None:
    want = meta.get("target")
    if not isinstance(want, dict):
        raise DrafterError(f"{path} does not say which target it was trained for (no \"target\" in its config.json)")
    if not serves(want, target):
        raise DrafterError(
            f"the drafter {path} was trained for target {want.get('name', '?')} (fingerprint "
            f"{want.get('fingerprint', '?')}), but the target loaded is {target.path.name} (fingerprint "
            f"{target.fingerprint}), another model; train a drafter for this target with `moaspec train`"
        )
    if want.get("fingerprint") != target.fingerprint:
        print(f"moaspec: the drafter {path.name} learnt from {want.get('name', '?')}'s weights; {model_name(target.path)} "
              "is the same model quantised otherwise, so its drafts may be accepted less often", file=sys.stderr)


DTYPE_VARIABLE = "MOASPEC_DRAFTER_DTYPE"  # what `--drafter-dtype` sets; processes it starts (servers) inherit it
DTYPE_CHOICES = ("auto", *FLOAT_DTYPES)  # the target's --dtype
DRAFTER_DTYPE_CHOICES = (*DTYPE_CHOICES, "int8")  # int8: 8-bit weights in small products (see named_precision)


def drafting_precision(target: LoadedModel) -> tuple[torch.dtype, bool]:
    """The precision ``$MOASPEC_DRAFTER_DTYPE`` (what ``--drafter-dtype`` sets; "auto" when unset) names
    beside ``target``: see :func:`named_precision`."""
    return named_precision(os.environ.get(DTYPE_VARIABLE, "auto"), target, DTYPE_VARIABLE)


def named_precision(choice: object, target: LoadedModel, what: str = "drafter_dtype") -> tuple[torch.dtype, bool]:
    """The dtype a drafter's weights and activations take beside ``target`` at inference, and whether its
    small products read int8 copies of the weights, for ``choice``, one of :data:`DRAFTER_DTYPE_CHOICES`
    (``what`` says where it came from, in the error for any other value).

    A float dtype's name is that dtype. "auto": bf16 activations and int8 weights on a CPU whose oneDNN
    has bf16 kernels (and whose torch has aten's int8 product); fp32 activations and 8-bit weight blocks
    beside an fp32 target on any other CPU where the compiled block kernel builds; the target's own dtype
    without 8-bit weights elsewhere. "int8": 8-bit weights on any CPU, with bf16 activations where the CPU has
    bf16 kernels or the block kernel is missing, fp32 ones otherwise (off a CPU it is "auto").

    A drafting step is memory-bound matrix–vector work over the drafter's weights, and
    oneDNN's packed bf16 products stream half the bytes of fp32 ones
    (docs/experiments/2026-11-25-drafting-precision.md, "Drafting in bf16 on the CPU"); int8
    copies halve them again ("Int8 drafter weights"). Without bf16 kernels, aten's int8 product with fp32
    activations took 2 to 30 times as long as oneDNN's fp32 products ("Int8 drafter weights on an Intel
    Xeon"), while the block kernel's Q8_0 products, with the drafter's layers compiled around them, made a
    MoA drafting step 2.5 times cheaper than fp32 in torch (:mod:`moaspec.drafters.compiled_layers`).
    The target keeps its dtype: its outputs are what decoding reproduces, while a drafter
    only proposes, so its precision can change which drafts are accepted but never the text.
    """
    if choice not in DRAFTER_DTYPE_CHOICES:
        raise MoaspecError(f"{what}={choice!r}: expected one of {', '.join(DRAFTER_DTYPE_CHOICES)}")
    if choice in FLOAT_DTYPES:
        return FLOAT_DTYPES[choice], False
    model = target.model
    cpu = model.device.type == "cpu"
    bf16_cpu = cpu and bf16_kernels()
    if cpu and not bf16_cpu and model.dtype == torch.float32 and kernel() is not None:  # "auto" or "int8"
        return torch.float32, True
    if choice == "int8" and cpu:  # aten's int8 product is quick with bf16 activations alone (int8_supported)
        return INT8_ACTIVATIONS, int8_kernels()
    bf16 = bf16_cpu and model.dtype == torch.float32
    return (torch.bfloat16 if bf16 else model.dtype), bf16 and int8_kernels()


def load_drafter(path: str | Path, target: LoadedModel, dtype: torch.dtype | str | None = None) -> Drafter:
    """Load a drafter for ``target`` (refusing one made for another target), attached and in eval mode.

    ``dtype``: its weights' dtype, or a precision's name (:func:`named_precision`: "int8" too); ``None``
    drafts in :func:`drafting_precision`. Training and exports pass the target's dtype, which keeps the
    checkpoint's precision (and no int8 copies).
    """
    if dtype is None:
        dtype, int8 = drafting_precision(target)
    elif isinstance(dtype, torch.dtype):
        int8 = False
    else:
        dtype, int8 = named_precision(dtype, target)
    path = Path(path)
    meta = read_meta(path)
    check_target(meta, target, path)
    if meta.get("kind") not in KINDS:
        raise DrafterError(f"{path} holds a drafter of unknown kind {meta.get('kind')!r}; known: {', '.join(KINDS)}")
    config_cls, drafter_cls = KINDS[meta["kind"]]
    try:
        cfg = config_cls.from_dict(meta["config"])
        cfg.check_target(target.cfg)
    except KeyError as exc:  # a field the architecture needs, or the "config" section itself
        raise DrafterError(f"{path} has an invalid drafter config: it lacks {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise DrafterError(f"{path} has an invalid drafter config: {exc}") from None
    try:
        state = load_file(str(path / "model.safetensors"))
    except (SafetensorError, OSError) as exc:
        raise DrafterError(f"cannot read {path / 'model.safetensors'}: {exc}") from None
    bad = [k for k, v in state.items() if v.is_floating_point() and not torch.isfinite(v).all()]
    if bad:
        raise DrafterError(f"{path} holds weights that are not finite (NaN or inf, e.g. {bad[0]}): the training that "
                           "wrote it diverged; use an earlier checkpoint or train again with a lower --lr")
    model = target.model
    try:
        drafter = drafter_cls(cfg).to(device=model.device, dtype=dtype)
        # 8-bit blocks need every input width in whole blocks of 32 (all shipped and default sizes are)
        drafter.use_int8(int8 and (dtype != torch.float32 or blocks_supported(drafter)))
    except (RuntimeError, ValueError, MemoryError) as exc:  # sizes a hand-edited config.json made impossible
        raise DrafterError(f"{path} has an invalid drafter config: cannot build it ({brief(exc)})") from None
    expected = drafter.state_dict()
    for k, v in state.items():
        if k in expected and v.is_floating_point():
            state[k] = v.to(expected[k].dtype)
    try:
        drafter.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise DrafterError(f"{path} does not match its own config: {brief(exc)}") from None
    try:
        drafter.attach(model)
    except ValueError as exc:
        raise DrafterError(f"{path} cannot run on this model: {exc}") from None
    drafter.requires_grad_(False)
    return drafter.eval()
