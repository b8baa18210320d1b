"""The target runtime against transformers' own forward, and its cache and mask mechanics."""

from __future__ import annotations

import pytest
import torch

from moaspec.models import causal_mask, load_model_dir, transformer, tree_mask
from moaspec.models.packed_linear import bf16_kernels

FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.fixture(scope="module")
def pairs(tiny_dirs):  # type: ignore[no-untyped-def]
    """(moaspec runtime, HF model) per family, same weights."""
    from transformers import AutoModelForCausalLM

    out = {}
    for fam in FAMILIES:
        ours = load_model_dir(tiny_dirs[fam], device="cpu", with_tokenizer=False).model
        hf = AutoModelForCausalLM.from_pretrained(str(tiny_dirs[fam]), dtype=torch.float32).eval()
        out[fam] = (ours, hf)
    return out


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.no_grad():
        return hf(ids).logits


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("length", [1, 7, 40, 130])
def test_logits_match_transformers_without_cache(pairs, family: str, length: int) -> None:  # type: ignore[no-untyped-def]
    ours, hf = pairs[family]
    ids = torch.randint(0, ours.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
    out = ours(ids, ours.new_cache(256))
    torch.testing.assert_close(out.logits, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers_with_cache(pairs, family: str) -> None:  # type: ignore[no-untyped-def]
    """Prefill in uneven chunks and token by token: every position matches the one-shot HF forward."""
    ours, hf = pairs[family]
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 60), generator=torch.Generator().manual_seed(1))
    ref = hf_logits(hf, ids)
    cache = ours.new_cache(128)
    pieces = []
    for a, b in [(0, 17), (17, 18), (18, 40), *[(i, i + 1) for i in range(40, 60)]]:
        pieces.append(ours(ids[:, a:b], cache).logits)
    torch.testing.assert_close(torch.cat(pieces, dim=1), ref, atol=1e-4, rtol=0)
    assert cache.length == 60


@pytest.mark.parametrize("family", FAMILIES)
def test_hidden_states_match_transformers(pairs, family: str) -> None:  # type: ignore[no-untyped-def]
    ours, hf = pairs[family]
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 25), generator=torch.Generator().manual_seed(2))
    L = ours.cfg.num_layers
    out = ours(ids, ours.new_cache(64), hidden_after=(0, 1, L - 1))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states  # embeddings, after layer 1..L-1, final (normed)
    for k in (0, 1, L - 1):
        torch.testing.assert_close(out.layer_hidden[k], ref[k], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.hidden, ref[L], atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_token_kv_matches_transformers_cache(pairs, family: str) -> None:  # type: ignore[no-untyped-def]
    """Every layer's K/V for the new tokens, in the Layer Self-Attention layout."""
    ours, hf = pairs[family]
    cfg = ours.cfg
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(3))
    cache = ours.new_cache(64)
    ours(ids[:, :5], cache)
    ours(ids[:, 5:], cache)
    kv = cache.token_kv(5, 12)
    assert kv.shape == (1, 7, cfg.num_layers, 2 * cfg.kv_dim)
    with torch.no_grad():
        pkv = hf(ids, use_cache=True).past_key_values
    for layer in range(cfg.num_layers):
        k_ref, v_ref = pkv.layers[layer].keys, pkv.layers[layer].values  # [1, H, T, D]
        ref = torch.cat([k_ref, v_ref], dim=1)[0, :, 5:].permute(1, 0, 2).reshape(7, -1)
        torch.testing.assert_close(kv[0, :, layer], ref, atol=1e-4, rtol=0)


def branches_tree() -> tuple[list[int], list[int]]:
    """A 7-node tree: node parents (-1 = child of the prefix) and depths.

        0 ─ 1 ─ 3
          └ 2 ─ 4 ─ 6
        5 (a second root)
    """
    parents = [-1, 0, 0, 1, 2, -1, 4]
    depths = [0, 1, 1, 2, 2, 0, 3]
    return parents, depths


def ancestors_matrix(parents: list[int]) -> torch.Tensor:
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        j = i
        while j != -1:
            anc[i, j] = True
            j = parents[j]
    return anc


