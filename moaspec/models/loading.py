"""Turn a model directory into a runnable :class:`Transformer` and its tokenizer.

Weights are read from safetensors with HF's parameter names and rearranged once for
speed: q/k/v become one fused matrix and gate/up another, so each block runs four
matmuls instead of seven.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from moaspec.errors import ModelLoadError, brief
from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.lineage import lineage
from moaspec.models.packed_linear import PAD_ROWS, pack_linears, packing_refused
from moaspec.models.sources import recorded_gguf
from moaspec.models.transformer import Transformer, causal_mask


@dataclass
class LoadedModel:
    """A target ready to run: runtime, tokenizer, config, and where it came from."""

    model: Transformer
    tokenizer: Any  # a transformers PreTrainedTokenizerBase (whose stubs type decode() as str | list[str])
    cfg: ModelConfig
    path: Path

    @property
    def fingerprint(self) -> str:
        """Identity of the weights (see :func:`fingerprint`)."""
        return self.model.fingerprint

    @cached_property
    def lineage(self) -> str | None:
        """Identity of the model whatever its quantisation, where its GGUF file names its source (see
        :mod:`moaspec.models.lineage`): what a drafter trained on another quantisation must share."""
        return lineage(self.path, self.cfg.identity(), self.tokenizer)


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def usable_device(device: torch.device | str | None) -> torch.device:
    """``device`` (default: :func:`default_device`), refused with a clear message if this torch cannot use it."""
    if device is None:
        return default_device()
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ModelLoadError(f"{device!r} is not a torch device (e.g. cpu, cuda, cuda:1)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device!r}: this torch has no usable CUDA GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ModelLoadError(f"device {device!r}: there are only {torch.cuda.device_count()} CUDA GPU(s)")
    if dev.type not in ("cpu", "cuda"):
        raise ModelLoadError(f"device {device!r}: moaspec runs on cpu or cuda")
    return dev


# The target's precision unless --dtype says otherwise, on every device. A GGUF's dequantised weights are exact in
# fp32, and only in fp32 is a forward's result for a token (all but) independent of how many tokens the forward
# holds, which greedy speculative decoding needs in order to reproduce vanilla decoding token for token. In bf16 or
# fp16 a verification of k tokens rounds differently from k one-token steps and the answers part at near-ties: with
# SmolLM2 in bf16 on a CPU, MoA chains differed from vanilla on 8 of 12 SpecBench prompts and trees on 11 of 12
# (BENCHMARKS.md, "Precision of drafting"; docs/experiments/2026-11-26-half-precision-target.md). So bf16 stays
# a choice for speed (``--dtype bfloat16``, e.g. on GPUs), not the default. Drafters, whose precision never changes
# the text, draft in bf16 where a CPU has bf16 kernels (``drafting_precision``).
DEFAULT_DTYPE = torch.float32
FLOAT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # what the runtime runs


def usable_dtype(dtype: torch.dtype | str | None) -> torch.dtype:
    """``dtype`` or its name (default, or "auto": :data:`DEFAULT_DTYPE`), refused with a clear message unless the
    runtime runs in it."""
    if dtype is None or dtype == "auto":
        return DEFAULT_DTYPE
    resolved = FLOAT_DTYPES.get(dtype) if isinstance(dtype, str) else dtype
    if resolved is None or resolved not in FLOAT_DTYPES.values():
        raise ModelLoadError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or its name), got {dtype!r}")
    return resolved


def weight_files(path: Path) -> list[Path]:
    """The safetensors files that hold ``path``'s model: those its index names, else ``model.safetensors``,
    else every ``*.safetensors`` there. Repositories may carry other weights beside the HF ones (Mistral's
    ship a ``consolidated.safetensors`` in its own naming), which must not be read as a second copy."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError):
            raise ModelLoadError(f"{index} is damaged: it holds no weight_map of tensor names to files") from None
        missing = [n for n in names if not (path / n).is_file()]
        if missing:
            raise ModelLoadError(f"{path} lacks weight files its index names: {', '.join(missing)}")
        return [path / n for n in names]
    if (path / "model.safetensors").is_file():
        return [path / "model.safetensors"]
    return sorted(path.glob("*.safetensors"))


def read_hf_state_dict(path: Path) -> dict[str, torch.Tensor]:
    files = weight_files(path)
    if not files:
        if list(path.glob("*.bin")) or list(path.glob("*.pt")):
            raise ModelLoadError(
                f"{path} holds PyTorch pickle weights; moaspec reads safetensors only "
                "(re-save the model with save_pretrained(..., safe_serialization=True))"
            )
        raise ModelLoadError(f"{path} has no *.safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read weights from {f}: {exc}") from None
    return state


