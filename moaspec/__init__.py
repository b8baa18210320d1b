"""moaspec: Mixture of Attentions for Speculative Decoding.

From Python, :func:`moaspec.load` gives a target with its drafter, ready to ``generate``
(:mod:`moaspec.api`). The package is organised as the speculative pipeline reads:

* :mod:`moaspec.models` — the target runtime: loading, a transformer forward that
  exposes every layer's K/V, and a KV cache with O(1) rollback.
* :mod:`moaspec.drafters` — the MoA drafter, the EAGLE and independent baselines, checkpoints.
* :mod:`moaspec.decoding` — token selection as pure functions and the decoding loops.
* :mod:`moaspec.training`, :mod:`moaspec.serving`, :mod:`moaspec.clientserver`, :mod:`moaspec.bench`.
* :mod:`moaspec.cli` — the ``moaspec`` command.
"""

from typing import Any

from moaspec.errors import MoaspecError

__all__ = ["MoaspecError", "PromptCache", "SpeculativeModel", "TreeShape", "load"]
__version__ = "0.1.0"

_LAZY = {"load": "moaspec.api", "SpeculativeModel": "moaspec.api", "TreeShape": "moaspec.decoding.tree",
         "PromptCache": "moaspec.decoding.prefill"}


def __getattr__(name: str) -> Any:
    """The Python API on first use: ``import moaspec`` stays light (the CLI starts without torch)."""
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moaspec' has no attribute {name!r}")
