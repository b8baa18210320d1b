"""The Mixture of Attentions drafter (Zimmer et al., ICLR 2025; DESIGN-FACTS §1).

Data flow for one drafted position ``j``::

    target K/V of every layer, per verified token i ──LSA──► mean over layers ──proj──► memory[i]
    token embeddings x_0..x_j ──SA (causal, own cache)──► s_j
    s_j ──CA over memory[i], i < start of the drafting cycle──► f_j
    N = 0: f_j ≈ target's final hidden h_j      → lm_head → draft logits for x_{j+1}
    N > 0: f_j ≈ target's state after layer L−N → target's last N layers → final norm → lm_head

The memory holds only tokens the target has verified, so the drafter drafts several
tokens ahead without any target activation for them (T-step bounded). The drafter
owns only LSA, its projection, SA and CA; the embedding table, the last N layers, the
final norm and ``lm_head`` are the target's, borrowed by reference and never saved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

import torch
from torch import nn

from moaspec.drafters.layers import DecoderLayer, RMSNorm
from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.packed_linear import Linear, pack_linears
from moaspec.models.transformer import Transformer, rope_tables


@dataclass(frozen=True)
class MoAConfig:
    """Architecture of a MoA drafter; the first block of fields is fixed by the target."""

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
    sa_mlp: int = 1536
    ca_mlp: int = 1536
    lsa_width: int = 192  # LSA runs at this width; the K/V of each layer are projected to it first
    lsa_heads: int = 3
    lsa_kv_heads: int = 1
    lsa_head_dim: int = 64
    lsa_mlp: int = 384
    tli_layers: int = 0  # N: how many of the target's last layers run on the drafter's prediction
    draft_vocab_size: int = 0  # 0 = the target's whole vocabulary

    @classmethod
    def for_target(cls, cfg: ModelConfig, **sizes: Any) -> "MoAConfig":
        """Defaults sized from the target: SA/CA as wide as the target's blocks.

        LSA processes L "layer tokens" for every verified token, so in training it costs
        L times a token-level layer; it runs at half the K/V width (rounded to 64-wide
        heads, MLP twice as wide), which on SmolLM2 cuts the drafter's training cost by
        half against full width. ``sizes`` overrides any of these.
        """
        kv_width = 2 * cfg.kv_dim
        lsa_width = max(64, kv_width // 2 // 64 * 64)
        heads = lsa_width // 64
        defaults: dict[str, Any] = dict(
            heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            sa_mlp=cfg.intermediate_size, ca_mlp=cfg.intermediate_size,
            lsa_width=lsa_width, lsa_heads=heads, lsa_kv_heads=next(k for k in (4, 2, 1) if heads % k == 0 and k <= heads),
            lsa_head_dim=64, lsa_mlp=2 * lsa_width,
        )
        defaults.update({k: v for k, v in sizes.items() if v is not None})
        return cls(
            hidden_size=cfg.hidden_size, num_target_layers=cfg.num_layers, target_kv_width=kv_width,
            vocab_size=cfg.vocab_size, rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings, **defaults,
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MoAConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown MoA config fields: {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def check_target(self, cfg: ModelConfig) -> None:
        """Raise ValueError naming the first shape in which ``cfg`` differs from the drafter's target."""
        expected = {
            "hidden size": (self.hidden_size, cfg.hidden_size),
            "number of layers": (self.num_target_layers, cfg.num_layers),
            "K/V width per layer": (self.target_kv_width, 2 * cfg.kv_dim),
            "vocabulary size": (self.vocab_size, cfg.vocab_size),
        }
        for what, (mine, theirs) in expected.items():
            if mine != theirs:
                raise ValueError(f"the drafter expects a target with {what} {mine}, this target has {theirs}")
        if not 0 <= self.tli_layers < cfg.num_layers:
            raise ValueError(f"tli_layers must be in 0..{cfg.num_layers - 1}, got {self.tli_layers}")


@dataclass
class MoAState:
    """Per-sequence inference state: SA's cache of token K/V and CA's keys/values of the memory.

    ``sa.length`` tokens have SA entries (rolled back with the target's cache);
    ``memory.length`` tokens are verified and in the memory (append-only).
    """

    sa: KVCache
    memory: KVCache


