"""``moaspec train --compile``: the drafter's teacher-forced pass compiled by ``torch.compile``.

A training update of the MoA drafter is mostly Layer Self-Attention, one decoder layer over
L "layer tokens" for every token of the batch (30 per token on SmolLM2). Eagerly, its RoPE,
norms and SiLU are a dozen passes over tensors L times a sequence's size; Inductor fuses them
into the products' neighbours. On a 2-core CPU an update under bf16 autocast took two thirds of
eager time after a one-off compilation of about 30 s (docs/experiments/2026-12-04-cpu-training-precision.md,
"Compiled training updates"), so it pays for runs of more than a few dozen updates and is off by default.

Only training-mode calls of ``forward`` are compiled: evaluation runs the drafter in eval mode,
where its linears read prepacked weight copies that the compiler does not trace. If compiling
fails (no C++ compiler for Inductor's CPU code, an operator it cannot lower), the call is
repeated eagerly; when that works, a warning names the failure and the run goes on eagerly.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from moaspec.drafters.base import Drafter
from moaspec.errors import brief


def compile_training_forward(drafter: Drafter) -> None:
    """Make ``drafter``'s training-mode ``forward`` calls run through ``torch.compile`` (shapes dynamic: every
    batch has its own length), falling back to eager ``forward`` for good if compiling fails."""
    eager = drafter.forward
    # fallback_random: random numbers drawn inside the pass (EAGLE's feature noise) come from torch's own
    # generator, as eagerly, instead of Inductor's: the same seed draws the same noise either way
    compiled: Any = torch.compile(eager, dynamic=True, options={"fallback_random": True})

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None or not drafter.training:
            return eager(*args, **kwargs)
        try:
            return compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - a real error recurs eagerly below and is raised from there
            out = eager(*args, **kwargs)
            compiled = None
            print(f"moaspec train: --compile failed ({type(exc).__name__}: {brief(exc, 200)}); training goes on "
                  "without compiling", file=sys.stderr)
            return out

    drafter.forward = forward
