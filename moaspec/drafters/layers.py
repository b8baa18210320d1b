"""Decoder layers for drafters: self-attention and cross-attention blocks with RoPE and GQA.

The target's blocks read and write one fixed cache layout; a drafter needs more
freedom — attention whose keys come from another sequence (Cross-Attention onto
verified target states), rotary positions that are layer indices (Layer
Self-Attention) or token positions, and small caches of its own. So queries and
keys/values are projected separately: ``keys_values`` turns any source sequence
into rotated keys and values, and ``attend`` runs the queries of ``x`` on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moaspec.errors import MoaspecError
from moaspec.models.fused_layers import FUSED_MAX_TOKENS
from moaspec.models.packed_linear import Linear
from moaspec.models.transformer import apply_rope, causal_mask, prefill_chunk, rms_norm
from moaspec.validation import whole_number


def check_widths(sizes: Mapping[str, Any], *names: str) -> None:
    """Refuse a layer width below 1 among the ``names`` a user gave in ``sizes`` (``sa_mlp`` is ``--sa-mlp``).

    No width may be 0 (no drafter has a way to leave out an MLP): a 0-wide MLP is built
    and then fails on its first forward pass, a negative one fails inside torch.
    """
    for name in names:
        width = sizes.get(name)
        if width is not None and not (whole_number(width) and width >= 1):
            raise MoaspecError(f"--{name.replace('_', '-')} must be a whole number >= 1, got {width!r}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class DraftAttention(nn.Module):
    """Multi-head attention with grouped KV heads whose keys/values may come from another sequence."""

    def __init__(self, dim: int, source_dim: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"{heads} query heads cannot share {kv_heads} KV heads evenly")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q = Linear(dim, heads * head_dim, bias=False)
        self.kv = Linear(source_dim, 2 * kv_heads * head_dim, bias=False)
        self.o = Linear(heads * head_dim, dim, bias=False)

    def keys_values(self, source: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated keys and values ``[B, kv_heads, T, head_dim]`` of ``source`` ``[B, T, source_dim]``."""
        B, T, _ = source.shape
        k, v = self.kv(source).view(B, T, 2, self.kv_heads, self.head_dim).transpose(1, 3).unbind(2)
        return apply_rope(k, cos, sin), v

    def attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Queries of ``x`` ``[B, T, dim]`` (rotated by ``cos/sin``) over ``k/v``; ``mask`` bool ``[.., T, S]``."""
        B, T, _ = x.shape
        q = apply_rope(self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2), cos, sin)
        if mask is not None and mask.dim() == 3:
            mask = mask[:, None]
        # a cache may be kept in another dtype than the weights (Drafter.cache_dtype): attend in the cache's
        y = F.scaled_dot_product_attention(q.to(k.dtype), k, v, attn_mask=mask, enable_gqa=self.heads != self.kv_heads)
        return self.o(y.to(x.dtype).transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, width: int) -> None:
        super().__init__()
        self.width = width
        self.gate_up = Linear(dim, 2 * width, bias=False)
        self.down = Linear(width, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.width, dim=-1)
        return self.down(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm attention + SwiGLU MLP; ``cross``: its queries attend to another sequence's keys and values
    (of width ``source_dim``), through :meth:`cross_attention`, instead of its own.

    ``compiled``: the same layer on 8-bit copies of its weights in the compiled CPU kernel
    (:mod:`moaspec.drafters.compiled_layers`), which a drafting step of a few tokens runs instead of torch's
    ~30 small operations; ``None`` elsewhere (training, other devices and dtypes).
    """

    compiled: Any = None

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, mlp_width: int, eps: float,
                 source_dim: int | None = None, cross: bool = False) -> None:
        super().__init__()
        self.cross = cross
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = DraftAttention(dim, source_dim or dim, heads, kv_heads, head_dim)
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = MLP(dim, mlp_width)

    def self_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None = None,
    ) -> torch.Tensor:
        """``x`` attends to itself; with ``cache = (keys, values, start)`` its K/V are written at ``start``
        and the queries see every cached position before them (``mask`` then covers ``start + T`` keys).

        With a cache and no ``mask`` the attention is causal, and a long ``x`` (a drafter catching
        up on a prompt) runs a chunk of :func:`prefill_chunk` tokens at a time, as the target's
        prefill does, instead of under one ``[T, T]`` mask. Training passes masks and no cache.
        """
        if cache is not None and compiled_applies(self.compiled, x, cache[0]) and (mask is None or mask.dtype == torch.bool):
            keys, values, start = cache
            T = x.shape[1]
            flat = None if mask is None else mask.reshape(T, start + T).contiguous()
            return self.compiled.run(x[0], keys[None], values[None], *rope_rows(cos, sin, T), start, flat, 0, 1, 0)[None]
        if cache is None and mask is None and compiled_each_applies(self.compiled, x):
            return self._compiled_each(x, cos, sin)
        if cache is not None and mask is None:
            keys, values, start = cache
            T, step = x.shape[1], prefill_chunk(x.device)
            if T > 1:
                out = [self._self_attention(x[:, a : a + step], cos[..., a : a + step, :], sin[..., a : a + step, :],
                                            causal_mask(start + a, min(step, T - a), x.device), (keys, values, start + a))
                       for a in range(0, T, step)]
                return out[0] if len(out) == 1 else torch.cat(out, dim=1)
        return self._self_attention(x, cos, sin, mask, cache)

    def _compiled_each(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Each of the few sequences of ``x`` ``[N, L, dim]`` attending to the whole of itself (Layer Self-Attention over
        a verified token's layers), one compiled call each, through a scratch cache of ``L`` entries."""
        L = x.shape[1]
        a = self.attn
        keys = x.new_empty(1, 1, a.kv_heads, L, a.head_dim)
        values = torch.empty_like(keys)
        whole = torch.ones(L, L, dtype=torch.bool)
        c, s = rope_rows(cos, sin, L)
        return torch.stack([self.compiled.run(row, keys, values, c, s, 0, whole, 0, 1, 0) for row in x])

    def _self_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
        cache: tuple[torch.Tensor, torch.Tensor, int] | None,
    ) -> torch.Tensor:
        h = self.attn_norm(x)
        k, v = self.attn.keys_values(h, cos, sin)
        if cache is not None:
            k_buf, v_buf, start = cache
            end = start + x.shape[1]
            k_buf[:, :, start:end], v_buf[:, :, start:end] = k, v
            k, v = k_buf[:, :, :end], v_buf[:, :, :end]
        x = x + self.attn.attend(h, cos, sin, k, v, mask)
        return x + self.mlp(self.mlp_norm(x))

    def cross_attention(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``x`` attends to keys/values made by :meth:`DraftAttention.keys_values` from another sequence."""
        if mask is None and compiled_applies(self.compiled, x, k):
            return self.compiled.cross(x[0], k, v, *rope_rows(cos, sin, x.shape[1]))[None]
        x = x + self.attn.attend(self.attn_norm(x), cos, sin, k, v, mask)
        return x + self.mlp(self.mlp_norm(x))


def rope_rows(cos: torch.Tensor, sin: torch.Tensor, T: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables of ``T`` positions as the compiled layers take them: contiguous ``[T, head_dim]``."""
    return cos.reshape(T, -1).contiguous(), sin.reshape(T, -1).contiguous()


COMPILED_EACH_MAX = 8  # sequences that _compiled_each runs one by one; more (a prompt's catch-up) go to torch's batch


def compiled_each_applies(compiled: Any, x: torch.Tensor) -> bool:
    """Whether ``x`` ``[N, L, dim]`` is a few short fp32 sequences, outside autograd, for :meth:`DecoderLayer._compiled_each`."""
    return (compiled is not None and x.dim() == 3 and x.shape[0] <= COMPILED_EACH_MAX
            and x.shape[1] <= FUSED_MAX_TOKENS and x.dtype == torch.float32
            and not (torch.is_grad_enabled() and x.requires_grad))


def compiled_applies(compiled: Any, x: torch.Tensor, keys: torch.Tensor) -> bool:
    """Whether a layer's compiled counterpart can run on ``x`` ``[1, T, dim]`` with ``keys`` ``[1, kv_heads, .., D]``:
    one sequence of at most FUSED_MAX_TOKENS fp32 tokens and an fp32 cache, outside autograd."""
    return (compiled is not None and x.dim() == 3 and x.shape[0] == 1 and x.shape[1] <= FUSED_MAX_TOKENS
            and x.dtype == torch.float32 and keys.dtype == torch.float32 and keys.shape[0] == 1
            and not (torch.is_grad_enabled() and x.requires_grad))