def run_tree(model, prefix_len: int, seed: int):  # type: ignore[no-untyped-def]
    """Feed a random prefix, then the 7-node tree in one masked forward; return what the checks need."""
    V = model.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, V, (1, prefix_len), generator=gen)
    parents, depths = branches_tree()
    nodes = torch.randint(0, V, (1, len(parents)), generator=gen)
    anc = ancestors_matrix(parents)
    cache = model.new_cache(64)
    model(prefix, cache)
    logits = model(nodes, cache, positions=prefix_len + torch.tensor(depths), mask=tree_mask(prefix_len, anc)).logits
    return prefix, nodes, anc, cache, logits, gen


@pytest.mark.parametrize("family", FAMILIES)
def test_tree_forward_equals_each_branch(pairs, family: str) -> None:  # type: ignore[no-untyped-def]
    ours, _ = pairs[family]
    prefix, nodes, anc, _, tree_out, _ = run_tree(ours, 20, seed=4)
    for leaf in (3, 6, 5):
        path = anc[leaf].nonzero().flatten().tolist()  # root..leaf, in index order = depth order
        ref = ours(torch.cat([prefix, nodes[:, path]], dim=1), ours.new_cache(64)).logits[:, 20:]
        torch.testing.assert_close(tree_out[:, path], ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_compact_keeps_accepted_path(pairs, family: str) -> None:  # type: ignore[no-untyped-def]
    """After verifying a tree, compacting to one path leaves the cache as if only that path was fed."""
    ours, _ = pairs[family]
    V = ours.cfg.vocab_size
    prefix, nodes, _, cache, _, gen = run_tree(ours, 15, seed=5)
    path = [0, 2, 4, 6]
    cache.compact(15, torch.tensor(path))
    assert cache.length == 19
    nxt = torch.randint(0, V, (1, 3), generator=gen)
    got = ours(nxt, cache).logits
    ref_cache = ours.new_cache(64)
    ref = ours(torch.cat([prefix, nodes[:, path], nxt], dim=1), ref_cache).logits[:, -3:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)


def test_truncate_is_rollback(pairs) -> None:  # type: ignore[no-untyped-def]
    ours, _ = pairs["llama"]
    V = ours.cfg.vocab_size
    gen = torch.Generator().manual_seed(6)
    a, rejected, b = (torch.randint(0, V, (1, n), generator=gen) for n in (10, 5, 4))
    cache = ours.new_cache(64)
    ours(a, cache)
    ours(rejected, cache)
    cache.truncate(10)
    got = ours(b, cache).logits
    ref = ours(torch.cat([a, b], dim=1), ours.new_cache(64)).logits[:, -4:]
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=0)
    with pytest.raises(ValueError):
        cache.truncate(99)


