"""What decoding costs on this host, measured once per setting and kept, for the cost-aware policy.

The policy (:mod:`moaspec.decoding.policy`) needs the target's forward time for 1..16 new tokens and the
drafter's per draft. These depend on the host (instruction set, cores, threads), the target's weights and
dtype, and the drafter, so they are measured the first time a setting decodes (about a second on a 2-core
CPU: 16 sizes, a few times each) and saved under ``$MOASPEC_TUNED`` (default: the cache's ``tuned``
folder), keyed by all of that; later processes read them. ``moaspec tune`` measures more carefully and
refreshes the drafter's costs from real decoding. While decoding, every cycle's timings refresh the
in-memory copy, and the drafter's costs are written back now and then.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from moaspec.decoding.policy import MAX_NEW, Costs, Policy, default_draft_costs
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_text
from moaspec.models import block_kernel

if TYPE_CHECKING:
    from moaspec.drafters.base import Drafter
    from moaspec.models.loading import LoadedModel
    from moaspec.models.transformer import Transformer

FORMAT = "moaspec-costs"
SAVE_EVERY_S = 60.0  # refreshed costs are written back at most this often
_policies: dict[str, Policy] = {}  # one per setting in this process, shared by every strategy that decodes with it
_lock = threading.Lock()


def machine_key(target: LoadedModel, drafter_path: str | Path | None, drafter: Drafter | None = None) -> dict[str, Any]:
    """What measured costs hold for: these weights and drafter file, on this device, in these dtypes and threads."""
    device = target.model.device
    key: dict[str, Any] = {
        "target": target.fingerprint,
        "target_dtype": str(target.model.dtype).removeprefix("torch."),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu {platform.machine()}",
        "threads": torch.get_num_threads() if device.type == "cpu" else None,
        "torch": torch.__version__,
        "kernel": block_kernel.build_id(),  # another kernel build, or its AVX2 loops beside AVX-512 ones, costs otherwise
        "drafter": None, "drafter_bytes": None, "drafter_mtime_ns": None, "drafter_dtype": None,
    }
    if drafter_path is not None:
        path = Path(drafter_path).resolve()
        weights = path / "model.safetensors"
        stat = weights.stat() if weights.exists() else None
        key.update(drafter=str(path), drafter_bytes=stat.st_size if stat else None,
                   drafter_mtime_ns=stat.st_mtime_ns if stat else None,
                   # "int8" is 8-bit blocks under fp32 activations or aten's int8 under bf16 ones: each costs its own
                   drafter_dtype=None if drafter is None else f"{drafter.precision}/{drafter.weight_dtype}")
    return key


def costs_file(key: dict[str, Any]) -> Path:
    """Where the costs for ``key`` live: ``$MOASPEC_TUNED``, else the cache's ``tuned`` folder."""
    from moaspec.models.sources import cache_root

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    folder = Path(os.environ["MOASPEC_TUNED"]) if os.environ.get("MOASPEC_TUNED") else cache_root() / "tuned"
    return folder / f"{key['target']}-{digest}.costs.json"


