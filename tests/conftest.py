from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from tiny import make_tiny_model  # noqa: E402

torch.set_num_threads(2)
# settings `moaspec tune` saved on this machine must not change what the tests decode with (CLI subprocesses inherit it)
os.environ["MOASPEC_TUNED"] = tempfile.mkdtemp(prefix="moaspec-tuned-")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The fast tests on tiny random models first, then those on the real default model (marked ``real``):
    a broken change fails in the first minutes, and the real model loads once the rest has passed."""
    items.sort(key=lambda item: item.get_closest_marker("real") is not None)  # stable: file order kept within each


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random model directory per supported family."""
    root = tmp_path_factory.mktemp("tiny")
    return {f: make_tiny_model(root / f, f, seed=i) for i, f in enumerate(["llama", "qwen2", "mistral"])}


@pytest.fixture(scope="session")
def tiny_llama(tiny_dirs: dict[str, Path]):  # type: ignore[no-untyped-def]
    from moaspec.models import load_model_dir

    return load_model_dir(tiny_dirs["llama"], device="cpu")


@pytest.fixture(scope="session")
def tiny_moa_dir(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    """An untrained MoA drafter saved for ``tiny_llama``: decoding with it must still be lossless."""
    from moaspec.drafters.checkpoint import save_drafter, target_identity
    from moaspec.drafters.moa import MoAConfig, MoADrafter

    torch.manual_seed(5)
    return save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path_factory.mktemp("moa") / "moa",
                        target_identity(tiny_llama))


@pytest.fixture(scope="module")
def tiny_moa(tiny_llama):  # type: ignore[no-untyped-def]
    """An untrained MoA drafter (seed 3) attached to ``tiny_llama``, one per test module: a module's server and its
    clients share it, and another module's state never reaches it."""
    from moaspec.drafters.moa import MoAConfig, MoADrafter

    torch.manual_seed(3)
    d = MoADrafter(MoAConfig.for_target(tiny_llama.cfg))
    d.attach(tiny_llama.model)
    return d.eval()


@pytest.fixture(scope="session")
def real_model():  # type: ignore[no-untyped-def]
    """The default target (SmolLM2-135M-Instruct), loaded once per session."""
    from moaspec.models import load_model

    return load_model(device="cpu")


SLOW_CHUNK = 2  # tokens per prefill chunk under ``slow_prefill``: decoding steps are 1 token, chain verifications more


@pytest.fixture()
def slow_prefill(tiny_llama, monkeypatch: pytest.MonkeyPatch) -> list[int]:  # type: ignore[no-untyped-def]
    """``tiny_llama`` prefilling in chunks of 2 tokens, 50 ms each, as a long prompt on a real model would take
    seconds; the list counts the chunks run (a server's abandoned prefill must stop adding to it)."""
    from moaspec.models import transformer

    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", SLOW_CHUNK)
    model = tiny_llama.model
    chunks: list[int] = []

    def slow(h, *args, _run=model.run_blocks, **kwargs):  # type: ignore[no-untyped-def]
        if h.shape[1] == SLOW_CHUNK:
            chunks.append(1)
            time.sleep(0.05)
        return _run(h, *args, **kwargs)

    monkeypatch.setattr(model, "run_blocks", slow)
    return chunks


@pytest.fixture(scope="module")
def tiny_data(tiny_llama, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """Distillation data (one set per test module) written by the tiny target (any non-empty prompt accepted: it writes gibberish)."""
    from moaspec.training.datagen import DataConfig, generate_dataset
    from tiny import accepting_gibberish

    out = tmp_path_factory.mktemp("data") / "d"
    with accepting_gibberish():
        generate_dataset(tiny_llama, out, DataConfig(examples=48, shard_size=16, batch_size=16, max_query_tokens=16,
                                                     max_answer_tokens=48, multi_turn=0.3), progress=False)
    return out
