"""``python -m moaspec.cli``: the ``moaspec`` command (benchmarks start servers this way)."""

import sys

from moaspec.cli import main

sys.exit(main())
