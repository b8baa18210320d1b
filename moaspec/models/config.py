"""The architecture facts the runtime needs, read from a Hugging Face ``config.json``.

Only decoder-only families whose blocks are (RMSNorm → GQA attention with RoPE →
RMSNorm → SwiGLU MLP) are accepted: Llama (1 to 3.3), Qwen2 (and 2.5), Qwen3 and Mistral.
They differ only in q/k/v biases (Qwen2, detected from the weights), RMSNorm on each
head's queries and keys (Qwen3), a sliding window (Mistral), and RoPE frequency scaling
(Llama 3.1's ``llama3``, ``linear``, ``yarn``: all fixed tables, so a verified token's
rotation never depends on how long the sequence has grown).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from moaspec.errors import ModelLoadError
from moaspec.validation import real_number, whole_number

SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
# RoPE scalings that give every position a fixed rotation; "dynamic" NTK and "longrope" change
# the rotations with the sequence's length, which a cache of already rotated keys cannot follow
# (their parameters besides the type, with the defaults transformers gives them)
ROPE_SCALING_KEYS: dict[str, dict[str, float | bool | None]] = {
    "linear": {"factor": None},
    "llama3": {"factor": None, "low_freq_factor": None, "high_freq_factor": None, "original_max_position_embeddings": None},
    "yarn": {"factor": None, "original_max_position_embeddings": None, "attention_factor": None, "beta_fast": 32.0,
             "beta_slow": 1.0, "mscale": None, "mscale_all_dim": None, "truncate": True},
}
SUPPORTED_ROPE_SCALINGS = tuple(ROPE_SCALING_KEYS)


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
    # added after drafters had been shipped: left out of to_dict (and so of identity, which the
    # fingerprint hashes) at their defaults, so that the fingerprints of models without them stay what they were
    rope_scaling: dict[str, Any] | None = None
    qk_norm: bool = False
    # EOS ids that only generation_config.json names (the first release of Llama-3-8B-Instruct's
    # <|eot_id|>, which ends its turns): generation stops at them as transformers' does, but they are not part of the
    # model's identity, so its fingerprint stays what it was before they were read
    generation_eos_ids: tuple[int, ...] = ()

    @property
    def kv_dim(self) -> int:
        """Width of one layer's keys (or values) for one token, all KV heads concatenated."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"], d["generation_eos_ids"] = list(self.eos_token_ids), list(self.generation_eos_ids)
        for name, default in (("rope_scaling", None), ("qk_norm", False), ("generation_eos_ids", [])):
            if d[name] == default:
                del d[name]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """The inverse of :meth:`to_dict` (a client bundle's ``bundle.json`` holds it)."""
        return cls(**{**d, "eos_token_ids": tuple(d.get("eos_token_ids", ())),
                      "generation_eos_ids": tuple(d.get("generation_eos_ids", ()))})

    def identity(self) -> dict[str, Any]:
        """What of the config identifies the model (its fingerprint hashes it with the weights)."""
        return {k: v for k, v in self.to_dict().items() if k != "generation_eos_ids"}

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
        if raw.get("mlp_bias"):
            raise ModelLoadError("MLP biases (mlp_bias) are not supported")
        if len(set(raw.get("layer_types") or ["full_attention"])) > 1:
            raise ModelLoadError("models mixing sliding-window and full-attention layers are not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ModelLoadError(f"'rope_parameters' (or 'rope_scaling') must be an object, got {rope!r}")
        theta = positive("rope_theta", rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        heads, hidden = whole("num_attention_heads", raw["num_attention_heads"]), whole("hidden_size", raw["hidden_size"])
        kv_heads = whole("num_key_value_heads", raw.get("num_key_value_heads", heads))
        if heads % kv_heads:
            raise ModelLoadError(f"'num_attention_heads' ({heads}) must be a multiple of 'num_key_value_heads' ({kv_heads})")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        bos = raw.get("bos_token_id")
        for name, ids in (("eos_token_id", eos_ids), ("bos_token_id", () if bos is None else (bos,))):
            for i in ids:
                whole(name, i, minimum=0)
        window = raw.get("sliding_window") if raw.get("use_sliding_window", family == "mistral") else None
        return cls(
            family=family,
            vocab_size=whole("vocab_size", raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=whole("intermediate_size", raw["intermediate_size"]),
            num_layers=whole("num_hidden_layers", raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=whole("head_dim", raw.get("head_dim") or hidden // heads),
            rope_theta=theta,
            rms_norm_eps=positive("rms_norm_eps", raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=whole("max_position_embeddings", raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            sliding_window=None if window is None else whole("sliding_window", window),
            bos_token_id=bos,
            eos_token_ids=eos_ids,
            rope_scaling=rope_scaling(rope, raw),
            qk_norm=family == "qwen3",
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
        if not isinstance(raw, dict):
            raise ModelLoadError(f"{cfg_file} must hold a JSON object, not {type(raw).__name__}")
        try:
            cfg = cls.from_hf_dict(raw)
        except KeyError as exc:
            raise ModelLoadError(f"{cfg_file} lacks the field {exc.args[0]!r}") from None
        except ModelLoadError as exc:
            raise ModelLoadError(f"{cfg_file}: {exc}") from None
        extra = [i for i in generation_eos_ids(path / "generation_config.json") if i not in cfg.eos_token_ids]
        return replace(cfg, generation_eos_ids=tuple(extra)) if extra else cfg


def whole(name: str, value: Any, minimum: int = 1) -> int:
    """``value``, the config field ``name``, checked to be a whole number of at least ``minimum``."""
    if not whole_number(value) or value < minimum:
        raise ModelLoadError(f"{name!r} must be a whole number >= {minimum}, got {value!r}")
    return value


def positive(name: str, value: Any) -> float:
    """``value``, the config field ``name``, checked to be a finite number above 0."""
    if not real_number(value) or value <= 0:
        raise ModelLoadError(f"{name!r} must be a number above 0, got {value!r}")
    return float(value)


def generation_eos_ids(path: Path) -> list[int]:
    """The EOS ids a ``generation_config.json`` names (none if it is absent or unreadable: it only adds stops)."""
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    ids = eos if isinstance(eos, list) else [eos]
    return [i for i in ids if isinstance(i, int) and not isinstance(i, bool)]


def rope_scaling(rope: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any] | None:
    """The RoPE scaling of an HF config's ``rope_parameters`` (or older ``rope_scaling``) as the runtime's
    rotation tables read it: its type and every parameter, defaults filled in as transformers fills
    them; ``None`` for plain RoPE. Scalings the runtime cannot reproduce exactly are refused."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelLoadError(f"partial rotary embeddings (partial_rotary_factor={partial}) are not supported")
    if kind in ("default", None):
        return None
    if kind not in SUPPORTED_ROPE_SCALINGS:
        raise ModelLoadError(f"unsupported RoPE scaling {kind!r}: moaspec runs plain RoPE and "
                             f"{', '.join(SUPPORTED_ROPE_SCALINGS)}")
    params: dict[str, Any] = {"rope_type": kind}
    for key, default in ROPE_SCALING_KEYS[kind].items():
        value = rope.get(key, raw.get(key) if key == "original_max_position_embeddings" else None)
        if value is None and key == "original_max_position_embeddings":
            value = raw.get("max_position_embeddings", 2048)
        params[key] = default if value is None else value
    if params["factor"] is None and kind == "yarn":  # as DeepSeek-V3 writes it: the context's growth
        params["factor"] = raw.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    missing = [key for key in ("factor", "low_freq_factor", "high_freq_factor") if key in params and params[key] is None]
    if missing:
        raise ModelLoadError(f"the {kind} RoPE scaling lacks {', '.join(map(repr, missing))}")
    return params
