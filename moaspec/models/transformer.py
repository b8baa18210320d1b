"""The target runtime's forward pass, written for speculation.

One module, read top to bottom like gpt-fast's ``model.py``: embeddings → N blocks
(RMSNorm → fused-QKV attention with RoPE → RMSNorm → fused gate/up SwiGLU MLP) →
final norm → ``lm_head``. Unlike a generic implementation it takes explicit token
positions and an arbitrary boolean attention mask (so a whole draft tree is verified
in one call), writes K/V into a preallocated :class:`~moaspec.models.kv_cache.KVCache`,
computes logits only where asked (``lm_head`` is a fifth of a small model's cost), and
returns the residual stream after any requested layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from moaspec.models.config import ModelConfig
from moaspec.models.fused_layers import FUSED_MAX_TOKENS
from moaspec.models.kv_cache import KVCache
from moaspec.models.packed_linear import Linear

ChunkCallback = Callable[[int, int], None]  # (new tokens processed so far, new tokens in all)


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables ``[max_positions, head_dim]`` in the half-split layout HF checkpoints use.

    ``scaling`` (:func:`~moaspec.models.config.rope_scaling`'s form) rescales the frequencies
    as the checkpoint was trained to read them (Llama 3.1's ``llama3``, ``linear``, ``yarn``);
    ``yarn`` also scales cos and sin. Always computed on the CPU (modules move them with
    ``.to``): under the meta device, where loading builds models, this arithmetic would run
    torch's Python reference ops, whose first use costs ~1.5 s of imports.
    """
    cpu = torch.device("cpu")
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=cpu).float() / head_dim))
    if scaling:
        inv_freq = scaled_frequencies(inv_freq, theta, head_dim, scaling)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32, device=cpu), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    magnitude = rope_magnitude(scaling)
    return emb.cos() * magnitude, emb.sin() * magnitude


def scaled_frequencies(inv_freq: torch.Tensor, theta: float, head_dim: int, scaling: dict[str, Any]) -> torch.Tensor:
    """RoPE's inverse frequencies rescaled for a longer context.

    The formulas are those the checkpoints were trained with (and transformers computes):
    ``linear`` divides every frequency by ``factor``; ``llama3`` divides only the slow ones
    (wavelengths beyond ``original / low_freq_factor``), keeps the fast ones (below
    ``original / high_freq_factor``) and blends in between; ``yarn`` blends interpolated and
    extrapolated frequencies over a ramp of dimensions (and scales cos/sin: :func:`rope_magnitude`).
    """
    kind, factor = scaling["rope_type"], scaling["factor"]
    if kind == "linear":
        return inv_freq / factor
    original = scaling["original_max_position_embeddings"]
    if kind == "llama3":
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        wavelen = 2 * math.pi / inv_freq
        slowed = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        smooth = (original / wavelen - low) / (high - low)
        blended = (1 - smooth) * slowed / factor + smooth * slowed
        between = (wavelen >= original / high) & (wavelen <= original / low)
        return torch.where(between, blended, slowed)
    return yarn_frequencies(inv_freq, theta, head_dim, factor, original, scaling)


