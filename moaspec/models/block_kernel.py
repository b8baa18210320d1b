"""The compiled product of fp32 activations with GGUF block-quantised weights (``block_kernel.cpp``).

A small model decoded on a CPU is memory-bound: every step streams every weight. A GGUF file's
4-bit blocks are a sixth of the fp32 bytes, so reading them as they are, and rebuilding each weight in
registers exactly as the fp32 dequantisation does, makes a step several times cheaper without
rounding anything that fp32 would not (the C++ file's header says how). No library does that with
fp32 activations: llama.cpp and ONNX Runtime's int4 kernels round activations to 8 bits or
dequantise whole matrices per call, torch's int4 kernel wants bf16 activations.

The extension is compiled on first use with torch's own C++ extension tooling (ninja and the
system's C++ compiler) into the cache (``~/.cache/moaspec/kernels/<name with the sources' digest>``) and
reused from there. Where it cannot be (no compiler, a CPU without AVX2, FMA or F16C), :func:`kernel` says
why in one line and GGUF targets run on their dequantised fp32 weights as before. Where the CPU has AVX-512
(F, BW, VL, DQ), products run on 16-lane loops (``block_kernel_avx512.cpp``), chosen at run time, so one build
serves every x86 CPU; ``$MOASPEC_KERNEL_ISA=avx2`` keeps such a CPU on the AVX2 loops.

How the build survives faults:

- A build finished once is loaded as a plain module, without ninja or a lock, so another checkout or
  virtual environment, a copied cache, or a machine without a compiler uses it as it is (ninja
  rebuilt it from another checkout: its build file names the sources by path).
- Builds take an OS file lock (``filelock``), which dies with its process: a build killed half-way
  (SIGKILL, out of memory) leaves nothing that blocks the next run. torch's own lock file, which it
  waits on forever, lives in a scratch directory that the next build, holding the lock, deletes first.
- The library is compiled in that scratch directory and only then moved into place, so the name
  that is loaded is never a half-written file.
- A process that finds another one compiling says so and waits at most ``BUILD_WAIT_S``, then runs on
  fp32. A build that fails leaves its reason beside it, so later processes do not try again (delete
  that file to retry); one with no compiler or no ninja is told so at once.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass
from importlib import util
from pathlib import Path
from types import ModuleType
from typing import cast

import torch
from filelock import FileLock, Timeout

from moaspec.errors import brief
from moaspec.models.sources import cache_root

SOURCES = [Path(__file__).with_name(n) for n in ("block_kernel.cpp", "block_kernel_avx512.cpp", "decode_layers.cpp")]
HEADERS = [Path(__file__).with_name(n) for n in ("block_kernel.h", "block_layouts.h")]
ISA_VARIABLE = "MOASPEC_KERNEL_ISA"  # "avx2" keeps a CPU with AVX-512 on the AVX2 loops
BLOCK = 32  # weights per block along the input dimension
BUILD_WAIT_S = 600.0  # longest wait for another process's build (one takes about a minute, several on a busy CPU)
COMPILER_ERROR = re.compile(r"(fatal )?error( C\d+)?:", re.IGNORECASE)  # gcc's and clang's "error:", MSVC's "error C2065:"
LIBRARY_SUFFIX = ".pyd" if sys.platform == "win32" else ".so"  # what torch's tooling writes


Q5 = 5  # layouts beyond 4- and 8-bit blocks of 32 (``block_kernel.h``): Q5_0/Q5_1's 5-bit codes,
Q4K, Q5K, Q6K = 0x104, 0x105, 0x106  # the K-quants' super-blocks of 256 weights,
Q8M = 0x108  # and signed 8-bit codes with offsets: a fused q/k/v of Q4_1 or Q5_1 parts beside a Q8_0 one
SUPER = 256  # weights per K-quant super-block
_SUPER_BYTES = {Q4K: 140, Q5K: 172, Q6K: 208}  # code bytes per super-block (everything but d and dmin)


@dataclass(frozen=True)
class BlockWeights:
    """A weight ``[out, in]`` as GGUF blocks along ``in``: codes, and fp16 scales ``d`` and offsets ``m`` as GGUF
    stores them, so that each weight is rebuilt exactly as gguf (and the converter) dequantises it.

    ``bits`` names the layout. 4: blocks of 32, two codes a byte (ggml's nibble order), weight d·q + m (Q4_0 and
    Q4_1); 8: one signed code a byte, weight d·q, offsets 0 (Q8_0, which the kernel does not read); :data:`Q5`: per
    block 4 bytes of fifth bits and then 16 as for 4 (Q5_0 and Q5_1); :data:`Q4K`, :data:`Q5K`, :data:`Q6K`:
    super-blocks of 256 with one ``d`` (and ``dmin``, the offsets; Q6_K has none) each, the codes holding the
    rest of ggml's super-block as the file stores it (sub-block scales, high bits, nibbles); :data:`Q8M`: as 8 with
    offsets, weight d·q + m (no file type: what :meth:`stack` makes of Q4_1/Q5_1 parts beside Q8_0 ones)."""

    bits: int
    codes: torch.Tensor  # uint8 [out, in / 32 * code bytes per block]
    scales: torch.Tensor  # fp16 [out, in / 32] (K-quants: [out, in / 256])
    offsets: torch.Tensor  # fp16, as scales

    def __post_init__(self) -> None:
        if self.codes.dtype != torch.uint8 or self.scales.dtype != torch.float16 or self.offsets.dtype != torch.float16:
            raise ValueError("blocks hold uint8 codes and fp16 scales and offsets")
        if self.bits not in (4, 8, Q5, Q8M, *_SUPER_BYTES):
            raise ValueError(f"unknown block layout {self.bits}")
        if self.bits in (8, Q6K) and bool(self.offsets.any()):
            raise ValueError("Q8_0 and Q6_K blocks have no offset: their offsets must be 0")

    @property
    def shape(self) -> tuple[int, int]:
        return self.scales.shape[0], self.scales.shape[1] * (SUPER if self.bits in _SUPER_BYTES else BLOCK)

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + self.offsets.nbytes

    def dequantise(self) -> torch.Tensor:
        """The fp32 weight these blocks stand for (tests, and checks against a model's dense weights), computed
        as gguf's ``dequantize`` computes it: every product below is exact in fp32, so only the last sum rounds."""
        out, cols = self.shape
        if self.bits in _SUPER_BYTES:
            return _dequantise_k(self).reshape(out, cols)
        blocks = cols // BLOCK
        codes = self.codes.view(out, blocks, -1)
        if self.bits in (8, Q8M):
            q = codes.view(torch.int8).float()
        else:
            nibbles = codes[..., -16:]
            q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1)
            if self.bits == Q5:  # bit i of the block's first 4 bytes (little-endian) is element i's fifth bit
                high = codes[..., :4].unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8) & 1
                q = q | high.reshape(out, blocks, BLOCK) << 4
            q = q.float()
        return (q * self.scales.float()[..., None] + self.offsets.float()[..., None]).reshape(out, cols)

    def rows(self, index: torch.Tensor) -> BlockWeights:
        """These blocks with their output rows reordered (or selected) by ``index``."""
        return BlockWeights(self.bits, self.codes[index].contiguous(), self.scales[index].contiguous(),
                            self.offsets[index].contiguous())

    def as_8_bit(self) -> BlockWeights | None:
        """The same weights with a signed byte a code, exactly: Q8_0 blocks for 4- and 5-bit blocks whose offsets
        are -8·d and -16·d (Q4_0, Q5_0: codes q - 8 and q - 16), :data:`Q8M` blocks for other 4- and 5-bit ones
        (Q4_1, Q5_1: codes q, offsets kept); ``None`` for the K-quants, whose scales are not per block of 32."""
        if self.bits in (8, Q8M):
            return self
        if self.bits not in (4, Q5):
            return None
        centre = 8 if self.bits == 4 else 16
        centred = torch.equal(self.offsets, self.scales * -centre)
        plain = BlockWeights(self.bits, self.codes, torch.ones_like(self.scales), torch.zeros_like(self.offsets))
        q = plain.dequantise() - (centre if centred else 0)
        codes = q.to(torch.int8).view(torch.uint8).contiguous()
        if centred:
            return BlockWeights(8, codes, self.scales, torch.zeros_like(self.offsets))
        return BlockWeights(Q8M, codes, self.scales, self.offsets)

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
        """Several weights of the same input width, one above the other (a fused q/k/v). Parts of different
        layouts are all taken as 8-bit codes, which is exact (a Q5_0 or Q5_1 q and k beside a Q8_0 v, as llama.cpp's
        quantiser writes narrow models): as Q8_0 where none needs an offset, else as :data:`Q8M`; K-quant parts
        among others raise :class:`ValueError`."""
        if len({p.bits for p in parts}) != 1:
            widened = [p.as_8_bit() for p in parts]
            if any(w is None for w in widened):
                raise ValueError("fused weights of different block types, not all exactly 8-bit codes")
            parts = cast(list[BlockWeights], widened)
            if any(p.bits == Q8M for p in parts):
                parts = [BlockWeights(Q8M, p.codes, p.scales, p.offsets) for p in parts]
        return BlockWeights(parts[0].bits, torch.cat([p.codes for p in parts]).contiguous(),
                            torch.cat([p.scales for p in parts]).contiguous(),
                            torch.cat([p.offsets for p in parts]).contiguous())


