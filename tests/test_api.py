"""The Python API (``moaspec.load``): same decoding as the CLI, lossless, clear errors for bad prompts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moaspec
from moaspec.api import SpeculativeModel, decoding_strategy, encode_prompt
from moaspec.errors import PromptError

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def lm(tiny_dirs, tiny_moa_dir) -> SpeculativeModel:  # type: ignore[no-untyped-def]
    return moaspec.load(tiny_dirs["llama"], tiny_moa_dir, device="cpu")


def test_importing_moaspec_does_not_load_torch() -> None:
    """The CLI imports the package first; its start-up must not pay for torch until a command needs it."""
    code = "import sys, moaspec; print('torch' in sys.modules, callable(moaspec.load), 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", "True"]


@pytest.mark.parametrize("decoding", [{"chain": 1}, {"chain": 4, "lookup": 0}, {"tree": moaspec.TreeShape(2, 2, 5)},
                                      {"chain": 3, "confidence": 0.3}])
def test_every_decoding_writes_what_the_target_alone_writes(lm, tiny_moa_dir, decoding) -> None:  # type: ignore[no-untyped-def]
    plain = lm.with_decoding(None).generate(PROMPT, max_new_tokens=24)
    spec = lm.with_decoding(tiny_moa_dir, **decoding)
    out = spec.generate(PROMPT, max_new_tokens=24)
    assert out.token_ids == plain.token_ids and out.text == plain.text
    assert spec.target is lm.target  # a new decoding, the same loaded weights
    assert out.target_calls <= plain.target_calls


def test_a_prompt_cache_carries_a_conversation_from_turn_to_turn(lm) -> None:  # type: ignore[no-untyped-def]
    chat = moaspec.PromptCache(1 << 28, min_tokens=8)
    conversation = [{"role": "user", "content": PROMPT + " jumps over the lazy dog"}]
    for turn in range(2):
        out = lm.generate(conversation, max_new_tokens=8, prompt_cache=chat)
        assert out.token_ids == lm.generate(conversation, max_new_tokens=8).token_ids
        assert (out.reused_prompt_tokens > 0) == (turn == 1)
        conversation += [{"role": "assistant", "content": out.text}, {"role": "user", "content": "Go on."}]


def test_a_prompt_string_a_conversation_and_token_ids_agree(lm) -> None:  # type: ignore[no-untyped-def]
    by_text = lm.generate(PROMPT, system="Be brief.", max_new_tokens=12)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}]
    by_messages = lm.generate(messages, max_new_tokens=12)
    ids = encode_prompt(lm.target, messages)
    by_ids = lm.generate(ids, max_new_tokens=12)
    assert by_text.token_ids == by_messages.token_ids == by_ids.token_ids
    assert lm.generate(PROMPT, raw=True, max_new_tokens=12).prompt_tokens != by_text.prompt_tokens


def test_streaming_stops_and_seeded_sampling(lm) -> None:  # type: ignore[no-untyped-def]
    pieces: list[str] = []
    out = lm.generate(PROMPT, max_new_tokens=16, on_text=pieces.append)
    assert "".join(pieces) == out.text
    if len(out.text) > 3:  # a stop string given alone, not as a sequence of characters
        stop = out.text[2:4]
        stopped = lm.generate(PROMPT, max_new_tokens=16, stop=stop)
        assert stopped.finish_reason == "stop" and stop not in stopped.text
    a, b = (lm.generate(PROMPT, max_new_tokens=16, temperature=0.9, top_p=0.95, seed=7) for _ in range(2))
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize(("prompt", "kw", "fragment"), [
    ("", {}, "the prompt is empty"),
    ([], {}, "the prompt is empty"),
    ([1, 10**9], {}, "outside the vocabulary"),
    ([1, True], {}, "a list of token ids"),
    ([1.5], {}, "a list of token ids"),
    ([{"role": "user", "content": "hi"}], {"system": "x"}, "applies to a single prompt string"),
    ([{"role": "user", "content": "hi"}], {"raw": True}, "applies to a single prompt string"),
    ([{"role": "bot", "content": "hi"}], {}, "message 0 has the role 'bot'"),
    (None, {}, "a list of token ids; got NoneType"),
    (42, {}, "a list of token ids; got int"),
])
def test_bad_prompts_are_refused_with_a_clear_error(lm, prompt, kw, fragment) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PromptError, match=fragment):
        lm.generate(prompt, max_new_tokens=4, **kw)


def test_bad_settings_are_refused(lm, tiny_moa_dir, tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    """Values out of range, and values of the wrong type (a caller's typo, not a traceback from deep inside)."""
    for bad, fragment in [({"temperature": -1}, "temperature"), ({"temperature": "0.7"}, "temperature"),
                          ({"top_k": 2.5}, "top_k"), ({"top_p": None}, "top_p"), ({"seed": "7"}, "seed"),
                          ({"max_new_tokens": True}, "max_new_tokens"), ({"stop": 5}, "stop must be a list"),
                          ({"stop": ["ok", 3]}, "stop must be a list")]:
        with pytest.raises(moaspec.MoaspecError, match=fragment):
            lm.generate(PROMPT, **{"max_new_tokens": 4, **bad})
    for bad, fragment in [({"chain": 0}, "whole number >= 1 of drafts"), ({"chain": "3"}, "whole number >= 1 of drafts"),
                          ({"lookup": 1.5}, "lookup drafts"), ({"tree": (2, 2, 4)}, "a tree is a TreeShape")]:
        with pytest.raises(moaspec.MoaspecError, match=fragment):
            lm.with_decoding(tiny_moa_dir, **bad)
    with pytest.raises(moaspec.MoaspecError, match="drafter_dtype='int9': expected one of auto, float32"):
        lm.with_decoding(tiny_moa_dir, drafter_dtype="int9")
    with pytest.raises(moaspec.MoaspecError, match="threads"):
        moaspec.load(tiny_dirs["llama"], None, threads=0)
    with pytest.raises(moaspec.MoaspecError, match="dtype must be"):
        moaspec.load(tiny_dirs["llama"], None, dtype="int8")
    assert moaspec.load(tiny_dirs["llama"], None, dtype="bfloat16").target.model.dtype == torch.bfloat16
    with pytest.raises(moaspec.MoaspecError, match="does not exist"):
        moaspec.load(tiny_dirs["llama"] / "missing", None)


@pytest.mark.parametrize("precision", ["float32", torch.float32, "bfloat16", "int8"])
def test_the_drafter_precision_is_named_as_on_the_command_line(lm, tiny_moa_dir, precision) -> None:  # type: ignore[no-untyped-def]
    """``drafter_dtype`` takes what ``--drafter-dtype`` takes, "int8" too (8-bit weights: with bf16 activations, or
    fp32 ones through the block kernel on CPUs without bf16 kernels), or a torch dtype; the text is the target's
    whichever it is."""
    from moaspec.models.block_kernel import kernel
    from moaspec.models.packed_linear import bf16_kernels, int8_kernels

    blocks = not bf16_kernels() and kernel() is not None
    dtype = {"float32": torch.float32, torch.float32: torch.float32, "bfloat16": torch.bfloat16,
             "int8": torch.float32 if blocks else torch.bfloat16}[precision]
    spec = lm.with_decoding(tiny_moa_dir, chain=3, drafter_dtype=precision)
    drafter = spec.strategy.drafter
    assert drafter is not None and drafter.weight_dtype == dtype
    eight_bit = precision == "int8" and (blocks or int8_kernels())
    assert drafter.precision == ("int8" if eight_bit else str(dtype).removeprefix("torch."))
    assert spec.generate(PROMPT, max_new_tokens=16).token_ids == lm.with_decoding(None).generate(PROMPT, max_new_tokens=16).token_ids


def test_a_target_without_a_shipped_drafter_decodes_without_one_and_says_so(lm) -> None:  # type: ignore[no-untyped-def]
    with pytest.warns(UserWarning, match="no drafter ships for .*; decoding with prompt lookup alone"):
        strategy = decoding_strategy(lm.target)
    assert strategy.drafter is None and strategy.lookup > 0
    notes: list[str] = []
    assert decoding_strategy(lm.target, lookup=0, notify=notes.append).describe() == "vanilla"
    assert notes and "plain decoding" in notes[0]


def test_the_cli_refuses_system_or_raw_beside_a_conversation(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from test_cli import assert_one_line_error, run_cli

    chat = tmp_path / "chat.json"
    chat.write_text('[{"role": "user", "content": "hi"}]')
    for extra in (["--system", "Be brief."], ["--raw"]):
        proc = run_cli("generate", "--messages", str(chat), "--model", str(tiny_dirs["llama"]), *extra)
        assert_one_line_error(proc, "--system and --raw apply to a single prompt")


def test_a_model_without_a_chat_template_refuses_what_it_cannot_render(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A base model completes one user message as plain text; a conversation or a system message would be dropped
    (the prompt was the last message alone, without a word), so it is refused."""
    from moaspec.chat import encode_chat, encode_text

    tok = tiny_llama.tokenizer
    monkeypatch.setattr(tok, "chat_template", None)
    assert encode_chat(tok, [{"role": "user", "content": "Hello there"}]) == encode_text(tok, "Hello there")
    for messages in ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                     [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yes?"},
                      {"role": "user", "content": "More"}]):
        with pytest.raises(PromptError, match=f"no chat template, so these {len(messages)} messages"):
            encode_chat(tok, messages)


@pytest.mark.parametrize("message, says", [
    ("hi", "message 0 must be an object with a role and a content, got str"),
    ({"role": "wizard", "content": "hi"}, "message 0 has the role 'wizard'; a role is one of system, user, assistant"),
    ({"role": "user", "content": ["hi"]}, "message 0 (user) must have a string content, got list"),
    ({"role": "user"}, "message 0 (user) must have a string content, got none"),
])
def test_a_malformed_message_says_what_is_wrong_with_it(message, says: str) -> None:  # type: ignore[no-untyped-def]
    from moaspec.chat import validate_messages

    with pytest.raises(PromptError) as err:
        validate_messages([message])
    assert str(err.value) == says
