"""Progress bars that read well in a terminal and in a log file alike.

Long jobs (data, training, benchmarks) run under ``nohup`` with stderr in a log. A
plain tqdm bar redraws itself with carriage returns ten times a second, which turns a
log into one enormous line; off a terminal, the bar here writes a whole line at most
once every :data:`LOG_INTERVAL_S` seconds instead (and on closing).
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0
LOG_FORMAT = "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) [{elapsed}<{remaining}, {rate_fmt}{postfix}]"


class _Lines:
    """A stream for tqdm that turns each redraw into one line of the real stderr."""

    def write(self, text: str) -> None:
        text = text.strip("\r\n")
        if text:
            sys.stderr.write(text + "\n")

    def flush(self) -> None:
        sys.stderr.flush()


def progress_bar(**kwargs: Any) -> tqdm:
    """``tqdm(**kwargs)`` on a terminal; one line per :data:`LOG_INTERVAL_S` seconds otherwise."""
    if sys.stderr.isatty():
        return tqdm(**kwargs)
    return tqdm(file=_Lines(), mininterval=LOG_INTERVAL_S, maxinterval=LOG_INTERVAL_S, bar_format=LOG_FORMAT, **kwargs)