def _dequantise_k(w: BlockWeights) -> torch.Tensor:
    """A K-quant weight as ``[out, super-blocks, 256]`` fp32, as gguf's Q4_K/Q5_K/Q6_K ``dequantize_blocks`` do."""
    out, supers = w.scales.shape
    codes = w.codes.view(out, supers, _SUPER_BYTES[w.bits])
    d = w.scales.float()[..., None]
    if w.bits == Q6K:  # 128 bytes of low nibbles, 64 of 2-bit high parts, 16 int8 scales (one per 16 weights)
        low = codes[..., :128].reshape(out, supers, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None] & 0x0F
        high = codes[..., 128:192].reshape(out, supers, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8
                                                                                   )[:, None] & 3
        q = (low.reshape(out, supers, 2, 128) | high.reshape(out, supers, 2, 128) << 4).float() - 32
        scale = d * codes[..., 192:208].view(torch.int8).float()
        return (scale[..., None] * q.reshape(out, supers, 16, 16)).reshape(out, supers, SUPER)
    s = codes[..., :12].long()
    low4, high2 = s[..., 0:4], s[..., 8:12]
    sc = torch.cat([low4 & 63, (high2 & 0x0F) | ((low4 >> 6) << 4)], dim=-1)  # ggml's get_scale_min_k4
    mn = torch.cat([s[..., 4:8] & 63, (high2 >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1)
    nibbles = codes[..., -128:].reshape(out, supers, 4, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None] & 0x0F
    q = nibbles.reshape(out, supers, 8, 32)
    if w.bits == Q5K:  # bit j of byte l of the 32 high bytes: sub-block j's element l
        high = codes[..., 12:44].reshape(out, supers, 1, 32) >> torch.arange(8, dtype=torch.uint8)[:, None] & 1
        q = q | high << 4
    scale, offset = d * sc.float(), w.offsets.float()[..., None] * mn.float()
    return (scale[..., None] * q.float() - offset[..., None]).reshape(out, supers, SUPER)


_module: ModuleType | None = None
_why_not: str | None = None


class Unavailable(Exception):
    """The kernel cannot be had here; the message says why, in a few words."""


def _cpu_flags() -> set[str] | None:
    """The CPU's feature flags as Linux lists them, or None where they cannot be read (other systems)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    line = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return None if line is None else set(line.partition(":")[2].split())


def cpu_supported() -> str | None:
    """Why this CPU cannot run the kernel, or ``None``: it needs AVX2, FMA and F16C (x86 CPUs since 2013–2015).

    torch's capability covers AVX2 and FMA, not F16C (the fp16 scales' conversions), which every such CPU
    has but a virtual machine may hide; where Linux lists the flags, F16C is checked too.
    """
    capability = torch.backends.cpu.get_cpu_capability()  # "DEFAULT", "AVX2", "AVX512", ...
    if not capability.startswith(("AVX2", "AVX512")):
        return f"this CPU's vector capability is {capability}, and the kernel needs AVX2 with FMA"
    flags = _cpu_flags()
    if flags is not None and "f16c" not in flags:
        return "this CPU does not report F16C (fp16 conversion), which the kernel needs"
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
        except Unavailable as exc:
            _why_not = str(exc)
        except Exception as exc:  # torch's tooling raises many types: report it, run on fp32
            _why_not = f"it could not be loaded or built ({type(exc).__name__}: {brief(exc, 200) or 'no message'})"
    if _module is None:
        print(f"moaspec: GGUF targets run on dequantised fp32 weights: {_why_not}", file=sys.stderr)
    else:
        _choose_instruction_set(_module)
    return _module


def _choose_instruction_set(module: ModuleType) -> None:
    """Apply ``$MOASPEC_KERNEL_ISA`` to a freshly loaded kernel; a value this CPU cannot run is said, in one line,
    and left (the kernel keeps the best loops it has)."""
    isa = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if isa and isa != module.instruction_set():
        try:
            module.set_instruction_set(isa)
        except RuntimeError as exc:
            print(f"moaspec: {ISA_VARIABLE}={isa} ignored: {brief(exc, 120)}", file=sys.stderr)


def instruction_set() -> str | None:
    """The loops block products run on in this process: ``"avx512"`` (16 lanes, wherever the CPU has AVX-512 F, BW,
    VL and DQ) or ``"avx2"``; ``None`` before the kernel is loaded or where it cannot be. The two give the same
    exact weights and differ only in the order of their fp32 sums, so a process keeps one (``$MOASPEC_KERNEL_ISA``
    chooses AVX2 on an AVX-512 CPU) and measured costs are kept apart per instruction set."""
    return None if _module is None else cast(str, _module.instruction_set())


def build_id() -> str | None:
    """What the loaded kernel is, for keys of measured costs: its build (its module name carries the sources'
    digest) and the loops it runs on; ``None`` before the kernel is loaded or where it cannot be. Another build or
    instruction set costs otherwise."""
    return None if _module is None else f"{_module.__name__} {instruction_set()}"


def instruction_sets() -> list[str]:
    """The loops this CPU can run (``[]`` where the kernel cannot be had): tests and benchmarks run each."""
    module = kernel()
    if module is None:
        return []
    return ["avx2", "avx512"] if module.avx512_supported() else ["avx2"]


def set_instruction_set(name: str) -> None:
    """Run every later block product of this process on ``name``'s loops (``"avx2"`` or ``"avx512"``); raises
    :class:`ValueError` for a name this CPU cannot run. Results of the two differ in the last bits, so switch only
    between whole decodings (benchmarks, tests), never inside one."""
    module = kernel()
    if name not in instruction_sets():
        raise ValueError(f"instruction set {name!r} is not available here (available: {instruction_sets()})")
    assert module is not None
    module.set_instruction_set(name)


def compile_flags(platform: str = sys.platform, openmp: bool = True) -> tuple[list[str], list[str]]:
    """The compiler's and the linker's flags on ``platform`` (``sys.platform``'s names); ``openmp``: torch runs
    at::parallel_for on OpenMP, which the kernel inlines (without the flag it runs on one thread)."""
    if platform == "win32":  # MSVC: intrinsics need no flag; /fp:precise does not contract a*b+c
        return ["/O2", "/arch:AVX2", "/fp:precise", *(["/openmp"] if openmp else [])], []
    # no contraction: the .cpp's arithmetic is written out
    cflags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off"]
    if openmp and platform != "darwin":  # Apple's clang refuses -fopenmp: one thread there
        # the extension then shares torch's own libgomp.so.1, already loaded, so both use one thread pool
        return [*cflags, "-fopenmp"], ["-fopenmp"]
    return cflags, []


def _flags() -> tuple[list[str], list[str]]:
    """This machine's compiler and linker flags (OpenMP where torch itself runs on it)."""
    return compile_flags(openmp="OpenMP" in torch.__config__.parallel_info())


def library_path() -> Path:
    """Where this checkout's build lives: its name carries the sources', flags' and torch version's digest, so
    an edited kernel is never confused with an old build (and tests find this build among others')."""
    cflags, ldflags = _flags()
    code = b"".join(p.read_bytes() for p in [*SOURCES, *HEADERS])
    digest = hashlib.sha256(code + " ".join(cflags + ldflags).encode() + torch.__version__.encode()).hexdigest()[:12]
    name = f"moaspec_block_kernel_{digest}"
    return cache_root() / "kernels" / name / f"{name}{LIBRARY_SUFFIX}"


def build() -> ModuleType:
    """Load the cached build of the extension, or compile it (see the module's docstring for the faults this
    survives), at :func:`library_path`. Raises :class:`Unavailable` when it can be neither."""
    cflags, ldflags = _flags()
    library = library_path()
    name, where = library.stem, library.parent
    unloadable = False
    if library.exists():
        try:
            return _load(name, library)
        except ImportError:  # not a build this Python can load (a copy from elsewhere?): build it here
            unloadable = True
    failed = where / "failed"
    if failed.exists():
        raise Unavailable(f"{failed.read_text(errors='replace').strip()} (remembered: delete {failed} to try again)")
    _toolchain()
    where.mkdir(parents=True, exist_ok=True)
    lock = FileLock(where / "build.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        print(f"moaspec: waiting for another process compiling the 4-bit CPU kernel (at most {BUILD_WAIT_S:.0f} s) ...",
              file=sys.stderr)
        try:
            lock.acquire(timeout=BUILD_WAIT_S)
        except Timeout:
            raise Unavailable(f"another process has been compiling it for over {BUILD_WAIT_S:.0f} s "
                              f"(it holds {lock.lock_file})") from None
    try:
        if library.exists() and not unloadable:  # built by the process this one waited for
            return _load(name, library)
        return _compile(name, where, library, cflags, ldflags)
    finally:
        lock.release()


def _load(name: str, library: Path) -> ModuleType:
    """The built extension, imported as the plain module it is (torch, which it links to, is loaded already)."""
    spec = util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        raise ImportError(f"{library} is not a loadable module")
    module = util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _toolchain() -> None:
    """Refuse at once, in a few words, where torch's tooling could not compile: no C++ compiler or no ninja
    (torch would print a banner on the compiler's ABI and end with 'ninja: build stopped')."""
    from torch.utils import cpp_extension

    _ninja_on_path()
    compiler = os.environ.get("CXX", "cl" if sys.platform == "win32" else "c++")
    if not compiler.split() or shutil.which(compiler.split()[0]) is None:
        raise Unavailable(f"no C++ compiler: {compiler!r} is not on PATH (install g++ or clang, or set CXX)")
    if not cpp_extension.is_ninja_available():
        raise Unavailable("ninja, which torch compiles extensions with, is not installed (pip install ninja)")


def _compile(name: str, where: Path, library: Path, cflags: list[str], ldflags: list[str]) -> ModuleType:
    """Compile in ``where/build`` (emptied first: a killed build's leftovers, torch's stale lock among them) and
    move the library into place; a failure is written to ``where/failed`` with the compiler's first error."""
    from torch.utils import cpp_extension

    scratch = where / "build"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    print("moaspec: compiling the 4-bit CPU kernel once (about a minute) ...", file=sys.stderr)
    # torch's banner on a compiler other than the g++ it was built with (clang works): a failure says its own reason
    log = logging.getLogger(cpp_extension.__name__)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        module = cpp_extension.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=cflags,
                                    extra_ldflags=ldflags, build_directory=str(scratch), verbose=False)
    except Exception as exc:
        reason = f"it could not be built ({_first_error(exc)})"
        (where / "failed").write_text(reason + "\n")
        raise Unavailable(reason) from None
    finally:
        log.setLevel(level)
    partial = library.with_name(library.name + ".partial")
    shutil.copyfile(scratch / library.name, partial)  # a copy: Windows cannot move a library that is loaded
    os.replace(partial, library)
    shutil.rmtree(scratch, ignore_errors=True)
    return module


def _first_error(exc: BaseException) -> str:
    """The compiler's first error line in torch's message (which ends with ninja's useless 'build stopped'),
    else the message itself, shortened; never empty."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    error = next((line for line in lines if COMPILER_ERROR.search(line)), None)
    return brief(error or " ".join(lines) or type(exc).__name__, 200)


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
    return module.product(x, w.codes, w.scales, w.offsets, w.bits)
