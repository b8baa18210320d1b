"""EAGLE-2 dynamic-tree decoding: greedy identical to vanilla, tree verification keeps the target's distribution."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.tree import DraftTree, TreeShape, generate_tree
from moaspec.decoding.verify import verify_tree
from moaspec.models.block_kernel import kernel
from moaspec.models.kv_cache import KVCache
from test_speculative import PROMPTS, chi_square_p, eagle_proposer, independent_proposer, moa_proposer


class OracleTree:
    """A tree whose first branch is the target's greedy continuation, with wrong siblings at every level."""

    def __init__(self, model, depth: int = 4, width: int = 3) -> None:  # type: ignore[no-untyped-def]
        self.model, self.depth, self.width = model, depth, width

    def begin(self, target_cache: KVCache, hidden: torch.Tensor) -> None:
        pass

    def propose_tree(self, tokens: Sequence[int], shape: TreeShape) -> DraftTree:
        seq = list(tokens)
        V = self.model.cfg.vocab_size
        toks, parents, depths = [seq[-1]], [-1], [0]
        parent = 0
        for level in range(1, self.depth + 1):
            logits = self.model(torch.tensor([seq]), self.model.new_cache(len(seq))).logits[0, -1]
            best = int(logits.argmax())
            first_child = len(toks)
            for w in range(self.width):  # wrong siblings first, then the right one
                toks.append((best + self.width - w) % V if w < self.width - 1 else best)
                parents.append(parent)
                depths.append(level)
            parent = first_child + self.width - 1
            seq.append(best)
        n = min(len(toks), shape.total)
        return DraftTree(torch.tensor(toks[:n]), parents[:n], torch.tensor(depths[:n]))

    def commit(self, verified: int, path: Sequence[int] | None = None, hidden=None) -> None:  # type: ignore[no-untyped-def]
        pass


@pytest.mark.parametrize("kind", ["oracle", "moa", "moa-tli1", "moa-vocab", "moa-no-lsa", "moa-final", "moa-newest", "eagle",
                                  "independent", "independent-whole", "moa-int8", "eagle-int8", "moa-q8", "eagle-q8"])
@pytest.mark.parametrize("shape", [TreeShape(1, 1, 2), TreeShape(3, 2, 8), TreeShape(5, 4, 24)])
def test_greedy_tree_equals_vanilla(tiny_llama, kind: str, shape: TreeShape) -> None:  # type: ignore[no-untyped-def]
    if kind.endswith("-q8") and kernel() is None:
        pytest.skip("the compiled block kernel does not build or run here")
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    for prompt in PROMPTS:
        proposer = {
            "oracle": lambda: OracleTree(model), "moa": lambda: moa_proposer(tiny_llama),
            "moa-tli1": lambda: moa_proposer(tiny_llama, tli=1), "moa-vocab": lambda: moa_proposer(tiny_llama, vocab=100),
            "eagle": lambda: eagle_proposer(tiny_llama, vocab=100),
            "independent": lambda: independent_proposer(tiny_llama, vocab=100),
            "independent-whole": lambda: independent_proposer(tiny_llama, layers=tiny_llama.cfg.num_layers),
            "moa-no-lsa": lambda: moa_proposer(tiny_llama, memory="last-layer"),
            "moa-final": lambda: moa_proposer(tiny_llama, memory="lsa+final"),
            "moa-newest": lambda: moa_proposer(tiny_llama, newest=True),
            "moa-int8": lambda: moa_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16, int8=True),
            "eagle-int8": lambda: eagle_proposer(tiny_llama, vocab=100, dtype=torch.bfloat16, int8=True),
            "moa-q8": lambda: moa_proposer(tiny_llama, vocab=100, int8=True),
            "eagle-q8": lambda: eagle_proposer(tiny_llama, vocab=100, int8=True),
        }[kind]()
        want = generate(model, tok, prompt, cfg)
        got = generate_tree(model, tok, proposer, prompt, cfg, shape)
        assert got.token_ids == want.token_ids
        if kind in ("oracle", "independent-whole") and shape.total >= 13:
            assert got.tau > 3.5


