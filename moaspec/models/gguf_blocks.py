"""A GGUF target's own quantised blocks, attached to the runtime's linear layers.

A GGUF file is first converted (dequantised to fp32) into a model directory, which every path of
this runtime can run: training, exports, prefill's large products. For decoding, each
:class:`~moaspec.models.packed_linear.Linear` whose weight was stored in a type the kernel reads (the legacy
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K: :data:`BLOCK_TYPES`) also gets that weight's
blocks, as the file holds them, for the compiled kernel of :mod:`~moaspec.models.block_kernel`: a decoding
step then reads a quarter to a seventh of the fp32 bytes. Files mix types (llama.cpp's quantiser writes a
"Q4_K_M" file as Q4_K, Q6_K and, where rows are not whole super-blocks of 256, Q5_0 and Q8_0): each weight
takes its own.

The runtime's layout differs from the file's in two ways, both undone here: q/k/v and gate/up are
fused (their blocks are stacked), and llama.cpp's converter permutes the rows of the query and key
projections, which transformers' reader permutes back (so do we, on whole rows of blocks). Each
attached weight is checked against the dense weight the converter wrote, on sampled rows, bit for
bit: a tensor whose blocks do not give exactly that weight (another permutation, another type)
keeps the fp32 path, so the blocks can only ever compute the model the rest of the runtime runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import cast

import numpy as np
import torch

from moaspec.models.block_kernel import Q4K, Q5, Q5K, Q6K, BlockWeights, kernel
from moaspec.models.fused_layers import fuse_layers, torch_layers
from moaspec.models.packed_linear import Linear
from moaspec.models.transformer import Transformer

BLOCKS_ENV = "MOASPEC_GGUF_BLOCKS"  # "0": run GGUF targets on their dequantised fp32 weights (--dense-weights)
_CHECKED_ROWS = 16  # sampled rows per weight compared bit for bit with the dense weight

# What the kernel reads, as ggml lays each block out: bytes per block, and the slices of a block that hold d, the
# offset m (None: computed, or 0), and what the kernel takes as codes; the layout it reads them in.
_LAYOUTS: dict[str, tuple[int, int, slice, slice | None, slice]] = {
    "Q4_0": (4, 18, slice(0, 2), None, slice(2, 18)),  # d·(q - 8): offset -8·d (exact in fp16)
    "Q4_1": (4, 20, slice(0, 2), slice(2, 4), slice(4, 20)),
    "Q5_0": (Q5, 22, slice(0, 2), None, slice(2, 22)),  # d·(q - 16): offset -16·d; codes: 4 bytes of fifth bits, 16
    "Q5_1": (Q5, 24, slice(0, 2), slice(2, 4), slice(4, 24)),
    "Q8_0": (8, 34, slice(0, 2), None, slice(2, 34)),
    "Q4_K": (Q4K, 144, slice(0, 2), slice(2, 4), slice(4, 144)),  # super-blocks of 256: d, dmin, then the rest
    "Q5_K": (Q5K, 176, slice(0, 2), slice(2, 4), slice(4, 176)),
    "Q6_K": (Q6K, 210, slice(208, 210), None, slice(0, 208)),  # d comes last; no offset
}
BLOCK_TYPES = tuple(_LAYOUTS)  # other tensor types (F16, F32, Q2_K, Q3_K, IQ*) keep the fp32 path


def blocks_of(tensor: object) -> BlockWeights | None:
    """A GGUF reader tensor's blocks, or ``None`` for a type the kernel does not read (ggml's block layouts, as
    gguf's ``quants`` module dequantises them: :data:`_LAYOUTS`)."""
    kind = tensor.tensor_type.name  # type: ignore[attr-defined]
    if kind not in _LAYOUTS:
        return None
    bits, size, d_at, m_at, codes_at = _LAYOUTS[kind]
    raw = np.asarray(tensor.data)  # type: ignore[attr-defined]  # uint8 [out, blocks * bytes per block]
    out = raw.shape[0]
    blocks = raw.reshape(out, -1, size)
    d = blocks[..., d_at].copy().view(np.float16)[..., 0]
    if m_at is not None:
        m = blocks[..., m_at].copy().view(np.float16)[..., 0]
    else:
        m = {"Q4_0": -8 * d, "Q5_0": -16 * d}.get(kind, np.zeros_like(d))
    codes = np.ascontiguousarray(blocks[..., codes_at]).reshape(out, -1)
    return BlockWeights(bits, torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(d)),
                        torch.from_numpy(np.ascontiguousarray(m)))


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers' GGUF reader gives a llama query or key projection: llama.cpp's
    converter interleaved each head's two rotary halves, the reader undoes it (``index[hf_row] = gguf_row``)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)


