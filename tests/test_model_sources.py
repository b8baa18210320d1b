"""Where a GGUF model's converted copy lives: one per file content, not one per installation."""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import pytest

from moaspec.models import sources


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOASPEC_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def digests(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the files whose bytes were hashed, in order."""
    seen: list[str] = []
    real = hashlib.file_digest

    def counting(f, digest):  # type: ignore[no-untyped-def]
        seen.append(Path(f.name).name)
        return real(f, digest)

    monkeypatch.setattr(sources.hashlib, "file_digest", counting)
    return seen


def _gguf(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_two_installations_of_one_file_share_its_conversion(tmp_path: Path, cache: Path, digests: list[str]) -> None:
    first = _gguf(tmp_path / "venv1" / "m.gguf", b"GGUF" + bytes(range(256)) * 10)
    second = _gguf(tmp_path / "venv2" / "m.gguf", first.read_bytes())
    dest = sources._gguf_cache_dir(first)
    assert dest.parent == cache / "models" and dest.name.startswith("m-")
    assert sources._gguf_cache_dir(second) == dest
    # a conversion made for the first is what the second resolves to, with nothing converted again
    dest.mkdir(parents=True)
    (dest / "moaspec-source.json").write_text("{}")
    assert sources.resolve_model(str(second)) == dest


def test_the_digest_is_computed_once_per_file_and_again_when_it_changes(
        tmp_path: Path, cache: Path, digests: list[str]) -> None:
    path = _gguf(tmp_path / "m.gguf", b"GGUF one")
    dest = sources._gguf_cache_dir(path)
    assert sources._gguf_cache_dir(path) == dest
    assert digests == ["m.gguf"]  # the second lookup read the stamp
    path.write_bytes(b"GGUF two, another model")
    os.utime(path, ns=(1, 1))  # a changed file: other size and mtime
    changed = sources._gguf_cache_dir(path)
    assert changed != dest and len(digests) == 2


def test_a_damaged_stamp_is_recomputed(tmp_path: Path, cache: Path, digests: list[str]) -> None:
    path = _gguf(tmp_path / "m.gguf", b"GGUF bytes")
    dest = sources._gguf_cache_dir(path)
    (stamp,) = (cache / "models" / ".stamps").iterdir()
    stamp.write_text("")
    assert sources._gguf_cache_dir(path) == dest and len(digests) == 2


@pytest.mark.parametrize(("scaling", "says"), [("rope_freqs", "per dimension (a rope_freqs tensor"),
                                               ("yarn", "scales its RoPE (yarn)"), (None, None)])
def test_a_gguf_whose_rope_scaling_transformers_would_drop_is_refused(tmp_path: Path, scaling: str | None,
                                                                      says: str | None) -> None:
    """transformers' GGUF reader keeps no RoPE scaling for these families: converting such a file would make another
    model (Llama 3.1 rotating as Llama 3.0) under the same name, so it is refused before conversion, in one line."""
    import numpy as np
    from gguf import GGUFWriter, RopeScalingType

    from moaspec.errors import ModelLoadError

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if scaling == "yarn":
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(4.0)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    if scaling == "rope_freqs":
        writer.add_tensor("rope_freqs.weight", np.ones(2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if says is None:
        sources.refuse_unreadable_rope(path)  # plain RoPE: on to transformers' reader
        path.write_bytes(path.read_bytes()[:-20])  # cut short: the last tensor's data incomplete
        with pytest.raises(ModelLoadError, match="damaged or cut short"):
            sources.refuse_unreadable_rope(path)
    else:
        with pytest.raises(ModelLoadError, match=re.escape(says)):
            sources.convert_gguf(path, tmp_path / "converted")
        assert not (tmp_path / "converted").exists()



@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_gguf_files_of_other_families_convert_to_the_same_model(tmp_path: Path, cache: Path, family: str) -> None:
    """A Qwen2 or Qwen3 GGUF (q/k/v biases and an untied head; query/key norms) converts through transformers' reader
    into the model it was written from: same logits, same tokenizer, same chat template."""
    import torch

    from moaspec.chat import chat_messages, encode_chat
    from moaspec.models import load_model_dir
    from tiny import make_tiny_gguf, make_tiny_model

    source = make_tiny_model(tmp_path / family, family, **({"head_dim": 128} if family == "qwen3" else {}))
    converted = load_model_dir(sources.resolve_model(str(make_tiny_gguf(source, tmp_path / f"{family}.gguf"))),
                               device="cpu")
    original = load_model_dir(source, device="cpu")
    assert (converted.cfg.family, converted.cfg.qk_norm) == (family, family == "qwen3")
    ids = torch.randint(0, original.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(12))
    torch.testing.assert_close(converted.model(ids, converted.model.new_cache(64)).logits,
                               original.model(ids, original.model.new_cache(64)).logits, atol=1e-5, rtol=0)
    messages = chat_messages("The quick brown fox")
    assert encode_chat(converted.tokenizer, messages) == encode_chat(original.tokenizer, messages)


def test_the_default_models_name_is_taken_in_any_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--model SmolLM2` named the default in other letters and was refused as a missing path."""
    from moaspec.errors import ModelLoadError

    converted = tmp_path / "converted"
    converted.mkdir()
    (converted / "moaspec-source.json").write_text("{}")
    monkeypatch.setattr(sources, "default_gguf_path", lambda: tmp_path / "default.gguf")
    monkeypatch.setattr(sources, "_gguf_cache_dir", lambda gguf: converted)
    monkeypatch.chdir(tmp_path)
    assert sources.resolve_model("SmolLM2") == sources.resolve_model(sources.DEFAULT_MODEL) == converted
    with pytest.raises(ModelLoadError, match="does not exist \\(--model takes a model directory, a .gguf file, or"):
        sources.resolve_model("SmolLM3")


def test_a_converted_model_is_named_for_people_without_its_digest(tmp_path: Path, cache: Path) -> None:
    """`moaspec serve` serves a converted GGUF by its file's stem: the digest and cache format were left in the name
    since the conversion cache added the format, so the README's model id got a 404."""
    path = _gguf(tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF bytes")
    assert sources.model_name(sources._gguf_cache_dir(path)) == "SmolLM2-135M-Instruct.Q4_1"
    assert sources.model_name(tmp_path / "Qwen2.5-0.5B-Instruct") == "Qwen2.5-0.5B-Instruct"  # a directory of one's own
