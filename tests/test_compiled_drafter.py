"""Drafters on 8-bit blocks of their weights with compiled layers (moaspec.drafters.compiled_layers): the Q8_0
rounding, steps that equal torch's on the rounded weights within fp32 noise, and copies that training drops."""

from __future__ import annotations

import pytest
import torch

from moaspec.drafters.base import Drafter
from moaspec.drafters.eagle import EagleConfig, EagleDrafter
from moaspec.drafters.layers import DecoderLayer
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.models.block_kernel import BlockWeights, kernel
from moaspec.models.packed_linear import Linear
from moaspec.models.transformer import tree_mask

pytestmark = pytest.mark.skipif(kernel() is None, reason="the compiled block kernel does not build or run here")


def test_q8_0_blocks_round_each_weight_to_its_blocks_step() -> None:
    """d = max|w| / 127 per block of 32, stored in fp16, q = round(w / d): each weight within half a step, a block of
    zeros stays zeros, and a width that is not whole blocks is refused."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 96, generator=g) * torch.tensor([1e-2, 1.0, 30.0]).repeat_interleave(32)
    w[2, 32:64] = 0
    b = BlockWeights.q8_0(w)
    d = (w.reshape(6, 3, 32).abs().amax(-1) / 127).half()
    assert b.bits == 8 and torch.equal(b.scales, d) and not b.offsets.any()
    step = d.float().repeat_interleave(32, dim=1)
    assert ((b.dequantise() - w).abs() <= step * 0.5 * (1 + 1e-6)).all()
    assert not b.dequantise()[2, 32:64].any()
    assert b.codes.view(torch.int8).abs().amax() == 127
    with pytest.raises(ValueError, match="multiple of 32"):
        BlockWeights.q8_0(torch.randn(4, 40))


def on_rounded_weights(drafter: Drafter, like: Drafter) -> Drafter:
    """``drafter`` (fp32, torch's path) given the weights ``like``'s 8-bit blocks stand for."""
    mine = dict(drafter.named_modules())
    for name, m in like.named_modules():
        if isinstance(m, Linear) and m.blocks is not None:
            mine[name].weight.data.copy_(m.blocks.dequantise())
    assert like._borrowed["head"].blocks is not None
    drafter._borrowed["head"].weight.data.copy_(like._borrowed["head"].blocks.dequantise())
    return drafter.eval()


def pair(tiny_llama, kind: str) -> tuple[Drafter, Drafter]:  # type: ignore[no-untyped-def]
    """The same random drafter twice: on 8-bit blocks with compiled layers, and in torch on the blocks' values."""
    def make() -> Drafter:
        torch.manual_seed(7)
        cfg = tiny_llama.cfg
        d: Drafter = (MoADrafter(MoAConfig.for_target(cfg, draft_vocab_size=100)) if kind == "moa"
                      else EagleDrafter(EagleConfig.for_target(cfg, draft_vocab_size=100)))
        d.set_draft_vocab(torch.arange(100))
        d.attach(tiny_llama.model)
        return d.eval()

    compiled = make().use_int8()
    assert all(m.compiled is not None for m in compiled.modules() if isinstance(m, DecoderLayer))
    return compiled, on_rounded_weights(make(), compiled)


def test_moa_steps_on_blocks_are_torchs_on_the_rounded_weights(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Memory entries of a few verified tokens (Layer Self-Attention over their layers, one compiled call per token), a
    prompt's catch-up, one-token chain steps and a three-token tree level give the same entries and draft logits
    through the compiled layers as through torch on the weights the blocks stand for, up to fp32 summation order."""
    compiled, reference = pair(tiny_llama, "moa")
    model = tiny_llama.model
    prompt = torch.tensor([[5, 17, 42, 7, 9, 11, 3, 60, 61, 2]])
    cache = model.new_cache(64)
    model(prompt, cache)
    logits, memories = [], []
    for d in (compiled, reference):
        state = d.new_state(64)
        d.observe(state, cache, 7)  # one compiled LSA call per token
        d.observe(state, cache, 10)
        memories.append(torch.cat([state.memory.keys[..., :10, :], state.memory.values[..., :10, :]]))
        out = [d.step(state, prompt, torch.arange(10), None, 1)]
        for i, token in enumerate([4, 8]):
            out.append(d.step(state, torch.tensor([[token]]), torch.tensor([10 + i]), None, 1))
        level = tree_mask(state.sa.length, torch.tensor([[True, False, False], [True, True, False], [True, False, True]]))
        out.append(d.step(state, torch.tensor([[20, 21, 22]]), torch.tensor([12, 13, 13]), level, 3))
        logits.append(torch.cat([o.reshape(-1, o.shape[-1]) for o in out]))
    torch.testing.assert_close(memories[0], memories[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[0].argmax(-1), logits[1].argmax(-1))


def test_eagle_steps_on_blocks_are_torchs_on_the_rounded_weights(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    compiled, reference = pair(tiny_llama, "eagle")
    g = torch.Generator().manual_seed(1)
    tokens, features = torch.randint(0, 300, (1, 6), generator=g), torch.randn(1, 6, 64, generator=g)
    outs = []
    for d in (compiled, reference):
        cache = d.new_cache(32)
        first = d.step(cache, tokens, features, torch.arange(6), None, 1)
        second = d.step(cache, tokens[:, :1], first[1], torch.tensor([6]), None, 1)
        outs.append(torch.cat([first[0], second[0], first[1], second[1]], dim=-1))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_training_drops_the_copies_and_eval_makes_them_again(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Blocks made from weights that training then moves would go stale; the fingerprint is the fp32 drafter's."""
    compiled, reference = pair(tiny_llama, "moa")
    layers = [m for m in compiled.modules() if isinstance(m, DecoderLayer)]
    linears = [m for m in compiled.modules() if isinstance(m, Linear)]
    compiled.train()
    assert all(m.compiled is None for m in layers) and all(m.blocks is None for m in linears)
    compiled.eval()
    assert all(m.compiled is not None for m in layers) and all(m.blocks is not None for m in linears)
    assert compiled.precision == "int8" and compiled.weight_dtype == torch.float32
    compiled.use_int8(False)
    assert all(m.compiled is None for m in layers) and compiled._borrowed["head"].blocks is None
    assert compiled.precision == "float32"
