"""The compiled decoder layers over a GGUF target's blocks (``decode_layers.cpp``): the torch path's results
within fp32 noise, and each token's results bitwise the same however many tokens a forward verifies."""

from __future__ import annotations

import pytest
import torch

from moaspec.models import block_kernel
from moaspec.models.gguf_blocks import dense_products
from moaspec.models.transformer import Transformer, tree_mask

needs_kernel = pytest.mark.skipif(block_kernel.cpu_supported() is not None, reason=str(block_kernel.cpu_supported()))
QUANTISED = {"attn_": "Q4_1", "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output.": "Q8_0"}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Transformer:
    """A tiny quantised Qwen2 GGUF target (it has a qkv bias), loaded on its blocks."""
    from moaspec.models import load_model
    from tiny import make_tiny_gguf, make_tiny_model

    root = tmp_path_factory.mktemp("fused")
    gguf = make_tiny_gguf(make_tiny_model(root / "qwen2", "qwen2", seed=9), root / "tiny.q4.gguf", QUANTISED)
    return load_model(str(gguf), device="cpu", with_tokenizer=False).model


def tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 300, (1, n), generator=torch.Generator().manual_seed(seed))


def logits_by_steps(model: Transformer, prefix: torch.Tensor, new: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """The logits of ``new`` after ``prefix``, fed in forwards of ``sizes`` tokens each."""
    cache = model.new_cache(64)
    model(prefix, cache)
    out, at = [], 0
    for n in sizes:
        out.append(model(new[:, at : at + n], cache).logits[0])
        at += n
    return torch.cat(out)


@needs_kernel
def test_the_compiled_layers_give_the_torch_paths_results_within_fp32_noise(target: Transformer) -> None:
    assert target.fused is not None
    prefix, new = tokens(20, 1), tokens(6, 2)
    fused = logits_by_steps(target, prefix, new, [1, 2, 3])
    layers, target.fused = target.fused, None
    try:
        torch_path = logits_by_steps(target, prefix, new, [1, 2, 3])
    finally:
        target.fused = layers
    torch.testing.assert_close(fused, torch_path, atol=2e-5, rtol=0)


@needs_kernel
def test_a_chain_verification_scores_each_token_bitwise_as_steps_do(target: Transformer) -> None:
    prefix, new = tokens(17, 3), tokens(8, 4)
    steps = logits_by_steps(target, prefix, new, [1] * 8)
    assert torch.equal(logits_by_steps(target, prefix, new, [8]), steps)
    assert torch.equal(logits_by_steps(target, prefix, new, [3, 5]), steps)


@needs_kernel
def test_a_tree_verification_scores_its_paths_bitwise_as_steps_do(target: Transformer) -> None:
    # five drafts: 0 and 1 follow the prefix; 2 follows 0; 3 follows 2; 4 follows 1. The path 0 → 2 → 3 sits at
    # tree positions 0, 2, 3, with a sibling's key (1) between its first two keys.
    parents = [-1, -1, 0, 2, 1]
    ancestors = torch.eye(5, dtype=torch.bool)
    for i, p in enumerate(parents):
        while p >= 0:
            ancestors[i, p], p = True, parents[p]
    prefix, drafts = tokens(11, 5), tokens(5, 6)
    cache = target.new_cache(64)
    target(prefix, cache)
    depth = ancestors.sum(1) - 1
    tree = target(drafts, cache, positions=11 + depth, mask=tree_mask(11, ancestors)).logits[0]
    path = torch.tensor([0, 2, 3])
    assert torch.equal(tree[path], logits_by_steps(target, prefix, drafts[:, path], [1, 1, 1]))


@needs_kernel
def test_layer_outputs_asked_for_are_those_of_the_torch_path(target: Transformer) -> None:
    ids = tokens(9, 7)
    fused = target(ids, target.new_cache(16), hidden_after=(0, 2)).layer_hidden
    with dense_products(target):
        assert target.fused is None
        dense = target(ids, target.new_cache(16), hidden_after=(0, 2)).layer_hidden
    assert target.fused is not None
    assert fused.keys() == dense.keys() == {0, 2}
    torch.testing.assert_close(fused[2], dense[2], atol=2e-5, rtol=0)


@needs_kernel
def test_many_sequences_in_one_forward_score_each_token_bitwise_as_its_own_forward_does(target: Transformer) -> None:
    """A server's batch (``forward_many``): a chain, a single token and a draft tree, each after its own prefix, go
    through the compiled layers as one forward, and every logit, final state and cache entry is its own forward's."""
    from moaspec.models.transformer import Call

    depths = [0, 1, 1, 2]  # a root, its two children, and a grandchild under the first
    ancestors = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    prefixes, news = [tokens(n, 30 + n) for n in (5, 17, 11)], [tokens(4, 40), tokens(1, 41), tokens(4, 42)]

    def calls(caches: list) -> list[Call]:  # type: ignore[type-arg]
        chain, one, tree = caches
        return [Call(news[0], chain), Call(news[1], one, logits_at=slice(-1, None)),
                Call(news[2], tree, tree.length + torch.tensor(depths),
                     tree_mask(tree.length, ancestors))]

    alone, together = [target.new_cache(32) for _ in prefixes], [target.new_cache(32) for _ in prefixes]
    for p, a, b in zip(prefixes, alone, together):
        target(p, a), target(p, b)
    want = [target(c.tokens, c.cache, c.positions, c.mask, c.logits_at) for c in calls(alone)]
    layers = target.fused
    calls_made: list[int] = []

    class Counting:  # the batch must go through the compiled layers, as one call
        def __getattr__(self, name: str) -> object:
            if name == "run_many":
                calls_made.append(1)
            return getattr(layers, name)

    target.fused = Counting()
    try:
        got = target.forward_many(calls(together))
    finally:
        target.fused = layers
    assert calls_made == [1]
    for w, g, a, b in zip(want, got, alone, together):
        assert g.start == w.start and b.length == a.length
        assert torch.equal(g.logits, w.logits) and torch.equal(g.hidden, w.hidden)
        assert torch.equal(b.keys[:, :, :, : b.length], a.keys[:, :, :, : a.length])
        assert torch.equal(b.values[:, :, :, : b.length], a.values[:, :, :, : a.length])
    x = torch.zeros(3, target.cfg.hidden_size)
    cos = sin = torch.zeros(3, target.cfg.head_dim)
    with pytest.raises(RuntimeError, match="rows add up"):
        layers.run_many(x, [alone[0].keys], [alone[0].values], cos, sin, [0], [2], [None])


@needs_kernel
def test_the_compiled_layers_refuse_inputs_that_do_not_fit_with_a_clear_error(target: Transformer) -> None:
    cache = target.new_cache(8)
    cos = sin = torch.zeros(1, target.cfg.head_dim)
    with pytest.raises(RuntimeError, match="x must be fp32"):
        target.fused.run(torch.zeros(1, 3), cache.keys, cache.values, cos, sin, 0, None, 0, 1, 0)
    x = torch.zeros(1, target.cfg.hidden_size)
    with pytest.raises(RuntimeError, match="no room in the cache"):
        target.fused.run(x, cache.keys, cache.values, cos, sin, 8, None, 0, 1, 0)
    with pytest.raises(RuntimeError, match="the mask must be"):
        target.fused.run(x, cache.keys, cache.values, cos, sin, 0, torch.ones(1, 5, dtype=torch.bool), 0, 1, 0)


@needs_kernel
def test_forwards_in_several_threads_give_each_its_own_result(target: Transformer) -> None:
    """The compiled layers release the GIL (a server's decoders run side by side) and share no scratch."""
    from concurrent.futures import ThreadPoolExecutor

    jobs = [(tokens(13, 10 + i), tokens(4, 20 + i)) for i in range(4)]
    alone = [logits_by_steps(target, p, n, [1, 3]) for p, n in jobs]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda job: logits_by_steps(target, *job, [1, 3]), jobs))
    assert all(torch.equal(a, b) for a, b in zip(alone, together))