def same_weight(blocks: BlockWeights, dense: torch.Tensor) -> bool:
    """Whether ``blocks`` give ``dense`` bit for bit on its first, last and evenly spread rows."""
    if blocks.shape != tuple(dense.shape):
        return False
    rows = torch.linspace(0, dense.shape[0] - 1, _CHECKED_ROWS).long().unique()
    return torch.equal(blocks.rows(rows).dequantise(), dense.detach()[rows].float())


BLOCKS_FILE = "gguf-blocks-v3.safetensors"  # beside the converted weights: reading the GGUF's index takes seconds
_WHY = "fp32:"  # BLOCKS_FILE's metadata: a weight left on fp32, and why ("name": layout for the others)


def attach_gguf_blocks(model: Transformer, model_dir: Path, gguf: Path) -> str:
    """Give ``model``'s linear layers the blocks of the GGUF file they were converted from; returns a
    one-line account (how many weights, how many bytes), or why none were attached. A weight that stays on
    fp32 while others read blocks is named, with the reason, in one line on stderr.

    The blocks are taken from the file once and kept in ``model_dir`` (:data:`BLOCKS_FILE`, written
    atomically); later loads map that file. Either way each weight is checked against the dense one."""
    if os.environ.get(BLOCKS_ENV, "") == "0":
        return f"{BLOCKS_ENV}=0"
    if model.device.type != "cpu" or model.dtype != torch.float32 or model.first_block:
        return "the kernel runs whole fp32 targets on a CPU"
    if kernel() is None:
        return "no kernel"
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    cached = model_dir / BLOCKS_FILE
    kept = read_blocks(cached) if cached.is_file() else None
    if kept is None:
        kept = gguf_blocks(model, gguf)
        write_blocks(*kept, cached)
    found, why = kept
    attached, nbytes = 0, 0
    for name, linear in linears.items():
        b = found.get(name)
        if b is not None and same_weight(b, linear.weight):
            linear.blocks = b
            attached += 1
            nbytes += b.nbytes
        else:
            why.setdefault(name, "its blocks do not give the converted weight")
    if attached == 0:
        return f"none of {gguf.name}'s weights is of a block type the kernel reads ({', '.join(BLOCK_TYPES)})"
    model.fused = fuse_layers(model)
    left = {name: reason for name, reason in why.items() if linears[name].blocks is None}
    if left:
        print(f"moaspec: {len(left)} of {len(linears)} weights of {gguf.name} stay on fp32: {grouped(left)}",
              file=sys.stderr)
    tail = f"; {len(left)} keep fp32" if left else ""
    return f"{attached} weights read as blocks ({nbytes / 2**20:.0f} MiB){tail}"


def grouped(why: dict[str, str], shown: int = 3) -> str:
    """``{weight: reason}`` as one line, by reason: "reason (a, b, c and 4 more); other reason (d)"."""
    by_reason: dict[str, list[str]] = {}
    for name, reason in why.items():
        by_reason.setdefault(reason, []).append(name)
    parts = []
    for reason, names in by_reason.items():
        more = f" and {len(names) - shown} more" if len(names) > shown else ""
        parts.append(f"{reason} ({', '.join(names[:shown])}{more})")
    return "; ".join(parts)