def yarn_frequencies(
    inv_freq: torch.Tensor, theta: float, head_dim: int, factor: float, original: int, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN (Peng et al., 2023): dimensions that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times kept,
    a linear ramp between; see :func:`scaled_frequencies`."""

    def dimension(rotations: float) -> float:  # the dimension that turns ``rotations`` times over ``original``
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(scaling["beta_fast"]), dimension(scaling["beta_slow"])
    if scaling["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def rope_magnitude(scaling: dict[str, Any] | None) -> float:
    """The factor on cos/sin: 1 except under YaRN, which scales queries and keys (so attention logits
    by its square) by ``0.1·ln(factor) + 1``, or the ``attention_factor`` the checkpoint gives."""
    if not scaling or scaling["rope_type"] != "yarn":
        return 1.0
    if scaling["attention_factor"] is not None:
        return float(scaling["attention_factor"])

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor, m, m_all = scaling["factor"], scaling["mscale"], scaling["mscale_all_dim"]
    return mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, with the weight cast to ``x``'s dtype.

    Under autocast, activations arrive in bf16 while trained weights stay fp32, and
    mixed dtypes miss the fused kernel (with a warning on every call).
    """
    return F.rms_norm(x, x.shape[-1:], weight.to(x.dtype), eps)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[B, H, T, D]`` by per-position angles ``cos/sin`` ``[B or 1, 1, T, D]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, bias: bool = False) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.kv_dim
        self.split = (q_dim, kv_dim, kv_dim)
        self.qkv = Linear(cfg.hidden_size, q_dim + 2 * kv_dim, bias=bias)
        self.o = Linear(q_dim, cfg.hidden_size, bias=False)
        # Qwen3: each head's queries and keys are RMS-normalised before their rotation
        self.eps = cfg.rms_norm_eps
        self.q_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None
        self.k_norm = nn.Parameter(torch.ones(cfg.head_dim)) if cfg.qk_norm else None

    def attend(
        self,
        qkv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        start: int,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """Attention of new tokens' fused ``qkv`` projection ``[B, T, q + 2 kv]`` over the cache and themselves, before
        the output projection ``o``: ``[B, T, q_dim]``. Apart from the projections so that several sequences' tokens
        can share them (:meth:`Transformer.forward_many`) while each attends to its own cache."""
        q, k, v = self.rotate(qkv, cos, sin)
        return self.attend_rotated(q, k, v, k_cache, v_cache, start, mask)

    def rotate(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The fused projection ``[B, T, q + 2 kv]`` as heads, queries and keys normed (Qwen3) and rotated: q
        ``[B, H, T, D]``, k and v ``[B, KV, T, D]``. One call for several sequences' tokens (their own positions in
        ``cos``/``sin``), where :meth:`attend_rotated` then runs once per sequence."""
        B, T, _ = qkv.shape
        q, k, v = qkv.split(self.split, dim=-1)
        q, k = q.view(B, T, self.num_heads, self.head_dim), k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm(q, self.q_norm, self.eps), rms_norm(k, self.k_norm, self.eps)
        q = apply_rope(q.transpose(1, 2), cos, sin)
        k = apply_rope(k.transpose(1, 2), cos, sin)
        return q, k, v.view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def attend_rotated(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """:meth:`attend` after :meth:`rotate`: the new keys and values written at ``start`` and the queries'
        attention over the cache up to them, ``[B, T, q_dim]``."""
        B, T = q.shape[0], q.shape[2]
        end = start + T
        if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
            # Training through these blocks (a drafter's own, or TLI): attend over fresh tensors.
            # Every layer's cache is a view of one buffer, so a later layer's in-place write
            # would invalidate the views autograd saved here.
            keys, values = torch.cat([k_cache[:, :, :start], k], dim=2), torch.cat([v_cache[:, :, :start], v], dim=2)
            k_cache[:, :, start:end], v_cache[:, :, start:end] = k.detach(), v.detach()
        else:
            k_cache[:, :, start:end], v_cache[:, :, start:end] = k, v
            keys, values = k_cache[:, :, :end], v_cache[:, :, :end]
        # a drafter's cache may be kept in another dtype than its weights (Drafter.cache_dtype): attend in the cache's.
        # Checked, not cast blindly: the target's own forwards (the hot path) never differ, and a no-op cast costs ~1 µs
        differs = keys.dtype != q.dtype
        y = F.scaled_dot_product_attention(q.to(keys.dtype) if differs else q, keys, values, attn_mask=mask,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return (y.to(q.dtype) if differs else y).transpose(1, 2).reshape(B, T, -1)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.inter, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    attn: Attention

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.attn = Attention(cfg, bias=qkv_bias)
        self.mlp_norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, k_cache, v_cache, start, mask):  # type: ignore[no-untyped-def]
        return self.around(x, lambda qkv: self.attn.attend(qkv, cos, sin, k_cache, v_cache, start, mask))

    def around(self, x: torch.Tensor, attend: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """The block on ``x`` given how its tokens attend: ``attend`` maps their fused qkv projection to attention
        outputs (before ``o``). One body for :meth:`forward` (one cache) and :meth:`Transformer.forward_many`
        (several sequences' tokens, each attending to its own cache)."""
        x = x + self.attn.o(attend(self.attn.qkv(rms_norm(x, self.attn_norm, self.eps))))
        return x + self.mlp(rms_norm(x, self.mlp_norm, self.eps))


@dataclass(frozen=True)
class Call:
    """One sequence's part of :meth:`Transformer.forward_many`: as :meth:`Transformer.forward`'s arguments, batch 1."""

    tokens: torch.Tensor  # [1, T]
    cache: KVCache
    positions: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    logits_at: slice | torch.Tensor | None = None


@dataclass
class ForwardOutput:
    """What one runtime forward returns.

    ``logits`` cover only the requested positions; ``hidden`` is the final hidden state
    after the final norm (the input of ``lm_head``, the MoA/EAGLE feature target);
    ``layer_hidden[k]`` is the residual stream after ``k`` blocks (``k = L - N`` feeds
    Target Layer Inference). The new tokens' K/V of every layer are in the cache at
    positions ``[start, start + T)``: read them with ``KVCache.token_kv``.
    """

    logits: torch.Tensor | None
    hidden: torch.Tensor
    start: int
    layer_hidden: dict[int, torch.Tensor] = field(default_factory=dict)


class Transformer(nn.Module):
    """A Llama/Qwen2/Qwen3/Mistral decoder with explicit positions, masks and cache control."""

    fingerprint: str = ""  # identity of the weights it was loaded from (set by the loader)
    # the compiled layers over a GGUF target's blocks (moaspec.models.fused_layers), set where they apply
    fused: Any = None
    rope_cos: torch.Tensor  # buffers, registered in __init__
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, qkv_bias: bool = False, first_block: int = 0) -> None:
        """``first_block > 0`` holds only the last ``L - first_block`` blocks (``blocks[j]`` is block
        ``first_block + j``): what a client needs to run Target Layer Inference, not a whole model."""
        super().__init__()
        if not 0 <= first_block <= cfg.num_layers:
            raise ValueError(f"first_block must be in 0..{cfg.num_layers}, got {first_block}")
        self.cfg = cfg
        # initialised here, not by nn.Embedding: its normal_ on the meta device is slow (see rope_tables)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        if not self.embed.weight.is_meta:
            nn.init.normal_(self.embed.weight)
        self.first_block = first_block
        self.blocks = nn.ModuleList(Block(cfg, qkv_bias) for _ in range(first_block, cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype

    def new_cache(self, capacity: int | None = None, batch_size: int = 1) -> KVCache:
        """A cache for this model; ``capacity`` defaults to the whole context window."""
        capacity = capacity or self.cfg.max_position_embeddings
        return KVCache.for_model(self.cfg, capacity, batch_size, self.dtype, self.device)

    def final_norm(self, h: torch.Tensor) -> torch.Tensor:
        return rms_norm(h, self.norm, self.cfg.rms_norm_eps)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[B or 1, 1, T, D]`` for positions ``[T]`` or ``[B, T]``."""
        pos = positions if positions.dim() == 2 else positions[None]
        return (self.rope_cos[pos][:, None].to(self.dtype), self.rope_sin[pos][:, None].to(self.dtype))

    def unrotated_keys(self, token_kv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``token_kv`` (``[B, T, L, 2 · kv_dim]``, :meth:`KVCache.token_kv`'s layout) with every layer's keys
        rotated back from their tokens' ``positions`` ``[T]``: ``W_k·x`` exactly (Qwen3: after its key norm), as before RoPE.

        The cache holds keys after RoPE (attention consumes them so); a reader blind to
        positions, like the MoA drafter's Layer Self-Attention, sees their fast-turning
        pairs as noise. Values carry no rotation and pass unchanged.
        """
        kvd, D = self.cfg.kv_dim, self.cfg.head_dim
        cos = self.rope_cos[positions].to(token_kv.dtype)[:, None, None]  # [T, 1, 1, D]: over layers and heads
        sin = self.rope_sin[positions].to(token_kv.dtype)[:, None, None]
        keys = apply_rope(token_kv[..., :kvd].unflatten(-1, (kvd // D, D)), cos, -sin)
        magnitude = rope_magnitude(self.cfg.rope_scaling)  # cached keys carry YaRN's scale; its tables applied it again
        if magnitude != 1.0:
            keys = keys / magnitude**2
        return torch.cat([keys.flatten(-2), token_kv[..., kvd:]], dim=-1)

    def run_blocks(
        self,
        h: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor,
        mask: torch.Tensor | None,
        first: int = 0,
        last: int | None = None,
        cache_layer_offset: int = 0,
        hidden_after: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run blocks ``first..last-1`` on ``h``, writing K/V at ``cache.length`` onward.

        ``cache_layer_offset`` maps block ``i`` to cache layer ``i - offset``, so a cache
        that holds only a few layers (Target Layer Inference) can be used. Does not
        advance ``cache.length``: the caller does, once, after all blocks ran.
        """
        last = self.cfg.num_layers if last is None else last
        if first < self.first_block:
            raise ValueError(f"this model holds blocks {self.first_block}.. only, not block {first}")
        if self.fused is not None and fused_applies(h, cache):
            return self._run_fused(h, cache, positions, mask, first, last, cache_layer_offset, hidden_after)
        cos, sin = self.rope(positions)
        start = cache.length
        if mask is not None and mask.dim() == 2:
            mask = mask[None, None]
        elif mask is not None and mask.dim() == 3:
            mask = mask[:, None]
        captured: dict[int, torch.Tensor] = {}
        if first in hidden_after:
            captured[first] = h
        for i in range(first, last):
            c = i - cache_layer_offset
            h = self.blocks[i - self.first_block](h, cos, sin, cache.keys[c], cache.values[c], start, mask)
            if i + 1 in hidden_after:
                captured[i + 1] = h
        return h, captured

    def _run_fused(
        self, h: torch.Tensor, cache: KVCache, positions: torch.Tensor, mask: torch.Tensor | None, first: int,
        last: int, cache_layer_offset: int, hidden_after: tuple[int, ...],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """:meth:`run_blocks` through the compiled layers: the same blocks, run in stretches that end where a
        layer's output is asked for."""
        T = h.shape[1]
        pos = positions.reshape(T)
        cos, sin = self.rope_cos[pos].contiguous(), self.rope_sin[pos].contiguous()
        flat = None if mask is None else mask.reshape(T, -1).contiguous()
        stops = sorted({first, last, *(k for k in hidden_after if first < k < last)})
        captured = {first: h} if first in hidden_after else {}
        x, base = h[0], self.first_block
        for a, b in zip(stops, stops[1:]):
            x = self.fused.run(x, cache.keys, cache.values, cos, sin, cache.length, flat, a - base, b - base,
                               cache_layer_offset - base)
            if b in hidden_after:
                captured[b] = x[None]
        return x[None], captured

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache,
        positions: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        logits_at: slice | torch.Tensor | None = None,
        hidden_after: tuple[int, ...] = (),
        on_chunk: ChunkCallback | None = None,
    ) -> ForwardOutput:
        """Process ``tokens`` ``[B, T]`` after the ``cache.length`` cached positions.

        ``positions`` (``[T]`` or ``[B, T]``) default to ``cache.length + arange(T)``.
        ``mask`` is boolean (True = may attend), shaped ``[T, S]`` or ``[B, T, S]`` with
        ``S = cache.length + T``; ``None`` means causal over the new tokens with the
        whole cache visible. ``logits_at`` selects the positions (last axis of the
        new tokens) whose logits are computed; ``None`` computes them all.

        A causal forward (no ``mask``) of many tokens, a long prompt's prefill, runs its
        blocks on :func:`prefill_chunk` tokens at a time, each chunk attending to the
        cache the chunks before it wrote: the same result (up to summation order), with
        activations and the attention mask sized by the chunk instead of the prompt
        (``[T, T]`` for all of it at once), and fewer attention products, since no chunk
        computes scores for the keys after it (BENCHMARKS.md, "Long prompts").
        ``on_chunk(done, T)`` is called after each chunk: a caller can report a long
        prefill's progress, or abandon it within one chunk by raising (a server whose
        client has gone); the cache is then left as it was before the call.
        """
        B, T = tokens.shape
        start = cache.length
        cache.check_room(T)
        if positions is None:
            positions = torch.arange(start, start + T, device=tokens.device)
        step = max(T, 1) if mask is not None else prefill_chunk(tokens.device)
        states: list[torch.Tensor] = []
        captures: list[dict[int, torch.Tensor]] = []
        try:
            for a in range(0, max(T, 1), step):
                pos = positions[..., a : a + step]
                n = pos.shape[-1]
                h, captured = self.run_blocks(self.embed(tokens[:, a : a + step]), cache, pos,
                                              self._mask(mask, cache.length, n, pos), hidden_after=hidden_after)
                cache.length += n
                states.append(h)
                captures.append(captured)
                if on_chunk is not None:
                    on_chunk(a + n, T)
        except BaseException:
            cache.length = start  # the cache holds what it held before: no half-processed prompt
            raise
        h = states[0] if len(states) == 1 else torch.cat(states, dim=1)
        captured = {k: torch.cat([c[k] for c in captures], dim=1) for k in captures[0]} if len(captures) > 1 else captures[0]
        hidden = self.final_norm(h)
        selected = hidden if logits_at is None else hidden[:, logits_at]
        logits = self.lm_head(selected)
        return ForwardOutput(logits=logits, hidden=hidden, start=start, layer_hidden=captured)

    @torch.inference_mode()
    def forward_many(self, calls: Sequence[Call]) -> list[ForwardOutput]:
        """Several sequences' forwards of a few new tokens each, as one: what ``forward`` returns for each call.

        Every linear layer runs once over all the calls' new tokens, so the weights are read once
        for all of them (a decoding step's cost is reading them: on a CPU, 8 tokens cost about what
        1 does; BENCHMARKS.md, "Plain decoding and the cost of a forward"); each call's tokens attend to
        its own cache, with its own positions and mask. Meant for a server verifying many sessions'
        drafts: no chunking, so calls should be small (a long prompt goes through ``forward``).
        """
        if self.first_block:
            raise ValueError("forward_many runs whole models, not the last blocks alone")
        spans: list[tuple[Any, ...]] = []  # per call: its columns a..b of the joint batch, first position, attention mask
        angles: list[torch.Tensor] = []  # per call: its new tokens' positions
        for c in calls:
            B, T = c.tokens.shape
            start = c.cache.length
            if B != 1:
                raise ValueError(f"forward_many takes one sequence per call, got a batch of {B}")
            c.cache.check_room(T)
            pos = torch.arange(start, start + T, device=c.tokens.device) if c.positions is None else c.positions
            mask = self._mask(c.mask, start, T, pos)
            mask = mask if mask is None else mask[None, None] if mask.dim() == 2 else mask[:, None]
            a = spans[-1][1] if spans else 0
            spans.append((a, a + T, start, mask))
            angles.append(pos)
        h = self.embed(torch.cat([c.tokens for c in calls], dim=1))
        if self.fused is not None and all(fused_applies(h[:, a:b], c.cache) for c, (a, b, *_) in zip(calls, spans)):
            # the compiled layers, each row computed exactly as in a forward of its call alone
            pos = torch.cat([p.reshape(-1) for p in angles])
            h = self.fused.run_many(h[0], [c.cache.keys for c in calls], [c.cache.values for c in calls],
                                    self.rope_cos[pos].contiguous(), self.rope_sin[pos].contiguous(),
                                    [s[2] for s in spans], [s[1] - s[0] for s in spans],
                                    [None if m is None else m.reshape(m.shape[-2], -1).contiguous()
                                     for *_, m in spans])[None]
        else:
            cos, sin = self.rope(torch.cat(angles))
            for i, block in enumerate(cast(Sequence[Block], self.blocks)):
                h = block.around(h, partial(_attend_each, block.attn, i, calls, spans, cos, sin))
        hidden = self.final_norm(h)
        pieces = [hidden[:, a:b] for a, b, *_ in spans]
        selected = [p if c.logits_at is None else p[:, c.logits_at] for c, p in zip(calls, pieces)]
        logits = self.lm_head(torch.cat(selected, dim=1)).split([s.shape[1] for s in selected], dim=1)
        outs = []
        for c, (a, b, start, *_), piece, lg in zip(calls, spans, pieces, logits):
            c.cache.length = start + b - a
            outs.append(ForwardOutput(logits=lg, hidden=piece, start=start))
        return outs

    def _mask(self, mask: torch.Tensor | None, start: int, T: int, positions: torch.Tensor) -> torch.Tensor | None:
        """The attention mask of ``T`` new tokens after ``start`` cached ones: ``mask``, or causal where none is
        given (and needed), with a sliding window's limit applied."""
        window = self.cfg.sliding_window
        if mask is None and (T > 1 or (window and start + T > window)):
            mask = causal_mask(start, T, positions.device)
        if mask is not None and window:
            mask = apply_sliding_window(mask, positions, start, window)
        return mask


def fused_applies(h: torch.Tensor, cache: KVCache) -> bool:
    """Whether the compiled layers can run these blocks: one sequence of at most ``FUSED_MAX_TOKENS`` new fp32
    tokens on a CPU, no gradient wanted, and an fp32 cache laid out as they read it."""
    return (h.dim() == 3 and h.shape[0] == 1 and 0 < h.shape[1] <= FUSED_MAX_TOKENS and h.dtype == torch.float32
            and h.device.type == "cpu" and not (torch.is_grad_enabled() and h.requires_grad)
            and cache.keys.dtype == torch.float32 and cache.keys.is_contiguous() and cache.values.is_contiguous())


def _attend_each(attn: Attention, layer: int, calls: Sequence[Call], spans: Sequence[tuple[Any, ...]],
                 cos: torch.Tensor, sin: torch.Tensor, qkv: torch.Tensor) -> torch.Tensor:
    """:meth:`Transformer.forward_many`'s attention in block ``layer``: the joint ``qkv`` rotated at once (each
    column by its own position), then each call's columns attend to its own cache, with its own mask."""
    q, k, v = attn.rotate(qkv, cos, sin)
    return torch.cat([attn.attend_rotated(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], c.cache.keys[layer],
                                          c.cache.values[layer], start, mask)
                      for c, (a, b, start, mask) in zip(calls, spans)], dim=1)


# New tokens per block pass in a causal forward, by device type. On this CPU (2 cores, SmolLM2) an
# 8,000-token prefill took 37 s in one pass, 22 s in chunks of 256 (no faster in 128 or 1,024) and held
# 24 MiB of activations instead of 441 (docs/experiments/2026-11-28-long-prompts-chunked-prefill.md).
# Elsewhere (a GPU, not measured here) larger chunks keep the device busy while still bounding the mask and activations.
PREFILL_CHUNKS = {"cpu": 256}
DEFAULT_PREFILL_CHUNK = 2048


def prefill_chunk(device: torch.device) -> int:
    """How many new tokens a causal forward on ``device`` runs through the blocks at a time."""
    return PREFILL_CHUNKS.get(device.type, DEFAULT_PREFILL_CHUNK)


def causal_mask(prefix: int, T: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """``[T, prefix+T]``: every new token sees the whole prefix and the new tokens before it."""
    mask = torch.ones(T, prefix + T, dtype=torch.bool, device=device)
    mask[:, prefix:] = torch.ones(T, T, dtype=torch.bool, device=device).tril()
    return mask


def tree_mask(prefix: int, ancestors: torch.Tensor) -> torch.Tensor:
    """``[T, prefix+T]`` from a ``[T, T]`` matrix where ``ancestors[i, j]`` says j is i or an ancestor of i."""
    T = ancestors.shape[0]
    mask = torch.ones(T, prefix + T, dtype=torch.bool, device=ancestors.device)
    mask[:, prefix:] = ancestors
    return mask


def apply_sliding_window(mask: torch.Tensor, positions: torch.Tensor, start: int, window: int) -> torch.Tensor:
    """Hide keys ``window`` or more positions behind each query (Mistral).

    Cached positions are contiguous (``0..start-1``) because trees are compacted to
    their accepted path before the next forward.
    """
    q_pos = positions if positions.dim() == 1 else positions[0]
    key_pos = torch.cat([torch.arange(start, device=mask.device), q_pos])
    return mask & (q_pos[:, None] - key_pos[None, :] < window)
