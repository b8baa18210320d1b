"""The block kernel's build under faults, and its boundary: a killed build, a build in progress elsewhere, no
compiler, a failing compiler, a cache copied from elsewhere, other platforms' flags, and tensors Python can
hand the extension that it must refuse rather than crash on.

The faults are made with stand-in compilers (shell scripts that sleep or fail), so these tests compile
nothing; those that load the real extension skip where it cannot be built here."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from moaspec.models import block_kernel

unix = pytest.mark.skipif(sys.platform == "win32", reason="the stand-in compilers are POSIX shell scripts")
needs_kernel = pytest.mark.skipif(block_kernel.cpu_supported() is not None, reason=str(block_kernel.cpu_supported()))
KERNEL = "from moaspec.models import block_kernel as bk; bk.BUILD_WAIT_S = {wait}; print('built' if bk.kernel() else 'fp32')"


def stand_in(bin_dir: Path, script: str) -> Path:
    """``bin_dir``, holding a ``c++`` that runs ``script`` (sh) instead of compiling and notes its process id
    in ``bin_dir/pids`` (ninja starts each compiler in a process group of its own, which killing the build's
    group does not reach)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    path = bin_dir / "c++"
    path.write_text(f'#!/bin/sh\necho $$ >> "{bin_dir / "pids"}"\n{script}\n')
    path.chmod(0o755)
    return bin_dir


def environment(cache: Path, bin_dir: Path | None = None, **extra: str) -> dict[str, str]:
    env = {**os.environ, "MOASPEC_CACHE": str(cache), "PYTHONPATH": str(Path(__file__).parents[1]), **extra}
    env.pop("CXX", None)
    if bin_dir is not None:
        env["PATH"] = os.pathsep.join([str(bin_dir), env.get("PATH", "")])
    return env


def kernel_process(env: dict[str, str], wait: float = 600.0) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", KERNEL.format(wait=wait)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def compiling(process: subprocess.Popen[str]) -> None:
    """Wait until ``process`` says it compiles (it then holds the build lock)."""
    assert process.stderr is not None
    line = process.stderr.readline()
    assert "compiling the 4-bit CPU kernel" in line, line


def kill(process: subprocess.Popen[str], bin_dir: Path) -> None:
    """SIGKILL the process, as an out-of-memory kill would, then the stand-in compilers it left running."""
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)
    pids = bin_dir / "pids"
    for pid in pids.read_text().split() if pids.exists() else []:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


@unix
@needs_kernel
def test_a_killed_first_build_never_hangs_the_next_run(tmp_path: Path) -> None:
    """The first build is killed mid-compile; the next run compiles again (here: a compiler that fails at once)
    and falls back in one line, within seconds (torch waited forever on the lock the killed build left)."""
    slow = stand_in(tmp_path / "slow", "sleep 600")
    first = kernel_process(environment(tmp_path / "cache", slow))
    try:
        compiling(first)
        time.sleep(1)
    finally:
        kill(first, slow)
    failing = stand_in(tmp_path / "failing", 'case "$1" in --version) echo "g++ (stand-in) 13.2.0"; exit 0;; esac\n'
                                             'echo "kernel.cpp:1:1: error: this compiler is a stand-in" >&2; exit 1')
    began = time.monotonic()
    second = subprocess.run([sys.executable, "-c", KERNEL.format(wait=600)], capture_output=True, text=True, timeout=300,
                            env=environment(tmp_path / "cache", failing))
    assert second.stdout.strip() == "fp32" and time.monotonic() - began < 240
    said = second.stderr.splitlines()
    assert len(said) == 2 and "compiling" in said[0], second.stderr  # no banner from torch on the compiler
    assert "could not be built (kernel.cpp:1:1: error: this compiler is a stand-in)" in said[1]
    # remembered: the next run does not try again, and says how to
    third = subprocess.run([sys.executable, "-c", KERNEL.format(wait=600)], capture_output=True, text=True, timeout=120,
                           env=environment(tmp_path / "cache", failing))
    assert third.stdout.strip() == "fp32" and third.stderr.count("\n") == 1
    assert "error: this compiler is a stand-in" in third.stderr and "delete" in third.stderr
    assert not list((tmp_path / "cache").rglob("*.so"))  # nothing half-written under a library's name


