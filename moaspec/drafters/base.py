"""What every drafter shares: its target's shape, a draft vocabulary, and the target's parts, borrowed.

A drafter stores only its own weights. The embedding table, ``lm_head`` (cut to the
draft vocabulary), the final norm and any reused layers belong to the target and are
borrowed by reference at :meth:`Drafter.attach`, never saved.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, fields
from typing import Any, ClassVar, TypeVar, get_type_hints

import torch
from torch import nn

from moaspec.drafters.compiled_layers import blocks_supported, use_blocks
from moaspec.models.config import ModelConfig
from moaspec.models.packed_linear import INT8_ACTIVATIONS, Linear, pack_linears, quantize_linears
from moaspec.models.transformer import Transformer, rope_tables
from moaspec.validation import real_number, whole_number

C = TypeVar("C", bound="DrafterConfig")


@dataclass(frozen=True)
class DrafterConfig:
    """Fields fixed by the target, plus the token-level attention shape and the draft vocabulary."""

    hidden_size: int
    num_target_layers: int
    target_kv_width: int  # one layer's K and V for one token: 2 · n_kv · head_dim
    vocab_size: int
    rope_theta: float
    rms_norm_eps: float
    max_positions: int
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary

    @classmethod
    def target_fields(cls, cfg: ModelConfig) -> dict[str, Any]:
        return dict(
            hidden_size=cfg.hidden_size, num_target_layers=cfg.num_layers, target_kv_width=2 * cfg.kv_dim,
            vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
        )

    MAY_BE_ZERO: ClassVar[frozenset[str]] = frozenset({"draft_vocab_size", "tli_layers"})

    @classmethod
    def from_dict(cls: type[C], d: dict[str, Any]) -> C:
        """The config a checkpoint's JSON describes, its fields checked (ValueError names the first bad one):
        whole numbers >= 1 (or >= 0 where 0 means "off"), finite non-negative floats, booleans, strings."""
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {sorted(unknown)}")
        missing = [f.name for f in fields(cls) if f.name not in d and f.default is MISSING]
        if missing:
            raise ValueError(f"missing {cls.__name__} fields: {missing}")
        hints = get_type_hints(cls)
        for name, value in d.items():
            kind = hints[name]
            if kind is bool:
                ok, want = isinstance(value, bool), "true or false"
            elif kind is int:
                low = 0 if name in cls.MAY_BE_ZERO else 1
                ok, want = whole_number(value) and value >= low, f"a whole number >= {low}"
            elif kind is float:
                ok = real_number(value) and value >= 0
                want = "a finite number >= 0"
            else:
                ok, want = isinstance(value, kind), kind.__name__
            if not ok:
                raise ValueError(f"{name} must be {want}, got {value!r}")
        cfg = cls(**d)
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise ValueError(f"draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size {cfg.vocab_size}")
        if cfg.heads % cfg.kv_heads:
            raise ValueError(f"heads ({cfg.heads}) must be a multiple of kv_heads ({cfg.kv_heads})")
        return cfg

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the first shape in which ``cfg`` differs from the drafter's target."""
        expected = {
            "hidden size": (self.hidden_size, cfg.hidden_size),
            "number of layers": (self.num_target_layers, cfg.num_layers),
            "K/V width per layer": (self.target_kv_width, 2 * cfg.kv_dim),
            "vocabulary size": (self.vocab_size, cfg.vocab_size),
            "context window": (self.max_positions, cfg.max_position_embeddings),
        }
        for what, (mine, theirs) in expected.items():
            if mine != theirs:
                raise ValueError(f"the drafter expects a target with {what} {mine}, this target has {theirs}")


def precision_name(dtype: torch.dtype, int8: bool) -> str:
    """A drafting precision as ``--drafter-dtype`` names it: the weights' dtype, or "int8"."""
    return "int8" if int8 else str(dtype).removeprefix("torch.")


