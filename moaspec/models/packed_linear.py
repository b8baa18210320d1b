"""A linear layer that runs inference on oneDNN's prepacked weights when it can.

Decoding a small model on a CPU is memory-bound matrix–vector work, and the default
``F.linear`` path (MKL sgemm on a ``[out, in]`` matrix) reaches about half the machine's
memory bandwidth for 1 row and less for the 2–64 rows of a verification. Reordering each
weight once into oneDNN's blocked layout — what ``torch.compile``'s CPU freezing does
behind the scenes — measured here: 30 layers of SmolLM2 for 1 token in 16 ms instead of
35 ms, 4 tokens in 13 ms instead of 48 ms, and ``lm_head`` for 1 token in 3.5 ms
instead of 9.4 ms. The dense weight stays the parameter (state dicts, training and
gradient flow are unchanged); the packed copy is used only when no gradient is needed.

On some CPUs oneDNN's kernel for a single row streams the weights more slowly than its
kernel for a few rows (BENCHMARKS.md, "Forward cost by number of new tokens": 4 tokens
cheaper than 1), so a 1-row product, a decoding or drafting step, is then computed as
row 0 of a zero-padded block of ``PAD_ROWS`` rows. Whether it pays is measured once per
process on the first large model packed (:func:`measure_single_row_padding`).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

PAD_ROWS = 4
_MEASURE_BYTES = 32 * 2**20  # smaller models fit in cache: their timings say nothing of decoding's
_pad_single_row: bool | None = None  # None: not measured yet (no padding)


def bf16_kernels() -> bool:
    """Whether this build's oneDNN has bf16 CPU kernels (AVX-512 or newer): packed bf16 weights then halve
    the bytes a memory-bound product streams."""
    return torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def packing_supported(weight: torch.Tensor) -> bool:
    """oneDNN prepacking exists for fp32 CPU tensors in builds with mkldnn, and for bf16 ones where it has
    bf16 kernels."""
    return (
        weight.device.type == "cpu"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and bf16_kernels()))
    )


def _packed_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` plus an optional inference-only prepacked copy of its weight."""

    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Prepack the current weight; call again after the weight changes."""
        if packing_supported(self.weight) and self.weight.device.type != "meta":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def unpack(self) -> None:
        self.packed = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # activations of the weight's dtype only: under CPU autocast (bf16) F.linear casts as autocast wants
        if (self.packed is not None and x.dtype == self.weight.dtype and not torch.is_autocast_enabled(x.device.type)
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            # the padding was measured on fp32 weights; oneDNN's bf16 1-row kernel is the faster one here
            if _pad_single_row and x.dtype == torch.float32 and x.numel() == self.in_features:
                padded = x.new_zeros(PAD_ROWS, self.in_features)
                padded[0] = x.reshape(-1)
                return _packed_product(padded, self.packed, self.bias)[:1].reshape(*x.shape[:-1], self.out_features)
            return _packed_product(x.contiguous(), self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def set_single_row_padding(enable: bool | None) -> bool | None:
    """Force the 1-row padding on or off for this process (``None``: measure again at the next large pack);
    returns the setting it replaces."""
    global _pad_single_row
    previous, _pad_single_row = _pad_single_row, enable
    return previous


def measure_single_row_padding(linears: list[Linear], repeats: int = 3) -> bool:
    """Time one 1-row product through every packed weight, as is and padded to ``PAD_ROWS`` rows (interleaved,
    medians of ``repeats``), and keep the padding when it is at least 5% faster. About 0.2 s for a 135M model."""
    xs = {m.in_features: torch.randn(PAD_ROWS, m.in_features) for m in linears}

    def one_pass(rows: int) -> float:
        t0 = time.perf_counter()
        for m in linears:
            assert m.packed is not None
            _packed_product(xs[m.in_features][:rows], m.packed, None)
        return time.perf_counter() - t0

    times: dict[int, list[float]] = {1: [], PAD_ROWS: []}
    with torch.inference_mode():
        for _ in range(repeats):
            for rows, ts in times.items():
                ts.append(one_pass(rows))
    return statistics.median(times[PAD_ROWS]) < 0.95 * statistics.median(times[1])


def pack_linears(module: nn.Module, enable: bool = True) -> None:
    """Prepack every :class:`Linear` inside ``module`` (a no-op off CPU, or for dtypes oneDNN cannot pack); ``enable=False`` drops the packs.

    The first time a module with at least 32 MB of packed weights is packed, the 1-row padding is measured
    on its weights and kept for the process."""
    global _pad_single_row
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    for m in linears:
        m.pack() if enable else m.unpack()
    packed = [m for m in linears if m.packed is not None and m.weight.dtype == torch.float32]
    if _pad_single_row is None and sum(m.weight.nbytes for m in packed) >= _MEASURE_BYTES:
        _pad_single_row = measure_single_row_padding(packed)
