"""PNG plots of a benchmark summary: speedup per category and method; accepted-length histograms."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def save_plots(summary: dict[str, Any], output: Path) -> list[Path]:
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
        ax.set_ylabel("speedup vs vanilla (tokens/s)")
        ax.legend()
        fig.tight_layout()
        written.append(output / "speedup.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    hist = summary.get("accepted_histogram", {})
    if hist:
        fig, ax = plt.subplots(figsize=(6, 4))
        for m, h in hist.items():
            total = sum(h.values())
            ks = sorted(int(k) for k in h)
            ax.plot(ks, [h[k] / total for k in ks], marker="o", label=m)
        ax.set_xlabel("tokens added per target forward")
        ax.set_ylabel("fraction of target forwards")
        ax.legend()
        fig.tight_layout()
        written.append(output / "accepted_lengths.png")
        fig.savefig(written[-1], dpi=120)
        plt.close(fig)
    return written