class Drafter(nn.Module):
    """Base of the drafters: draft vocabulary, rotary tables, and the borrowed head."""

    cfg: DrafterConfig
    draft_vocab: torch.Tensor | None  # buffers, registered in __init__
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.cfg = cfg
        if cfg.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))
        else:
            self.draft_vocab = None
        cos, sin = rope_tables(cfg.head_dim, cfg.max_positions, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._borrowed: dict[str, Any] = {}
        self.int8_products = False  # see use_int8

    def attach(self, target: Transformer, vocab_limit: int | None = None) -> None:
        """Borrow the target's parts; the head is a copy of the draft-vocabulary rows of ``lm_head``, in the
        drafter's dtype.

        Call after moving both models to their device and dtype. The draft vocabulary is
        stored most frequent first, so ``vocab_limit`` keeps a smaller, faster head at
        inference without retraining.
        """
        self.cfg.check_target(target.cfg)
        weight = target.lm_head.weight.detach()
        if self.draft_vocab is not None:
            if vocab_limit is not None:
                if not 0 < vocab_limit <= self.cfg.draft_vocab_size:
                    raise ValueError(f"vocab_limit must be in 1..{self.cfg.draft_vocab_size}")
                self.draft_vocab = self.draft_vocab[:vocab_limit].clone()
            weight = weight.index_select(0, self.draft_vocab.to(weight.device))
        head = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(weight.to(self.weight_dtype, copy=True), requires_grad=False)
        self._borrowed = {"target": target, "head": head}
        self._prepare_products(head)

    @property
    def target(self) -> Transformer:
        if "target" not in self._borrowed:
            raise RuntimeError("attach the drafter to its target first")
        return self._borrowed["target"]

    def set_draft_vocab(self, ids: torch.Tensor) -> None:
        if self.draft_vocab is None or ids.shape != self.draft_vocab.shape:
            raise ValueError(f"draft vocabulary must hold {self.cfg.draft_vocab_size} ids")
        self.draft_vocab.copy_(ids)

    def own_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def fingerprint(self) -> str:
        """Identity of the drafter: its architecture and its own weights (rounded to bf16, so any load dtype of
        one checkpoint agrees).

        A client and a server must hold the same MoA drafter: the server's LSA half makes
        the memory entries the client's CA half reads. The same weights read differently
        (keys derotated or not) are another drafter.
        """
        h = hashlib.sha256(json.dumps(self.cfg.to_dict(), sort_keys=True).encode())
        for name, p in sorted(self.named_parameters()):
            h.update(name.encode())
            h.update(p.detach().to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (or the whole vocabulary)."""
        return self._borrowed["head"](features)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def train(self, mode: bool = True) -> Drafter:
        super().train(mode)
        self._prepare_products(self)
        if "head" in self._borrowed:
            self._prepare_products(self._borrowed["head"])
        return self

    def use_int8(self, enable: bool = True) -> Drafter:
        """Let inference products read 8-bit copies of the weights (the head's too) where a CPU kernel for the
        weights' dtype exists.

        A drafting step streams the drafter's weights right after the target's forward has evicted them from
        the caches, so its time is their bytes. bf16 weights get aten's int8 product with bf16 activations
        (int8 halves bf16's bytes: docs/experiments/2026-11-25-drafting-precision.md, "Int8 drafter weights");
        fp32 weights get Q8_0 blocks read with fp32 activations by the GGUF runtime's compiled kernel, with
        the decoder layers compiled as well (:mod:`moaspec.drafters.compiled_layers`). The parameters are
        untouched, and the text cannot change: only which drafts the target accepts.
        """
        if enable and self.weight_dtype == torch.float32 and not blocks_supported(self):
            raise ValueError("8-bit copies of fp32 weights need the compiled CPU kernel (see the message above) "
                             "and fp32 weights on the CPU")
        if enable and self.weight_dtype not in (torch.float32, INT8_ACTIVATIONS):
            raise ValueError("int8 weights take bf16 or fp32 activations (load the drafter in one of those first)")
        self.int8_products = enable
        self.train(self.training)
        return self

    def _prepare_products(self, module: nn.Module) -> None:
        """Inference copies of ``module``'s weights for eval (8-bit ones only with ``int8_products``), none in
        training (they would go stale)."""
        pack_linears(module, not self.training)
        eight_bit = self.int8_products and not self.training
        blocks = eight_bit and self.weight_dtype == torch.float32
        quantize_linears(module, eight_bit and not blocks)
        use_blocks(module, blocks)

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def precision(self) -> str:
        """How it drafts, as ``--drafter-dtype`` names it."""
        return precision_name(self.weight_dtype, self.int8_products)

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype of the drafter's own K/V caches: its weights', but fp32 for bf16 weights on a CPU.

        torch's CPU attention kernel is slow for one bf16 query: over 1,000 cached keys it took
        475 µs against 57 µs in fp32, and 163 µs for four queries (torch 2.13, AMD EPYC with
        AVX-512 bf16; docs/experiments/2026-11-25-drafting-precision.md, "The drafter's caches in
        fp32"). A drafting step asks one query of SA's cache and one of CA's memory, so bf16 caches
        cost more than the drafter's weights take to read. Queries are cast to the cache's dtype, outputs
        back to the weights'.
        """
        dtype = self.weight_dtype
        cpu = next(self.parameters()).device.type == "cpu"
        return torch.float32 if cpu and dtype == torch.bfloat16 else dtype

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B or 1, 1, T, head_dim]`` for token positions ``[T]`` or ``[B, T]``."""
        pos = positions if positions.dim() == 2 else positions[None]
        dtype = self.weight_dtype
        return self.rope_cos[pos][:, None].to(dtype), self.rope_sin[pos][:, None].to(dtype)
