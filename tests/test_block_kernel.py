"""The 4-bit/8-bit block kernel: exact weights, fp32 arithmetic, rows independent of the product's size,
GGUF's layouts read as gguf dequantises them, and GGUF targets decoding from their blocks losslessly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ggml_pack import quantise_k, random_k_blocks
from moaspec.models import block_kernel, gguf_blocks
from moaspec.models.block_kernel import BlockWeights
from moaspec.models.packed_linear import Linear

needs_kernel = pytest.mark.skipif(block_kernel.cpu_supported() is not None, reason=str(block_kernel.cpu_supported()))


@pytest.fixture(params=["avx2", "avx512"])
def isa(request: pytest.FixtureRequest) -> object:
    """Runs a test on each instruction set's loops that this CPU has (and restores the process's own after)."""
    if request.param not in block_kernel.instruction_sets():
        pytest.skip(f"this CPU has no {request.param} loops (AVX-512 needs F, BW, VL and DQ)")
    before = block_kernel.instruction_set()
    block_kernel.set_instruction_set(request.param)
    yield request.param
    block_kernel.set_instruction_set(before or "avx2")


@needs_kernel
def test_instruction_sets_are_chosen_by_name_and_a_missing_one_is_refused(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    module = block_kernel.kernel()
    assert module is not None and "avx2" in block_kernel.instruction_sets()
    own = block_kernel.instruction_set()
    with pytest.raises(ValueError, match="not available here"):
        block_kernel.set_instruction_set("avx1024")
    try:
        monkeypatch.setenv(block_kernel.ISA_VARIABLE, "avx2")
        block_kernel._choose_instruction_set(module)
        assert block_kernel.instruction_set() == "avx2"
        monkeypatch.setenv(block_kernel.ISA_VARIABLE, "sse2")
        block_kernel._choose_instruction_set(module)
        assert block_kernel.instruction_set() == "avx2"  # kept, and said in one line
        assert capsys.readouterr().err.strip().splitlines() == [
            "moaspec: MOASPEC_KERNEL_ISA=sse2 ignored: unknown instruction set 'sse2': avx2 or avx512"]
    finally:
        block_kernel.set_instruction_set(own or "avx2")


def random_blocks(bits: int, out: int, inner: int, seed: int = 0) -> BlockWeights:
    """Blocks with every code value and scales/offsets as fp16 would store them (what GGUF files hold)."""
    g = torch.Generator().manual_seed(seed)
    blocks = inner // 32
    codes = torch.randint(0, 256, (out, blocks * (16 if bits == 4 else 32)), dtype=torch.uint8, generator=g)
    scales = (torch.rand(out, blocks, generator=g) * 0.02 + 1e-3).half()
    offsets = (-8 * scales if bits == 4 else torch.zeros_like(scales)) + (torch.randn(out, blocks, generator=g) * 1e-3
                                                                          ).half() * (bits == 4)
    return BlockWeights(bits, codes, scales, offsets)


class GGUFTensor:
    """What GGUFReader gives for a tensor: its type and raw bytes, one row of blocks per output row."""

    def __init__(self, kind: str, data: np.ndarray) -> None:
        from gguf import GGMLQuantizationType

        self.tensor_type, self.data = GGMLQuantizationType[kind], data


def gguf_tensor(kind: str, out: int, inner: int, seed: int = 0) -> GGUFTensor:
    """A ``kind`` tensor with codes and scales drawn at random: gguf's own quantiser for the legacy types (from
    random weights), :mod:`ggml_pack` for the K-quants."""
    from gguf import GGMLQuantizationType, quants

    if kind.endswith("_K"):
        return GGUFTensor(kind, random_k_blocks(kind, out, inner, seed))
    weights = np.random.default_rng(seed).standard_normal((out, inner)).astype(np.float32)
    return GGUFTensor(kind, quants.quantize(weights, GGMLQuantizationType[kind]))


def file_blocks(kind: str, out: int, inner: int, seed: int = 0) -> BlockWeights:
    blocks = gguf_blocks.blocks_of(gguf_tensor(kind, out, inner, seed))
    assert blocks is not None
    return blocks


NEW_TYPES = ["Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"]


@needs_kernel
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("out", [1, 5, 64, 203])  # short groups of four rows, tasks of 64 rows and their remainders
@pytest.mark.usefixtures("isa")
def test_product_is_fp32_arithmetic_on_the_exact_weights(bits: int, out: int) -> None:
    check_product(random_blocks(bits, out, 96))


@needs_kernel
@pytest.mark.parametrize("kind", NEW_TYPES)
@pytest.mark.parametrize("out", [1, 5, 67])
@pytest.mark.usefixtures("isa")
def test_every_file_type_is_fp32_arithmetic_on_the_exact_weights(kind: str, out: int) -> None:
    check_product(file_blocks(kind, out, 512, seed=out))


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", *NEW_TYPES])
@pytest.mark.usefixtures("isa")
def test_the_kernel_rebuilds_every_weight_bit_for_bit(kind: str) -> None:
    """A product with the identity reads each weight back alone (every other term is a zero): a code decoded one
    bit off, or a scale applied to the wrong weights, shows here however small its effect on a product."""
    w = file_blocks(kind, 9, 512, seed=4)
    eye = torch.eye(512)
    assert torch.equal(block_kernel.product(eye[:1].contiguous(), w), w.dequantise()[:, :1].T)
    assert torch.equal(block_kernel.product(eye, w), w.dequantise().T)


def check_product(w: BlockWeights) -> None:
    inner = w.shape[1]
    x = torch.randn(70, inner, generator=torch.Generator().manual_seed(1))
    exact = x.double() @ w.dequantise().double().T
    for rows in (1, 2, 3, 4, 7, 70):
        got = block_kernel.product(x[:rows].contiguous(), w)
        # fp32 sums of 96 to 512 terms: the error measured here is ~1e-6 of the largest output; allow 1e-5
        assert (got.double() - exact[:rows]).abs().max() <= 1e-5 * exact[:rows].abs().max()


@needs_kernel
@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", *NEW_TYPES])
@pytest.mark.usefixtures("isa")
def test_a_rows_result_does_not_depend_on_how_many_rows_the_product_has(kind: str) -> None:
    """Bit for bit: a verification of k tokens must score each exactly as a one-token step does."""
    w = file_blocks(kind, 131, 256, seed=2)
    x = torch.randn(67, 256, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([block_kernel.product(x[i : i + 1].contiguous(), w) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 16, 64, 67):
        assert torch.equal(block_kernel.product(x[:rows].contiguous(), w), alone[:rows])
    with torch.inference_mode():  # and with torch's other thread count
        threads = torch.get_num_threads()
        torch.set_num_threads(1 if threads > 1 else 2)
        try:
            assert torch.equal(block_kernel.product(x.contiguous(), w), alone)
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", *NEW_TYPES])
def test_gguf_blocks_decode_exactly_as_gguf_dequantises_them(kind: str) -> None:
    from gguf import quants

    tensor = gguf_tensor(kind, 6, 512, seed=4)
    blocks = gguf_blocks.blocks_of(tensor)
    assert blocks is not None and blocks.shape == (6, 512)
    want = torch.from_numpy(quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32))
    assert torch.equal(blocks.dequantise(), want)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_the_test_quantiser_packs_k_blocks_that_gguf_reads_back_near_the_weights(kind: str) -> None:
    """The tiny models' K-quant files come from ggml_pack's rough quantiser: its blocks must be what gguf reads
    as weights near the originals (a wrong bit position would give noise)."""
    from gguf import GGMLQuantizationType, quants

    weights = np.random.default_rng(7).standard_normal((8, 512)).astype(np.float32) * 0.2
    back = quants.dequantize(quantise_k(kind, weights), GGMLQuantizationType[kind])
    bound = {"Q4_K": 0.15, "Q5_K": 0.08, "Q6_K": 0.04}[kind]  # a step of the 4/5/6-bit grid over a sub-block's range
    assert np.abs(back - weights).max() <= bound * np.abs(weights).max()


@pytest.mark.parametrize("kinds,bits", [(["Q5_0", "Q4_0", "Q8_0"], 8), (["Q5_1", "Q4_1", "Q8_0"], block_kernel.Q8M)])
def test_legacy_parts_fuse_with_q8_0_exactly(kinds: list[str], bits: int) -> None:
    """llama.cpp's quantiser writes a narrow model's q and k as Q5_0 (Q4_K_M) or Q5_1 (Q5_K_M) beside a Q8_0 v: they
    fuse as 8-bit codes, with offsets where a part has them."""
    parts = [file_blocks(kind, 8, 64, seed) for seed, kind in enumerate(kinds)]
    fused = BlockWeights.stack(parts)
    assert fused.bits == bits and torch.equal(fused.dequantise(), torch.cat([p.dequantise() for p in parts]))
    with pytest.raises(ValueError, match="different block types"):
        BlockWeights.stack([file_blocks("Q4_K", 8, 256), file_blocks("Q8_0", 4, 256)])


@needs_kernel
@pytest.mark.usefixtures("isa")
def test_q5_1_parts_beside_q8_0_are_fp32_arithmetic_on_the_exact_weights() -> None:
    fused = BlockWeights.stack([file_blocks("Q5_1", 67, 256, 1), file_blocks("Q8_0", 5, 256, 2)])
    check_product(fused)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([block_kernel.product(x[i : i + 1].contiguous(), fused) for i in range(len(x))])
    assert torch.equal(block_kernel.product(x, fused), alone)


def test_other_tensor_types_have_no_blocks() -> None:
    for kind in ("F16", "Q2_K", "Q3_K"):
        assert gguf_blocks.blocks_of(GGUFTensor(kind, np.zeros((2, 32), np.uint8))) is None


def test_query_rows_are_put_back_in_the_order_transformers_reads_them() -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    rows = np.arange(48)[:, None]  # 4 heads of 12 rows
    want = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 4}).process(
        weights=rows, name="blk.0.attn_q.weight").weights[:, 0]
    assert gguf_blocks.unpermute_rows(48, 4).tolist() == want.tolist()


QUANTISED = {"attn_": "Q4_1", "ffn_gate": "Q4_0", "ffn_up": "Q4_0", "ffn_down": "Q8_0", "output.": "Q8_0"}


@pytest.fixture(scope="module")
def quantised_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tiny import make_tiny_gguf, make_tiny_model

    root = tmp_path_factory.mktemp("blocks")
    return make_tiny_gguf(make_tiny_model(root / "qwen2", "qwen2", seed=5), root / "tiny.q4.gguf", QUANTISED)


# as llama.cpp's quantiser mixes types in a "Q4_K_M" file: a layer's q and k as Q5_0 beside a Q8_0 v (its fallback
# where rows are not whole super-blocks), K-quants elsewhere; the first fragment a tensor's name holds decides
MIXED = {"blk.0.attn_q": "Q5_0", "blk.0.attn_k": "Q5_0", "blk.0.attn_v": "Q8_0", "attn_output": "Q4_K",
         "blk.2.attn_q": "Q5_1", "blk.2.attn_k": "Q5_1", "blk.2.attn_v": "Q8_0",  # as a Q5_K_M file's
         "attn_": "Q5_K", "ffn_gate": "Q5_1", "ffn_up": "Q5_1", "blk.1.ffn_down": "Q4_K", "ffn_down": "Q6_K",
         "output.": "Q6_K"}


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2 wide enough for K-quants' super-blocks of 256 (hidden 256, MLP 512), stored as :data:`MIXED`."""
    from tiny import make_tiny_gguf, make_tiny_model

    root = tmp_path_factory.mktemp("mixed")
    source = make_tiny_model(root / "qwen2", "qwen2", seed=8, hidden_size=256, intermediate_size=512,
                             num_hidden_layers=3)
    return make_tiny_gguf(source, root / "tiny.mixed.gguf", MIXED)


