"""A server's resident memory over a load run: sampling it, and summarising the samples so that a
plateau can be told apart from slow growth (shared by serve_load.py and cs_reliability.py).

Not run on its own; it is imported by, for example:

    .venv/bin/python benchmarks/cs_reliability.py --clients 16 --seconds 1200 --output bench-out/cs-reliability.json
"""

from __future__ import annotations

import itertools
import re
import statistics
from pathlib import Path


def rss_mb(pid: int) -> float:
    """Resident set size of process `pid` in MiB (Linux /proc)."""
    return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1)) / 1024  # type: ignore[union-attr]


def quarters(samples: list[float]) -> list[list[float]]:
    """The samples in four consecutive runs of (nearly) equal length, none empty."""
    n = len(samples)
    bounds = [round(n * k / 4) for k in range(5)]
    return [samples[a:b] for a, b in itertools.pairwise(bounds) if b > a]


def rss_summary(samples: list[float]) -> dict | None:
    """First, max and last sample, the max of each half, and the max and median of each quarter.

    A plateau shows as quarters that stop rising, slow growth as ones that keep rising; the median,
    unlike the max, is not lifted by a few long prompts that happen to coincide.
    """
    if not samples:
        return None
    half = len(samples) // 2
    by_quarter = quarters(samples)
    return {"first": round(samples[0], 1), "max": round(max(samples), 1), "last": round(samples[-1], 1),
            "max_first_half": round(max(samples[:half] or samples), 1),
            "max_second_half": round(max(samples[half:]), 1),
            "max_by_quarter": [round(max(q), 1) for q in by_quarter],
            "median_by_quarter": [round(statistics.median(q), 1) for q in by_quarter]}
