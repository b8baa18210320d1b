"""The Mixture of Attentions drafter (Zimmer et al., ICLR 2025; DESIGN-FACTS §1).

Data flow for one drafted position ``j``::

    target K/V of every layer, per verified token i ──LSA──► mean over layers ──proj──► memory[i]
    (optional, beyond the paper: + a projection of the target's final state of token i)
    token embeddings x_0..x_j ──SA (causal, own cache)──► s_j
    (optional, beyond the paper: s_j += a projection of memory[n], the newest entry position j may read)
    s_j ──CA over memory[i], i < start of the drafting cycle──► f_j
    N = 0: f_j ≈ target's final hidden h_j      → lm_head → draft logits for x_{j+1}
    N > 0: f_j ≈ target's state after layer L−N → target's last N layers → final norm → lm_head

The memory holds only tokens the target has verified, so the drafter drafts several
tokens ahead without any target activation for them (T-step bounded). The drafter
owns only LSA, its projection, SA and CA; the embedding table, the last N layers, the
final norm and ``lm_head`` are the target's, borrowed by reference and never saved.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moaspec.drafters.base import Drafter, DrafterConfig
from moaspec.drafters.layers import DecoderLayer, RMSNorm, check_widths
from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.packed_linear import Linear
from moaspec.models.transformer import Transformer, causal_mask, rope_tables

# "lsa": the paper's memory; "last-layer": the target's final states instead (the ablation without LSA);
# "lsa+final": both, summed (an extension: the newest entry then carries the target's own next-token state)
MEMORY_SOURCES = ("lsa", "last-layer", "lsa+final")
# Verified tokens whose memory entries are made in one pass. On SmolLM2 (2 CPU cores) an 8,000-token
# prompt's, all at once, took 4.2 s and held 1.1 GiB beside the target's prefill; 4,000 tokens' took
# 0.24 s in chunks of 128 (the same entries), 0.59 s in chunks of 512, 2.0 s at once
# (docs/experiments/2026-11-28-long-prompts-chunked-prefill.md)
LSA_CHUNK = 128


@dataclass(frozen=True)
class MoAConfig(DrafterConfig):
    """Architecture of a MoA drafter (SA/CA use the base's heads; LSA its own)."""

    sa_mlp: int = 1536
    ca_mlp: int = 1536
    lsa_width: int = 192  # LSA runs at this width; the K/V of each layer are projected to it first
    lsa_heads: int = 3
    lsa_kv_heads: int = 1
    lsa_head_dim: int = 64
    lsa_mlp: int = 384
    tli_layers: int = 0  # N: how many of the target's last layers run on the drafter's prediction
    memory_source: str = "lsa"  # one of MEMORY_SOURCES
    ca_reach: int = 15  # a CA query is rotated as if at most this many positions past the newest entry it reads
    newest_entry: bool = False  # beyond the paper: CA's input also carries the newest memory entry it may read
    derotate_keys: bool = False  # beyond the paper: LSA reads each layer's keys with their rotary position removed

    @classmethod
    def for_target(cls, cfg: ModelConfig, **sizes: Any) -> MoAConfig:
        """Defaults sized from the target: SA/CA as wide as the target's blocks.

        LSA processes L "layer tokens" for every verified token, so in training it costs
        L times a token-level layer. The paper runs it at the full K/V width of a layer
        token (DESIGN-FACTS §1); by default it runs here at half that (rounded to 64-wide
        heads, MLP twice as wide), which on SmolLM2 halves the drafter's training cost.
        ``sizes`` overrides any of these; a given ``lsa_width`` (a multiple of 64, or "full":
        a layer token's width, the paper's) sets LSA's heads and MLP from it.
        """
        token_width = 2 * cfg.kv_dim  # a layer token: one layer's K and V of one token
        if sizes.get("lsa_width") == "full":
            sizes = {**sizes, "lsa_width": max(64, token_width // 64 * 64)}
        check_widths(sizes, "sa_mlp", "ca_mlp", "lsa_width", "lsa_mlp")
        lsa_width = sizes.get("lsa_width") or max(64, token_width // 2 // 64 * 64)
        if lsa_width % 64:
            raise ValueError(f"the LSA width must be a multiple of 64 (its heads are 64 wide), got {lsa_width}")
        heads = lsa_width // 64
        defaults: dict[str, Any] = dict(
            sa_mlp=cfg.intermediate_size, ca_mlp=cfg.intermediate_size,
            lsa_width=lsa_width, lsa_heads=heads, lsa_kv_heads=next(k for k in (4, 2, 1) if heads % k == 0 and k <= heads),
            lsa_head_dim=64, lsa_mlp=2 * lsa_width,
        )
        defaults.update({k: v for k, v in sizes.items() if v is not None})
        return cls(**{**cls.target_fields(cfg), **defaults})

    def check_target(self, cfg: ModelConfig) -> None:
        super().check_target(cfg)
        if not 0 <= self.tli_layers < cfg.num_layers:
            raise ValueError(f"tli_layers must be in 0..{cfg.num_layers - 1}, got {self.tli_layers}")
        if self.memory_source not in MEMORY_SOURCES:
            raise ValueError(f"memory_source must be one of {', '.join(MEMORY_SOURCES)}, got {self.memory_source!r}")
        if self.derotate_keys and self.memory_source == "last-layer":
            raise ValueError("derotated keys are Layer Self-Attention's input, and a memory of last-layer states has no LSA")
        if self.ca_reach < 1:
            raise ValueError(f"ca_reach must be >= 1, got {self.ca_reach}")


@dataclass
class MoAState:
    """Per-sequence inference state: SA's cache of token K/V and CA's keys/values of the memory.

    ``sa.length`` tokens have SA entries (rolled back with the target's cache);
    ``memory.length`` tokens are verified and in the memory (append-only); ``latest``
    is the newest of those entries, ``[1, 1, d]`` (read by drafters with ``newest_entry``).
    """

    sa: KVCache
    memory: KVCache
    latest: torch.Tensor | None = None


class MoADrafter(Drafter):
    cfg: MoAConfig
    layer_cos: torch.Tensor  # buffers: LSA's rotary tables over layer indices
    layer_sin: torch.Tensor

    def __init__(self, cfg: MoAConfig) -> None:
        super().__init__(cfg)
        d, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.uses_lsa = cfg.memory_source != "last-layer"
        self.reads_final = cfg.memory_source != "lsa"
        if self.uses_lsa:
            self.lsa_in = Linear(cfg.target_kv_width, cfg.lsa_width, bias=False)
            self.lsa = DecoderLayer(cfg.lsa_width, cfg.lsa_heads, cfg.lsa_kv_heads, cfg.lsa_head_dim, cfg.lsa_mlp, eps)
        self.lsa_proj = Linear(cfg.lsa_width if self.uses_lsa else d, d, bias=False)
        self.final_proj: Linear | None = None
        if self.uses_lsa and self.reads_final:
            # starts at zero: a drafter trained without it computes the same memory until training uses it
            self.final_proj = Linear(d, d, bias=False)
            torch.nn.init.zeros_(self.final_proj.weight)
        self.memory_norm = RMSNorm(d, eps)
        self.sa = DecoderLayer(d, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.sa_mlp, eps)
        self.ca = DecoderLayer(d, cfg.heads, cfg.kv_heads, cfg.head_dim, cfg.ca_mlp, eps, source_dim=d, cross=True)
        self.out_norm = RMSNorm(d, eps) if cfg.tli_layers == 0 else None
        lcos, lsin = rope_tables(cfg.lsa_head_dim, cfg.num_target_layers, 10000.0)
        self.register_buffer("layer_cos", lcos[None, None], persistent=False)
        self.register_buffer("layer_sin", lsin[None, None], persistent=False)
        self.newest_proj: Linear | None = None
        if cfg.newest_entry:
            # EAGLE's first draft reads the target's state of the newest verified token in its residual stream;
            # MoA's CA reads its memory as a summary and leaves that entry nearly unread
            # (docs/experiments/2026-11-24-reading-the-newest-state.md), so
            # this hands it over directly. It is the same entry for every draft of a cycle: still T-step
            # bounded. Zero at first, so a warm start drafts exactly as the drafter it starts from; made last,
            # so that with the same seed every other weight starts as a plain drafter's.
            self.newest_proj = Linear(d, d, bias=False)
            torch.nn.init.zeros_(self.newest_proj.weight)

    def attach(self, target: Transformer, vocab_limit: int | None = None) -> None:
        held = target.cfg.num_layers - target.first_block
        if self.cfg.tli_layers > held:
            raise ValueError(f"the drafter runs the target's last {self.cfg.tli_layers} layers, and this copy of the "
                             f"target holds {held} (a client bundle made for another drafter? export one for this one)")
        super().attach(target, vocab_limit)

    def adapted(self, tli_layers: int | None = None, memory_source: str | None = None,
                newest_entry: bool | None = None, derotate_keys: bool | None = None) -> MoADrafter:
        """A copy with another N, with the final state added to its memory, with the newest memory entry
        added to CA's input, or reading keys without their rotation: a warm start for training.

        LSA, SA and CA build the drafter's picture of the context and carry over
        unchanged. A new N changes only what CA's output is compared with (the target's
        final state for N = 0, its state after layer L−N otherwise), and with it the
        output norm, which exists only for N = 0 and then starts as the target's final
        norm. Going from "lsa" to "lsa+final" adds the final state's projection at zero,
        and gaining ``newest_entry`` adds its projection at zero, so the copy drafts exactly
        as the original until training moves it. Gaining ``derotate_keys`` is the one change
        that is not exact: LSA's input projection then reads keys it learnt on rotated, so
        its slowly turning pairs (still nearly unrotated) carry over and the fast ones start
        over.
        Call on an attached drafter.
        """
        from dataclasses import replace

        target = self.target
        cfg = replace(self.cfg, tli_layers=self.cfg.tli_layers if tli_layers is None else tli_layers,
                      memory_source=memory_source or self.cfg.memory_source,
                      newest_entry=self.cfg.newest_entry if newest_entry is None else newest_entry,
                      derotate_keys=self.cfg.derotate_keys if derotate_keys is None else derotate_keys)
        cfg.check_target(target.cfg)
        if self.cfg.newest_entry and not cfg.newest_entry:
            raise ValueError("a drafter that reads the newest memory entry cannot continue as one that does not")
        if self.cfg.derotate_keys and not cfg.derotate_keys:
            raise ValueError("a drafter that reads keys without their rotation cannot continue as one that reads them rotated")
        if cfg.memory_source != self.cfg.memory_source and (self.cfg.memory_source, cfg.memory_source) != ("lsa", "lsa+final"):
            raise ValueError(f"a drafter with memory {self.cfg.memory_source!r} cannot continue as one with "
                             f"{cfg.memory_source!r} (only 'lsa' can gain the final state)")
        new = MoADrafter(cfg).to(device=self.lsa_proj.weight.device, dtype=self.weight_dtype)
        missing, unexpected = new.load_state_dict(self.state_dict(), strict=False)
        assert {k.split(".")[0] for k in missing + unexpected} <= {"out_norm", "final_proj", "newest_proj"}, \
            (missing, unexpected)
        if cfg.tli_layers != self.cfg.tli_layers:
            new.start_out_norm_from(target)
        new.attach(target)
        return new

    def start_norms_near_zero(self, std: float = 0.02) -> None:
        """Draw the gains of SA's, CA's and LSA's pre-norms and of the memory norm from N(0, std²), as the authors'
        ``_init_weights`` does (their ``initializer_range``, 0.02), instead of starting them at 1.

        Each residual branch then reads inputs scaled nearly to zero, so SA, CA and LSA start close to the
        identity and the drafter's first prediction is close to the token's own embedding. The memory norm
        is the counterpart of their CA norm, which normalises the memory as well as the queries; the output
        norm (N = 0) keeps the target's final norm, which the prediction is compared through.
        """
        norms = [self.sa.attn_norm, self.sa.mlp_norm, self.ca.attn_norm, self.ca.mlp_norm, self.memory_norm]
        if self.uses_lsa:
            norms += [self.lsa.attn_norm, self.lsa.mlp_norm]
        with torch.no_grad():
            for norm in norms:
                norm.weight.normal_(0.0, std)

    def start_out_norm_from(self, target: Transformer) -> None:
        """Start the output norm (N = 0 only) as the target's final norm: the prediction lives in its output space."""
        if self.out_norm is not None:
            self.out_norm.weight.data.copy_(target.norm.detach().to(self.out_norm.weight.dtype))

    # --- pieces shared by training and inference ----------------------------------------

    def memory(self, token_kv: torch.Tensor | None, final: torch.Tensor | None,
               positions: torch.Tensor | None = None) -> torch.Tensor:
        """Memory entries ``[B, T, d]`` of verified tokens.

        With LSA (the method), from ``token_kv``, every layer's K/V per token
        ``[B, T, L, kv_width]``, attended over the layer axis. The ablation without LSA
        reads ``final``, the target's final states ``[B, T, d]``, instead, as EAGLE does;
        "lsa+final" reads both. Each reads only what its memory source needs.
        ``positions`` ``[T]``: the tokens' positions (default ``0..T-1``, as in training),
        read by a drafter with ``derotate_keys``.
        """
        if not self.uses_lsa:
            assert final is not None
            return self.memory_norm(self.lsa_proj(final.to(self.weight_dtype)))
        assert token_kv is not None
        B, T, L, W = token_kv.shape
        # rotated, the keys' fast-turning pairs read as noise (docs/experiments/2026-11-25-lsa-keys-and-probes.md)
        if self.cfg.derotate_keys:
            token_kv = self.target.unrotated_keys(token_kv, torch.arange(T, device=token_kv.device) if positions is None
                                                  else positions)
        x = self.lsa_in(token_kv.reshape(B * T, L, W).to(self.weight_dtype))
        x = self.lsa.self_attention(x, self.layer_cos, self.layer_sin, mask=None)
        x = self.lsa_proj(x.mean(dim=1)).view(B, T, -1)
        if self.final_proj is not None:
            assert final is not None
            x = x + self.final_proj(final.to(self.weight_dtype))
        return self.memory_norm(x)

    def memory_entries(self, target_cache: KVCache, start: int, end: int, hidden: torch.Tensor | None) -> torch.Tensor:
        """Entries ``[end - start, d]`` for verified positions ``start..end-1`` from the target's cache and/or
        ``hidden``, the target's final states of (at least) the last of them (read without LSA or with "lsa+final")."""
        final = None
        if self.reads_final:
            if hidden is None or hidden.shape[0] < end - start:
                raise ValueError(f"a MoA drafter with memory {self.cfg.memory_source!r} needs the target's final "
                                 "states of the newly verified tokens")
            final = hidden[hidden.shape[0] - (end - start) :][None]
        # LSA reads each token's layers alone, so a long prompt's entries are made a chunk of tokens at a
        # time: its L layer tokens per token would otherwise hold L times a target layer's activations
        entries = []
        for a in range(start, max(end, start + 1), LSA_CHUNK):
            b = min(end, a + LSA_CHUNK)
            token_kv = target_cache.token_kv(a, b) if self.uses_lsa else None
            piece = None if final is None else final[:, a - start : b - start]
            entries.append(self.memory(token_kv, piece, torch.arange(a, b, device=target_cache.keys.device))[0])
        return entries[0] if len(entries) == 1 else torch.cat(entries)

    def predict(self, s: torch.Tensor, positions: torch.Tensor, newest: torch.Tensor | int, mem_k: torch.Tensor,
                mem_v: torch.Tensor, mask: torch.Tensor | None, latest: torch.Tensor | None) -> torch.Tensor:
        """Cross-Attention from SA outputs at ``positions`` onto the memory: the predicted target state.

        ``latest``: the newest entry each query may read, ``[B, Q or 1, d]`` (read with ``newest_entry``).

        ``newest``: the position of the newest memory entry each query may read. A query
        is rotated as if it stood at most ``ca_reach`` positions past it. Training's
        usual segments are at most that long (longer ones, ``--segment-long-fraction``,
        are bounded alike), so this changes nothing there or in ordinary drafting; it
        keeps a client that generates alone for many tokens (or a long pipelined
        chain) at query-to-memory distances training has shown, instead of ever larger
        ones that it never has.
        """
        limit = torch.as_tensor(newest + self.cfg.ca_reach, device=positions.device)
        cos, sin = self.rope(torch.minimum(positions, limit))
        if self.newest_proj is not None:
            assert latest is not None
            s = s + self.newest_proj(latest)
        f = self.ca.cross_attention(s, cos, sin, mem_k, mem_v, mask)
        return self.out_norm(f) if self.out_norm is not None else f

    def run_tli(self, state: torch.Tensor, cache: KVCache, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Target Layer Inference: the target's last N layers, then its final norm, on predicted states.

        ``cache`` holds either every target layer or only the last ``cache.num_layers`` of
        them (a client's, or training's): its K/V for the preceding positions are what
        these layers attend to.
        """
        target = self.target
        L = target.cfg.num_layers
        if cache.num_layers < self.cfg.tli_layers:
            raise ValueError(f"Target Layer Inference over {self.cfg.tli_layers} layers needs their caches; "
                             f"this cache holds {cache.num_layers}")
        # the target's layers run in its dtype, which a drafter drafting in bf16 beside an fp32 target does not share
        h, _ = target.run_blocks(state.to(target.dtype), cache, positions, mask, first=L - self.cfg.tli_layers,
                                 cache_layer_offset=L - cache.num_layers)
        return target.final_norm(h).to(self.weight_dtype)

    # --- training -----------------------------------------------------------------------

    def forward(self, tokens: torch.Tensor, token_kv: torch.Tensor, final: torch.Tensor, sa_mask: torch.Tensor,
                ca_mask: torch.Tensor) -> torch.Tensor:
        """Teacher-forced pass over whole sequences: predicted states ``[B, S, d]`` for every position.

        ``token_kv``/``final``: the target's features of the whole sequences (see :meth:`memory`);
        ``sa_mask``/``ca_mask`` are bool ``[B, S, S]`` (see :mod:`moaspec.training.masks`).
        For N > 0 the result is the predicted state after layer L−N; the trainer runs
        :meth:`run_tli` on it with the target's true states of those layers.
        """
        S = tokens.shape[1]
        positions = torch.arange(S, device=tokens.device)
        cos, sin = self.rope(positions)
        s = self.sa.self_attention(self.target.embed(tokens).to(cos.dtype), cos, sin, sa_mask)
        memory = self.memory(token_kv, final)
        mem_k, mem_v = self.ca.attn.keys_values(memory, cos, sin)
        newest = ca_mask.sum(-1) - 1  # the masks are prefixes: each query reads the memory before a limit
        latest = None
        if self.newest_proj is not None:  # a query that may read nothing (none in training's loss) gets zeros
            index = newest.clamp(min=0)[..., None].expand(-1, -1, memory.shape[-1])
            latest = memory.gather(1, index) * (newest >= 0)[..., None]
        return self.predict(s, positions, newest, mem_k, mem_v, ca_mask, latest)

    # --- inference ----------------------------------------------------------------------

    def new_state(self, capacity: int, batch_size: int = 1) -> MoAState:
        dtype, device = self.cache_dtype, self.lsa_proj.weight.device
        sa = KVCache(1, self.cfg.kv_heads, self.cfg.head_dim, capacity, batch_size, dtype, device)
        memory = KVCache(1, self.cfg.kv_heads, self.cfg.head_dim, capacity, batch_size, dtype, device)
        return MoAState(sa=sa, memory=memory)

    @torch.inference_mode()
    def observe(self, state: MoAState, target_cache: KVCache, verified: int, hidden: torch.Tensor | None = None) -> None:
        """Add the tokens verified since the last call (up to position ``verified``) to the memory.

        ``hidden``: the target's final states of the newly verified tokens (read when the memory source needs them).
        """
        start = state.memory.length
        if verified > start:
            self.remember(state, start, self.memory_entries(target_cache, start, verified, hidden))

    @torch.inference_mode()
    def remember(self, state: MoAState, start: int, entries: torch.Tensor) -> None:
        """Append memory ``entries`` ``[T, d]`` (LSA outputs) for positions ``start..start+T-1``.

        The split between :meth:`memory` and this is the client–server split: the server
        runs LSA next to the target's K/V and sends one d-sized entry per verified token.
        """
        if start != state.memory.length:
            raise ValueError(f"memory entries must continue at position {state.memory.length}, got {start}")
        end = start + entries.shape[0]
        cos, sin = self.rope(torch.arange(start, end, device=entries.device))
        k, v = self.ca.attn.keys_values(entries[None].to(self.weight_dtype), cos, sin)
        state.memory.keys[0, :, :, start:end] = k
        state.memory.values[0, :, :, start:end] = v
        state.memory.length = end
        state.latest = entries[None, -1:].to(self.weight_dtype)

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
        s = self.sa.self_attention(x, cos, sin, sa_mask, cache=(state.sa.keys[0], state.sa.values[0], start))
        state.sa.length = start + T
        n = state.memory.length
        mem_k, mem_v = state.memory.keys[0, :, :, :n], state.memory.values[0, :, :, :n]
        f = self.predict(s[:, T - outputs :], positions[..., T - outputs :], n - 1, mem_k, mem_v, None, state.latest)
        if self.cfg.tli_layers:
            if target_cache is None:
                raise ValueError("a drafter with Target Layer Inference needs the target's cache")
            if tli_mask is None and outputs > 1:
                tli_mask = causal_mask(target_cache.length, outputs, tokens.device)
            f = self.run_tli(f, target_cache, positions[..., T - outputs :], tli_mask)
        return self.head(f)