def test_tree_respects_budget_and_context(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    model, tok = tiny_llama.model, tiny_llama.tokenizer
    for budget in (1, 3, 7):
        cfg = GenerationConfig(max_new_tokens=budget)
        want = generate(model, tok, PROMPTS[0], cfg)
        got = generate_tree(model, tok, OracleTree(model), PROMPTS[0], cfg, TreeShape(4, 3, 13))
        assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason)
    long_prompt = list(range(3, 3 + model.cfg.max_position_embeddings - 5))
    cfg = GenerationConfig(max_new_tokens=50, ignore_eos=True)
    got = generate_tree(model, tok, moa_proposer(tiny_llama), long_prompt, cfg, TreeShape(4, 3, 13))
    assert got.token_ids == generate(model, tok, long_prompt, cfg).token_ids and len(got.token_ids) == 5


def test_verify_tree_greedy_follows_the_argmax() -> None:
    # root 0 with children 1 (tok 5), 2 (tok 6); node 2 has child 3 (tok 7)
    tokens, parents = torch.tensor([0, 5, 6, 7]), [-1, 0, 0, 2]
    logits = torch.zeros(4, 10)
    logits[0, 6] = logits[2, 7] = logits[3, 1] = 5.0
    assert verify_tree(tokens, parents, logits, True, None) == ([2, 3], 1)
    logits[2, 7], logits[2, 8] = 0.0, 5.0
    assert verify_tree(tokens, parents, logits, True, None) == ([2], 8)


@pytest.mark.parametrize("seed", [0, 1])
def test_verify_tree_sampling_draws_from_the_target(seed: int) -> None:
    """Whatever the children are, the first token after the root follows p; so does the next one."""
    g = torch.Generator().manual_seed(seed)
    V = 6
    tokens, parents = torch.tensor([0, 4, 1, 2, 3]), [-1, 0, 0, 1, 1]  # root → {4, 1}; 4 → {2, 3}
    p = torch.softmax(torch.randn(5, V, generator=g) * 1.5, -1)
    first, second = torch.zeros(V), torch.zeros(V)
    for _ in range(30_000):
        path, nxt = verify_tree(tokens, parents, p, False, g)
        seq = [int(tokens[i]) for i in path] + [nxt]
        first[seq[0]] += 1
        if seq[0] == 4:
            second[seq[1]] += 1
    assert chi_square_p(first, p[0]) > 1e-3
    assert chi_square_p(second, p[1]) > 1e-3  # after token 4 (node 1), the target's row 1


@pytest.fixture(scope="module", params=["qwen3", "llama-rope-llama3", "qwen3-rope-yarn"])
def other_architecture(request, tmp_path_factory):  # type: ignore[no-untyped-def]
    from moaspec.models import load_model_dir
    from test_runtime import VARIANTS
    from tiny import make_tiny_model

    family, overrides = VARIANTS[request.param]
    return load_model_dir(make_tiny_model(tmp_path_factory.mktemp("arch") / request.param, family, **overrides), device="cpu")


@pytest.mark.parametrize("kind", ["moa", "moa-tli1", "moa-derot", "eagle", "independent"])
def test_greedy_drafting_is_lossless_on_other_architectures(other_architecture, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Qwen3 (query/key norms, also in the blocks Target Layer Inference reuses) and scaled RoPE (also undone
    for derotated keys): chains and trees give the target's greedy output, which is transformers' own."""
    from moaspec.decoding.speculative import generate_chain
    from test_vanilla import hf_greedy

    loaded = other_architecture
    model, tok = loaded.model, loaded.tokenizer
    cfg = GenerationConfig(max_new_tokens=40, ignore_eos=True)
    make = {"moa": lambda: moa_proposer(loaded), "moa-tli1": lambda: moa_proposer(loaded, tli=1),
            "moa-derot": lambda: moa_proposer(loaded, derotate=True), "eagle": lambda: eagle_proposer(loaded, vocab=100),
            "independent": lambda: independent_proposer(loaded, vocab=100)}[kind]
    for prompt in PROMPTS:
        want = generate(model, tok, prompt, cfg)
        assert generate_chain(model, tok, make(), prompt, cfg, draft_len=4).token_ids == want.token_ids
        assert generate_tree(model, tok, make(), prompt, cfg, TreeShape(3, 2, 8)).token_ids == want.token_ids
    if kind == "moa":
        prompt = PROMPTS[1]
        assert generate(model, tok, prompt, GenerationConfig(max_new_tokens=40)).token_ids == hf_greedy(loaded.path, prompt, 40)