@needs_kernel
def test_a_mixed_k_quant_file_decodes_from_its_blocks_as_its_fp32_weights_do(mixed_gguf: Path) -> None:
    from moaspec.decoding import GenerationConfig, generate
    from moaspec.decoding.speculative import generate_chain
    from moaspec.models import load_model

    loaded = load_model(str(mixed_gguf), device="cpu")
    model, tok = loaded.model, loaded.tokenizer
    kinds = {n: m.blocks.bits for n, m in linears(model).items() if m.blocks is not None}
    assert len(kinds) == len(linears(model)) and model.fused is not None
    assert kinds["blocks.0.attn.qkv"] == 8 and kinds["blocks.2.attn.qkv"] == block_kernel.Q8M
    assert kinds["blocks.1.mlp.down"] == block_kernel.Q4K
    assert {kinds["blocks.0.attn.o"], kinds["blocks.1.attn.qkv"], kinds["lm_head"]} == {
        block_kernel.Q4K, block_kernel.Q5K, block_kernel.Q6K}
    ids = torch.randint(0, loaded.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    with torch.inference_mode():
        blocks = model(ids, model.new_cache(16)).logits
        plain = generate(model, tok, [5, 17, 42, 7], cfg).token_ids
        with gguf_blocks.dense_products(model):
            dense = model(ids, model.new_cache(16)).logits
            assert generate(model, tok, [5, 17, 42, 7], cfg).token_ids == plain
    # fp32 sums of 256 to 512 terms in another order, through three layers: measured 4e-6 of the largest logit
    torch.testing.assert_close(blocks, dense, atol=1e-5 * float(dense.abs().max()), rtol=0)
    from test_speculative import moa_proposer

    assert generate_chain(model, tok, moa_proposer(loaded), [5, 17, 42, 7], cfg, draft_len=4).token_ids == plain


@needs_kernel
def test_a_weight_left_on_fp32_is_named_with_why_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from moaspec.models import load_model
    from tiny import make_tiny_gguf, make_tiny_model

    source = make_tiny_model(tmp_path / "qwen2", "qwen2", seed=9, num_hidden_layers=2, hidden_size=256,
                             intermediate_size=512)
    gguf = make_tiny_gguf(source, tmp_path / "tiny.gguf", {"blk.0.attn_v": "Q8_0", "attn_": "Q4_K",
                                                           "ffn_": "Q4_0", "output.": "F16"})
    for _ in range(2):  # converted and kept, then read back from what was kept: the same line
        load_model(str(gguf), device="cpu")
        lines = [line for line in capsys.readouterr().err.splitlines() if "stay on fp32" in line]
        assert len(lines) == 1 and "2 of 9 weights" in lines[0], lines
        assert "fuses Q4_K and Q8_0 parts" in lines[0] and "blocks.0.attn.qkv" in lines[0]
        assert "stored as F16" in lines[0] and "lm_head" in lines[0]


def linears(model: torch.nn.Module) -> dict[str, Linear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Linear)}


