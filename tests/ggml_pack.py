"""ggml's K-quant blocks packed in numpy from hand-made parts, and rough quantisers built on them.

The gguf package dequantises every block type but quantises only the legacy ones (Q4_0 ... Q8_0); llama.cpp's
quantiser is not a test dependency. So the tests make K-quant blocks here, from codes and scales chosen by
hand (or by the rough quantisers below), laid out as ggml's ``block_q4_K``, ``block_q5_K`` and ``block_q6_K``
are, and check the runtime against gguf's own ``dequantize`` of those bytes.
"""

from __future__ import annotations

import numpy as np

SUPER = 256


def _half(x: np.ndarray) -> np.ndarray:
    """fp16 values as their 2 bytes, on a new last axis."""
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def pack_k_scales(scale: np.ndarray, minimum: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minima per super-block (``[..., 8]`` each) as Q4_K/Q5_K's 12 bytes: bytes 0-3 hold
    scales 0-3 and the top 2 bits of scales 4-7, bytes 4-7 minima 0-3 and the top bits of minima 4-7, bytes 8-11
    the low 4 bits of scales 4-7 (low nibble) and minima 4-7 (high nibble)."""
    sc, mn = scale.astype(np.uint8), minimum.astype(np.uint8)
    first = (sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6)
    second = (mn[..., :4] & 63) | ((mn[..., 4:] >> 4) << 6)
    third = (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)
    return np.concatenate([first, second, third], axis=-1)


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, scale: np.ndarray, minimum: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_K blocks (144 bytes: fp16 d, fp16 dmin, 12 scale bytes, 128 of nibbles) of weights d·scale_j·q - dmin·min_j.

    ``d``, ``dmin``: ``[rows, supers]``; ``scale``, ``minimum``: ``[rows, supers, 8]`` in 0..63; ``q``: ``[rows, supers,
    8, 32]`` in 0..15. Sub-blocks 2i and 2i+1 share 32 bytes: 2i in the low nibbles, 2i+1 in the high ones."""
    pairs = q.astype(np.uint8).reshape(*q.shape[:2], 4, 2, 32)
    nibbles = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(*q.shape[:2], 128)
    parts = [_half(d), _half(dmin), pack_k_scales(scale, minimum), nibbles]
    return np.concatenate(parts, axis=-1).reshape(q.shape[0], -1)


def pack_q5_k(d: np.ndarray, dmin: np.ndarray, scale: np.ndarray, minimum: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q5_K blocks (176 bytes: d, dmin, 12 scale bytes, 32 of fifth bits, 128 of nibbles); ``q`` in 0..31. Bit j
    of high byte l is sub-block j's element l's fifth bit."""
    q = q.astype(np.uint8)
    fifth = ((q >> 4) & 1).transpose(0, 1, 3, 2)  # [rows, supers, 32 (l), 8 (j)]
    high = np.packbits(fifth, axis=-1, bitorder="little")[..., 0]
    low = pack_q4_k(d, dmin, scale, minimum, q & 15).reshape(*q.shape[:2], 144)
    return np.concatenate([low[..., :16], high, low[..., 16:]], axis=-1).reshape(q.shape[0], -1)


def pack_q6_k(d: np.ndarray, scale: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q6_K blocks (210 bytes: 128 of low nibbles, 64 of 2-bit high parts, 16 signed scales, fp16 d) of weights
    d·scale_i·(q - 32). ``scale``: ``[rows, supers, 16]`` in -128..127, one per 16 weights; ``q``: ``[rows, supers,
    256]`` in 0..63. In each half of 128, low byte l holds elements l (low nibble) and l + 64, and high byte l
    holds elements l, l + 32, l + 64, l + 96 (2 bits each, from the lowest)."""
    rows, supers = q.shape[:2]
    half = q.astype(np.uint8).reshape(rows, supers, 2, 128)
    low = (half[..., :64] & 15) | ((half[..., 64:] & 15) << 4)
    top = (half >> 4).reshape(rows, supers, 2, 4, 32)
    high = top[..., 0, :] | (top[..., 1, :] << 2) | (top[..., 2, :] << 4) | (top[..., 3, :] << 6)
    parts = [low.reshape(rows, supers, 128), high.reshape(rows, supers, 64),
             scale.astype(np.int8).view(np.uint8), _half(d)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def random_k_blocks(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """``rows`` × ``cols`` weights of ``kind`` (Q4_K, Q5_K, Q6_K) with every code and scale drawn at random, and
    fp16 super-block scales of a realistic size: what a file could hold, not a fit to any weight."""
    rng = np.random.default_rng(seed)
    supers = cols // SUPER
    d = (rng.random((rows, supers)) * 2e-3 + 1e-5).astype(np.float16)
    if kind == "Q6_K":
        return pack_q6_k(d, rng.integers(-128, 128, (rows, supers, 16)), rng.integers(0, 64, (rows, supers, SUPER)))
    dmin = (rng.random((rows, supers)) * 2e-3).astype(np.float16)
    scale, minimum = rng.integers(0, 64, (rows, supers, 8)), rng.integers(0, 64, (rows, supers, 8))
    top = 16 if kind == "Q4_K" else 32
    pack = pack_q4_k if kind == "Q4_K" else pack_q5_k
    return pack(d, dmin, scale, minimum, rng.integers(0, top, (rows, supers, 8, 32)))


def quantise_k(kind: str, weight: np.ndarray) -> np.ndarray:
    """A rough K-quantisation of ``weight`` ``[rows, cols]`` (``cols`` a multiple of 256): per sub-block the range
    (or the largest magnitude, for Q6_K) sets a scale, which the super-block's fp16 d then quantises to 6 (or 8)
    bits. Not llama.cpp's search for the best scales: close enough for a tiny test model to behave."""
    rows, cols = weight.shape
    w = weight.astype(np.float32).reshape(rows, cols // SUPER, -1)
    if kind == "Q6_K":
        sub = w.reshape(rows, -1, 16, 16)
        wanted = np.abs(sub).max(axis=-1) / 31
        d = (wanted.max(axis=-1) / 127).astype(np.float16)
        scale = np.clip(np.round(wanted / np.maximum(d.astype(np.float32), 1e-30)[..., None]), -128, 127)
        step = d.astype(np.float32)[..., None] * scale
        q = np.clip(np.round(sub / np.where(step == 0, 1, step)[..., None]) + 32, 0, 63)
        return pack_q6_k(d, scale, q.reshape(rows, -1, SUPER))
    top = 15 if kind == "Q4_K" else 31
    sub = w.reshape(rows, -1, 8, 32)
    low = np.maximum(0, -sub.min(axis=-1))
    span = (sub.max(axis=-1) + low) / top
    d = (span.max(axis=-1) / 63).astype(np.float16)
    dmin = (low.max(axis=-1) / 63).astype(np.float16)
    scale = np.clip(np.round(span / np.maximum(d.astype(np.float32), 1e-30)[..., None]), 0, 63)
    minimum = np.clip(np.round(low / np.maximum(dmin.astype(np.float32), 1e-30)[..., None]), 0, 63)
    step = d.astype(np.float32)[..., None] * scale
    shift = dmin.astype(np.float32)[..., None] * minimum
    q = np.clip(np.round((sub + shift[..., None]) / np.where(step == 0, 1, step)[..., None]), 0, top)
    return (pack_q4_k if kind == "Q4_K" else pack_q5_k)(d, dmin, scale, minimum, q)
