"""The default target in the quantisations people download, written by llama.cpp's own quantiser.

Almost no user has the shipped Q4_1 file: Q4_K_M is the usual download, and even a file named
"Q4_0" is mixed (llama.cpp writes its ``output.weight`` / tied embedding as Q6_K unless told
``--pure``). These files are what the block kernel's mixed-file path and the shipped drafter's
lineage matching are measured on. They are requantised from the shipped Q4_1 file
(``allow_requantize``), the only copy of the weights this project ships, so their errors add to
Q4_1's: a user's Q4_K_M made from the original fp16 weights is closer to them, not farther. Each
file's tensor types are printed (a 576-wide model's rows are not whole K super-blocks of 256, so
the quantiser falls back to Q5_0/Q8_0 for most of them).

llama-cpp-python is not a dependency of the project:

    .venv/bin/pip install llama-cpp-python==0.3.36
    .venv/bin/python benchmarks/quantise_default.py --out ~/gguf
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from moaspec.models.sources import default_gguf_path

# file suffix -> llama.cpp's file type; "Q4_0" with its default settings (its Q6_K output), not --pure
KINDS = {"Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q5_K_M": "LLAMA_FTYPE_MOSTLY_Q5_K_M",
         "Q6_K": "LLAMA_FTYPE_MOSTLY_Q6_K", "Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0"}


def quantise(source: Path, out: Path, kind: str, threads: int) -> None:
    """``source`` requantised as ``kind`` (a key of :data:`KINDS`) into ``out`` by ``llama_model_quantize``."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("llama-cpp-python is not installed: .venv/bin/pip install llama-cpp-python==0.3.36") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = getattr(llama_cpp, KINDS[kind]), True, threads
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SystemExit(f"llama.cpp could not quantise {source} as {kind}")


def tensor_types(path: Path) -> Counter[str]:
    from gguf import GGUFReader

    return Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for the GGUF files")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    source = default_gguf_path()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = source.name.removesuffix(".gguf").rsplit(".", 1)[0]  # SmolLM2-135M-Instruct
    for kind in args.kinds.split(","):
        out = args.out / f"{stem}.{kind}.gguf"
        if not out.is_file():
            quantise(source, out, kind, args.threads)
        counts = ", ".join(f"{n} {t}" for t, n in tensor_types(out).most_common())
        print(f"{out} ({out.stat().st_size / 2**20:.0f} MiB): {counts}")


if __name__ == "__main__":
    main()
