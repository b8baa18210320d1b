"""The architecture facts the runtime needs, read from a Hugging Face ``config.json``.

Only decoder-only families whose blocks are (RMSNorm → GQA attention with RoPE →
RMSNorm → SwiGLU MLP) are accepted: Llama, Qwen2 and Mistral. They differ only in
q/k/v biases (Qwen2, detected from the weights) and a sliding window (Mistral).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from moaspec.errors import ModelLoadError

SUPPORTED_FAMILIES = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a decoder-only target model."""

    family: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_dim(self) -> int:
        """Width of one layer's keys (or values) for one token, all KV heads concatenated."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        return d

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config, refusing families the runtime cannot run."""
        family = raw.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise ModelLoadError(
                f"unsupported architecture {family!r}: moaspec runs {', '.join(SUPPORTED_FAMILIES)} models"
            )
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelLoadError(f"unsupported activation {act!r}: only SwiGLU (silu) MLPs are supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ModelLoadError(f"unsupported RoPE scaling {rope_type!r}: only plain RoPE is supported")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        window = raw.get("sliding_window") if raw.get("use_sliding_window", family == "mistral") else None
        return cls(
            family=family,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or hidden // heads,
            rope_theta=float(theta),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=window,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_model_dir(cls, path: Path) -> ModelConfig:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ModelLoadError(f"{path} is not a model directory: config.json is missing")
        try:
            raw = json.loads(cfg_file.read_text())
        except json.JSONDecodeError as exc:
            raise ModelLoadError(f"{cfg_file} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
        try:
            return cls.from_hf_dict(raw)
        except KeyError as exc:
            raise ModelLoadError(f"{cfg_file} lacks the field {exc.args[0]!r}") from None