def convert_hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Map HF Llama/Qwen2/Qwen3/Mistral parameter names onto this runtime's fused layout.

    Consumes ``state``: each HF tensor leaves it as its fused copy is made, so that loading holds
    about one copy of the weights, not two (what is left over, e.g. a stale rotary buffer, is dropped).
    """
    for key in list(state):  # renamed in place: a second dict would keep every unfused tensor alive
        state[key.removeprefix("model.")] = state.pop(key)

    def take(name: str) -> torch.Tensor:
        try:
            return state.pop(name)
        except KeyError:
            raise ModelLoadError(f"the weights lack {name!r}: not a {cfg.family} checkpoint of this config") from None

    out = {"embed.weight": take("embed_tokens.weight"), "norm": take("norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        a = p + "self_attn."
        out[f"blocks.{i}.attn.qkv.weight"] = torch.cat([take(a + f"{x}_proj.weight") for x in "qkv"])
        if a + "q_proj.bias" in state:
            out[f"blocks.{i}.attn.qkv.bias"] = torch.cat([take(a + f"{x}_proj.bias") for x in "qkv"])
        out[f"blocks.{i}.attn.o.weight"] = take(a + "o_proj.weight")
        if cfg.qk_norm:
            out[f"blocks.{i}.attn.q_norm"], out[f"blocks.{i}.attn.k_norm"] = take(a + "q_norm.weight"), take(a + "k_norm.weight")
        if a + "o_proj.bias" in state:
            raise ModelLoadError("attention output biases are not supported")
        out[f"blocks.{i}.mlp.gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        out[f"blocks.{i}.mlp.down.weight"] = take(p + "mlp.down_proj.weight")
        out[f"blocks.{i}.attn_norm"] = take(p + "input_layernorm.weight")
        out[f"blocks.{i}.mlp_norm"] = take(p + "post_attention_layernorm.weight")
    extra = sorted({int(k.split(".")[1]) for k in state if k.startswith("layers.") and k.split(".")[1].isdigit()})
    if extra:
        raise ModelLoadError(f"the weights hold {extra[-1] + 1} layers and the config {cfg.num_layers} "
                             "('num_hidden_layers'): config.json belongs to another model")
    state.clear()
    return out


def hf_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse of :func:`convert_hf_state_dict`: this runtime's fused layout under HF Llama names."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.kv_dim
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["norm"]}
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(cfg.num_layers):
        b, p = f"blocks.{i}.", f"model.layers.{i}."
        for name, part in zip("qkv", state[b + "attn.qkv.weight"].split((q, kv, kv))):
            out[p + f"self_attn.{name}_proj.weight"] = part
        if b + "attn.qkv.bias" in state:
            for name, part in zip("qkv", state[b + "attn.qkv.bias"].split((q, kv, kv))):
                out[p + f"self_attn.{name}_proj.bias"] = part
        out[p + "self_attn.o_proj.weight"] = state[b + "attn.o.weight"]
        gate, up = state[b + "mlp.gate_up.weight"].split(cfg.intermediate_size)
        out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = gate, up
        out[p + "mlp.down_proj.weight"] = state[b + "mlp.down.weight"]
        out[p + "input_layernorm.weight"] = state[b + "attn_norm"]
        out[p + "post_attention_layernorm.weight"] = state[b + "mlp_norm"]
    return out


def build_transformer(
    cfg: ModelConfig, hf_state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype
) -> Transformer:
    """The runtime for HF-named weights, identified by their fingerprint."""
    state = convert_hf_state_dict(hf_state, cfg)
    tied = {"lm_head.weight": state["embed.weight"]} if cfg.tie_word_embeddings else {}
    return assemble(cfg, state, device, dtype, fingerprint(cfg, {**state, **tied}))


BLOCK_NAME = re.compile(r"blocks\.(\d+)\.(.+)")


def assemble(cfg: ModelConfig, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype,
             weights_id: str, first_block: int = 0) -> Transformer:
    """Instantiate without initialising (meta device), then adopt ``state`` (this runtime's names), consuming it.

    With ``first_block > 0`` the model holds only the blocks from there on (a client's
    Target Layer Inference); ``state`` names them by their index in the whole target.
    """
    qkv_bias = any(k.endswith("attn.qkv.bias") for k in state)
    with torch.device("meta"):
        model = Transformer(cfg, qkv_bias=qkv_bias, first_block=first_block)
    own = {}
    for name in list(state):  # consumed as cast: the stored copy of a tensor is freed once its cast exists
        m = BLOCK_NAME.fullmatch(name)
        own[f"blocks.{int(m[1]) - first_block}.{m[2]}" if m else name] = state.pop(name).to(device=device, dtype=dtype)
    try:
        model.load_state_dict(own, strict=not cfg.tie_word_embeddings, assign=True)
    except RuntimeError as exc:
        raise ModelLoadError(f"weights do not match the model's config: {brief(exc)}") from None
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    # the RoPE tables are real even under the meta device (rope_tables computes on the CPU): move, not rebuild
    model.rope_cos, model.rope_sin = model.rope_cos.to(device), model.rope_sin.to(device)
    model.eval().requires_grad_(False)
    refused = packing_refused(model)
    if refused is None:
        pack_linears(model, forward=_timing_forward(model))
    else:
        print(f"moaspec: the target's weights are not prepacked ({refused}): verifying several tokens at once "
              "is slower", file=sys.stderr)
    model.fingerprint = weights_id
    return model


def _timing_forward(model: Transformer, cached: int = 32) -> Callable[[int], None]:
    """What the small-row kernels are measured with: ``rows`` tokens through every block ``model`` holds
    (after ``cached`` cached positions, causally masked, as a chain's verification), the final norm and
    ``lm_head``. A forward of the blocks, not of the embeddings, so that a client's partial model works too."""
    cfg = model.cfg
    cache = KVCache(len(model.blocks), cfg.num_kv_heads, cfg.head_dim, cached + PAD_ROWS, 1, model.dtype, model.device)
    h = torch.randn(1, PAD_ROWS, cfg.hidden_size, dtype=model.dtype, device=model.device) * 0.1

    def run(rows: int) -> None:
        cache.length = cached
        positions = torch.arange(cached, cached + rows, device=model.device)
        out, _ = model.run_blocks(h[:, :rows], cache, positions, causal_mask(cached, rows, model.device),
                                  first=model.first_block, cache_layer_offset=model.first_block)
        model.lm_head(model.final_norm(out))

    return run


def fingerprint(cfg: ModelConfig, state: dict[str, torch.Tensor]) -> str:
    """A short hash of the architecture and a sample of every weight tensor, as stored.

    Identifies a target cheaply (milliseconds): drafters and distillation data record
    it, so that they are never used with a model they were not made for. It is taken
    from the weights as read from disk, before any cast, so the same model loaded in
    fp32 on a CPU or in bf16 on a GPU has the same fingerprint.
    """
    h = hashlib.sha256(json.dumps(cfg.identity(), sort_keys=True).encode())
    for name, t in sorted(state.items()):
        flat = t.detach().reshape(-1)
        step = max(1, flat.numel() // 4096)
        h.update(name.encode())
        h.update(flat[::step].float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def load_tokenizer(path: Path) -> Any:
    """The tokenizer saved in ``path``.

    Directories this project wrote (a converted GGUF, a client bundle) name the exact class
    transformers chose when they were made, and load it directly. ``AutoTokenizer`` would
    choose it again, after importing the model's config class and, through it, much of
    transformers and torch's compiler: ~3 s of a CLI call's start-up, for the same tokenizer.
    """
    import transformers  # deferred: importing transformers costs ~1 s

    if not path.is_dir():  # transformers would take the path for a hub repository's name
        raise ModelLoadError(f"cannot load the tokenizer: {path} is missing")
    cls = transformers.AutoTokenizer
    if (path / "moaspec-source.json").is_file() or (path.parent / "bundle.json").is_file():
        try:
            name = json.loads((path / "tokenizer_config.json").read_text())["tokenizer_class"]
            cls = getattr(transformers, name)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass  # not what we wrote: let AutoTokenizer decide
    try:
        return cls.from_pretrained(str(path))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {brief(exc)}") from None


def converted_from(path: Path) -> Path | None:
    """The GGUF file a model directory was converted from (:func:`~moaspec.models.sources.convert_gguf`), if it
    still exists."""
    recorded = recorded_gguf(path)
    return Path(recorded) if recorded is not None and Path(recorded).is_file() else None


def load_model_dir(
    path: Path, device: torch.device | str | None = None, dtype: torch.dtype | str | None = None,
    with_tokenizer: bool = True,
) -> LoadedModel:
    """Load a local HF model directory (config.json + safetensors + tokenizer)."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model path {path} does not exist")
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory (a model is a Hugging Face model directory or "
                             "a .gguf file)")
    cfg = ModelConfig.from_model_dir(path)
    device = usable_device(device)
    dtype = usable_dtype(dtype)
    model = build_transformer(cfg, read_hf_state_dict(path), device, dtype)
    gguf = converted_from(path)
    if gguf is not None:
        from moaspec.models.gguf_blocks import attach_gguf_blocks

        attach_gguf_blocks(model, path, gguf)
    tokenizer = load_tokenizer(path) if with_tokenizer else None
    return LoadedModel(model=model, tokenizer=tokenizer, cfg=cfg, path=path)