def gguf_blocks(model: Transformer, gguf: Path) -> tuple[dict[str, BlockWeights], dict[str, str]]:
    """The blocks of ``gguf`` for each of ``model``'s linear layers (by module name) that the file stores in
    types the kernel reads, in the runtime's layout: fused, and with llama's query/key rows in transformers'
    order where that is what the converted weights hold (checked against them, else taken as stored); and for
    each other linear layer, why it has none."""
    from gguf import GGUFReader

    tensors = {t.name: t for t in GGUFReader(str(gguf)).tensors}

    def take(names: list[str], heads: list[int | None]) -> BlockWeights | str:
        missing = [n for n in names if n not in tensors]
        if missing:
            return f"no tensor {missing[0]} in the file"
        found = [blocks_of(tensors[n]) for n in names]
        unread = sorted({tensors[n].tensor_type.name for n, p in zip(names, found) if p is None})
        if unread:
            return f"stored as {'/'.join(unread)}, which the kernel does not read"
        parts = [p if h is None else p.rows(unpermute_rows(p.shape[0], h))
                 for p, h in zip(cast(list[BlockWeights], found), heads)]
        try:
            return parts[0] if len(parts) == 1 else BlockWeights.stack(parts)
        except ValueError:  # e.g. a Q4_K q and k beside a Q8_0 v: no one layout holds all three exactly
            kinds = sorted({tensors[n].tensor_type.name for n in names})
            return f"fuses {' and '.join(kinds)} parts, which share no block type exactly"

    heads = (model.cfg.num_heads, model.cfg.num_kv_heads)
    plan: dict[str, tuple[list[str], list[int | None]]] = {}
    for i in range(len(model.blocks)):
        p, b = f"blk.{i}.", f"blocks.{i}."
        plan[b + "attn.qkv"] = ([p + "attn_q.weight", p + "attn_k.weight", p + "attn_v.weight"], [*heads, None])
        plan[b + "attn.o"] = ([p + "attn_output.weight"], [None])
        plan[b + "mlp.gate_up"] = ([p + "ffn_gate.weight", p + "ffn_up.weight"], [None, None])
        plan[b + "mlp.down"] = ([p + "ffn_down.weight"], [None])
    plan["lm_head"] = (["output.weight" if "output.weight" in tensors else "token_embd.weight"], [None])
    linears = dict(model.named_modules())
    found: dict[str, BlockWeights] = {}
    why: dict[str, str] = {}
    for name, (names, order) in plan.items():
        weight = cast(Linear, linears[name]).weight
        as_stored: list[int | None] = [None] * len(names)
        for attempt in (order, as_stored):  # transformers' row order for llama, else the file's
            got = take(names, attempt)
            if isinstance(got, str):
                why[name] = got
                break
            if same_weight(got, weight):
                found[name] = got
                break
        if name not in found:
            why.setdefault(name, "its blocks do not give the converted weight")
    return found, why


def write_blocks(found: dict[str, BlockWeights], why: dict[str, str], path: Path) -> None:
    """Save ``found`` (and ``why`` the other weights have no blocks) as one safetensors file, atomically (a
    rename), so a crash leaves no half-written cache."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}
    for name, b in found.items():
        tensors.update({f"{name}.codes": b.codes, f"{name}.scales": b.scales, f"{name}.offsets": b.offsets})
    metadata = {name: str(b.bits) for name, b in found.items()} | {_WHY + name: r for name, r in why.items()}
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        save_file(tensors, str(tmp), metadata=metadata)
        tmp.replace(path)
    except OSError as exc:  # a read-only cache: the blocks are used all the same, read from the file next time too
        tmp.unlink(missing_ok=True)
        print(f"moaspec: could not keep the GGUF blocks in {path.parent} ({exc.strerror})", file=sys.stderr)


def read_blocks(path: Path) -> tuple[dict[str, BlockWeights], dict[str, str]] | None:
    """What :func:`write_blocks` saved, or ``None`` if the file cannot be read (it is then made again)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            why = {name.removeprefix(_WHY): r for name, r in meta.items() if name.startswith(_WHY)}
            found = {name: BlockWeights(int(w), f.get_tensor(f"{name}.codes"), f.get_tensor(f"{name}.scales"),
                                        f.get_tensor(f"{name}.offsets"))
                     for name, w in meta.items() if not name.startswith(_WHY)}
            return found, why
    except (SafetensorError, OSError, ValueError):
        return None


@contextmanager
def dense_products(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, ``model``'s products run on its dequantised fp32 weights, as with ``--dense-weights``
    (benchmarks compare both paths in one process)."""
    held = {m: m.blocks for m in model.modules() if isinstance(m, Linear) and m.blocks is not None}
    for m in held:
        m.blocks = None
    try:
        with torch_layers(model):  # the compiled layers read the blocks
            yield
    finally:
        for m, b in held.items():
            m.blocks = b
