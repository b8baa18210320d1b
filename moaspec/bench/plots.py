"""PNG plots of a benchmark summary: speedup per category and method; accepted-length histograms."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_plots(summary: dict[str, Any], output: Path, baseline: str = "vanilla") -> list[Path]:
    """``speedup.png`` (each method's tokens/s per category over ``baseline``'s) and ``accepted_lengths.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    res = summary["results"]
    methods = [m for m in res if res[m]["overall"].get("speedup") is not None]
    if methods:
        cats = list(res[methods[0]])
        fig, ax = plt.subplots(figsize=(max(6, len(cats) * 1.4), 4))
        width = 0.8 / len(methods)
        for i, m in enumerate(methods):
            ax.bar([c + i * width for c in range(len(cats))], [res[m][c]["speedup"] for c in cats], width, label=m)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xticks([c + width * (len(methods) - 1) / 2 for c in range(len(cats))], cats, rotation=20)
        written.append(_save(fig, ax, f"speedup vs {baseline} (tokens/s)", output / "speedup.png"))
    hist = summary.get("accepted_histogram", {})
    if hist:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m, h in hist.items():
            total = sum(h.values())
            ks = sorted(int(k) for k in h)
            ax.plot(ks, [h[k] / total for k in ks], marker="o", label=m)
        ax.set_xlabel("tokens added per target forward")
        written.append(_save(fig, ax, "fraction of target forwards", output / "accepted_lengths.png"))
    return written


def _save(fig, ax, ylabel: str, path: Path) -> Path:  # type: ignore[no-untyped-def]
    import matplotlib.pyplot as plt

    ax.set_ylabel(ylabel)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)  # beside the plot: never over a bar
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
