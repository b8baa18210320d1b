"""Vanilla decoding on tiny models: greedy equals transformers' generate; stopping rules; streaming."""

from __future__ import annotations

import pytest
import torch

from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.opening import stop_token_ids
from moaspec.errors import MoaspecError, PromptError
from moaspec.models import load_model_dir


def hf_greedy(path, prompt: list[int], n: int) -> list[int]:  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt):].tolist()
    eos = hf.generation_config.eos_token_id
    ends = [i for i, t in enumerate(out) if t in (eos if isinstance(eos, list) else [eos])]
    return out[: ends[0]] if ends else out


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_greedy_equals_transformers_generate(tiny_dirs, family: str) -> None:  # type: ignore[no-untyped-def]
    lm = load_model_dir(tiny_dirs[family], device="cpu")
    for text in ["The quick brown", "def add(a, b):", "Paris is the capital of"]:
        prompt = encode_chat(lm.tokenizer, chat_messages(text))
        res = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_new_tokens=40))
        assert res.token_ids == hf_greedy(tiny_dirs[family], prompt, 40)


def test_max_new_tokens_and_counts(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    prompt = encode_chat(lm.tokenizer, chat_messages("hello"))
    res = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_new_tokens=7, ignore_eos=True))
    assert res.new_tokens == 7 and res.finish_reason == "length"
    assert res.target_calls == 6 and res.prompt_tokens == len(prompt)
    assert res.tokens_per_s > 0 and res.total_s >= res.prefill_s


def test_eos_ends_generation(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """Make EOS the argmax: generation stops at once with reason 'eos', and EOS is not part of the output."""
    lm = tiny_llama
    eos = next(iter(stop_token_ids(lm.model, lm.tokenizer)))
    prompt = encode_chat(lm.tokenizer, chat_messages("hello"))
    bias = torch.zeros(lm.cfg.vocab_size)
    bias[eos] = 1e4
    head = lm.model.lm_head
    saved = head.bias
    head.bias = torch.nn.Parameter(bias, requires_grad=False)
    try:
        res = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_new_tokens=20))
    finally:
        head.bias = saved
    assert res.finish_reason == "eos" and res.token_ids == [] and res.text == ""


def test_stop_string_and_stream(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    prompt = encode_chat(lm.tokenizer, chat_messages("The quick brown"))
    full = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_new_tokens=30, ignore_eos=True))
    assert len(full.text) > 6
    stop = full.text[3:6]
    pieces: list[str] = []
    res = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_new_tokens=30, ignore_eos=True, stop=[stop]),
                   on_text=pieces.append)
    assert res.finish_reason == "stop"
    assert res.text == full.text[: full.text.index(stop)]
    assert "".join(pieces) == res.text


def test_sampling_is_reproducible_with_seed(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    prompt = encode_chat(lm.tokenizer, chat_messages("hello"))
    cfg = GenerationConfig(max_new_tokens=25, ignore_eos=True, sampling=SamplingParams(1.0, top_k=50, top_p=0.9, seed=7))
    a = generate(lm.model, lm.tokenizer, prompt, cfg).token_ids
    b = generate(lm.model, lm.tokenizer, prompt, cfg).token_ids
    c = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(25, SamplingParams(1.0, seed=8), ignore_eos=True)).token_ids
    assert a == b and a != c


def test_multi_turn_messages(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    ids = encode_chat(lm.tokenizer, msgs)
    text = lm.tokenizer.decode(ids)
    assert text.count("<|im_start|>") == 4 and text.endswith("<|im_start|>assistant\n")
    assert generate(lm.model, lm.tokenizer, ids, GenerationConfig(max_new_tokens=3)).prompt_tokens == len(ids)


@pytest.mark.parametrize(
    "messages",
    [[], [{"role": "user", "content": "   "}], [{"role": "bot", "content": "x"}], [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]],
)
def test_bad_conversations_are_refused(tiny_llama, messages) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PromptError):
        encode_chat(tiny_llama.tokenizer, messages)


def test_prompt_longer_than_context_is_refused(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    with pytest.raises(PromptError, match="context window"):
        generate(lm.model, lm.tokenizer, [5] * lm.cfg.max_position_embeddings, GenerationConfig())


def test_generation_stops_at_context_end(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    lm = tiny_llama
    n = lm.cfg.max_position_embeddings - 3
    res = generate(lm.model, lm.tokenizer, [5] * n, GenerationConfig(max_new_tokens=50, ignore_eos=True))
    assert res.new_tokens == 3 and res.finish_reason == "length"


def test_invalid_max_new_tokens() -> None:
    with pytest.raises(MoaspecError):
        GenerationConfig(max_new_tokens=0)


def test_generation_stops_at_the_eos_ids_only_generation_config_names(tiny_dirs, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The first release of Llama-3-8B-Instruct names <|eot_id|>, which ends its turns, only in generation_config.json: decoding stops there
    as transformers' does, and the model's fingerprint (which drafters record) is the same as without it."""
    import json
    import shutil

    path = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], path)
    lm = load_model_dir(path, device="cpu")
    prompt = encode_chat(lm.tokenizer, chat_messages("The quick brown"))
    free = generate(lm.model, lm.tokenizer, prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    ender = free[3]  # a token the model emits: made an EOS only by the generation config
    first = free.index(ender)
    settings = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**settings, "eos_token_id": [settings["eos_token_id"], ender]}))
    stopped = load_model_dir(path, device="cpu")
    assert stopped.cfg.generation_eos_ids == (ender,) and stopped.fingerprint == lm.fingerprint
    res = generate(stopped.model, stopped.tokenizer, prompt, GenerationConfig(max_new_tokens=12))
    assert res.token_ids == free[:first] and res.finish_reason == "eos"
    assert res.token_ids == hf_greedy(path, prompt, 12)
