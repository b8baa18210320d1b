"""A GGUF target's decoder layers in one compiled call, for the few new tokens of a step or a verification.

Once the products read the file's 4-bit blocks (:mod:`moaspec.models.block_kernel`), a one-token step of
SmolLM2-135M on a 2-core CPU spends more time in the ~30 small torch operations per layer around them
(norms, rotations, cache writes, attention, SwiGLU: microseconds of dispatch each, for a few hundred floats
of work) than in the products (``benchmarks/forward_breakdown.py``). ``decode_layers.cpp`` runs all of a
layer in C++ around the same block products, in fp32.

It also makes greedy speculation exact by construction: each token's values are computed by the same loops
in the same order however many tokens a forward carries (attention sums each token's visible keys in cache
order, gathered first, so a tree's ancestors sum as a chain's keys do), so a verification scores every
token bitwise as a step of plain decoding does (``tests/test_fused_layers.py``).

Used by :meth:`Transformer.run_blocks` for forwards of one sequence and at most :data:`FUSED_MAX_TOKENS`
new tokens, where every product of the model reads blocks; larger forwards (prefill) keep the torch path.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

import torch

from moaspec.models.block_kernel import kernel
from moaspec.models.packed_linear import BLOCK_MAX_ROWS, Linear

if TYPE_CHECKING:
    from moaspec.models.transformer import Block, Transformer

FUSED_MAX_TOKENS = BLOCK_MAX_ROWS  # the products inside read blocks up to this many rows


def fuse_layers(model: Transformer) -> Any | None:
    """The compiled layers of ``model`` (``decode_layers.cpp``'s ``Layers``), or ``None`` where they do not apply:
    no kernel, a product without blocks, or a layer the C++ loop does not implement (Qwen3's query/key norms)."""
    module = kernel()
    if module is None or model.cfg.qk_norm:
        return None
    tensors: list[torch.Tensor] = []
    bits: list[int] = []
    for block in cast("list[Block]", list(model.blocks)):
        linears = cast(list[Linear], [block.attn.qkv, block.attn.o, block.mlp.gate_up, block.mlp.down])
        if any(lin.blocks is None or (lin is not block.attn.qkv and lin.bias is not None) for lin in linears):
            return None
        for lin in linears:
            assert lin.blocks is not None
            tensors += [lin.blocks.codes, lin.blocks.scales, lin.blocks.offsets]
            bits.append(lin.blocks.bits)
        bias = block.attn.qkv.bias
        tensors += [block.attn_norm.detach(), block.mlp_norm.detach(),
                    torch.empty(0) if bias is None else bias.detach()]
    cfg = model.cfg
    return module.Layers(tensors, bits, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, False)


@contextmanager
def torch_layers(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, the targets in ``model`` run their layers as torch operations around the same products
    (benchmarks compare both in one process)."""
    from moaspec.models.transformer import Transformer

    held = {m: m.fused for m in model.modules() if isinstance(m, Transformer) and m.fused is not None}
    for m in held:
        m.fused = None
    try:
        yield
    finally:
        for m, layers in held.items():
            m.fused = layers
