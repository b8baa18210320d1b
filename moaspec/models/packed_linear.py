"""A linear layer that picks, per row count, the fastest CPU kernel this process measured.

Decoding a small model on a CPU is memory-bound matrix–vector work: each product streams
its whole weight for a handful of rows. Two kernels do it. ``F.linear`` (MKL sgemm on a
``[out, in]`` matrix) is quick for one to three rows on some CPUs and slow from four on;
oneDNN's prepacked weights (its blocked layout, what ``torch.compile``'s CPU freezing uses
behind the scenes) are far faster for the 4–64 rows of a verification (4 tokens: 13 ms
instead of 48 ms for SmolLM2's 30 layers, BENCHMARKS.md) but on some CPUs slower for one
row than for four, and on others slower than MKL for one to three rows (a fixed cost per
call shows on small matrices). So a product of 1 to ``PAD_ROWS - 1`` rows runs through
whichever of three kernels was fastest *for that row count*: MKL on the dense weight
("plain"), the packed weight ("packed"), or the packed weight on a zero-padded block of
``PAD_ROWS`` rows ("padded"); larger products always run packed. The
choice is measured once per process, with forwards of the first large model loaded
(:func:`measure_small_row_kernels`). The dense weight stays the parameter (state dicts,
training and gradient flow are unchanged); the packed copy is used only when no gradient
is needed.

A drafter's small products can also read an int8 copy of each weight (:meth:`Linear.quantize`):
a drafting step is the same memory-bound work on weights the target's forward has just
evicted from the caches, so half of bf16's bytes is what it saves. aten's int8 kernel
costs time in proportion to the rows, though (16 rows took as long as oneDNN's bf16
products, 256 rows 2.7 times as long), so products of more than
``INT8_MAX_ROWS`` rows, such as a drafter's pass over a prompt, keep the packed weight.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from moaspec.models.block_kernel import BlockWeights
from moaspec.models.block_kernel import product as block_product

Kernel = Literal["plain", "packed", "padded"]
KERNELS: tuple[Kernel, ...] = ("plain", "packed", "padded")
PAD_ROWS = 4
SMALL_ROWS = tuple(range(1, PAD_ROWS))  # row counts whose kernel is chosen by measurement
_MEASURE_BYTES = 32 * 2**20  # smaller models fit in cache: their timings say nothing of decoding's
_MARGIN = 0.97  # another kernel replaces the packed one only when at least 3% faster (timings are noisy)


@dataclass(frozen=True)
class SmallRowKernels:
    """The kernel for each row count in :data:`SMALL_ROWS` (``by_rows[rows - 1]``), for every fp32 weight."""

    by_rows: tuple[Kernel, ...]

    @classmethod
    def uniform(cls, kernel: Kernel) -> SmallRowKernels:
        """The same kernel for every small row count (tests and benchmarks force one so)."""
        return cls((kernel,) * len(SMALL_ROWS))

    def choose(self, rows: int) -> Kernel:
        return self.by_rows[rows - 1]


_kernels: SmallRowKernels | None = None  # None: not measured yet (every product runs packed)


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


def _padded_product(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x`` ``[rows, in]`` (rows < ``PAD_ROWS``) as the first rows of a zero-padded ``PAD_ROWS``-row block."""
    padded = x.new_zeros(PAD_ROWS, x.shape[-1])
    padded[: x.shape[0]] = x
    return _packed_product(padded, packed, bias)[: x.shape[0]]


INT8_MAX_ROWS = 8  # a drafting step's products in int8 took 0.37-0.42, 0.54, 0.83 and 0.98 times packed bf16's time
# for 1-4, 8, 12 and 16 rows, 2.7 times for 256 (benchmarks/int8_products.py, AMD EPYC)
INT8_COLUMNS = 32  # with bf16 activations aten's CPU int8 kernel was wrong for 1, 7, 8, 9 and 30 input columns, right for 16, 48, 96
INT8_ACTIVATIONS = torch.bfloat16  # the one activation dtype aten's int8 product is quick with (int8_supported)