def test_left_padded_batch_matches_single_rows(pairs) -> None:  # type: ignore[no-untyped-def]
    """Batched prompts of different lengths (left padding, per-row positions and masks)."""
    ours, _ = pairs["llama"]
    V = ours.cfg.vocab_size
    gen = torch.Generator().manual_seed(7)
    rows = [torch.randint(0, V, (n,), generator=gen) for n in (9, 4)]
    T = 9
    ids = torch.zeros(2, T, dtype=torch.long)
    pos = torch.zeros(2, T, dtype=torch.long)
    valid = torch.zeros(2, T, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = r
        pos[i, T - len(r):] = torch.arange(len(r))
        valid[i, T - len(r):] = True
    mask = causal_mask(0, T)[None] & valid[:, None, :]
    mask |= torch.eye(T, dtype=torch.bool)[None]  # padding rows attend to themselves: no NaN
    out = ours(ids, ours.new_cache(32, batch_size=2), positions=pos, mask=mask).logits
    for i, r in enumerate(rows):
        ref = ours(r[None], ours.new_cache(32)).logits[0]
        torch.testing.assert_close(out[i, T - len(r):], ref, atol=1e-4, rtol=0)


def test_sliding_window_matches_transformers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    from tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "mistral-sw", "mistral", sliding_window=8)
    ours = load_model_dir(path, device="cpu", with_tokenizer=False).model
    assert ours.cfg.sliding_window == 8
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(8))
    cache = ours.new_cache(64)
    got = torch.cat([ours(ids[:, :20], cache).logits] + [ours(ids[:, i:i + 1], cache).logits for i in range(20, 30)], 1)
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_long_causal_forward_runs_in_chunks_as_one_pass(pairs, family: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A prefill longer than the chunk (7 here, 256 on a CPU) runs in chunks: logits, captured layers, the final
    state and every cached K/V equal transformers' one-shot forward, and the cache continues from them."""
    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 7)
    ours, hf = pairs[family]
    L = ours.cfg.num_layers
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(12))
    cache = ours.new_cache(64)
    calls = []
    monkeypatch.setattr(ours, "run_blocks", lambda h, *a, _run=ours.run_blocks, **k: calls.append(h.shape[1]) or _run(h, *a, **k))
    out = ours(ids[:, :33], cache, hidden_after=(1, L))
    assert calls == [7, 7, 7, 7, 5] and cache.length == 33
    nxt = ours(ids[:, 33:], cache).logits  # 7 tokens after the chunked prefill: one more chunk
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True, use_cache=True)
    torch.testing.assert_close(torch.cat([out.logits, nxt], 1), ref.logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(out.layer_hidden[1], ref.hidden_states[1][:, :33], atol=1e-4, rtol=0)
    torch.testing.assert_close(out.hidden, ref.hidden_states[L][:, :33], atol=1e-4, rtol=0)
    for layer in range(L):
        keys = ref.past_key_values.layers[layer].keys  # [1, kv heads, T, D]
        torch.testing.assert_close(cache.keys[layer][..., :40, :], keys, atol=1e-4, rtol=0)


def test_chunked_prefill_keeps_a_sliding_window(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Chunks past the window of a Mistral-style model each hide the keys the window hides."""
    from transformers import AutoModelForCausalLM

    from tiny import make_tiny_model

    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 5)
    path = make_tiny_model(tmp_path / "mistral-sw", "mistral", sliding_window=8)
    ours = load_model_dir(path, device="cpu", with_tokenizer=False).model
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 30), generator=torch.Generator().manual_seed(13))
    torch.testing.assert_close(ours(ids, ours.new_cache(32)).logits, hf_logits(hf, ids), atol=1e-4, rtol=0)


def test_a_failed_forward_leaves_the_cache_as_it_was(pairs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An error (or Ctrl-C) in a later chunk of a prefill leaves the cache's length where it started, so the
    cache never claims a half-processed prompt."""
    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 4)
    ours, _ = pairs["llama"]
    cache = ours.new_cache(32)
    ours(torch.zeros(1, 3, dtype=torch.long), cache)
    calls = []

    def failing(h, *args, _run=ours.run_blocks, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return _run(h, *args, **kwargs)

    monkeypatch.setattr(ours, "run_blocks", failing)
    with pytest.raises(KeyboardInterrupt):
        ours(torch.zeros(1, 10, dtype=torch.long), cache)
    assert cache.length == 3


def test_on_chunk_follows_a_prefill_and_can_abandon_it(pairs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``on_chunk`` hears (done, total) after each chunk; raising from it stops the prefill there (a server whose
    client has gone) and leaves the cache as it was."""
    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 4)
    ours, _ = pairs["llama"]
    heard: list[tuple[int, int]] = []
    cache = ours.new_cache(32)
    ours(torch.zeros(1, 10, dtype=torch.long), cache, on_chunk=lambda done, total: heard.append((done, total)))
    assert heard == [(4, 10), (8, 10), (10, 10)] and cache.length == 10

    class Gone(Exception):
        pass

    def give_up(done: int, total: int) -> None:
        heard.append((done, total))
        if done >= 8:
            raise Gone

    heard.clear()
    with pytest.raises(Gone):
        ours(torch.zeros(1, 20, dtype=torch.long), cache, on_chunk=give_up)
    assert heard == [(4, 20), (8, 20)] and cache.length == 10


def test_logits_at_selects_positions(pairs) -> None:  # type: ignore[no-untyped-def]
    ours, _ = pairs["llama"]
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(9))
    full = ours(ids, ours.new_cache(16)).logits
    last = ours(ids, ours.new_cache(16), logits_at=slice(-1, None)).logits
    assert last.shape == (1, 1, ours.cfg.vocab_size)
    torch.testing.assert_close(last, full[:, -1:], atol=1e-5, rtol=0)


def test_cache_overflow_is_refused(pairs) -> None:  # type: ignore[no-untyped-def]
    ours, _ = pairs["llama"]
    with pytest.raises(ValueError, match="cache overflow"):
        ours(torch.zeros(1, 9, dtype=torch.long), ours.new_cache(8))


def test_half_precision_path(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    """The bf16 path (used on CUDA; on a CPU packed where oneDNN has bf16 kernels) stays close to fp32."""
    fp32 = load_model_dir(tiny_dirs["llama"], device="cpu", with_tokenizer=False).model
    bf16 = load_model_dir(tiny_dirs["llama"], device="cpu", dtype=torch.bfloat16, with_tokenizer=False).model
    assert bf16.dtype == torch.bfloat16 and (bf16.lm_head.packed is not None) == bf16_kernels()
    ids = torch.randint(0, fp32.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(10))
    a = fp32(ids, fp32.new_cache(32)).logits
    b = bf16(ids, bf16.new_cache(32)).logits.float()
    assert (a - b).abs().max() < 0.1 * a.abs().max()


def test_packed_linear_keeps_gradients(pairs) -> None:  # type: ignore[no-untyped-def]
    """Target layers reused by a drafter (Target Layer Inference) must pass gradients to their input."""
    ours, _ = pairs["llama"]
    block = ours.blocks[-1]
    assert block.mlp.down.packed is not None
    x = torch.randn(1, 3, ours.cfg.hidden_size, requires_grad=True)
    y = block.mlp(x)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        torch.testing.assert_close(block.mlp(x), y, atol=1e-5, rtol=0)


def test_int8_products_compute_the_product_of_the_rounded_weight() -> None:
    """An int8 copy's product is the product of the weight rounded per row to 255 levels (in any leading
    shape, with a bias); products of more rows than aten's kernel is quick for, training, gradients and widths
    it gets wrong keep the float weight, fp32 weights (whose activations the kernel is slow with) get no copy,
    and unpacking drops the copy."""
    from moaspec.models import packed_linear

    dtype = torch.bfloat16
    torch.manual_seed(0)
    wide = packed_linear.Linear(64, 40)
    wide.quantize()
    assert wide.int8 is None  # fp32 activations: aten's scalar path, slower than the float product
    lin = packed_linear.Linear(64, 40).to(dtype)
    lin.quantize()
    if not packed_linear.int8_supported(lin.weight):
        pytest.skip("no int8 CPU kernel in this torch build")
    q, scales = lin.int8
    assert q.dtype == torch.int8 and q.abs().max() == 127
    rounded = q.float() * scales.float()[:, None]
    assert (rounded - lin.weight.float()).abs().max() <= scales.float().max() / 2 + 1e-2 * lin.weight.abs().max()
    x = torch.randn(2, 3, 64).to(dtype)
    with torch.inference_mode():
        got = lin(x)
    want = x.float() @ rounded.T + lin.bias.float()
    assert got.dtype == dtype and got.shape == (2, 3, 40)
    torch.testing.assert_close(got.float(), want, atol=0.03, rtol=0.02)
    many = torch.randn(packed_linear.INT8_MAX_ROWS + 1, 64).to(dtype)
    with torch.inference_mode():
        exact = torch.nn.functional.linear(many.float(), lin.weight.float(), lin.bias.float())
        assert (lin(many).float() - exact).abs().max() < (many.float() @ rounded.T + lin.bias.float() - exact).abs().max()
    x.requires_grad_(True)
    lin(x).sum().backward()  # training reads the parameter, gradients flow
    assert x.grad is not None and x.grad.abs().sum() > 0
    narrow = packed_linear.Linear(30, 8).to(dtype)
    narrow.quantize()
    assert narrow.int8 is None  # 30 input columns: bf16 activations gave garbage there
    lin.unpack()
    assert lin.int8 is None


@pytest.mark.parametrize("kernel", ["plain", "packed", "padded"])
def test_every_small_row_kernel_computes_the_plain_product(monkeypatch, kernel: str) -> None:  # type: ignore[no-untyped-def]
    """Whichever kernel runs a small product (MKL, oneDNN's packed weight, or the packed weight on rows
    padded with zeros) gives the plain product's values and shape, for 1 to 3 rows in any leading shape and
    for larger products (always packed); and the first large pack given a forward measures a kernel per row
    count with it."""
    from moaspec.models import packed_linear

    lin = packed_linear.Linear(48, 40)
    lin.pack()
    if lin.packed is None:
        pytest.skip("no oneDNN prepacking in this torch build")
    previous = packed_linear.set_small_row_kernels(packed_linear.SmallRowKernels.uniform(kernel))  # type: ignore[arg-type]
    try:
        with torch.no_grad():
            for shape in [(48,), (1, 48), (1, 1, 48), (2, 48), (1, 3, 48), (3, 1, 48), (5, 48), (2, 4, 48)]:
                x = torch.randn(shape)
                y = lin(x)
                assert y.shape == (*shape[:-1], 40)
                torch.testing.assert_close(y, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-5, rtol=0)
        packed_linear.set_small_row_kernels(None)
        monkeypatch.setattr(packed_linear, "_MEASURE_BYTES", 0)
        calls: list[int] = []
        packed_linear.pack_linears(torch.nn.Sequential(lin), forward=lambda rows: calls.append(lin(torch.randn(rows, 48)).shape[0]))
        measured = packed_linear._kernels
        assert set(calls) == {1, packed_linear.PAD_ROWS - 1}  # timed forwards of 1 and 3 rows
        assert measured is not None and len(measured.by_rows) == packed_linear.PAD_ROWS - 1
        assert set(measured.by_rows) <= set(packed_linear.KERNELS)
    finally:
        packed_linear.set_small_row_kernels(previous)


@pytest.mark.parametrize("first_block", [0, 1])
def test_kernel_timing_forward_runs_whole_and_partial_models(pairs, first_block: int) -> None:  # type: ignore[no-untyped-def]
    """The forward the small-row kernels are timed with runs 1 to 3 tokens through whatever blocks a model
    holds: a whole target, or a client's last layers (Target Layer Inference), without touching its
    embeddings."""
    from moaspec.models.loading import _timing_forward
    from moaspec.models.transformer import Transformer

    whole = pairs["llama"][0]
    model = Transformer(whole.cfg, first_block=first_block).eval()
    calls: list[int] = []
    model.lm_head.register_forward_hook(lambda mod, inp, out: calls.append(out.shape[1]))
    run = _timing_forward(model)
    for rows in (1, 2, 3):
        run(rows)
    assert calls == [1, 2, 3]


# Architectures beyond the three families above: Qwen3's per-head query/key norms (with a head width
# other than hidden / heads), and the RoPE scalings of Llama 3.1 and long-context checkpoints.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
YARN_ROPE = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
VARIANTS = {
    "qwen3": ("qwen3", {"head_dim": 32}),
    "llama-rope-llama3": ("llama", {"rope_scaling": LLAMA3_ROPE}),
    "llama-rope-linear": ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    "qwen2-rope-yarn": ("qwen2", {"rope_scaling": YARN_ROPE}),
    "qwen3-rope-yarn": ("qwen3", {"head_dim": 16, "rope_scaling": {**YARN_ROPE, "beta_fast": 16.0, "attention_factor": 1.3}}),
}


@pytest.fixture(scope="module")
def variant_dirs(tmp_path_factory):  # type: ignore[no-untyped-def]
    from tiny import make_tiny_model

    root = tmp_path_factory.mktemp("variants")
    return {name: make_tiny_model(root / name, fam, seed=i, **kw) for i, (name, (fam, kw)) in enumerate(VARIANTS.items())}


@pytest.mark.parametrize("name", VARIANTS)
def test_other_architectures_match_transformers(variant_dirs, name: str) -> None:  # type: ignore[no-untyped-def]
    """Logits past the original context (where the scalings differ from plain RoPE), in one shot and
    token by token from a cache, and every layer's cached K/V, equal transformers' own forward."""
    from transformers import AutoModelForCausalLM

    from moaspec.models.transformer import rope_tables

    ours = load_model_dir(variant_dirs[name], device="cpu", with_tokenizer=False).model
    hf = AutoModelForCausalLM.from_pretrained(str(variant_dirs[name]), dtype=torch.float32).eval()
    cfg = ours.cfg
    assert (cfg.qk_norm, cfg.rope_scaling is not None) == (name.startswith("qwen3"), "rope" in name)
    if cfg.rope_scaling:  # the scaling is applied, not ignored
        assert not torch.allclose(ours.rope_cos, rope_tables(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta)[0])
    ids = torch.randint(0, cfg.vocab_size, (1, 150), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        ref = hf(ids, use_cache=True)
    torch.testing.assert_close(ours(ids, ours.new_cache(256)).logits, ref.logits, atol=1e-4, rtol=0)
    cache = ours.new_cache(256)
    pieces = [ours(ids[:, :120], cache).logits] + [ours(ids[:, i:i + 1], cache).logits for i in range(120, 150)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), ref.logits, atol=1e-4, rtol=0)
    kv = cache.token_kv(0, 150)
    for layer in range(cfg.num_layers):
        k_ref, v_ref = ref.past_key_values.layers[layer].keys, ref.past_key_values.layers[layer].values
        torch.testing.assert_close(kv[0, :, layer], torch.cat([k_ref, v_ref], dim=1)[0].permute(1, 0, 2).reshape(150, -1),
                                   atol=1e-4, rtol=0)


def test_unrotated_keys_undo_yarn_and_keep_qwen3_key_norms(variant_dirs) -> None:  # type: ignore[no-untyped-def]
    """What Layer Self-Attention reads with ``derotate_keys``: a layer's keys as before RoPE (after Qwen3's key
    norm), YaRN's scale on cos/sin undone too."""
    from moaspec.models.transformer import rms_norm

    target = load_model_dir(variant_dirs["qwen3-rope-yarn"], device="cpu", with_tokenizer=False).model
    cfg, attn = target.cfg, target.blocks[0].attn
    tokens = torch.randint(0, cfg.vocab_size, (1, 90), generator=torch.Generator().manual_seed(10))
    cache = target.new_cache(90)
    target(tokens, cache)
    q_dim, kvd = cfg.num_heads * cfg.head_dim, cfg.kv_dim
    keys = attn.qkv(rms_norm(target.embed(tokens), target.blocks[0].attn_norm, cfg.rms_norm_eps))[..., q_dim:q_dim + kvd]
    expected = rms_norm(keys.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim)), attn.k_norm, cfg.rms_norm_eps).flatten(-2)
    derotated = target.unrotated_keys(cache.token_kv(0, 90), torch.arange(90))
    torch.testing.assert_close(derotated[:, :, 0, :kvd], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("change", "message"), [
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported RoPE scaling 'dynamic'"),
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}}, "unsupported RoPE scaling 'longrope'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks 'low_freq_factor', 'high_freq_factor'"),
    ({"partial_rotary_factor": 0.5}, "partial rotary embeddings"),
    ({"mlp_bias": True}, "MLP biases"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "mixing sliding-window and full-attention layers"),
])
def test_configs_the_runtime_cannot_reproduce_are_refused(change: dict, message: str) -> None:  # type: ignore[type-arg]
    from moaspec.errors import ModelLoadError
    from moaspec.models.config import ModelConfig

    raw = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2, **change}
    with pytest.raises(ModelLoadError, match=message):
        ModelConfig.from_hf_dict(raw)


