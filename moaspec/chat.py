"""From user input to prompt token ids, with the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from moaspec.errors import PromptError

Message = dict[str, str]
ROLES = ("system", "user", "assistant")


def validate_messages(messages: Sequence[Message]) -> list[Message]:
    """Check a chat conversation's shape; raise :class:`PromptError` with what is wrong."""
    if not messages:
        raise PromptError("the conversation is empty: give at least one user message")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise PromptError(f"message {i} must be an object with a role and a content, got {type(m).__name__}")
        if m.get("role") not in ROLES:
            raise PromptError(f"message {i} has the role {m.get('role')!r}; a role is one of {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise PromptError(f"message {i} ({m['role']}) must have a string content, got "
                              f"{type(m.get('content')).__name__ if 'content' in m else 'none'}")
        check_text(m["content"], "the prompt" if i == len(messages) - 1 else f"message {i} ({m['role']})")
        out.append({"role": m["role"], "content": m["content"]})
    if out[-1]["role"] != "user":
        raise PromptError("the last message must come from the user")
    if not any(m["content"].strip() for m in out if m["role"] == "user"):
        raise PromptError("the prompt is empty")
    return out


def check_text(text: str, what: str = "the prompt") -> None:
    """Refuse text that cannot be encoded as UTF-8: bytes that were not UTF-8 on the command line or stdin
    (Python keeps them as lone surrogates), or a lone surrogate escaped in JSON; tokenizers cannot take either."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PromptError(f"{what} is not valid UTF-8 text") from None


def chat_messages(prompt: str, system: str | None = None) -> list[Message]:
    messages = [{"role": "system", "content": system}] if system else []
    return messages + [{"role": "user", "content": prompt}]


def encode_chat(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template, ready for the assistant's turn.

    A model without a chat template (a base model) gets a lone user message as plain text; a
    conversation or a system message it cannot render is refused rather than dropped.
    """
    messages = validate_messages(messages)
    if getattr(tokenizer, "chat_template", None):
        text = render_chat(tokenizer, messages, add_generation_prompt=True)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if len(messages) > 1:
        raise PromptError(f"the model has no chat template, so these {len(messages)} messages (a conversation or a "
                          "system message) cannot be rendered: give it one user message, or plain text to complete")
    return encode_text(tokenizer, messages[-1]["content"])


def render_chat(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> str:
    """``messages`` through the model's chat template, as text. Some templates refuse what they were not
    trained on (Gemma's and early Mistral's a system message, others turns that do not alternate): that is
    a :class:`PromptError` with the template's own reason, not a traceback from its engine."""
    from jinja2 import TemplateError  # transformers renders chat templates with jinja2

    try:
        return str(tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=add_generation_prompt))
    except TemplateError as exc:
        raise PromptError(f"the model's chat template refuses these messages: {exc}") from None


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Plain completion: the text as is, with the tokenizer's usual special tokens."""
    if not text.strip():
        raise PromptError("the prompt is empty")
    check_text(text)
    return list(tokenizer(text)["input_ids"])


def outside_vocabulary(ids: Sequence[int], vocab_size: int) -> int | None:
    """The first token id not in ``[0, vocab_size)``, or None. Every entry point that takes token ids
    (the Python API, the OpenAI server, client-server sessions) asks this before an embedding lookup
    could fail deep inside the model; each reports it in its own error type."""
    return next((t for t in ids if not 0 <= t < vocab_size), None)


def check_fits(prompt_len: int, context: int) -> None:
    """A prompt must leave room for at least one generated token."""
    if prompt_len == 0:
        raise PromptError("the prompt is empty")
    if prompt_len >= context:
        raise PromptError(
            f"the prompt is {prompt_len} tokens but the model's context window is {context}: shorten it"
        )
