"""Decoding settings measured on this machine by ``moaspec tune``, used where no decoding option is given.

The built-in defaults (prompt lookup 10, else chains of 2) were measured on 2-core CPUs;
elsewhere the best chain length or tree differs (a GPU verifies dozens of tokens for
the price of one, so the paper's 62-node tree pays there). ``moaspec tune`` times a
grid of settings against plain decoding and saves the fastest here; ``generate``,
``serve`` and :func:`moaspec.load` then use it whenever none of chain, tree, lookup or
confidence is given. A saved result is keyed by everything that decides what is fastest
(the target's weights, the drafter's file, device, dtypes and CPU threads), so it is
never applied to another setting; a changed drafter file makes it stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moaspec.decoding.lookup import DEFAULT_LOOKUP
from moaspec.decoding.speculative import DEFAULT_CHAIN
from moaspec.decoding.tree import TreeShape
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_text

if TYPE_CHECKING:
    from moaspec.drafters.base import Drafter
    from moaspec.models.loading import LoadedModel

FORMAT = "moaspec-tuned"


@dataclass(frozen=True)
class Decoding:
    """A drafter's decoding settings: chains of ``chain`` or a ``tree``, after up to ``lookup`` prompt-lookup drafts;
    or, with ``drafts`` false, plain decoding, where no setting that drafts was faster (a CPU whose target step is
    cheap beside a drafting step)."""

    chain: int = DEFAULT_CHAIN
    tree: TreeShape | None = None
    lookup: int = DEFAULT_LOOKUP
    drafts: bool = True

    def __post_init__(self) -> None:
        if self.chain < 1 or self.lookup < 0:
            raise MoaspecError(f"a chain needs >= 1 draft and lookup >= 0 drafts, got {self.chain} and {self.lookup}")

    def name(self) -> str:
        if not self.drafts:
            return "vanilla"  # as the benchmark names plain decoding
        shape = (f"tree-{self.tree.depth}x{self.tree.top_k}-{self.tree.total}" if self.tree is not None
                 else f"chain-{self.chain}")
        return f"lookup-{self.lookup}+{shape}" if self.lookup else shape

    def to_json(self) -> dict[str, Any]:
        tree = None if self.tree is None else {"depth": self.tree.depth, "top_k": self.tree.top_k, "total": self.tree.total}
        return {"chain": self.chain, "tree": tree, "lookup": self.lookup, "drafts": self.drafts}

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Decoding:
        tree = obj["tree"]
        return cls(int(obj["chain"]), None if tree is None else TreeShape(int(tree["depth"]), int(tree["top_k"]),
                                                                          int(tree["total"])), int(obj["lookup"]),
                   bool(obj.get("drafts", True)))  # settings saved before plain decoding could win draft


PLAIN = Decoding(lookup=0, drafts=False)


def machine_key(target: LoadedModel, drafter_path: str | Path, drafter: Drafter | None = None) -> dict[str, Any]:
    """What a tuned setting holds for: these weights and drafter file, on this device, in these dtypes and threads."""
    import torch

    path = Path(drafter_path).resolve()
    weights = path / "model.safetensors"
    stat = weights.stat() if weights.exists() else None
    device = target.model.device
    return {
        "target": target.fingerprint,
        "target_dtype": str(target.model.dtype).removeprefix("torch."),
        "drafter": str(path),
        "drafter_bytes": stat.st_size if stat else None,
        "drafter_mtime_ns": stat.st_mtime_ns if stat else None,
        "drafter_dtype": None if drafter is None else drafter.precision,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
    }


def tuned_file(key: dict[str, Any]) -> Path:
    """Where the setting for ``key`` lives: ``$MOASPEC_TUNED``, else the cache's ``tuned`` folder."""
    from moaspec.models.sources import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(os.environ["MOASPEC_TUNED"]) if os.environ.get("MOASPEC_TUNED") else cache_root() / "tuned"
    return folder / f"{key['target']}-{digest}.json"


def save_tuned(key: dict[str, Any], best: Decoding, results: dict[str, Any]) -> Path:
    """Write the winner and the measurements behind it, atomically; returns the file."""
    path = tuned_file(key)
    record = {"format": FORMAT, "key": key, "decoding": best.to_json(), "name": best.name(),
              "measured": datetime.now(UTC).isoformat(timespec="seconds"), "results": results}
    atomic_write_text(path, json.dumps(record, indent=1))
    return path


def load_tuned(key: dict[str, Any]) -> tuple[Decoding, Path] | None:
    """The setting tuned for ``key``, and its file; None when there is none (or a stale one)."""
    path = tuned_file(key)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoaspecError(f"cannot read the tuned decoding settings {path} ({exc}): delete the file, or run "
                           "`moaspec tune` again") from None
    try:
        if record["format"] != FORMAT or record["key"] != key:
            return None
        return Decoding.from_json(record["decoding"]), path
    except (KeyError, TypeError, ValueError, MoaspecError):
        raise MoaspecError(f"{path} is not a tuned decoding setting that this moaspec can read: delete the file, "
                           "or run `moaspec tune` again") from None