@needs_kernel
def test_a_quantised_gguf_target_decodes_from_its_blocks_as_its_fp32_weights_do(
        quantised_gguf: Path) -> None:
    from moaspec.decoding import GenerationConfig, generate
    from moaspec.decoding.speculative import generate_chain
    from moaspec.decoding.tree import TreeShape, generate_tree
    from moaspec.models import load_model, sources

    loaded = load_model(str(quantised_gguf), device="cpu")
    assert all(m.blocks is not None for m in linears(loaded.model).values())
    assert (sources.resolve_model(str(quantised_gguf)) / gguf_blocks.BLOCKS_FILE).is_file()
    again = load_model(str(quantised_gguf), device="cpu")  # the second load maps the kept blocks
    assert all(torch.equal(a.blocks.codes, b.blocks.codes)  # type: ignore[union-attr]
               for a, b in zip(linears(loaded.model).values(), linears(again.model).values()))

    model, tok = loaded.model, loaded.tokenizer
    ids = torch.randint(0, loaded.cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(6))
    with torch.inference_mode():
        blocks = model(ids, model.new_cache(16)).logits
        saved = {n: m.blocks for n, m in linears(model).items()}
        for m in linears(model).values():
            m.blocks = None
        dense = model(ids, model.new_cache(16)).logits
        for n, m in linears(model).items():
            m.blocks = saved[n]
    torch.testing.assert_close(blocks, dense, atol=1e-5, rtol=0)

    from test_speculative import moa_proposer

    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    for prompt in ([5, 17, 42, 7], list(range(30, 60))):
        want = generate(model, tok, prompt, cfg)
        assert generate_chain(model, tok, moa_proposer(loaded), prompt, cfg, draft_len=4).token_ids == want.token_ids
        assert generate_tree(model, tok, moa_proposer(loaded), prompt, cfg, TreeShape(4, 3, 13)).token_ids == want.token_ids


