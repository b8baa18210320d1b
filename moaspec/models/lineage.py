"""Which model a target is, whatever file type its weights were quantised to.

A drafter learns from its target's hidden states and tokens, so it depends on the target's
architecture and shapes, its vocabulary and tokenizer, and the model the weights came from, not on how
those weights were rounded: the same model as Q4_1, Q4_K_M or Q6_K gives states that differ slightly,
and a drafter trained on one serves the others (at some cost in acceptance, measured per file in
BENCHMARKS.md). The weight fingerprint (:func:`~moaspec.models.loading.fingerprint`) still tells them
apart; the lineage is what they share.

The source model is named only by a GGUF file's ``general.*`` keys (organisation, base name, fine-tune,
size label: what llama.cpp's converter writes from the original repository, and its quantiser copies).
A target with no such name (a HF directory) has no lineage, so drafters match it by fingerprint alone.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from moaspec.fileio import atomic_write_text
from moaspec.models.sources import recorded_gguf

SOURCE_KEYS = ("general.organization", "general.basename", "general.finetune", "general.size_label", "general.name")
KEPT = "moaspec-lineage.json"  # beside a converted model: reading a GGUF's header takes seconds


def gguf_source(gguf: Path) -> dict[str, str]:
    """The ``general.*`` keys of :data:`SOURCE_KEYS` that ``gguf`` holds: where its weights came from."""
    from gguf import GGUFReader

    fields = GGUFReader(str(gguf)).fields
    return {k: str(fields[k].contents()) for k in SOURCE_KEYS if k in fields}


def lineage(path: Path, identity: dict[str, Any], tokenizer: Any) -> str | None:
    """A short hash of ``identity`` (the config's, :meth:`~moaspec.models.config.ModelConfig.identity`), the
    tokenizer's vocabulary (``tokenizer``, or ``path``'s when ``None``) and the source model named by the GGUF file
    the model directory ``path`` was converted from; ``None`` if ``path`` is no such conversion or the file names no
    source. Kept in ``path``."""
    kept = path / KEPT
    try:
        return json.loads(kept.read_text())["lineage"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    gguf = recorded_gguf(path)
    if gguf is None or not Path(gguf).is_file():
        return None
    source = gguf_source(Path(gguf))
    found = None
    if source:
        h = hashlib.sha256(json.dumps({"config": identity, "source": source}, sort_keys=True).encode())
        if tokenizer is None:
            from moaspec.models.loading import load_tokenizer  # loading imports this module

            tokenizer = load_tokenizer(path)
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        found = h.hexdigest()[:16]
    try:
        atomic_write_text(kept, json.dumps({"lineage": found, "source": source}))
    except OSError:
        pass  # a read-only cache: worked out again next time
    return found
