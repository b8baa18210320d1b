"""How per-token state vectors travel between server and client: fp16, or int8 with a scale per token;
and the verified tokens' log-probabilities, when a session asks for them.

Pure functions over tensors and JSON-safe dicts (base64 payloads), tested alone. int8
halves the bytes of fp16 (d + 2 bytes per token instead of 2d) at the cost of a
rounding error of at most half a step (absmax / 254) per element.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from moaspec.decoding.generation import TokenLogprob

FORMATS = ("fp16", "int8")


class CodecError(ValueError):
    """A state payload that does not decode to the announced shape."""


def encode(x: torch.Tensor, fmt: str) -> dict[str, Any]:
    """``x`` ``[T, d]`` → ``{"format", "shape", "data"[, "scales"]}``."""
    if fmt not in FORMATS:
        raise CodecError(f"unknown state format {fmt!r}; choose from {', '.join(FORMATS)}")
    x = x.detach().float().cpu()
    out: dict[str, Any] = {"format": fmt, "shape": list(x.shape)}
    if fmt == "fp16":
        out["data"] = base64.b64encode(x.half().numpy().tobytes()).decode()
    else:
        scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127
        q = (x / scale).round().clamp(-127, 127).to(torch.int8)
        out["data"] = base64.b64encode(q.numpy().tobytes()).decode()
        out["scales"] = base64.b64encode(scale.half().numpy().tobytes()).decode()
    return out


def _array(b64: str, dtype: type, count: int) -> np.ndarray:
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise CodecError("state data is not valid base64") from None
    if len(raw) != count * np.dtype(dtype).itemsize:
        raise CodecError(f"state data has {len(raw)} bytes, expected {count * np.dtype(dtype).itemsize}")
    return np.frombuffer(raw, dtype=dtype)


def decode(payload: dict[str, Any]) -> torch.Tensor:
    """The inverse of :func:`encode` (float32 ``[T, d]``)."""
    try:
        fmt, shape = payload["format"], [int(n) for n in payload["shape"]]
    except (KeyError, TypeError, ValueError):
        raise CodecError("state must have a format and a shape") from None
    if len(shape) != 2 or min(shape) < 0:
        raise CodecError(f"state shape must be [tokens, width], got {shape}")
    t, d = shape
    if fmt == "fp16":
        return torch.from_numpy(_array(payload.get("data", ""), np.float16, t * d).astype(np.float32)).view(t, d)
    if fmt == "int8":
        q = torch.from_numpy(_array(payload.get("data", ""), np.int8, t * d).astype(np.float32)).view(t, d)
        scale = torch.from_numpy(_array(payload.get("scales", ""), np.float16, t).astype(np.float32)).view(t, 1)
        return q * scale
    raise CodecError(f"unknown state format {fmt!r}")


def payload_bytes(payload: dict[str, Any]) -> int:
    """Bytes of state carried (before base64), for bytes-per-token accounting."""
    return len(base64.b64decode(payload["data"])) + (len(base64.b64decode(payload["scales"])) if "scales" in payload else 0)


def encode_logprobs(entries: Sequence[TokenLogprob]) -> list[list[Any]]:
    """Log-probability entries as ``[token, logprob, [[id, logprob], ...]]`` each (the likeliest first)."""
    return [[e.token, e.logprob, [list(pair) for pair in e.top]] for e in entries]


def decode_logprobs(raw: Any, tokens: Sequence[int]) -> list[TokenLogprob]:
    """The entries of ``tokens`` (the newly verified ones, in order) from :func:`encode_logprobs`'s form."""
    try:
        entries = [TokenLogprob(int(t), float(lp), tuple((int(i), float(v)) for i, v in top)) for t, lp, top in raw]
    except (TypeError, ValueError) as exc:
        raise CodecError(f"malformed log-probabilities: {exc}") from None
    if [e.token for e in entries] != list(tokens):
        raise CodecError(f"log-probabilities for {len(entries)} tokens that are not the {len(tokens)} verified")
    return entries
