"""Type predicates for values that arrive from outside: Python callers, JSON files, hand-edited configs.

``True`` is an ``int`` in Python and ``"3" < 1`` fails deep inside whatever compares it, so
each entry point that takes numbers checks them with these first and says what it wanted.
"""

from __future__ import annotations

import math
from typing import Any


def whole_number(value: Any) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def real_number(value: Any) -> bool:
    """A finite ``int`` or ``float`` that is not a ``bool``."""
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