def save_costs(key: dict[str, Any], costs: Costs, how: str) -> Path:
    """Write ``costs`` for ``key`` atomically (``how``: what measured them); returns the file."""
    path = costs_file(key)
    record = {"format": FORMAT, "key": key, "how": how, "target_s": [c * costs.scale for c in costs.target],
              "draft_first_s": costs.draft_first, "draft_next_s": costs.draft_next,
              "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    atomic_write_text(path, json.dumps(record, indent=1))
    return path


def load_costs(key: dict[str, Any]) -> Costs | None:
    """The costs saved for ``key``; None when there are none (or they were saved for another setting)."""
    path = costs_file(key)
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MoaspecError(f"cannot read the measured decoding costs {path} ({exc}): delete the file, or run "
                           "`moaspec tune` again") from None
    try:
        if record["format"] != FORMAT or record["key"] != key:
            return None
        target = [float(s) for s in record["target_s"]]
        if len(target) != MAX_NEW:
            return None
        return Costs(target, float(record["draft_first_s"]), float(record["draft_next_s"]))
    except (KeyError, TypeError, ValueError):
        raise MoaspecError(f"{path} is not a file of decoding costs that this moaspec can read: delete the file, "
                           "or run `moaspec tune` again") from None


@torch.inference_mode()
def measure_target(model: Transformer, repeats: int = 3, context: int = 128) -> list[float]:
    """The quickest of ``repeats`` timings of a target forward with 1..:data:`~moaspec.decoding.policy.MAX_NEW` new
    tokens after ``context`` cached ones (one untimed round first; the sizes alternate within each round).

    The quickest, not the median: the policy decides by the table's shape (what a verification of k tokens costs
    against a plain step), while the current load sets its level (:attr:`~moaspec.decoding.policy.Costs.scale`),
    and these timings are kept for later processes. A round slowed by something else on the host (the process's
    own first forwards after loading, another program) must not bend that shape for good."""
    context = max(1, min(context, model.cfg.max_position_embeddings - MAX_NEW - 1))
    ids = (torch.arange(context + MAX_NEW, device=model.device) * 7919 + 13) % model.cfg.vocab_size
    cache = model.new_cache(context + MAX_NEW)
    model(ids[None, :context], cache, logits_at=slice(-1, None))
    times: list[list[float]] = [[] for _ in range(MAX_NEW)]
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for r in range(repeats + 1):
        for k in range(1, MAX_NEW + 1):
            sync()
            t = time.perf_counter()
            model(ids[None, context : context + k], cache)
            sync()
            if r:
                times[k - 1].append(time.perf_counter() - t)
            cache.truncate(context)
    return [min(t) for t in times]


def measured_costs(model: Transformer, repeats: int = 3) -> Costs:
    """The target's costs measured now, the drafter's from them until decoding times it."""
    target = measure_target(model, repeats)
    return Costs(target, *default_draft_costs(target[0]))


def policy_for(target: LoadedModel, drafter_path: str | Path | None, drafter: Drafter | None = None,
               notify: Callable[[str], None] | None = None) -> Policy:
    """The cost-aware policy for this target and drafter on this host: one per process and setting, from the
    costs saved for it, or measured now (and saved) where none are; ``notify`` hears when they are measured."""
    key = machine_key(target, drafter_path, drafter)
    name = json.dumps(key, sort_keys=True)
    with _lock:
        policy = _policies.get(name)
        if policy is None:
            costs = load_costs(key)
            source = str(costs_file(key))
            if costs is None:
                if notify is not None:
                    notify("measuring this host's decoding costs once (about a second) ...")
                costs = measured_costs(target.model)
                source = str(save_costs(key, costs, "measured at first use"))
            policy = _policies[name] = Policy(costs, source=source, keep=_keeper(key, list(costs.target)))
        return policy


def _keeper(key: dict[str, Any], target: list[float]) -> Callable[[Costs], None]:
    """Write the drafter's refreshed costs back, at most every :data:`SAVE_EVERY_S` seconds (never failing a
    generation). The target's stay as measured (``target``): refreshed while decoding they follow the contexts
    and the load of the moment, which the next process need not share; it refreshes its own copy as it decodes.
    The drafter's are saved in the same frame, divided by the target's current ``scale``: a host busy with other
    work slows both alike, and a drafter saved at its loaded cost would look too dear to ever draft again."""
    last = [time.monotonic()]

    def keep(costs: Costs) -> None:
        if time.monotonic() - last[0] < SAVE_EVERY_S:
            return
        last[0] = time.monotonic()
        try:
            save_costs(key, Costs(target, costs.draft_first / costs.scale, costs.draft_next / costs.scale),
                       "drafter refreshed while decoding")
        except OSError:
            pass  # a read-only cache: the next process measures again

    return keep
