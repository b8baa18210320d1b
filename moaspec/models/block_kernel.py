"""The compiled product of fp32 activations with GGUF block-quantised weights (``block_kernel.cpp``).

A small model decoded on a CPU is memory-bound: every step streams every weight. A GGUF file's
4-bit blocks are a sixth of the fp32 bytes, so reading them as they are, and rebuilding each weight in
registers exactly as the fp32 dequantisation does, makes a step several times cheaper without
rounding anything that fp32 would not (the C++ file's header says how). No library does that with
fp32 activations: llama.cpp and ONNX Runtime's int4 kernels round activations to 8 bits or
dequantise whole matrices per call, torch's int4 kernel wants bf16 activations.

The extension is compiled on first use with torch's own C++ extension tooling (ninja and the
system's C++ compiler) into the cache (``~/.cache/moaspec/kernels``) and reused from there. Where it cannot
be (no compiler, a CPU without AVX2/FMA), :func:`kernel` says why once and GGUF targets run on their
dequantised fp32 weights as before.
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from moaspec.models.sources import cache_root

SOURCES = [Path(__file__).with_name(n) for n in ("block_kernel.cpp", "decode_layers.cpp")]
HEADER = Path(__file__).with_name("block_kernel.h")
BLOCK = 32  # weights per block along the input dimension
FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off",  # no contraction: the .cpp's arithmetic is written out
         "-fopenmp"]  # at::parallel_for is OpenMP in torch's CPU builds, inlined here: without it, one thread
# (the extension then shares torch's own libgomp.so.1, already loaded, so both use one thread pool)


@dataclass(frozen=True)
class BlockWeights:
    """A weight ``[out, in]`` as blocks of 32 along ``in``: codes, and each block's scale ``d`` and offset ``m`` in
    fp16, as GGUF stores them, so that weight = d·q + m exactly. ``bits`` 4: two codes a byte (ggml's nibble
    order), 0..15; 8: one signed code a byte, and offsets of 0 (the kernel does not read them)."""

    bits: int
    codes: torch.Tensor  # uint8 [out, in / 32 * (16 or 32)]
    scales: torch.Tensor  # fp16 [out, in / 32]
    offsets: torch.Tensor  # fp16 [out, in / 32]

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8 or self.scales.dtype != torch.float16 or self.offsets.dtype != torch.float16:
            raise ValueError("blocks hold uint8 codes and fp16 scales and offsets")
        if self.bits == 8 and bool(self.offsets.any()):
            raise ValueError("8-bit blocks have no offset (Q8_0): their offsets must be 0")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * BLOCK

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    def dequantise(self) -> torch.Tensor:
        """The fp32 weight these blocks stand for (tests, and checks against a model's dense weights)."""
        out, blocks = self.scales.shape
        if self.bits == 4:
            lo, hi = self.codes.view(out, blocks, 16) & 0x0F, self.codes.view(out, blocks, 16) >> 4
            q = torch.cat([lo, hi], dim=-1).float()
        else:
            q = self.codes.view(torch.int8).view(out, blocks, BLOCK).float()
        return (q * self.scales.float()[..., None] + self.offsets.float()[..., None]).reshape(out, blocks * BLOCK)

    def rows(self, index: torch.Tensor) -> BlockWeights:
        """These blocks with their output rows reordered (or selected) by ``index``."""
        return BlockWeights(self.bits, self.codes[index].contiguous(), self.scales[index].contiguous(),
                            self.offsets[index].contiguous())

    @staticmethod
    def q8_0(weight: torch.Tensor) -> BlockWeights:
        """``weight`` ``[out, in]`` (``in`` a multiple of 32) as ggml's Q8_0 blocks: per block, d = max|w| / 127 stored
        in fp16, and q = round(w / d) with that stored d (ggml divides by the unrounded one), so that each weight is
        within d/2 of its own. For weights that do not come from a GGUF file (a drafter's)."""
        out, cols = weight.shape
        if cols % BLOCK:
            raise ValueError(f"Q8_0 blocks need an input width that is a multiple of {BLOCK}, got {cols}")
        w = weight.detach().float().reshape(out, cols // BLOCK, BLOCK)
        scales = (w.abs().amax(dim=-1) / 127).to(torch.float16)
        d = scales.float()
        inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
        codes = torch.round(w * inverse[..., None]).clamp(-127, 127).to(torch.int8).view(torch.uint8)
        return BlockWeights(8, codes.reshape(out, cols).contiguous(), scales, torch.zeros_like(scales))

    @staticmethod
    def stack(parts: list[BlockWeights]) -> BlockWeights:
        """Several weights of the same input width and code width, one above the other (a fused q/k/v)."""
        if len({p.bits for p in parts}) != 1:
            raise ValueError("fused weights must share their code width")
        return BlockWeights(parts[0].bits, torch.cat([p.codes for p in parts]).contiguous(),
                            torch.cat([p.scales for p in parts]).contiguous(),
                            torch.cat([p.offsets for p in parts]).contiguous())


_module: ModuleType | None = None
_why_not: str | None = None


def cpu_supported() -> str | None:
    """Why this CPU cannot run the kernel, or ``None``: it needs AVX2 and FMA (x86 CPUs since 2013–2015)."""
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if not capability.startswith(("AVX2", "AVX512")):
        return f"this CPU's vector capability is {capability}, and the kernel needs AVX2 with FMA"
    return None


def kernel() -> ModuleType | None:
    """The compiled extension, built once per source version and machine; ``None`` (said once, on stderr)
    where it cannot be built or run."""
    global _module, _why_not
    if _module is not None or _why_not is not None:
        return _module
    _why_not = cpu_supported()
    if _why_not is None:
        try:
            _module = build()
        except Exception as exc:  # a missing compiler or ninja raises many types: report it, run on fp32
            _why_not = f"it could not be built ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
    if _module is None:
        print(f"moaspec: GGUF targets run on dequantised fp32 weights: {_why_not}", file=sys.stderr)
    return _module


def build() -> ModuleType:
    """Compile (or load the cached build of) the extension; its name carries the source's and flags' digest,
    so an edited kernel is never confused with an old build."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    code = b"".join(p.read_bytes() for p in [*SOURCES, HEADER])
    digest = hashlib.sha256(code + " ".join(FLAGS).encode() + torch.__version__.encode()).hexdigest()[:12]
    # torch's parallel backend decides how at::parallel_for runs inside the kernel: OpenMP wants the flag
    ldflags = ["-fopenmp"] if "OpenMP" in torch.__config__.parallel_info() else []
    name = f"moaspec_block_kernel_{digest}"
    where = cache_root() / "kernels" / name
    where.mkdir(parents=True, exist_ok=True)
    if not (where / f"{name}.so").exists():
        print("moaspec: compiling the 4-bit CPU kernel once (about a minute) ...", file=sys.stderr)
    return cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=FLAGS, extra_ldflags=ldflags,
                              build_directory=str(where), verbose=False)


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the ``ninja`` package this project installs puts it in the virtual
    environment's bin, which is not on PATH when a script runs ``.venv/bin/python`` directly."""
    try:
        import ninja
    except ImportError:  # then a system ninja, or the one-line fallback
        return
    path = os.environ.get("PATH", "")
    if ninja.BIN_DIR not in path.split(os.pathsep):
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path]) if path else ninja.BIN_DIR


def product(x: torch.Tensor, w: BlockWeights) -> torch.Tensor:
    """``x @ W.T`` for fp32 ``x`` ``[rows, in]`` (contiguous) and block weights ``W`` (the kernel must exist)."""
    module = _module if _module is not None else kernel()
    assert module is not None, "product() needs the compiled kernel: check kernel() first"
    return (module.q4 if w.bits == 4 else module.q8)(x, w.codes, w.scales, w.offsets)