class MoADrafter(nn.Module):
    def __init__(self, cfg: MoAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.lsa_in = Linear(cfg.target_kv_width, cfg.lsa_width, bias=False)
        self.lsa = DecoderLayer(cfg.lsa_width, cfg.lsa_heads, cfg.lsa_kv_heads, cfg.lsa_head_dim, cfg.lsa_mlp, eps)
        self.lsa_proj = Linear(cfg.lsa_width, d, bias=False)
        self.memory_norm = RMSNorm(d, eps)
        self.sa = DecoderLayer(d, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.sa_mlp, eps)
        self.ca = DecoderLayer(d, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ca_mlp, eps, source_dim=d)
        self.out_norm = RMSNorm(d, eps) if cfg.tli_layers == 0 else None
        if cfg.draft_vocab_size:
            self.register_buffer("draft_vocab", torch.arange(cfg.draft_vocab_size))
        else:
            self.draft_vocab = None
        lcos, lsin = rope_tables(cfg.lsa_head_dim, cfg.num_target_layers, 10000.0)
        self.register_buffer("layer_cos", lcos[None, None], persistent=False)
        self.register_buffer("layer_sin", lsin[None, None], persistent=False)
        cos, sin = rope_tables(cfg.head_dim, cfg.max_positions, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self._borrowed: dict[str, Any] = {}

    # --- the target's parts, borrowed -------------------------------------------------

    def attach(self, target: Transformer, vocab_limit: int | None = None) -> None:
        """Borrow the target's embeddings, last N layers, final norm and (sliced) ``lm_head``.

        Call after moving both models to their device and dtype. The head is a copy of
        the draft-vocabulary rows only (the whole head when no draft vocabulary is set),
        prepacked for fast CPU inference. The draft vocabulary is stored most frequent
        first, so ``vocab_limit`` keeps a smaller, faster head without retraining.
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
        head.weight = nn.Parameter(weight.clone(), requires_grad=False)
        self._borrowed = {"target": target, "head": head}
        pack_linears(head, not self.training)

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

    def head(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits over the draft vocabulary (or the whole vocabulary)."""
        return self._borrowed["head"](features)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_vocab is None else self.draft_vocab[draft_ids]

    def train(self, mode: bool = True) -> "MoADrafter":
        super().train(mode)
        pack_linears(self, not mode)  # packed weights are stale once training changes them
        if "head" in self._borrowed:
            pack_linears(self._borrowed["head"], not mode)
        return self

    # --- pieces shared by training and inference ----------------------------------------

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pos = positions if positions.dim() == 2 else positions[None]
        dtype = self.lsa_proj.weight.dtype
        return self.rope_cos[pos][:, None].to(dtype), self.rope_sin[pos][:, None].to(dtype)

    def memory(self, token_kv: torch.Tensor) -> torch.Tensor:
        """Layer Self-Attention: ``[B, T, L, kv_width]`` per-layer K/V → ``[B, T, d]`` memory entries."""
        B, T, L, W = token_kv.shape
        x = self.lsa_in(token_kv.reshape(B * T, L, W).to(self.lsa_proj.weight.dtype))
        x = self.lsa.self_attention(x, self.layer_cos, self.layer_sin, mask=None)
        return self.memory_norm(self.lsa_proj(x.mean(dim=1))).view(B, T, -1)

    def predict(self, s: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mem_k: torch.Tensor,
                mem_v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Cross-Attention from SA outputs onto the memory: the predicted target state."""
        f = self.ca.cross_attention(s, cos, sin, mem_k, mem_v, mask)
        return self.out_norm(f) if self.out_norm is not None else f

    def run_tli(self, state: torch.Tensor, cache: KVCache, positions: torch.Tensor, mask: torch.Tensor | None,
                cache_layer_offset: int = 0) -> torch.Tensor:
        """Target Layer Inference: the target's last N layers, then its final norm, on predicted states."""
        target = self.target
        first = target.cfg.num_layers - self.cfg.tli_layers
        h, _ = target.run_blocks(state, cache, positions, mask, first=first, cache_layer_offset=cache_layer_offset)
        return target.final_norm(h)

    # --- training -----------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, token_kv: torch.Tensor, sa_mask: torch.Tensor,
                ca_mask: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass over whole sequences: predicted states ``[B, S, d]`` for every position.

        ``sa_mask``/``ca_mask`` are bool ``[B, S, S]`` (see :mod:`moaspec.training.masks`).
        For N > 0 the result is the predicted state after layer L−N; the trainer runs
        :meth:`run_tli` on it with the target's true states of those layers.
        """
        S = tokens.shape[1]
        cos, sin = self.rope(torch.arange(S, device=tokens.device))
        s = self.sa.self_attention(self.target.embed(tokens).to(cos.dtype), cos, sin, sa_mask)
        mem_k, mem_v = self.ca.attn.keys_values(self.memory(token_kv), cos, sin)
        return self.predict(s, cos, sin, mem_k, mem_v, ca_mask)

    # --- inference ----------------------------------------------------------------------

    def new_state(self, capacity: int, batch_size: int = 1) -> MoAState:
        dtype, device = self.lsa_proj.weight.dtype, self.lsa_proj.weight.device
        sa = KVCache(1, self.cfg.kv_heads, self.cfg.head_dim, capacity, batch_size, dtype, device)
        memory = KVCache(1, self.cfg.kv_heads, self.cfg.head_dim, capacity, batch_size, dtype, device)
        return MoAState(sa=sa, memory=memory)

    @torch.inference_mode()
    def observe(self, state: MoAState, target_cache: KVCache, verified: int) -> None:
        """Add the tokens verified since the last call (up to position ``verified``) to the memory."""
        start = state.memory.length
        if verified <= start:
            return
        mem = self.memory(target_cache.token_kv(start, verified))
        cos, sin = self.rope(torch.arange(start, verified, device=mem.device))
        k, v = self.ca.attn.keys_values(mem, cos, sin)
        state.memory.keys[0, :, :, start:verified] = k
        state.memory.values[0, :, :, start:verified] = v
        state.memory.length = verified

    @torch.inference_mode()
    def step(self, state: MoAState, tokens: torch.Tensor, positions: torch.Tensor, sa_mask: torch.Tensor | None,
             outputs: int, target_cache: KVCache | None = None, tli_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Feed ``tokens`` ``[B, T]`` to SA and return draft logits ``[B, outputs, K]`` for the last ``outputs`` of them.

        SA entries go to ``state.sa`` from its current length on (the caller truncates it
        on rollback); ``sa_mask`` is bool ``[T, sa.length + T]`` (``None``: causal).
        Every output position sees the whole memory. With N > 0 the predicted states run
        through the target's last N layers, whose K/V for these positions are written into
        ``target_cache`` at ``target_cache.length``; ``tli_mask`` ``[outputs, length + outputs]``
        (``None``: causal) says which of them each output sees.
        """
        start = state.sa.length
        T = tokens.shape[1]
        cos, sin = self.rope(positions)
        x = self.target.embed(tokens).to(cos.dtype)
        if sa_mask is None and T > 1:
            sa_mask = torch.ones(T, start + T, dtype=torch.bool, device=tokens.device).tril(start)
        s = self.sa.self_attention(x, cos, sin, sa_mask, cache=(state.sa.keys[0], state.sa.values[0], start))
        state.sa.length = start + T
        n = state.memory.length
        mem_k, mem_v = state.memory.keys[0, :, :, :n], state.memory.values[0, :, :, :n]
        out_cos, out_sin = cos[:, :, T - outputs :], sin[:, :, T - outputs :]
        f = self.predict(s[:, T - outputs :], out_cos, out_sin, mem_k, mem_v, None)
        if self.cfg.tli_layers:
            if target_cache is None:
                raise ValueError("a drafter with Target Layer Inference needs the target's cache")
            f = self.run_tli(f, target_cache, positions[..., T - outputs :], tli_mask)
        return self.head(f)
