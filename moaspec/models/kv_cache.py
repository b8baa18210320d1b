"""A preallocated per-layer KV cache whose rollback is O(1).

Speculative decoding writes K/V for drafted tokens that are then rejected, so the
cache must forget a suffix cheaply (``truncate`` only moves the length marker) and,
after tree verification, keep only the accepted path (``compact`` moves those few
rows into place). Memory is allocated once, as in gpt-fast, so decoding allocates
nothing per step.
"""

from __future__ import annotations

import torch

from moaspec.models.config import ModelConfig


class KVCache:
    """Keys and values of ``layers`` layers: ``[layers, batch, kv_heads, capacity, head_dim]``.

    Keys are stored after RoPE, as the attention consumes them. Every batch row shares
    one length; rows that should not see some positions (left padding) are handled by
    the attention mask, not by the cache.
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        batch_size: int = 1,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (num_layers, batch_size, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.length = 0

    @classmethod
    def for_model(
        cls, cfg: ModelConfig, capacity: int, batch_size: int = 1, dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> KVCache:
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, capacity, batch_size, dtype, device)

    @property
    def num_layers(self) -> int:
        return self.keys.shape[0]

    @property
    def capacity(self) -> int:
        return self.keys.shape[3]

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def reset(self) -> None:
        self.length = 0

    def check_room(self, new: int) -> None:
        """Refuse ``new`` positions that would not fit after the cached ones (before any of them is written)."""
        if self.length + new > self.capacity:
            raise ValueError(f"cache overflow: {self.length} cached + {new} new > capacity {self.capacity}")

    def truncate(self, length: int) -> None:
        """Forget every position from ``length`` on (O(1): stale rows are overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot truncate a cache of length {self.length} to {length}")
        self.length = length

    def compact(self, start: int, keep: torch.Tensor) -> None:
        """Keep, in order, the positions ``start + keep`` and drop the rest after ``start``.

        After a tree verification the accepted path is scattered through the tree's
        block; this moves its rows to ``start, start+1, ...`` in place.
        """
        keep = keep.to(device=self.keys.device, dtype=torch.long)
        n = keep.numel()
        src = start + keep
        if n and not torch.equal(src, torch.arange(start, start + n, device=src.device)):
            self.keys[:, :, :, start : start + n] = self.keys.index_select(3, src)
            self.values[:, :, :, start : start + n] = self.values.index_select(3, src)
        self.length = start + n

    def load_prefix(self, keys: torch.Tensor, values: torch.Tensor, n: int) -> None:
        """Begin with the first ``n`` positions of ``keys``/``values`` (another cache's, or a stored copy), nothing after."""
        self.keys[:, :, :, :n] = keys[:, :, :, :n]
        self.values[:, :, :, :n] = values[:, :, :, :n]
        self.length = n

    def token_kv(self, start: int, end: int) -> torch.Tensor:
        """Per-token view of every layer's K and V: ``[batch, end-start, layers, 2*kv_heads*head_dim]``.

        This is the input layout of the MoA drafter's Layer Self-Attention: one "layer
        token" per layer holding that layer's key and value for the token.
        """
        k = self.keys[:, :, :, start:end]  # [L, B, H, T, D]
        v = self.values[:, :, :, start:end]
        kv = torch.cat([k, v], dim=2)  # [L, B, 2H, T, D]
        L, B, H2, T, D = kv.shape
        return kv.permute(1, 3, 0, 2, 4).reshape(B, T, L, H2 * D)

    def put_token_kv(self, start: int, kv: torch.Tensor) -> None:
        """The inverse of :meth:`token_kv`: write ``kv`` ``[batch, T, layers, 2*kv_heads*head_dim]`` at
        positions ``start..start+T-1`` and make the cache end there.

        How K/V computed elsewhere (the target's, sent to a client or read in training)
        fill a cache of the last few layers that Target Layer Inference attends to.
        """
        L, B, H, _, D = self.keys.shape
        T = kv.shape[1]
        k, v = kv.reshape(B, T, L, 2, H, D).permute(3, 2, 0, 4, 1, 5).to(self.keys.dtype)  # 2 × [L, B, H, T, D]
        self.keys[:, :, :, start : start + T], self.values[:, :, :, start : start + T] = k, v
        self.length = start + T
