"""The MoA drafter: training and inference paths agree, sizes, checkpoints, refusal of a foreign target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moaspec.decoding import GenerationConfig, SamplingParams
from moaspec.decoding.speculative import generate_chain
from moaspec.drafters.checkpoint import (
    DTYPE_VARIABLE,
    DrafterError,
    drafting_precision,
    load_drafter,
    save_drafter,
    target_identity,
)
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.drafters.proposers import proposer_for
from moaspec.models.block_kernel import kernel
from moaspec.models.config import ModelConfig
from moaspec.models.kv_cache import KVCache
from moaspec.models.packed_linear import bf16_kernels, int8_kernels
from moaspec.models.transformer import Transformer
from moaspec.training.dataset import Batch, Example, collate
from moaspec.training.distill import (
    Masks,
    accepted_runs,
    build_masks,
    full_argmax,
    simulate_chain,
    step_accuracy,
    step_matches,
    tli_mask,
)
from moaspec.training.features import target_pass
from moaspec.training.masks import cross_attention_mask, segment_starts, self_attention_mask


def make_drafter(loaded, tli: int = 0, vocab: int = 0, seed: int = 0, memory: str = "lsa", reach: int = 15,  # type: ignore[no-untyped-def]
                 newest: bool = False, derotate: bool = False) -> MoADrafter:
    torch.manual_seed(seed)
    d = MoADrafter(MoAConfig.for_target(loaded.cfg, tli_layers=tli, draft_vocab_size=vocab, memory_source=memory,
                                        ca_reach=reach, newest_entry=newest, derotate_keys=derotate))
    for proj in (d.final_proj, d.newest_proj):  # they start at zero, which would hide their paths from the tests
        if proj is not None:
            torch.nn.init.normal_(proj.weight, std=0.05)
    if vocab:
        d.set_draft_vocab(torch.randperm(loaded.cfg.vocab_size)[:vocab].sort().values)
    d.attach(loaded.model)
    return d.eval()


@pytest.mark.parametrize("tli, together, memory, reach, newest, derotate, inclusive", [
    (0, False, "lsa", 15, False, False, False), (1, False, "lsa", 15, False, False, False),
    (2, False, "lsa", 15, False, False, False), (1, True, "lsa", 15, False, False, False),
    (2, True, "lsa", 15, False, False, False), (0, False, "last-layer", 15, False, False, False),
    (1, True, "lsa+final", 15, False, False, False),
    (0, False, "lsa", 4, False, False, False), (1, True, "lsa", 4, False, False, False),  # segment longer than CA's reach
    (0, False, "lsa", 15, True, False, False), (1, True, "lsa", 4, True, False, False),  # CA's input: the newest entry
    (0, False, "lsa", 15, False, True, False), (1, True, "lsa+final", 15, False, True, False),  # derotated keys
    # --segment-start-in-memory: the segment starts one position before the first draft, which reads it
    (0, False, "lsa", 15, False, False, True), (1, False, "lsa", 15, False, False, True),
    (2, True, "lsa", 15, False, False, True), (1, True, "lsa+final", 4, True, False, True),
    (0, False, "last-layer", 4, False, False, True),
])
def test_inference_steps_match_teacher_forced_training_pass(tiny_llama, tli: int, together: bool, memory: str,  # type: ignore[no-untyped-def]
                                                            reach: int, newest: bool, derotate: bool,
                                                            inclusive: bool) -> None:
    """Drafting after a verification at position p sees exactly what training shows a segment starting at p; with
    segment starts in memory (``inclusive``, the authors' mask), what it shows the positions after a start at p − 1
    (distance >= 1 from the newest entry)."""
    drafter = make_drafter(tiny_llama, tli=tli, vocab=64, memory=memory, reach=reach, newest=newest, derotate=derotate)
    target = tiny_llama.model
    S, p = 24, 9
    tokens = torch.randint(0, tiny_llama.cfg.vocab_size, (1, S), generator=torch.Generator().manual_seed(1))
    cache = target.new_cache(S)
    final = target(tokens, cache).hidden
    start = p - 1 if inclusive else p
    starts = torch.zeros(S, dtype=torch.long)
    starts[start:] = start  # one segment: every position from p on sees memory < p
    batch = Batch(tokens, torch.tensor([S]), torch.tensor([start]))
    masks = Masks(sa=torch.ones(S, S, dtype=torch.bool).tril()[None],
                  ca=cross_attention_mask(starts, start, inclusive)[None], starts=starts[None],
                  loss=(torch.arange(S) >= start)[None], inclusive=inclusive)
    with torch.no_grad():
        pred = drafter(tokens, cache.token_kv(0, S), final, masks.sa, masks.ca)
        if tli:
            L = tiny_llama.cfg.num_layers
            tc = KVCache(tli, tiny_llama.cfg.num_kv_heads, tiny_llama.cfg.head_dim, 2 * S)
            tc.keys[:, :, :, :S], tc.values[:, :, :, :S] = cache.keys[L - tli :], cache.values[L - tli :]
            tc.length = S
            pred = drafter.run_tli(pred, tc, torch.arange(S), tli_mask(masks, batch.lengths))
        trained = drafter.head(pred[:, p:])

    state = drafter.new_state(64)
    drafter.observe(state, cache, p, final[0, :p])
    cache.truncate(p)  # the drafter writes its own TLI states from p on
    # all at once (the prompt plus its first outputs), then one token at a time, as chain drafting does
    first = drafter.step(state, tokens[:, : p + 1], torch.arange(p + 1), None, outputs=1, target_cache=cache)
    outs = [first]
    if together:  # the rest in one step, as a client catches up on what it generated alone (TLI mask: causal)
        cache.length = p + 1
        outs.append(drafter.step(state, tokens[:, p + 1 :], torch.arange(p + 1, S), None, outputs=S - p - 1,
                                 target_cache=cache))
    for j in range(p + 1, S if not together else p + 1):
        cache.length = j if tli else cache.length
        outs.append(drafter.step(state, tokens[:, j : j + 1], torch.tensor([j]), None, outputs=1, target_cache=cache,
                                 tli_mask=torch.ones(1, j + 1, dtype=torch.bool)))
    steps = torch.cat(outs, dim=1)
    torch.testing.assert_close(steps, trained, atol=1e-4, rtol=1e-4)


def test_near_zero_norm_gains_start_sa_ca_and_lsa_close_to_identity(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """--norm-init-std 0.02 (the authors' init): the pre-norm gains of SA, CA, LSA and the memory norm ~ N(0, 0.02²);
    every other weight as the plain drafter's, the output norm included; each layer then nearly passes its input on."""
    plain = make_drafter(tiny_llama)
    drafter = make_drafter(tiny_llama)
    torch.manual_seed(3)
    drafter.start_norms_near_zero(0.02)
    names = {"sa.attn_norm.weight", "sa.mlp_norm.weight", "ca.attn_norm.weight", "ca.mlp_norm.weight",
             "lsa.attn_norm.weight", "lsa.mlp_norm.weight", "memory_norm.weight"}
    before, after = plain.state_dict(), drafter.state_dict()
    gains = torch.cat([after[n] for n in sorted(names)])
    assert all((before[n] == 1).all() for n in names)
    assert abs(float(gains.mean())) < 0.004 and 0.017 < float(gains.std()) < 0.023 and float(gains.abs().max()) < 0.1
    assert all(torch.equal(before[n], after[n]) for n in before if n not in names)  # out_norm: the target's final norm
    x = torch.randn(2, 5, tiny_llama.cfg.hidden_size)
    cos, sin = drafter.rope(torch.arange(5))
    memory = drafter.memory(torch.randn(2, 5, tiny_llama.cfg.num_layers, drafter.cfg.target_kv_width), None)
    with torch.no_grad():
        k, v = drafter.ca.attn.keys_values(memory, cos, sin)
        for y in (drafter.sa.self_attention(x, cos, sin, None), drafter.ca.cross_attention(x, cos, sin, k, v, None)):
            assert float((y - x).norm() / x.norm()) < 0.02
        plain_y = plain.sa.self_attention(x, cos, sin, None)
        assert float((plain_y - x).norm() / x.norm()) > 0.1  # gains of 1: far from the identity


def test_cross_attention_reach_bounds_the_query_to_memory_distance(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Within the reach nothing changes; past it, a query reads the memory as if it stood at the reach."""
    near, far = make_drafter(tiny_llama, reach=3), make_drafter(tiny_llama, reach=1000)  # same seed: same weights
    s = torch.randn(1, 1, tiny_llama.cfg.hidden_size)
    memory = torch.randn(1, 6, tiny_llama.cfg.hidden_size)
    with torch.no_grad():
        k, v = near.ca.attn.keys_values(memory, *near.rope(torch.arange(6)))
        def predict(d: MoADrafter, position: int) -> torch.Tensor:
            return d.predict(s, torch.tensor([position]), 5, k, v, None, None)
        torch.testing.assert_close(predict(near, 8), predict(far, 8))  # 3 past the newest entry (5): within
        torch.testing.assert_close(predict(near, 40), predict(far, 8))  # 35 past it: read as if 3 past
        assert not torch.allclose(predict(far, 40), predict(far, 8))


def test_memory_grows_only_with_verified_tokens(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    drafter = make_drafter(tiny_llama)
    cache = tiny_llama.model.new_cache(32)
    tiny_llama.model(torch.arange(10)[None] + 5, cache)
    state = drafter.new_state(32)
    drafter.observe(state, cache, 6)
    assert state.memory.length == 6
    before = state.memory.keys[0, :, :, :6].clone()
    drafter.observe(state, cache, 10)
    assert state.memory.length == 10
    torch.testing.assert_close(state.memory.keys[0, :, :, :6], before)  # append-only: old entries untouched
    drafter.observe(state, cache, 8)  # nothing to forget
    assert state.memory.length == 10


def test_derotated_keys_are_the_targets_keys_before_rope(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """LSA with ``derotate_keys`` reads ``W_k·x`` whatever the token's position; memory built in pieces equals memory
    built at once (each piece derotated by its own positions)."""
    from moaspec.models.transformer import rms_norm

    drafter = make_drafter(tiny_llama, derotate=True)
    target, cfg = tiny_llama.model, tiny_llama.cfg
    tokens = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(5))
    cache = target.new_cache(12)
    target(tokens, cache)
    kvd = cfg.kv_dim
    block = target.blocks[0]
    q_dim = cfg.num_heads * cfg.head_dim
    expected = block.attn.qkv(rms_norm(target.embed(tokens), block.attn_norm, block.eps))[..., q_dim : q_dim + kvd]
    rotated = cache.token_kv(0, 12)
    derotated = target.unrotated_keys(rotated, torch.arange(12))
    torch.testing.assert_close(derotated[:, :, 0, :kvd], expected, atol=1e-5, rtol=1e-5)  # layer 0's keys, unrotated
    assert not torch.allclose(rotated[:, 1:, 0, :kvd], expected[:, 1:], atol=1e-3)  # the cache's keys are rotated
    torch.testing.assert_close(derotated[..., kvd:], rotated[..., kvd:])  # values carry no rotation
    state = drafter.new_state(16)
    drafter.observe(state, cache, 5)
    drafter.observe(state, cache, 12)
    whole = drafter.new_state(16)
    drafter.observe(whole, cache, 12)
    torch.testing.assert_close(state.memory.keys[..., :12, :], whole.memory.keys[..., :12, :])
    plain = make_drafter(tiny_llama)  # the same weights (same seed), reading rotated keys: another memory
    assert not torch.allclose(plain.memory(rotated, None), drafter.memory(rotated, None))
    assert plain.fingerprint() != drafter.fingerprint()  # a client and a server must not mix the two


def test_default_drafter_is_under_ten_percent_of_smollm2() -> None:
    """Parameter budget for the shipped configuration, counted on the real architecture (no weights needed)."""
    cfg = ModelConfig(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192, tie_word_embeddings=True)
    with torch.device("meta"):
        target = Transformer(cfg)
        drafter = MoADrafter(MoAConfig.for_target(cfg, draft_vocab_size=8192))
    target_params = sum(p.numel() for p in target.parameters())
    assert 134_000_000 < target_params < 135_000_000
    assert drafter.own_parameters() <= 0.10 * target_params
    assert drafter.cfg.target_kv_width == 384  # one layer token = K and V of 3 heads of 64
    assert (drafter.cfg.lsa_width, drafter.cfg.lsa_heads, drafter.cfg.lsa_mlp) == (192, 3, 384)  # half width by default
    full = MoAConfig.for_target(cfg, draft_vocab_size=8192, lsa_width=384)  # the paper's: LSA as wide as a layer token
    assert (full.lsa_heads, full.lsa_kv_heads, full.lsa_mlp) == (6, 2, 768)
    assert MoAConfig.for_target(cfg, draft_vocab_size=8192, lsa_width="full") == full  # --lsa-width full
    with torch.device("meta"):
        assert MoADrafter(full).own_parameters() <= 0.10 * target_params
    with pytest.raises(ValueError, match="multiple of 64"):
        MoAConfig.for_target(cfg, lsa_width=100)


def test_checkpoint_round_trip(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    drafter = make_drafter(tiny_llama, tli=1, vocab=100)
    path = save_drafter(drafter, tmp_path / "d", target_identity(tiny_llama), {"steps": 3}, dtype=torch.float32)
    meta = json.loads((path / "config.json").read_text())
    assert meta["config"]["tli_layers"] == 1 and meta["config"]["draft_vocab_size"] == 100
    assert meta["target"]["fingerprint"] == tiny_llama.fingerprint and meta["training"] == {"steps": 3}
    loaded = load_drafter(path, tiny_llama, torch.float32)
    torch.testing.assert_close(loaded.draft_vocab, drafter.draft_vocab)
    for (k, a), (_, b) in zip(sorted(loaded.state_dict().items()), sorted(drafter.state_dict().items())):
        torch.testing.assert_close(a, b, msg=k)
    assert not list(tmp_path.glob(".d.*")), "no temporary directory left behind"


def test_drafters_load_in_the_drafting_dtype_with_one_fingerprint(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """By default a drafter drafts in bf16 (with int8 weights) beside an fp32 target on a CPU with bf16 kernels;
    the target keeps fp32, and a client in one dtype and a server in another still agree on the drafter's
    identity."""
    path = save_drafter(make_drafter(tiny_llama, vocab=100), tmp_path / "d", target_identity(tiny_llama), {})
    default, exact = load_drafter(path, tiny_llama), load_drafter(path, tiny_llama, torch.float32)
    blocks = not bf16_kernels() and kernel() is not None  # fp32 with 8-bit blocks (compiled_layers)
    want = torch.bfloat16 if bf16_kernels() else torch.float32
    assert drafting_precision(tiny_llama) == (want, bf16_kernels() or blocks) and default.weight_dtype == want
    assert default.precision == ("int8" if bf16_kernels() or blocks else "float32")
    assert default.head(torch.zeros(1, tiny_llama.cfg.hidden_size, dtype=want)).dtype == want  # the head came along
    assert tiny_llama.model.dtype == torch.float32 and exact.weight_dtype == torch.float32
    assert default.fingerprint() == exact.fingerprint()


def test_int8_drafters_quantize_their_own_weights_and_never_the_targets(tiny_llama, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                        monkeypatch) -> None:
    """A bf16 drafter's ``use_int8`` gives its products and its head int8 copies for aten's kernel (``--drafter-dtype
    int8`` on CPUs with bf16 kernels or without the block kernel; fp16 refuses); the layers Target
    Layer Inference borrows stay the target's float products (an int8 copy there would change the text),
    training drops the copies and eval makes them again, ``use_int8(False)`` drops them for good, and the
    fingerprint is the float drafter's, so a client drafting in int8 agrees with a server in bf16."""
    from moaspec.models.packed_linear import Linear, int8_supported

    path = save_drafter(make_drafter(tiny_llama, vocab=100, tli=1), tmp_path / "d", target_identity(tiny_llama), {})
    monkeypatch.setenv(DTYPE_VARIABLE, "int8")
    aten = bf16_kernels() or kernel() is None
    assert drafting_precision(tiny_llama) == ((torch.bfloat16, int8_kernels()) if aten else (torch.float32, True))
    with pytest.raises(ValueError, match="bf16 or fp32 activations"):
        load_drafter(path, tiny_llama, torch.float16).use_int8()
    want = torch.bfloat16
    drafter = load_drafter(path, tiny_llama, want).use_int8()
    if not int8_supported(drafter._borrowed["head"].weight):
        pytest.skip("no int8 CPU kernel in this torch build")
    own = [m for m in drafter.modules() if isinstance(m, Linear)]
    assert drafter.precision == "int8" and drafter.weight_dtype == want
    assert own and all(m.int8 is not None for m in own) and drafter._borrowed["head"].int8 is not None
    assert not any(isinstance(m, Linear) and m.int8 is not None for m in tiny_llama.model.modules())
    assert drafter.head(torch.zeros(1, tiny_llama.cfg.hidden_size, dtype=want)).dtype == want
    assert drafter.fingerprint() == load_drafter(path, tiny_llama, torch.float32).fingerprint()
    drafter.train()
    assert all(m.int8 is None for m in own)
    drafter.eval()
    assert all(m.int8 is not None for m in own)
    drafter.use_int8(False)
    assert drafter.precision == str(want).removeprefix("torch.")
    assert all(m.int8 is None for m in own) and drafter._borrowed["head"].int8 is None


def test_bf16_drafters_keep_their_caches_in_fp32_on_a_cpu(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """torch's CPU attention is slow for one bf16 query (docs/experiments/2026-11-25-drafting-precision.md,
    "The drafter's caches in fp32"), so a bf16 drafter's own caches are fp32 there. They hold the bf16 K/V exactly,
    so a step drafts as with bf16 caches up to the attention's rounding: the same draft, near-identical logits."""
    from moaspec.drafters.eagle import EagleConfig, EagleDrafter
    from moaspec.drafters.independent import IndependentConfig, IndependentDrafter

    cfg = tiny_llama.cfg
    torch.manual_seed(0)
    moa = MoADrafter(MoAConfig.for_target(cfg)).to(torch.bfloat16)
    eagle = EagleDrafter(EagleConfig.for_target(cfg)).to(torch.bfloat16)
    independent = IndependentDrafter(IndependentConfig.for_target(cfg, layers=1)).to(torch.bfloat16)
    for d in (moa, eagle, independent):
        d.attach(tiny_llama.model)
        d.eval()
    assert moa.cache_dtype == eagle.cache_dtype == independent.cache_dtype == torch.float32
    assert make_drafter(tiny_llama).cache_dtype == torch.float32  # fp32 weights: fp32 caches, as always
    state = moa.new_state(64)
    assert state.sa.keys.dtype == state.memory.keys.dtype == torch.float32
    assert eagle.new_cache(64).keys.dtype == independent.new_cache(64).keys.dtype == torch.float32

    target = tiny_llama.model
    prompt = torch.tensor([[5, 17, 42, 7, 9, 11, 3, 8]])
    cache = target.new_cache(64)
    out = target(prompt, cache)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        st = moa.new_state(64)
        if dtype == torch.bfloat16:  # the caches as they were before: in the weights' dtype
            st = type(st)(sa=KVCache(1, cfg.num_kv_heads, cfg.head_dim, 64, 1, dtype, "cpu"),
                          memory=KVCache(1, cfg.num_kv_heads, cfg.head_dim, 64, 1, dtype, "cpu"))
        moa.observe(st, cache, 8, out.hidden[0])
        moa.step(st, prompt, torch.arange(8), None, 1)  # SA catches up on the prompt
        logits[dtype] = moa.step(st, torch.tensor([[4]]), torch.tensor([8]), None, 1).float()
        assert st.sa.keys.dtype == st.memory.keys.dtype == dtype
    assert logits[torch.float32].argmax() == logits[torch.bfloat16].argmax()
    torch.testing.assert_close(logits[torch.float32], logits[torch.bfloat16], atol=0.05, rtol=0.02)

    # what a prompt cache keeps of the drafter's state: bf16 again, losing nothing, at half the bytes
    proposer = proposer_for(moa)
    proposer.begin(cache, out.hidden[0])
    proposer.propose(prompt[0].tolist() + [4], 2, SamplingParams(), None)
    kept = proposer.kept()
    assert kept.dtype == torch.bfloat16 and kept.shape[0] == 8
    resumed = proposer_for(moa)
    resumed.begin(cache, out.hidden[0], known=kept)
    for a, b in zip(proposer._per_position(proposer.state), resumed._per_position(resumed.state)):
        assert torch.equal(a[..., :8, :], b[..., :8, :])


def test_fp16_checkpoint_is_half_the_size_and_close(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    drafter = make_drafter(tiny_llama)
    full = save_drafter(drafter, tmp_path / "f32", target_identity(tiny_llama), dtype=torch.float32)
    half = save_drafter(drafter, tmp_path / "f16", target_identity(tiny_llama))
    assert (half / "model.safetensors").stat().st_size < 0.6 * (full / "model.safetensors").stat().st_size
    back = load_drafter(half, tiny_llama, torch.float32)
    torch.testing.assert_close(back.sa.mlp.down.weight, drafter.sa.mlp.down.weight, atol=1e-3, rtol=1e-3)


def test_refuses_a_drafter_for_another_target(tiny_llama, tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.models import load_model_dir
    from tiny import make_tiny_model

    path = save_drafter(make_drafter(tiny_llama), tmp_path / "d", target_identity(tiny_llama))
    same_shape_other_weights = load_model_dir(make_tiny_model(tmp_path / "other", "llama", seed=7), device="cpu")
    with pytest.raises(DrafterError, match="was trained for target .*fingerprint"):
        load_drafter(path, same_shape_other_weights)
    with pytest.raises(DrafterError, match="trained for target"):
        load_drafter(path, load_model_dir(tiny_dirs["qwen2"], device="cpu"))


def test_a_drafter_serves_another_quantisation_of_its_target_and_says_so(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The same source model in another GGUF file type has other weights (another fingerprint) but the same
    lineage: its drafter loads, with one line; a model of another name, same shapes and tokenizer, is refused."""
    from moaspec.models import load_model
    from tiny import make_tiny_gguf, make_tiny_model

    source = make_tiny_model(tmp_path / "qwen2", "qwen2", seed=3)

    def quantised(kind: str, name: str):  # type: ignore[no-untyped-def]
        gguf = make_tiny_gguf(source, tmp_path / f"{name}.{kind}.gguf", {"blk.": kind}, name=name)
        return load_model(str(gguf), device="cpu")

    q8 = quantised("Q8_0", "Tiny")
    path = save_drafter(make_drafter(q8), tmp_path / "d", target_identity(q8))
    q4 = quantised("Q4_1", "Tiny")
    assert q4.fingerprint != q8.fingerprint and q4.lineage == q8.lineage is not None
    capsys.readouterr()
    load_drafter(path, q4, torch.float32)
    assert "is the same model quantised otherwise" in capsys.readouterr().err
    with pytest.raises(DrafterError, match="another model"):
        load_drafter(path, quantised("Q4_1", "Other"))


def test_shipped_drafters_are_found_by_kind_and_target(tiny_llama, tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """MoA and its EAGLE baseline ship side by side; decoding must get MoA, `bench --methods eagle2` EAGLE."""
    import moaspec.drafters as drafters
    from moaspec.drafters.eagle import EagleConfig, EagleDrafter

    monkeypatch.setattr(drafters, "SHIPPED", tmp_path)
    assert drafters.shipped_drafter(tiny_llama) is None
    eagle = save_drafter(EagleDrafter(EagleConfig.for_target(tiny_llama.cfg)), tmp_path / "a-eagle", target_identity(tiny_llama))
    assert drafters.shipped_drafter(tiny_llama) is None  # an EAGLE drafter alone is no MoA default
    moa = save_drafter(make_drafter(tiny_llama), tmp_path / "b-moa", target_identity(tiny_llama))
    assert drafters.shipped_drafter(tiny_llama) == moa and drafters.shipped_drafter(tiny_llama, "eagle") == eagle


HAND_EDITS = {"negative-vocab": ("draft_vocab_size", -5, "draft_vocab_size must be a whole number >= 0"),
              "string-vocab": ("draft_vocab_size", "abc", "draft_vocab_size must be a whole number"),
              "float-heads": ("heads", 1.5, "heads must be a whole number >= 1"),
              "bool-width": ("lsa_width", True, "lsa_width must be a whole number"),
              "negative-width": ("lsa_width", -64, "lsa_width must be a whole number >= 1"),
              "huge-vocab": ("draft_vocab_size", 10**12, "exceeds vocab_size"),
              "nan-theta": ("rope_theta", "NaN", "rope_theta must be a finite number"),
              "positions": ("max_positions", 7, "context window"),
              "flag": ("newest_entry", 1, "newest_entry must be true or false"),
              "missing": ("hidden_size", "delete", "missing MoAConfig fields: ['hidden_size']")}


@pytest.mark.parametrize("edit", sorted(HAND_EDITS))
def test_a_hand_edited_config_is_refused_naming_the_field(tiny_llama, tmp_path: Path, edit: str) -> None:  # type: ignore[no-untyped-def]
    path = save_drafter(make_drafter(tiny_llama), tmp_path / "d", target_identity(tiny_llama))
    field, value, words = HAND_EDITS[edit]
    meta = json.loads((path / "config.json").read_text())
    if value == "delete":
        del meta["config"][field]
    else:
        meta["config"][field] = float("nan") if value == "NaN" else value
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="invalid drafter config") as err:
        load_drafter(path, tiny_llama)
    assert words in str(err.value)
    del meta["config"]  # the whole architecture section
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(DrafterError, match="invalid drafter config: it lacks 'config'"):
        load_drafter(path, tiny_llama)


@pytest.mark.parametrize("damage", ["missing", "not-json", "wrong-format", "no-weights", "bad-config", "no-target",
                                    "run-dir", "nan-weights"])
def test_broken_checkpoints_give_clear_errors(tiny_llama, tmp_path: Path, damage: str) -> None:  # type: ignore[no-untyped-def]
    from safetensors.torch import load_file, save_file

    path = save_drafter(make_drafter(tiny_llama), tmp_path / "d", target_identity(tiny_llama))
    cfg = path / "config.json"
    if damage == "no-target":
        meta = json.loads(cfg.read_text())
        meta["target"] = None
        cfg.write_text(json.dumps(meta))
        words = "which target"
    elif damage == "run-dir":  # a training run's directory, whose drafter is in drafter/
        run = tmp_path / "run"
        run.mkdir()
        path.rename(run / "drafter")
        path, words = run, "run/drafter is the drafter this training run exported"
    elif damage == "nan-weights":
        state = load_file(str(path / "model.safetensors"))
        name = next(k for k, v in state.items() if v.is_floating_point())
        state[name] = torch.full_like(state[name], float("nan"))
        save_file(state, str(path / "model.safetensors"))
        words = "not finite"
    elif damage == "missing":
        path, words = tmp_path / "nowhere", "does not exist"
    elif damage == "not-json":
        cfg.write_text("{oops")
        words = "not valid JSON"
    elif damage == "wrong-format":
        cfg.write_text(json.dumps({"format": "something-else"}))
        words = "not a moaspec drafter checkpoint"
    elif damage == "no-weights":
        (path / "model.safetensors").unlink()
        words = "cannot read"
    else:
        meta = json.loads(cfg.read_text())
        meta["config"]["bogus"] = 1
        cfg.write_text(json.dumps(meta))
        words = "unknown MoAConfig fields"
    with pytest.raises(DrafterError, match=words):
        load_drafter(path, tiny_llama)


def test_training_masks_leave_no_row_empty() -> None:
    g = torch.Generator().manual_seed(0)
    batch = Batch(torch.zeros(2, 30, dtype=torch.long), torch.tensor([30, 17]), torch.tensor([6, 4]))
    masks = build_masks(batch, g, torch.tensor([True, False]))
    assert masks.sa.any(-1).all() and masks.ca.any(-1).all()
    assert int(masks.loss[0].sum()) == 24 and int(masks.loss[1].sum()) == 13
    st = segment_starts(6, 30, torch.Generator().manual_seed(0))
    assert torch.equal(masks.starts[0], st)  # same generator stream: the first row's segmentation
    tm = tli_mask(masks, batch.lengths)
    assert tm.shape == (2, 30, 60) and tm.any(-1).all()


def test_batched_training_masks_equal_each_sequences_own() -> None:
    """build_masks builds all rows at once (on the training device): each real row must be its sequence's masks."""
    lengths, prompts, local = torch.tensor([30, 17, 9]), torch.tensor([6, 4, 9]), torch.tensor([True, False, True])
    masks = build_masks(Batch(torch.zeros(3, 30, dtype=torch.long), lengths, prompts), torch.Generator().manual_seed(3),
                        local, 2, 4)
    g = torch.Generator().manual_seed(3)
    for b in range(3):
        n, p = int(lengths[b]), int(prompts[b])
        st = segment_starts(p, n, g, 2, 4)
        assert torch.equal(masks.starts[b, :n], st)
        assert torch.equal(masks.sa[b, :n, :n], self_attention_mask(st, bool(local[b])))
        assert torch.equal(masks.ca[b, :n, :n], cross_attention_mask(st, p))
        assert not masks.sa[b, :n, n:].any() and not masks.ca[b, :n, n:].any()  # padding is never attended


@pytest.mark.parametrize("tli,vocab,seed,newest", [(0, 0, 0, False), (0, 64, 1, False), (1, 0, 2, False), (2, 0, 3, False),
                                                    (0, 0, 4, True)])
def test_replayed_cycles_equal_real_chain_decoding(tiny_llama, tli: int, vocab: int, seed: int, newest: bool) -> None:  # type: ignore[no-untyped-def]
    """accepted_runs + simulate_chain (the held-out val_tau_decode) accept, cycle for cycle, what greedy chain-6 decoding
    accepts; step 0 of step_matches says which cycles accepted their first draft (val_first_draft)."""
    drafter = make_drafter(tiny_llama, tli=tli, vocab=vocab, seed=seed, newest=newest)
    prompt = torch.randint(3, tiny_llama.cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    res = generate_chain(tiny_llama.model, tiny_llama.tokenizer, proposer_for(drafter), prompt,
                         GenerationConfig(max_new_tokens=40), draft_len=6)
    batch = collate([Example(tuple(prompt + res.token_ids), len(prompt), greedy=True)])
    with torch.no_grad():
        tgt = target_pass(tiny_llama.model, batch.tokens, tli)
        matches = step_matches(drafter, tiny_llama.model, batch, tgt, full_argmax(tiny_llama.model, tgt.final[0, len(prompt) :]))
        runs = accepted_runs(matches, batch)
    replayed = simulate_chain(runs[0].tolist(), len(prompt), len(res.token_ids))
    n = len(res.accepted_lengths) - (res.finish_reason == "stop")  # a stop token ends the real run's last cycle early
    assert replayed[:n] == res.accepted_lengths[:n]
    start = len(prompt)  # the first cycle drafts after the prefill's token
    for accepted in res.accepted_lengths[:n]:
        assert bool(matches[0, 0, start]) == (accepted >= 2)
        start += accepted
    hits, cases = step_accuracy(matches, batch)
    assert cases.tolist() == [len(res.token_ids) - k for k in range(6)]  # every answer position starts a cycle
    assert all(0 <= h <= c for h, c in zip(hits.tolist(), cases.tolist()))
