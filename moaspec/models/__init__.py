"""The target runtime: model config, loading, the transformer forward and its KV cache."""

from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.loading import LoadedModel, load_model_dir
from moaspec.models.sources import resolve_model
from moaspec.models.transformer import ForwardOutput, Transformer, causal_mask, tree_mask


def load_model(spec: str | None = None, device: str | None = None, dtype=None, with_tokenizer: bool = True) -> LoadedModel:  # type: ignore[no-untyped-def]
    """Load ``spec`` (the default model, a ``.gguf`` file or a local HF directory)."""
    return load_model_dir(resolve_model(spec), device=device, dtype=dtype, with_tokenizer=with_tokenizer)


__all__ = [
    "ForwardOutput", "KVCache", "LoadedModel", "ModelConfig", "Transformer",
    "causal_mask", "load_model", "load_model_dir", "resolve_model", "tree_mask",
]