def int8_kernels() -> bool:
    """Whether this torch build has aten's weight-only int8 CPU product."""
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def int8_supported(weight: torch.Tensor) -> bool:
    """Whether ``weight``'s products may read an int8 copy: aten's weight-only int8 product
    (``_weight_int8pack_mm``) on a CPU, with bf16 activations, for input widths that are a multiple of
    its vector width (for others it returned garbage or crashed).

    It also takes fp32 activations, but then a drafting step's products of 1 to 16 rows took 2 to 30
    times as long as on oneDNN's packed fp32 weights (an AVX-512 Intel Xeon,
    docs/experiments/2026-11-25-drafting-precision.md, "Int8 drafter weights on an Intel Xeon"), so fp32
    weights keep their float products. (torchao 0.18's int8 weight-only tensors took 2–3 times bf16's time
    for a drafting step's products; this kernel half of it.)"""
    return (
        weight.device.type == "cpu"
        and int8_kernels()
        and weight.dtype == INT8_ACTIVATIONS
        and weight.shape[1] % INT8_COLUMNS == 0
    )


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-row int8 weights and their scales (in the weight's dtype): ``weight ≈ q * scales[:, None]``."""
    w = weight.detach().float()
    scales = w.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / 127
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
    return q, scales.to(weight.dtype)


BLOCK_MAX_ROWS = 64  # products of up to this many rows read a GGUF target's blocks: every decoding step and
# verification (trees of 62 drafts included), so that plain and speculative decoding score each token with the same
# kernel; prefill's larger products keep oneDNN's packed fp32 weights, about twice as fast there


class Linear(nn.Linear):
    """``nn.Linear`` plus optional inference-only copies of its weight: prepacked for oneDNN, int8, or a GGUF
    file's own blocks (:mod:`moaspec.models.gguf_blocks`)."""

    packed: torch.Tensor | None = None
    int8: tuple[torch.Tensor, torch.Tensor] | None = None  # (weights, per-row scales), see int8_rows
    blocks: BlockWeights | None = None

    def pack(self) -> None:
        """Prepack the current weight; call again after the weight changes."""
        if packing_supported(self.weight) and self.weight.device.type != "meta":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())

    def unpack(self) -> None:
        self.packed = None
        self.int8 = None

    def quantize(self) -> None:
        """Products of at most ``INT8_MAX_ROWS`` rows read an int8 copy of the current weight, where supported;
        the parameter stays as it is (state dicts and fingerprints are unchanged)."""
        if int8_supported(self.weight):
            self.int8 = int8_rows(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # activations of the weight's dtype only: under CPU autocast (bf16) F.linear casts as autocast wants
        if ((self.packed is None and self.int8 is None and self.blocks is None) or x.dtype != self.weight.dtype
                or torch.is_autocast_enabled(x.device.type)
                or (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad))):
            return F.linear(x, self.weight, self.bias)
        rows = x.numel() // self.in_features
        if self.blocks is not None and rows <= BLOCK_MAX_ROWS and x.dtype == torch.float32:  # the kernel's is fp32
            y = block_product(x.reshape(rows, self.in_features).contiguous(), self.blocks)
            y = y if self.bias is None else y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.int8 is not None and rows <= INT8_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, self.in_features).contiguous(), *self.int8)
            y = y if self.bias is None else y + self.bias
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.packed is None:
            return F.linear(x, self.weight, self.bias)
        # measured on fp32 weights; oneDNN's bf16 kernels are the fastest for every row count here
        kernel = _kernels.choose(rows) if (
            _kernels is not None and rows < PAD_ROWS and x.dtype == torch.float32) else "packed"
        if kernel == "plain":
            return F.linear(x, self.weight, self.bias)
        flat = x.reshape(rows, self.in_features)
        y = _padded_product(flat, self.packed, self.bias) if kernel == "padded" else _packed_product(
            flat, self.packed, self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


def small_row_kernels() -> SmallRowKernels | None:
    """The kernels this process runs small fp32 products on (``None`` before any measurement: packed)."""
    return _kernels


def set_small_row_kernels(kernels: SmallRowKernels | None) -> SmallRowKernels | None:
    """Use ``kernels`` for this process's small products (``None``: measure again at the next large pack);
    returns the setting it replaces."""
    global _kernels
    previous, _kernels = _kernels, kernels
    return previous


def measure_small_row_kernels(forward: Callable[[int], None], repeats: int = 2) -> SmallRowKernels:
    """Time ``forward(rows)``, a forward of ``rows`` tokens through the packed model, under each kernel for 1
    and for ``PAD_ROWS - 1`` rows, and keep, per row count, the fastest when it beats the packed kernel by
    3%; rows in between take the choice made for ``PAD_ROWS - 1``.

    Whole forwards, not the products alone: timed alone, the products understated MKL's lead on the Intel
    Xeon of BENCHMARKS.md (6% against 12% in a forward), close enough to the margin that a process started
    beside a busy core chose wrongly. The settings alternate within each repeat, each forward's fastest
    of ``repeats`` counts (noise only adds). About 0.6 s for a 135M model on one thread, 0.35 s on two."""
    ends = (SMALL_ROWS[0], SMALL_ROWS[-1])
    # padding pays where oneDNN's 1-row kernel is the slow one; 3 rows padded to 4 cost what 1 row padded does
    runs = [(kernel, rows) for rows in ends for kernel in KERNELS if rows == 1 or kernel != "padded"]
    times: dict[tuple[Kernel, int], float] = dict.fromkeys(runs, float("inf"))
    previous = small_row_kernels()
    try:
        with torch.inference_mode():
            for _ in range(repeats):
                for kernel, rows in runs:
                    set_small_row_kernels(SmallRowKernels.uniform(kernel))
                    t0 = time.perf_counter()
                    forward(rows)
                    times[(kernel, rows)] = min(times[(kernel, rows)], time.perf_counter() - t0)
    finally:
        set_small_row_kernels(previous)

    def best(rows: int) -> Kernel:
        kernel = min((k for k in KERNELS if (k, rows) in times), key=lambda k: times[(k, rows)])
        return kernel if times[(kernel, rows)] < _MARGIN * times[("packed", rows)] else "packed"

    return SmallRowKernels((best(ends[0]),) + (best(ends[1]),) * (len(SMALL_ROWS) - 1))


PACK_ENV = "MOASPEC_PACK"  # "0": never prepack, "1": always, unset: when the copies fit in memory
PACK_HEADROOM = 2**30  # memory left for activations, caches and the rest of the process after packing


def available_memory() -> int:
    """Bytes of memory the system can give this process now without swapping."""
    import psutil  # deferred: only loads of CPU models need it

    return int(psutil.virtual_memory().available)


def packing_refused(module: nn.Module) -> str | None:
    """Why ``module``'s weights should not be prepacked, or ``None`` to pack them.

    A packed copy sits beside each dense weight (which stays the parameter), doubling a CPU
    target's weight memory: 0.5 GB more for SmolLM2, 13 GB more for a 3B model in fp32. Where that
    would leave under :data:`PACK_HEADROOM` free, decoding runs on the dense weights instead
    (slower for verifications of several tokens, BENCHMARKS.md) rather than driving the machine
    into swap or the kernel's OOM killer. ``MOASPEC_PACK`` overrides the check."""
    setting = os.environ.get(PACK_ENV, "")
    if setting == "0":
        return f"{PACK_ENV}=0"
    need = sum(m.weight.nbytes for m in module.modules() if isinstance(m, Linear) and packing_supported(m.weight))
    if setting == "1" or need == 0:
        return None
    free = available_memory()
    if need + PACK_HEADROOM > free:
        return (f"their packed copies would take {need / 2**30:.1f} GiB more and {free / 2**30:.1f} GiB is available; "
                f"{PACK_ENV}=1 packs them anyway")
    return None


def quantize_linears(module: nn.Module, enable: bool = True) -> None:
    """Give every :class:`Linear` inside ``module`` that supports it an int8 copy of its weight for small
    products; ``enable=False`` drops the copies (as :func:`pack_linears` with ``enable=False`` does too)."""
    for m in module.modules():
        if isinstance(m, Linear):
            if enable:
                m.quantize()
            else:
                m.int8 = None


def pack_linears(module: nn.Module, enable: bool = True, forward: Callable[[int], None] | None = None) -> None:
    """Prepack every :class:`Linear` inside ``module`` (a no-op off CPU, or for dtypes oneDNN cannot pack); ``enable=False`` drops the packs.

    The first time a module with at least 32 MB of packed fp32 weights is packed with a ``forward`` (a
    representative forward of a given number of tokens through it), the small-row kernels are measured
    with it and kept for the process."""
    linears = [m for m in module.modules() if isinstance(m, Linear)]
    for m in linears:
        m.pack() if enable else m.unpack()
    packed = [m for m in linears if m.packed is not None and m.weight.dtype == torch.float32]
    if small_row_kernels() is None and forward is not None and sum(m.weight.nbytes for m in packed) >= _MEASURE_BYTES:
        set_small_row_kernels(measure_small_row_kernels(forward))
