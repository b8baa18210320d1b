"""The independent drafter: a cut-short copy of the target, and a real Llama model for transformers."""

from __future__ import annotations

import pytest
import torch

from moaspec.drafters.independent import IndependentConfig, IndependentDrafter, to_hf_llama


def drafter_for(loaded, layers: int, down_scale: float = 1.0) -> IndependentDrafter:  # type: ignore[no-untyped-def]
    d = IndependentDrafter(IndependentConfig.for_target(loaded.cfg, layers=layers))
    d.copy_target_layers(loaded.model)
    with torch.no_grad():
        d.blocks[-1].mlp.down.weight.mul_(down_scale)  # before eval(), which packs the weights for inference
    d.attach(loaded.model)
    return d.eval()


def test_a_copy_of_every_layer_is_the_target(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    model = tiny_llama.model
    d = drafter_for(tiny_llama, model.cfg.num_layers)
    tokens = torch.tensor([[5, 17, 42, 7, 99, 3]])
    want = model(tokens, model.new_cache(8)).logits
    got = d.step(d.new_cache(8), tokens, torch.arange(6), None, 6)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_transformers_model_computes_the_same_logits(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    d = drafter_for(tiny_llama, 2, down_scale=1.5)  # no longer a plain copy of the target: the conversion must carry it
    tokens = torch.tensor([[5, 17, 42, 7, 99, 3, 250]])
    hf = to_hf_llama(d)
    with torch.inference_mode():
        want = hf(tokens).logits
    got = d.step(d.new_cache(8), tokens, torch.arange(7), None, 7)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_copying_refuses_another_mlp_width(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    d = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=1, mlp=32))
    with pytest.raises(ValueError, match="MLP width"):
        d.copy_target_layers(tiny_llama.model)


def test_export_hf_writes_a_model_transformers_loads(tiny_llama, tiny_dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from moaspec.cli import main
    from moaspec.drafters.checkpoint import save_drafter, target_identity
    from moaspec.drafters.moa import MoAConfig, MoADrafter

    d = drafter_for(tiny_llama, 2, down_scale=1.5)
    path = save_drafter(d, tmp_path / "independent", target_identity(tiny_llama), dtype=torch.float32)
    model_args = ["--model", str(tiny_dirs["llama"])]
    assert main(["export-hf", "--drafter", str(path), "--output", str(tmp_path / "hf"), *model_args]) == 0
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert AutoTokenizer.from_pretrained(str(tmp_path / "hf")).vocab_size == tiny_llama.tokenizer.vocab_size
    tokens = torch.tensor([[5, 17, 42, 7]])
    with torch.inference_mode():
        torch.testing.assert_close(hf(tokens).logits, d.step(d.new_cache(4), tokens, torch.arange(4), None, 4),
                                   atol=1e-4, rtol=1e-4)
    moa = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "moa", target_identity(tiny_llama))
    assert main(["export-hf", "--drafter", str(moa), "--output", str(tmp_path / "x"), *model_args]) == 2
    assert "not an independent drafter" in capsys.readouterr().err