def test_without_a_kernel_gguf_targets_run_on_fp32_and_say_why_once(
        quantised_gguf: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from moaspec.models import load_model

    def no_compiler() -> None:
        raise RuntimeError("Error building extension\nc++: command not found")

    monkeypatch.setattr(block_kernel, "_module", None)
    monkeypatch.setattr(block_kernel, "_why_not", None)
    monkeypatch.setattr(block_kernel, "build", no_compiler)
    monkeypatch.setattr(block_kernel, "cpu_supported", lambda: None)
    for _ in range(2):
        loaded = load_model(str(quantised_gguf), device="cpu")
        assert not any(m.blocks is not None for m in linears(loaded.model).values())
    err = capsys.readouterr().err
    assert err.count("GGUF targets run on dequantised fp32 weights") == 1 and "c++: command not found" in err
    assert loaded.model(torch.tensor([[1, 2, 3]]), loaded.model.new_cache(4)).logits.isfinite().all()


def test_dense_weights_option_keeps_gguf_targets_on_fp32(quantised_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moaspec.cli import build_parser
    from moaspec.cli.options import load_target

    monkeypatch.setenv(gguf_blocks.BLOCKS_ENV, "1")  # restored after the test, whatever load_target sets
    args = build_parser().parse_args(["generate", "hi", "--model", str(quantised_gguf), "--dense-weights"])
    loaded = load_target(args)
    assert not any(m.blocks is not None for m in linears(loaded.model).values())


def test_a_conversion_reused_from_another_path_reads_the_blocks_of_the_file_given(
        quantised_gguf: Path, tmp_path: Path) -> None:
    """The conversion cache is keyed by the file's bytes: a copy elsewhere (another virtual environment's
    package, the first since deleted) reuses it, and must still find a GGUF to read the blocks from."""
    import shutil

    from moaspec.models import load_model, sources
    from moaspec.models.loading import converted_from

    first = sources.resolve_model(str(quantised_gguf))
    (first / gguf_blocks.BLOCKS_FILE).unlink(missing_ok=True)
    copy = tmp_path / "elsewhere" / quantised_gguf.name
    copy.parent.mkdir()
    shutil.copy(quantised_gguf, copy)
    assert sources.resolve_model(str(copy)) == first and converted_from(first) == copy.resolve()
    if block_kernel.cpu_supported() is None:
        assert all(m.blocks is not None for m in linears(load_model(str(copy), device="cpu").model).values())