@unix
@needs_kernel
def test_a_build_in_progress_elsewhere_is_waited_for_a_bounded_time(tmp_path: Path) -> None:
    slow = stand_in(tmp_path / "slow", "sleep 600")
    env = environment(tmp_path / "cache", slow)
    first = kernel_process(env)
    try:
        compiling(first)
        began = time.monotonic()
        second = subprocess.run([sys.executable, "-c", KERNEL.format(wait=1)], capture_output=True, text=True,
                                timeout=120, env=env)
        assert second.stdout.strip() == "fp32" and time.monotonic() - began < 60
        said = second.stderr.splitlines()
        assert len(said) == 2 and "waiting for another process" in said[0], second.stderr
        assert "another process has been compiling it for over 1 s" in said[1]
    finally:
        kill(first, slow)


@needs_kernel
def test_no_compiler_is_one_line_that_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "moaspec-no-such-compiler")
    monkeypatch.setattr(block_kernel, "_module", None)
    monkeypatch.setattr(block_kernel, "_why_not", None)
    assert block_kernel.kernel() is None
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no C++ compiler: 'moaspec-no-such-compiler' is not on PATH" in err, err


def test_an_error_without_a_message_still_falls_back(monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def silent() -> None:
        raise RuntimeError("")

    monkeypatch.setattr(block_kernel, "_module", None)
    monkeypatch.setattr(block_kernel, "_why_not", None)
    monkeypatch.setattr(block_kernel, "cpu_supported", lambda: None)
    monkeypatch.setattr(block_kernel, "build", silent)
    assert block_kernel.kernel() is None
    assert "(RuntimeError: no message)" in capsys.readouterr().err


def built_library() -> Path:
    """The library this checkout's kernel() loaded (built here once, about a minute, if it was not)."""
    if block_kernel.kernel() is None:
        pytest.skip(f"the kernel cannot be built here: {block_kernel._why_not}")
    library = block_kernel.library_path()
    assert library.exists(), library
    return library


@needs_kernel
def test_a_built_library_loads_without_ninja_a_compiler_or_its_lock(tmp_path: Path) -> None:
    """A cache copied from another checkout or machine (here: beside a stale lock, as a killed build left it
    under torch) is loaded as it is: no compiler, no ninja, no wait."""
    library = built_library()
    copy = tmp_path / "cache" / "kernels" / library.parent.name
    copy.mkdir(parents=True)
    shutil.copy2(library, copy / library.name)
    (copy / "lock").touch()
    (copy / "build").mkdir()
    (copy / "build" / "lock").touch()
    env = environment(tmp_path / "cache", PATH=str(tmp_path / "empty"), CXX="moaspec-no-such-compiler")
    began = time.monotonic()
    run = subprocess.run([sys.executable, "-c", KERNEL.format(wait=600)], capture_output=True, text=True, timeout=120,
                         env=env)
    assert run.stdout.strip() == "built" and run.stderr == "" and time.monotonic() - began < 60, run.stderr


BAD_CALLS = '''
import torch
from moaspec.models import block_kernel as bk

m = bk.kernel()
g = torch.Generator().manual_seed(0)

def blocks(out, inner):
    return [torch.randint(0, 256, (out, inner // 2), dtype=torch.uint8, generator=g),
            torch.full((out, inner // 32), 0.01).half(), torch.full((out, inner // 32), -0.08).half()]

x = torch.randn(2, 64)
q, d, o = blocks(8, 64)
meta = lambda t: t.to("meta")
layer = [*blocks(64, 32), *blocks(32, 32), *blocks(64, 32), *blocks(32, 32), torch.ones(32), torch.ones(32), torch.empty(0)]
args = dict(heads=2, kv=1, dim=16)
cache = torch.zeros(1, 1, 1, 8, 16)
cos, sin = torch.ones(1, 16), torch.zeros(1, 16)
h = torch.randn(1, 32)
ok = m.Layers(layer, [4] * 4, 2, 1, 16, 1e-5, False)
ok.run(h, cache, cache.clone(), cos, sin, 0, None, 0, 1, 0)  # a good call first
cross = m.Layers([*blocks(32, 32), *layer[3:]], [4] * 4, 2, 1, 16, 1e-5, True)
memory = torch.randn(1, 1, 3, 16)
cross.cross(h, memory, memory.clone(), cos, sin)

def with_meta(i):
    return m.Layers([meta(t) if j == i else t for j, t in enumerate(layer)], [4] * 4, 2, 1, 16, 1e-5, False)

bad = {
    "q4 meta scales and offsets": lambda: m.product(x, q, meta(d), meta(o), 4),
    "q4 meta codes": lambda: m.product(x, meta(q), d, o, 4),
    "q4 meta x": lambda: m.product(meta(x), q, d, o, 4),
    "q8 strided scales": lambda: m.product(x, torch.zeros(8, 64, dtype=torch.uint8), d.t().contiguous().t(), o, 8),
    "q4 fp32 scales": lambda: m.product(x, q, d.float(), o, 4),
    "q4 1-D offsets": lambda: m.product(x, q, d, o.flatten(), 4),
    "q4 bf16 x": lambda: m.product(x.bfloat16(), q, d, o, 4),
    "q4 sparse x": lambda: m.product(x.to_sparse(), q, d, o, 4),
    "meta norm gain": lambda: with_meta(12).run(h, cache, cache.clone(), cos, sin, 0, None, 0, 1, 0),
    "meta bias": lambda: with_meta(14),
    "meta cos": lambda: ok.run(h, cache, cache.clone(), meta(cos), sin, 0, None, 0, 1, 0),
    "meta sin": lambda: ok.run(h, cache, cache.clone(), cos, meta(sin), 0, None, 0, 1, 0),
    "meta mask": lambda: ok.run(h, cache, cache.clone(), cos, sin, 0, meta(torch.ones(1, 1, dtype=torch.bool)), 0, 1, 0),
    "meta cache": lambda: ok.run(h, meta(cache), meta(cache), cos, sin, 0, None, 0, 1, 0),
    "meta x": lambda: ok.run(meta(h), cache, cache.clone(), cos, sin, 0, None, 0, 1, 0),
    "meta memory": lambda: cross.cross(h, meta(memory), meta(memory), cos, sin),
    "meta memory values": lambda: cross.cross(h, memory, meta(memory), cos, sin),
}
for name, call in bad.items():
    try:
        call()
    except (RuntimeError, TypeError, ValueError) as exc:
        assert str(exc), name
    else:
        raise AssertionError(f"{name} was accepted")
    print(name, flush=True)
print("refused all")
'''


@needs_kernel
def test_every_tensor_is_checked_at_the_extension_boundary() -> None:
    """Tensors on another device (meta here: its data pointer is null), of another dtype, layout or shape are
    refused with an error; a crash of the process would end this subprocess with a signal."""
    built_library()
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(BAD_CALLS)], capture_output=True, text=True, timeout=300,
                         env=environment(block_kernel.cache_root()))
    assert run.returncode == 0 and run.stdout.strip().endswith("refused all"), (run.returncode, run.stdout, run.stderr[-2000:])


