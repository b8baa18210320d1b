"""moaspec: Mixture of Attentions for Speculative Decoding.

The package is organised as the speculative pipeline reads:

* :mod:`moaspec.models` — the target runtime: loading, a transformer forward that
  exposes every layer's K/V, and a KV cache with O(1) rollback.
* :mod:`moaspec.decoding` — token selection as pure functions and the decoding loops.
* :mod:`moaspec.cli` — the ``moaspec`` command.
"""

from moaspec.errors import MoaspecError

__all__ = ["MoaspecError"]
__version__ = "0.1.0"