def test_fields_added_later_leave_older_models_fingerprints_alone() -> None:
    """A drafter records its target's fingerprint, a hash of ``to_dict``: fields added after drafters shipped
    must not appear there at their defaults, or every shipped drafter would stop matching its target."""
    from dataclasses import replace

    from moaspec.models.config import ModelConfig

    raw = {"model_type": "llama", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
           "num_attention_heads": 2}
    assert not {"rope_scaling", "qk_norm", "generation_eos_ids"} & set(ModelConfig.from_hf_dict(raw).to_dict())
    scaled = ModelConfig.from_hf_dict({**raw, "model_type": "qwen3", "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert scaled.to_dict()["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and scaled.to_dict()["qk_norm"]
    assert ModelConfig.from_dict(scaled.to_dict()) == scaled  # as a client bundle rebuilds it
    stops = replace(scaled, generation_eos_ids=(5,))  # stops, not identity: carried to a bundle, not fingerprinted
    assert ModelConfig.from_dict(stops.to_dict()) == stops and stops.identity() == scaled.identity()


@pytest.mark.parametrize(("setting", "memory", "packed"), [("", 2**40, True), ("", 2**20, False), ("1", 2**20, True),
                                                           ("0", 2**40, False)])
def test_weights_are_prepacked_only_where_the_copies_fit(tiny_dirs, monkeypatch, capsys, setting: str, memory: int,  # type: ignore[no-untyped-def]
                                                         packed: bool) -> None:
    """The packed copies double a CPU target's weight memory: without room for them (or with MOASPEC_PACK=0) the model
    runs on its dense weights, says so in one line, and computes the same logits."""
    import moaspec.models.packed_linear as pl

    monkeypatch.setenv(pl.PACK_ENV, setting)
    monkeypatch.setattr(pl, "available_memory", lambda: memory)
    model = load_model_dir(tiny_dirs["llama"], device="cpu", with_tokenizer=False).model
    linears = [m for m in model.modules() if isinstance(m, pl.Linear)]
    assert all((m.packed is not None) == packed for m in linears)
    assert ("not prepacked" in capsys.readouterr().err) != packed
    monkeypatch.setenv(pl.PACK_ENV, "1")
    reference = load_model_dir(tiny_dirs["llama"], device="cpu", with_tokenizer=False).model
    ids = torch.randint(0, model.cfg.vocab_size, (1, 9), generator=torch.Generator().manual_seed(11))
    torch.testing.assert_close(model(ids, model.new_cache(16)).logits, reference(ids, reference.new_cache(16)).logits,
                               atol=1e-4, rtol=0)


def test_only_the_files_that_hold_the_model_are_read(tiny_dirs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A sharded checkpoint is read through its index, and weights in another naming beside the HF ones (Mistral's
    consolidated.safetensors) are not read as a second copy; an index naming a missing shard is one clear error."""
    import json
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from moaspec.errors import ModelLoadError
    from moaspec.models.loading import weight_files

    reference = load_model_dir(tiny_dirs["llama"], device="cpu", with_tokenizer=False).model
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(str(tiny_dirs["llama"])).save_pretrained(str(sharded), max_shard_size="100KB")
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, str(sharded / "consolidated.safetensors"))
    assert len(weight_files(sharded)) > 1 and (sharded / "consolidated.safetensors") not in weight_files(sharded)
    single = tmp_path / "single"
    shutil.copytree(tiny_dirs["llama"], single)
    shutil.copy(sharded / "consolidated.safetensors", single)
    assert weight_files(single) == [single / "model.safetensors"]
    for path in (sharded, single):
        model = load_model_dir(path, device="cpu", with_tokenizer=False).model
        assert model.fingerprint == reference.fingerprint
    index = sharded / "model.safetensors.index.json"
    first = sorted(set(json.loads(index.read_text())["weight_map"].values()))[0]
    (sharded / first).unlink()
    with pytest.raises(ModelLoadError, match=f"lacks weight files its index names: {first}"):
        load_model_dir(sharded, device="cpu", with_tokenizer=False)
    index.write_text("[]")
    with pytest.raises(ModelLoadError, match="is damaged"):
        load_model_dir(sharded, device="cpu", with_tokenizer=False)


# config.json of released checkpoints (their RoPE fields as published), for the scalings at their real sizes
RELEASED_CONFIGS = {
    "Llama-3.2-1B-Instruct": {
        "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "eos_token_id": [128001, 128008, 128009],
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}},
    "Qwen2.5-7B-Instruct with its long-context setting": {
        "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "max_position_embeddings": 32768,
        "rope_theta": 1000000.0, "rope_scaling": {"factor": 4.0, "original_max_position_embeddings": 32768, "type": "yarn"}},
    "Qwen3-0.6B": {
        "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
        "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
        "max_position_embeddings": 40960, "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": True},
}


@pytest.mark.parametrize("name", RELEASED_CONFIGS)
def test_rope_of_released_configs_matches_transformers(name: str) -> None:
    """Frequencies and cos/sin scale as transformers computes them for these configs (no weights needed)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from moaspec.models.config import ModelConfig
    from moaspec.models.transformer import rope_magnitude, scaled_frequencies

    raw = RELEASED_CONFIGS[name]
    ours = ModelConfig.from_hf_dict(raw)
    assert ours.qk_norm == (raw["model_type"] == "qwen3")
    hf_config = AutoConfig.for_model(**raw)
    plain = 1.0 / (ours.rope_theta ** (torch.arange(0, ours.head_dim, 2, dtype=torch.int64).float() / ours.head_dim))
    if ours.rope_scaling is None:
        assert hf_config.rope_parameters["rope_type"] == "default"
        return
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[ours.rope_scaling["rope_type"]](hf_config, torch.device("cpu"))
    torch.testing.assert_close(scaled_frequencies(plain, ours.rope_theta, ours.head_dim, ours.rope_scaling), inv_freq,
                               rtol=1e-6, atol=0)
    assert rope_magnitude(ours.rope_scaling) == pytest.approx(attention_factor)


@pytest.mark.parametrize("family", FAMILIES)
def test_forward_many_computes_what_each_forward_computes(pairs, family: str) -> None:  # type: ignore[no-untyped-def]
    """Three sequences at different lengths, a chain, a single token and a draft tree, in one forward: each call's
    logits, final states and cache are those of its own forward."""
    from moaspec.models.transformer import Call

    ours, _ = pairs[family]
    V, gen = ours.cfg.vocab_size, torch.Generator().manual_seed(7)
    parents, depths = branches_tree()

    def calls(caches):  # type: ignore[no-untyped-def]
        chain, one, tree = caches
        return [Call(news[0], chain), Call(news[1], one, logits_at=slice(-1, None)),
                Call(news[2], tree, tree.length + torch.tensor(depths), tree_mask(tree.length, ancestors_matrix(parents)))]

    prefixes = [torch.randint(0, V, (1, n), generator=gen) for n in (5, 17, 11)]
    news = [torch.randint(0, V, (1, n), generator=gen) for n in (4, 1, len(parents))]
    alone, together = [ours.new_cache(64) for _ in prefixes], [ours.new_cache(64) for _ in prefixes]
    for p, a, b in zip(prefixes, alone, together):
        ours(p, a), ours(p, b)
    want = [ours(c.tokens, c.cache, c.positions, c.mask, c.logits_at) for c in calls(alone)]
    got = ours.forward_many(calls(together))
    for w, g, a, b in zip(want, got, alone, together):
        assert g.start == w.start and b.length == a.length
        torch.testing.assert_close(g.logits, w.logits, atol=1e-4, rtol=0)
        torch.testing.assert_close(g.hidden, w.hidden, atol=1e-4, rtol=0)
        torch.testing.assert_close(b.keys[:, :, :, : b.length], a.keys[:, :, :, : a.length], atol=1e-5, rtol=0)
        torch.testing.assert_close(b.values[:, :, :, : b.length], a.values[:, :, :, : a.length], atol=1e-5, rtol=0)
    full = ours.new_cache(6)
    ours(torch.zeros(1, 4, dtype=torch.long), full)
    with pytest.raises(ValueError, match="cache overflow"):
        ours.forward_many([Call(torch.zeros(1, 3, dtype=torch.long), full)])
    assert full.length == 4
