"""Tiny randomly initialised models (Llama, Qwen2, Qwen3, Mistral) saved as real HF directories (or GGUF files).

Each directory has config.json, safetensors weights, and a small byte-level BPE tokenizer
with a ChatML template, so the whole load → encode → generate path runs in milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 4,
    "Speculative decoding drafts tokens with a small model and verifies them with a large one.",
    "def add(a, b):\n    return a + b\n",
    "Paris is the capital of France. Berlin is the capital of Germany. 1 2 3 4 5 6 7 8 9 10",
    "Café, naïve, jalapeño: unicode text ☕ 日本語 🙂",
]


def make_tokenizer(vocab_size: int):  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(path: Path, family: str = "llama", seed: int = 0, vocab_size: int = 320, **overrides) -> Path:  # type: ignore[no-untyped-def]
    """Write a tiny random ``family`` model with a tokenizer to ``path``; return ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = make_tokenizer(vocab_size)
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=family != "qwen2",
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    if family == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init is near-uniform; sharpen so greedy has clear winners
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
            else:  # norm weights
                p.normal_(1.0, 0.1)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    return path



def make_tiny_gguf(source: Path, out: Path, quantise: dict[str, str] | None = None, name: str | None = None) -> Path:
    """Write the tiny HF model at ``source`` (a Qwen2 or Qwen3 one) as a GGUF file, as llama.cpp names its tensors
    and keys, with its tokenizer (byte-level BPE: tokens, merges) and chat template; return ``out``.

    ``quantise`` maps GGUF tensor-name fragments to a ggml block type ("Q4_1", "Q6_K", ...): matrices whose name
    holds the first such fragment are stored in it (with gguf's own quantiser; K-quants with :mod:`ggml_pack`'s),
    the rest as fp32. ``name``: the source model's ``general.name``, as llama.cpp's converter writes it."""
    import json

    from gguf import GGMLQuantizationType, GGUFWriter, TokenType, quants
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from ggml_pack import quantise_k

    hf = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    cfg, state = hf.config, hf.state_dict()
    writer = GGUFWriter(str(out), cfg.model_type)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    tok = json.loads((source / "tokenizer.json").read_text())
    added = {a["id"]: a["content"] for a in tok["added_tokens"]}
    tokens = {i: t for t, i in tok["model"]["vocab"].items()} | added
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list([tokens[i] for i in range(len(tokens))])
    writer.add_token_types([TokenType.CONTROL if i in added else TokenType.NORMAL for i in range(len(tokens))])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)
    if name is not None:
        writer.add_name(name)
    for gguf_name, hf_name in get_gguf_hf_weights_map(hf, TensorProcessor()).items():
        if hf_name not in state:
            continue
        array = state[hf_name].numpy()
        kind = next((k for part, k in (quantise or {}).items() if part in gguf_name), None) if array.ndim == 2 else None
        if kind is None:
            writer.add_tensor(gguf_name, array)
        else:
            qtype = GGMLQuantizationType[kind]
            data = quantise_k(kind, array) if kind.endswith("_K") else quants.quantize(array, qtype)
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out

@contextmanager
def accepting_gibberish() -> Iterator[None]:
    """Let ``moaspec data`` run on a random tiny model, which writes gibberish user prompts.

    Any non-empty prompt is accepted, and long runs of empty shards (it finishes a prompt
    within the budget in only ~1 of 70 tries) do not stop the run as they would a real model's.
    """
    import moaspec.training.datagen as datagen

    saved = datagen.usable_query, datagen.STALL_SHARDS
    datagen.usable_query, datagen.STALL_SHARDS = (lambda q: bool(q.strip())), 10**9
    try:
        yield
    finally:
        datagen.usable_query, datagen.STALL_SHARDS = saved
