"""The server on the real default target with its shipped drafter: the OpenAI client and the chat page."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import openai
import pytest

from browser import Browser, chromium_path
from moaspec.chat import chat_messages, encode_chat
from moaspec.decoding import GenerationConfig, generate
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.serving import Engine, create_app
from moaspec.strategy import Strategy
from servers import running

pytestmark = pytest.mark.real
ARTIFACTS = Path(os.environ.get("MOASPEC_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts"))
PROMPTS = ["Explain in three sentences why the sky is blue.", "Write a Python function that reverses a string."]


@pytest.fixture(scope="module")
def server(real_model) -> Iterator[str]:  # type: ignore[no-untyped-def]
    engine = Engine(real_model, Strategy(load_drafter(shipped_drafter(real_model), real_model)), parallel=2)
    with running(create_app(engine, "smollm2")) as url:
        yield url
    engine.close()


def greedy_text(real_model, prompt: str, max_new: int) -> str:  # type: ignore[no-untyped-def]
    ids = encode_chat(real_model.tokenizer, chat_messages(prompt))
    return generate(real_model.model, real_model.tokenizer, ids, GenerationConfig(max_new_tokens=max_new)).text


def test_openai_client_gets_the_targets_greedy_text(server: str, real_model) -> None:  # type: ignore[no-untyped-def]
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    for prompt in PROMPTS:
        msgs = [{"role": "user", "content": prompt}]
        resp = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=64)
        assert resp.choices[0].message.content == greedy_text(real_model, prompt, 64)
        assert resp.model_extra["moaspec"]["tau"] > 1  # the shipped drafter's tokens were accepted
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model="smollm2", messages=msgs, temperature=0, max_tokens=64, stream=True) if c.choices)
        assert streamed == resp.choices[0].message.content


@pytest.mark.browser
@pytest.mark.skipif(chromium_path() is None, reason="no Chromium installed (scripts/test.sh installs Debian's when it can)")
def test_chat_page_streams_and_colours_accepted_drafts(server: str, real_model) -> None:  # type: ignore[no-untyped-def]
    prompt = PROMPTS[0]
    browser = Browser()
    try:
        browser.goto(f"{server}/?send=1&temperature=0&max_tokens=80&prompt={quote(prompt)}")
        state = browser.wait_for("['done', 'error'].includes(document.body.dataset.state) && document.body.dataset.state", 180)
        page = browser.evaluate("""(() => {
            const a = document.querySelector('.assistant');
            return {text: a.querySelector('.text').textContent, stats: a.querySelector('.stats').textContent,
                    drafted: a.querySelectorAll('.text span.d').length, spans: a.querySelectorAll('.text span').length,
                    coloured: a.classList.contains('coloured'),
                    draftColour: getComputedStyle(a.querySelector('.text span.d') || a).color,
                    plainColour: getComputedStyle(a.querySelector('.text span:not(.d)') || a).color,
                    user: document.querySelector('.user').textContent};
        })()""")
        browser.screenshot(ARTIFACTS / "chat-page.png")
        # a long pasted text: the page says it is being read, and Stop during the read ends the request
        browser.evaluate("send('Summarise this. ' + 'The quick brown fox jumps over the lazy dog. '.repeat(250))")
        reading = browser.evaluate("document.querySelectorAll('.assistant')[1].querySelector('.stats').textContent")
        browser.evaluate("document.getElementById('stop').click()")
        stopped = browser.wait_for("document.body.dataset.state === 'done' && "
                                   "document.querySelectorAll('.assistant')[1].querySelector('.stats').textContent", 30)
    finally:
        browser.close()
    assert state == "done", page["stats"]
    assert page["user"] == prompt
    assert page["text"] == greedy_text(real_model, prompt, 80)  # lossless all the way to the screen
    assert 0 < page["drafted"] < page["spans"]  # both drafted and target-made text is shown
    assert page["coloured"] and page["draftColour"] != page["plainColour"]
    assert "τ" in page["stats"] and "target calls" in page["stats"]
    assert (reading, stopped) == ("reading the prompt…", "stopped")


def test_logprobs_with_the_shipped_drafter_are_the_targets_own(server: str, real_model) -> None:  # type: ignore[no-untyped-def]
    """Over the real tokenizer (whose tokens split characters like "—" and "é") and the shipped drafter's trees."""
    prompt = "Translate to French, then explain the accents: 'The café — near the lake — is open.'"
    msgs = [{"role": "user", "content": prompt}]
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model="smollm2", messages=msgs, temperature=0, max_tokens=48,
                                          logprobs=True, top_logprobs=1)
    content = resp.choices[0].logprobs.content
    ids = encode_chat(real_model.tokenizer, chat_messages(prompt))
    plain = generate(real_model.model, real_model.tokenizer, ids, GenerationConfig(max_new_tokens=48, logprobs=0))
    assert resp.model_extra["moaspec"]["tau"] > 1
    assert b"".join(bytes(e.bytes) for e in content).decode() == resp.choices[0].message.content == plain.text
    assert [e.logprob for e in content] == pytest.approx([e.logprob for e in plain.logprobs], abs=1e-3)
    assert all(e.top_logprobs[0].token == e.token for e in content)  # greedy: each token is the most likely
