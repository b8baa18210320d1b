"""Drafters: the MoA drafter, its checkpoints, and the drafters shipped with moaspec."""

from __future__ import annotations

import json
from pathlib import Path

from moaspec.drafters.checkpoint import DrafterError, load_drafter, serves
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.models.loading import LoadedModel

SHIPPED = Path(__file__).resolve().parent.parent / "assets" / "drafters"


def shipped_drafter(target: LoadedModel, kind: str = "moa") -> Path | None:
    """The drafter of ``kind`` shipped for this target (its weights, or another quantisation of them:
    :func:`~moaspec.drafters.checkpoint.serves`), if any.

    MoA is what moaspec decodes with; an EAGLE drafter ships beside it as the baseline that
    ``moaspec bench --methods eagle2`` compares against, so the comparison runs out of the box.
    """
    for cfg in sorted(SHIPPED.glob("*/config.json")):
        try:
            meta = json.loads(cfg.read_text())
            if meta["kind"] == kind and serves(meta["target"], target):
                return cfg.parent
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


__all__ = ["DrafterError", "MoAConfig", "MoADrafter", "load_drafter", "shipped_drafter"]