def test_flags_suit_each_platform() -> None:
    from torch.utils import cpp_extension

    mac, _ = block_kernel.compile_flags("darwin")
    linux, linked = block_kernel.compile_flags("linux")
    windows, _ = block_kernel.compile_flags("win32")
    assert "-fopenmp" not in mac and "-mf16c" in mac  # Apple's clang refuses -fopenmp
    assert "-fopenmp" in linux and linked == ["-fopenmp"]
    assert "-fopenmp" not in block_kernel.compile_flags("linux", openmp=False)[0]
    assert "/arch:AVX2" in windows and not any(f.startswith("-") for f in windows)
    assert block_kernel.LIBRARY_SUFFIX == cpp_extension.LIB_EXT  # .pyd on Windows: what torch's tooling writes


def test_f16c_is_checked_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    monkeypatch.setattr(block_kernel, "_cpu_flags", lambda: {"avx2", "fma"})
    assert "F16C" in (block_kernel.cpu_supported() or "")
    monkeypatch.setattr(block_kernel, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    assert block_kernel.cpu_supported() is None
    monkeypatch.setattr(block_kernel, "_cpu_flags", lambda: None)  # not Linux: torch's AVX2 is taken on trust
    assert block_kernel.cpu_supported() is None


@pytest.mark.skipif(sys.platform != "win32", reason="a Windows build needs MSVC, which this test host lacks")
def test_the_kernel_builds_with_msvc() -> None:
    assert block_kernel.kernel() is not None


def test_a_linear_with_blocks_in_bfloat16_falls_back() -> None:
    from moaspec.models.packed_linear import Linear

    linear = Linear(64, 8)
    linear.blocks = block_kernel.BlockWeights.q8_0(linear.weight.detach())
    linear = linear.to(torch.bfloat16)
    with torch.inference_mode():
        y = linear(torch.randn(2, 64, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16 and y.shape == (2, 8)
