"""A drafter's products and layers on 8-bit copies of its weights, through the GGUF runtime's compiled CPU kernel.

Once a GGUF target's forward reads its 4-bit blocks (:mod:`moaspec.models.fused_layers`), a one-token step
costs about 13 ms on a 2-core AVX2 EPYC, and a MoA drafting step in torch about 4 ms: half of it in
streaming 47 MB of fp32 weights that the target's forward has just evicted from the caches, most of the rest
in the Python around the ~60 small operations of its two layers. Here each weight gets a Q8_0 copy (ggml's 8-bit blocks: a
quarter of the bytes, each weight within half a step of 1/127 of its block's largest), its products run
through :func:`moaspec.models.block_kernel.product` with fp32 activations, and its decoder layers through
``decode_layers.cpp`` in one call each. The drafter only proposes, so this can change which drafts the
target accepts, never the text.

Used for fp32 drafters beside a CPU target where the kernel builds (``--drafter-dtype int8`` there, and the
default on CPUs without bf16 kernels: :func:`moaspec.drafters.checkpoint.named_precision`); the parameters
stay as they are, and training drops the copies.
"""

from __future__ import annotations

from typing import Any, cast

import torch
from torch import nn

from moaspec.drafters.layers import DecoderLayer
from moaspec.models.block_kernel import BLOCK, BlockWeights, kernel
from moaspec.models.packed_linear import Linear


def blocks_supported(module: nn.Module) -> bool:
    """Whether ``module``'s products can read Q8_0 blocks: the kernel exists, and every weight is fp32 on the CPU
    with an input width in whole blocks."""
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    return kernel() is not None and all(
        m.weight.dtype == torch.float32 and m.weight.device.type == "cpu" and m.in_features % BLOCK == 0
        for m in linears)


def use_blocks(module: nn.Module, enable: bool) -> None:
    """Give (or, ``enable`` false, take away from) every linear layer of ``module`` a Q8_0 copy of its weight,
    and every decoder layer its compiled counterpart over those copies."""
    for m in module.modules():
        if isinstance(m, Linear):
            m.blocks = BlockWeights.q8_0(m.weight) if enable else None
    for m in module.modules():
        if isinstance(m, DecoderLayer):
            m.compiled = compile_layer(m) if enable else None


def compile_layer(layer: DecoderLayer) -> Any:
    """``decode_layers.cpp``'s ``Layers`` for one drafter layer whose linear layers hold blocks: q and kv stacked as
    the target's fused qkv (q alone for a cross-attention layer, whose keys and values come from elsewhere)."""
    attn, mlp = layer.attn, layer.mlp
    projections = [attn.q] if layer.cross else [attn.q, attn.kv]
    blocks = [lin.blocks for lin in (*projections, attn.o, mlp.gate_up, mlp.down)]
    if any(b is None for b in blocks):
        raise ValueError("give the layer's linear layers blocks first (use_blocks)")
    fused = len(projections)
    weights = [BlockWeights.stack(cast(list[BlockWeights], blocks[:fused])), *cast(list[BlockWeights], blocks[fused:])]
    tensors: list[torch.Tensor] = []
    for w in weights:
        tensors += [w.codes, w.scales, w.offsets]
    tensors += [layer.attn_norm.weight.detach().contiguous(), layer.mlp_norm.weight.detach().contiguous(), torch.empty(0)]
    module = kernel()
    assert module is not None
    return module.Layers(tensors, [w.bits for w in weights], attn.heads, attn.kv_heads, attn.head_dim,
                         layer.attn_norm.eps, layer.cross)
