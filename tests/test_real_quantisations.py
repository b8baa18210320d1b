"""The default model as the files people download, made by llama.cpp's own quantiser (``benchmarks/
quantise_default.py``, from the shipped Q4_1 file): every weight of each mixed file on the block path, the shipped
drafter serving it, and greedy speculation equal to plain decoding on it. Skipped without llama-cpp-python, which is
not a dependency of the project."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.speculative import generate_chain
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.drafters.proposers import MoAProposer
from moaspec.models import load_model
from moaspec.models.block_kernel import cpu_supported
from moaspec.models.packed_linear import Linear

pytestmark = pytest.mark.real

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("llama_cpp")
    from moaspec.models.sources import default_gguf_path
    from quantise_default import quantise

    out = tmp_path_factory.mktemp("quantised")
    for kind in ("Q4_K_M", "Q5_K_M"):
        quantise(default_gguf_path(), out / f"SmolLM2-135M-Instruct.{kind}.gguf", kind, threads=2)
    return out


@pytest.mark.parametrize("kind", ["Q4_K_M", "Q5_K_M"])
def test_a_k_quant_file_reads_every_weight_as_blocks_and_speculates_losslessly(files: Path, kind: str) -> None:
    if cpu_supported() is not None:
        pytest.skip(str(cpu_supported()))
    lm = load_model(str(files / f"SmolLM2-135M-Instruct.{kind}.gguf"), device="cpu")
    assert all(m.blocks is not None for m in lm.model.modules() if isinstance(m, Linear))
    path = shipped_drafter(lm)
    assert path is not None, "the shipped drafter serves every quantisation of its target"
    proposer = MoAProposer(load_drafter(path, lm))
    cfg = GenerationConfig(max_new_tokens=48)
    for question in ("Write a Python function that reverses a list.", "What is the capital of France?"):
        prompt = encode_chat(lm.tokenizer, chat_messages(question))
        assert generate_chain(lm.model, lm.tokenizer, proposer, prompt, cfg, draft_len=2).token_ids == generate(
            lm.model, lm.tokenizer, prompt, cfg).token_ids
