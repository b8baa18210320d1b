"""The OpenAI-compatible server, end to end over real sockets, on a tiny random target.

Clients are the official ``openai`` package and plain ``curl`` — clients nobody here
wrote — so the wire format is checked as real users meet it.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch

from moaspec.chat import encode_chat, encode_text
from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.generation import GenerationResult
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.serving import Engine, create_app
from moaspec.strategy import Strategy
from servers import running

KEY = "sk-test-key"
MODEL = "tiny"


def tiny_strategy(loaded) -> Strategy:  # type: ignore[no-untyped-def]
    torch.manual_seed(3)
    drafter = MoADrafter(MoAConfig.for_target(loaded.cfg))
    drafter.attach(loaded.model)
    return Strategy(drafter.eval(), chain=3)


@pytest.fixture(scope="module")
def server(tiny_llama) -> Iterator[str]:  # type: ignore[no-untyped-def]
    engine = Engine(tiny_llama, tiny_strategy(tiny_llama), parallel=2, max_queue=8)
    with running(create_app(engine, MODEL, api_key=KEY, default_max_tokens=24, max_body_bytes=4096)) as url:
        yield url
    engine.close()


@pytest.fixture()
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)


def vanilla(loaded, ids: list[int], max_new: int) -> GenerationResult:  # type: ignore[no-untyped-def]
    return generate(loaded.model, loaded.tokenizer, ids, GenerationConfig(max_new_tokens=max_new))


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox"}]


def test_chat_greedy_equals_the_targets_own_greedy_output(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
    want = vanilla(tiny_llama, encode_chat(tiny_llama.tokenizer, MESSAGES), 20)
    assert resp.choices[0].message.content == want.text
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == {"eos": "stop", "length": "length"}[want.finish_reason]
    assert resp.usage.prompt_tokens == want.prompt_tokens
    assert resp.usage.completion_tokens == want.new_tokens
    stats = resp.model_extra["moaspec"]
    assert stats["method"] == "moa-chain(3)" and stats["target_calls"] >= 1 and stats["tau"] >= 1


def test_chat_stream_gives_the_same_text_with_usage_and_draft_marks(client) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].model_extra["moaspec"]["tau"] >= 1
    pieces = [c for c in chunks if c.choices and c.choices[0].delta.content]
    assert pieces and all(isinstance(c.model_extra["moaspec"]["drafted"], bool) for c in pieces)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions_text_and_token_prompts(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    prompt = "Paris is the capital of"
    ids = encode_text(tiny_llama.tokenizer, prompt)
    want = vanilla(tiny_llama, ids, 12).text
    resp = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert resp.object == "text_completion" and resp.choices[0].text == want
    assert client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12).choices[0].text == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=12, stream=True) if c.choices)
    assert streamed == want


def test_sampling_is_reproducible_with_a_seed_and_stop_strings_cut(client) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=1.0, top_p=0.9, max_tokens=16, seed=7)
    a = client.chat.completions.create(**kwargs).choices[0].message.content
    assert a == client.chat.completions.create(**kwargs).choices[0].message.content
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24).choices[0].message.content
    stop = full[len(full) // 2: len(full) // 2 + 1]
    if not stop.strip():
        pytest.skip("no usable stop character in this output")
    cut = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert stop not in cut.choices[0].message.content and full.startswith(cut.choices[0].message.content)


def target_logprobs(loaded, ids: list[int], answer: list[int]) -> list[float]:  # type: ignore[no-untyped-def]
    """The target's log-probability of each answer token, from one forward over prompt and answer."""
    seq = ids + answer
    with torch.no_grad():
        logits = loaded.model(torch.tensor([seq]), loaded.model.new_cache(len(seq))).logits[0]
    logp = torch.log_softmax(logits[len(ids) - 1 : len(seq) - 1].float(), dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(answer)]


def test_chat_logprobs_are_the_targets_own_streamed_or_not(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20, logprobs=True, top_logprobs=2)
    resp = client.chat.completions.create(**kwargs)
    content = resp.choices[0].logprobs.content
    want = vanilla(tiny_llama, encode_chat(tiny_llama.tokenizer, MESSAGES), 20)
    assert len(content) == resp.usage.completion_tokens == want.new_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode(errors="replace") == resp.choices[0].message.content
    ref = target_logprobs(tiny_llama, encode_chat(tiny_llama.tokenizer, MESSAGES), want.token_ids)
    assert [e.logprob for e in content] == pytest.approx(ref, abs=1e-4)
    for e in content:  # greedy: the chosen token is the most likely one, and bytes spell the token
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob and e.top_logprobs[0].bytes == e.bytes
    chunks = list(client.chat.completions.create(**kwargs, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4).choices[0].logprobs is None


def test_completions_logprobs_in_the_legacy_shape(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    ids = encode_text(tiny_llama.tokenizer, "The quick brown fox")
    resp = client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12, logprobs=2)
    lp = resp.choices[0].logprobs
    want = vanilla(tiny_llama, ids, 12)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == want.new_tokens
    assert lp.token_logprobs == pytest.approx(target_logprobs(tiny_llama, ids, want.token_ids), abs=1e-4)
    text = resp.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for tok, offset in zip(lp.tokens, lp.text_offset):  # whole tokens sit at their offsets; parts of a character
        assert tok.startswith("bytes:") or text[offset: offset + len(tok)] == tok  # are named by their bytes
    for tok, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[tok] == logprob and 1 <= len(top) <= 3  # the top 2, and the chosen token among them
    chunks = list(client.completions.create(model=MODEL, prompt=ids, temperature=0, max_tokens=12, logprobs=2,
                                            stream=True))
    parts = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset


def test_n_choices_are_n_generations_streamed_or_not(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    kwargs = dict(model=MODEL, messages=MESSAGES, temperature=0.9, max_tokens=16, seed=5)
    resp = client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in resp.choices] == [0, 1, 2]
    alone = [client.chat.completions.create(**{**kwargs, "seed": 5 + i}) for i in range(3)]
    assert [c.message.content for c in resp.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in resp.choices}) > 1  # other seeds, other samples
    assert resp.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert resp.usage.prompt_tokens == alone[0].usage.prompt_tokens
    assert resp.model_extra["moaspec"]["target_calls"] == sum(a.model_extra["moaspec"]["target_calls"] for a in alone)
    chunks = list(client.chat.completions.create(**kwargs, n=3, stream=True, stream_options={"include_usage": True}))
    texts, finished = ["", "", ""], []
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
    assert texts == [c.message.content for c in resp.choices] and sorted(finished) == [0, 1, 2]
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens
    greedy = client.completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=8, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text  # greedy choices are the target's one answer


def test_penalties_reach_the_verification(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                          presence_penalty=0.5, frequency_penalty=1.0)
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(presence_penalty=0.5, frequency_penalty=1.0))
    want = generate(tiny_llama.model, tiny_llama.tokenizer, encode_chat(tiny_llama.tokenizer, MESSAGES), config)
    assert resp.choices[0].message.content == want.text
    assert want.text != vanilla(tiny_llama, encode_chat(tiny_llama.tokenizer, MESSAGES), 20).text  # they bit
    first = want.token_ids[0]  # a logit bias that bans the penalised answer's first token
    resp = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=20,
                                          logit_bias={str(first): -100})
    config = GenerationConfig(max_new_tokens=20, sampling=SamplingParams(logit_bias=((first, -100.0),)))
    banned = generate(tiny_llama.model, tiny_llama.tokenizer, encode_chat(tiny_llama.tokenizer, MESSAGES), config)
    assert resp.choices[0].message.content == banned.text and first not in banned.token_ids


def test_completions_echo_and_batches_of_prompts(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    tok = tiny_llama.tokenizer
    a, b = encode_text(tok, "The quick brown fox"), encode_text(tok, "Once upon a time")
    # a batch of token-id prompts (as lm-evaluation-harness sends them), two choices each: index = prompt · n + choice
    resp = client.completions.create(model=MODEL, prompt=[a, b], temperature=0, max_tokens=6, n=2)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [vanilla(tiny_llama, a, 6).text] * 2 + [vanilla(tiny_llama, b, 6).text] * 2
    assert len(a) != len(b) and resp.usage.prompt_tokens == len(a) + len(b)  # each prompt once, however many choices
    streamed = list(client.completions.create(model=MODEL, prompt=[a, b], temperature=0, max_tokens=6, n=2,
                                              stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens == len(a) + len(b)
    assert streamed[-1].usage.completion_tokens == resp.usage.completion_tokens
    # echo: the prompt's text before the answer, and with logprobs the prompt tokens' log-probabilities too
    resp = client.completions.create(model=MODEL, prompt=[a], temperature=0, max_tokens=4, echo=True, logprobs=1)
    want = vanilla(tiny_llama, a, 4)
    choice = resp.choices[0]
    assert choice.text == tok.decode(a) + want.text
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(a) + want.new_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:] == pytest.approx(target_logprobs(tiny_llama, a[:1], a[1:] + want.token_ids), abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert all(len(top) <= 2 for top in lp.top_logprobs[1:])
    streamed = list(client.completions.create(model=MODEL, prompt="The quick brown fox", temperature=0, max_tokens=4,
                                              echo=True, stream=True))
    assert streamed[0].choices[0].text == "The quick brown fox"
    assert "".join(c.choices[0].text for c in streamed) == "The quick brown fox" + want.text
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model=MODEL, prompt=a, max_tokens=4, echo=True, logprobs=1, stream=True)
    # max_tokens 0: the prompt scored, nothing written
    scored = client.completions.create(model=MODEL, prompt=a, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == tok.decode(a) and scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.token_logprobs == lp.token_logprobs[: len(a)]
    for bad in ({"echo": False}, {"echo": True, "stream": True}):
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=MODEL, prompt=a, max_tokens=0, **bad)
    with pytest.raises(openai.BadRequestError, match="choices"):
        client.completions.create(model=MODEL, prompt=[a, b], max_tokens=4, n=6)  # 12 > the server's 10 places


def test_lm_evaluation_harness_payloads(server: str, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """The two requests lm-evaluation-harness's ``local-completions`` sends, read as it reads the answers."""
    tok = tiny_llama.tokenizer
    context, continuation = encode_text(tok, "The quick brown fox"), encode_text(tok, " jumps over")
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        # loglikelihood: a batch of token lists, echoed, scored; the harness sums token_logprobs[ctxlen:-1]
        out = http.post("/v1/completions", json={"model": MODEL, "prompt": [context + continuation, context],
                                                 "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
                                                 "echo": True}).json()
        choice = sorted(out["choices"], key=lambda c: c["index"])[0]
        ctxlen = len(context)
        got = sum(choice["logprobs"]["token_logprobs"][ctxlen:-1])
        want = sum(target_logprobs(tiny_llama, context, continuation))
        assert got == pytest.approx(want, abs=1e-3)
        greedy = all(lp == max(top.values()) for lp, top in zip(choice["logprobs"]["token_logprobs"][ctxlen:-1],
                                                                 choice["logprobs"]["top_logprobs"][ctxlen:-1]))
        assert greedy == (vanilla(tiny_llama, context, len(continuation)).token_ids == continuation)
        # generate_until: greedy with the task's stop strings and the end of text (more than OpenAI's 4)
        out = http.post("/v1/completions", json={"model": MODEL, "prompt": [context], "max_tokens": 8, "temperature": 0,
                                                 "stop": ["Question:", "\n\n", "</s>", "<|im_end|>", "<|endoftext|>"],
                                                 "seed": 1234}).json()
        assert out["choices"][0]["text"] == vanilla(tiny_llama, context, 8).text.split("\n\n")[0]


def test_models_and_unknown_model(client) -> None:  # type: ignore[no-untyped-def]
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="gpt-9", messages=MESSAGES)
    assert err.value.body["code"] == "model_not_found" and "gpt-9" in err.value.body["message"]


def test_authentication(server: str) -> None:
    for key in ("wrong", ""):
        bad = openai.OpenAI(base_url=server + "/v1", api_key=key or "x", max_retries=0,
                            default_headers={} if key else {"Authorization": ""})
        with pytest.raises(openai.AuthenticationError) as err:
            bad.models.list()
        assert err.value.status_code == 401 and err.value.body["type"] == "authentication_error"


@pytest.mark.parametrize("kwargs, words", [
    ({"temperature": 5}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 0}, "n"),
    ({"n": 11}, "n"),
    ({"presence_penalty": 3.0}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop takes at most 16 strings, got 17"),
    ({"stop": ["a", ""]}, "a stop string must not be empty"),
    ({"extra_body": {"frobnicate": 1}}, "frobnicate"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "assistant", "content": "hi"}]}, "last message"),
    ({"messages": [{"role": "user", "content": "   "}]}, "empty"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ({"max_tokens": 10_000}, "context length"),
    ({"messages": [{"role": "user", "content": "fox " * 300}]}, "context length"),
])
def test_bad_parameters_get_a_400_in_openai_format(client, kwargs, words) -> None:  # type: ignore[no-untyped-def]
    args = {"model": MODEL, "messages": MESSAGES, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    body = err.value.body
    assert body["type"] == "invalid_request_error" and words in body["message"].lower()


def test_raw_http_errors(server: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server, headers=auth) as http:
        r = http.post("/v1/chat/completions", content=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
        for body in ([{"model": MODEL}], "hi", 5):
            r = http.post("/v1/chat/completions", json=body)
            assert r.status_code == 400 and r.json()["error"]["message"] == "the request body must be a JSON object"
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1] * 300})  # beyond the tiny model's context
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"  # not "messages": it has none
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "token id 1000000000 is outside the vocabulary" in r.json()["error"]["message"]
        for prompt in ([], [[]], [""], [[1, 2], [3, 10**9]], [[1], "a"], [1, "a"], [[[1]]]):  # batches, token lists
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2})
            assert r.status_code == 400 and "prompt" in json.dumps(r.json()["error"]), (prompt, r.text)
        big = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x" * 5000}]}).encode()
        r = http.post("/v1/chat/completions", content=iter([big[:1000], big[1000:]]),  # chunked: no Content-Length
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "no body" in r.json()["error"]["message"]
        for loose in ({"max_tokens": True}, {"stream": "yes"}, {"temperature": "0.5"}, {"seed": 1.5}, {"stop": 5},
                      {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]}):
            r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **loose})
            param = r.json()["error"]["param"]
            assert r.status_code == 400 and param.split(".")[0] == next(iter(loose)), (loose, r.text)
            assert not {"str", "int"} & set(param.split(".")) and "[" not in param, param  # no union branch names
        r = http.post("/v1/chat/completions", content=b'{"model": "%s", "messages": %s, "temperature": NaN}'
                      % (MODEL.encode(), json.dumps(MESSAGES).encode()), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
        lone = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "a\ud800b"}]})  # escaped in JSON
        r = http.post("/v1/chat/completions", content=lone.encode(), headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "UTF-8" in r.json()["error"]["message"]
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "temperature": 1e-45,
                                                    "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0  # near-greedy, not NaN
        r = http.get("/v1/nowhere")
        assert r.status_code == 404 and "error" in r.json()
        assert http.get("/health").json()["status"] == "ok"
        page = http.get("/")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"] and "/v1/chat/completions" in page.text


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl(server: str, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": 0, "max_tokens": 16})
    base = ["curl", "-sS", "--max-time", "60", "-H", f"Authorization: Bearer {KEY}", "-H", "Content-Type: application/json"]
    out = subprocess.run(base + ["-d", body, server + "/v1/chat/completions"], capture_output=True, text=True, check=True)
    whole = json.loads(out.stdout)["choices"][0]["message"]["content"]
    assert whole == vanilla(tiny_llama, encode_chat(tiny_llama.tokenizer, MESSAGES), 16).text
    stream_body = json.dumps({**json.loads(body), "stream": True})
    out = subprocess.run(base + ["-N", "-d", stream_body, server + "/v1/chat/completions"], capture_output=True, text=True, check=True)
    events = [line[len("data: "):] for line in out.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]) == whole
    out = subprocess.run(["curl", "-sS", "-o", "/dev/null", "-w", "%{http_code}", server + "/v1/models"], capture_output=True, text=True)
    assert out.stdout == "401"


def test_concurrent_requests_do_not_touch_each_others_caches(client, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    prompts = ["The quick brown fox", "def add(a, b):", "Paris is the capital", "1 2 3 4 5", "Café naïve"]
    want = {p: vanilla(tiny_llama, encode_chat(tiny_llama.tokenizer, [{"role": "user", "content": p}]), 20).text for p in prompts}
    got: dict[str, str] = {}

    def ask(p: str) -> None:
        msgs = [{"role": "user", "content": p}]
        got[p] = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=MODEL, messages=msgs, temperature=0, max_tokens=20, stream=True) if c.choices)

    threads = [threading.Thread(target=ask, args=(p,)) for p in prompts * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got == want


def test_requests_decoded_together_answer_as_alone(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Four requests at once, their forwards run as one by the batcher (plain decoding, chains, a sampled chain):
    each answer is what the request gets alone, and the forwards were batched."""
    from moaspec.batching import ForwardBatcher

    model = tiny_llama.model
    run_many = model.forward_many
    monkeypatch.setattr(model, "forward_many", lambda calls: time.sleep(0.005) or run_many(calls))  # let the queue fill
    prompts = [encode_chat(tiny_llama.tokenizer, [{"role": "user", "content": p}]) for p in
               ("The quick brown fox", "def add(a, b):", "Paris is the capital", "1 2 3 4 5")]
    configs = [GenerationConfig(max_new_tokens=16, ignore_eos=True),
               GenerationConfig(max_new_tokens=16, ignore_eos=True, sampling=SamplingParams(temperature=0.9, seed=5))]

    async def answers(engine: Engine) -> list[list[int]]:
        async def one(ids: list[int], cfg: GenerationConfig) -> list[int]:
            return [item for item in [x async for x in engine.stream(ids, cfg)] if isinstance(item, GenerationResult)][0].token_ids
        return list(await asyncio.gather(*(one(p, c) for p in prompts for c in configs)))

    for strategy in (Strategy(), tiny_strategy(tiny_llama)):
        batcher = ForwardBatcher(model)
        together, alone = Engine(tiny_llama, strategy, parallel=4, batcher=batcher), Engine(tiny_llama, strategy, parallel=1)
        try:
            got, want = asyncio.run(answers(together)), asyncio.run(answers(alone))
        finally:
            together.close(), alone.close()
        assert got == want
        assert batcher.runs < batcher.forwards  # some requests' forwards ran together


def test_a_conversations_next_turn_reuses_its_prompt(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """With a prompt cache the second turn reads only what the first turn's prompt and answer leave (OpenAI's
    cached_tokens), and its answer is the target's own greedy answer to the whole conversation."""
    from moaspec.decoding.prefill import PromptCache

    engine = Engine(tiny_llama, tiny_strategy(tiny_llama), parallel=1, prompt_cache=PromptCache(1 << 28, min_tokens=8))
    try:
        with running(create_app(engine, MODEL)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
            msgs = [*MESSAGES, {"role": "user", "content": "jumps over the lazy dog"}]
            first = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
            msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "and then?"}]
            second = client.chat.completions.create(model=MODEL, messages=msgs, temperature=0, max_tokens=8)
    finally:
        engine.close()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < second.usage.prompt_tokens_details.cached_tokens < second.usage.prompt_tokens
    want = vanilla(tiny_llama, encode_chat(tiny_llama.tokenizer, msgs), 8)
    assert second.choices[0].message.content == want.text


class Controlled:
    """A stand-in strategy whose generations run until released or cancelled (admission tests)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.cancelled = threading.Event()
        self.started = threading.Semaphore(0)

    def describe(self) -> str:
        return "controlled"

    def run(self, target, prompt_ids, config, on_text=None, on_piece=None, prefill=None, on_logprobs=None):  # type: ignore[no-untyped-def]
        self.started.release()
        try:
            while not self.release.wait(0.01):
                on_piece("tick ", False)
        except Exception:
            self.cancelled.set()
            raise
        return GenerationResult([1], "done", "length", len(prompt_ids), 0.0, 0.01, 1, [1])


def test_over_capacity_gets_503_and_a_vanished_client_is_cancelled(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    strategy = Controlled()
    engine = Engine(tiny_llama, strategy, parallel=1, max_queue=0)  # type: ignore[arg-type]
    body = {"model": MODEL, "messages": MESSAGES, "stream": True}
    try:
        with running(create_app(engine, MODEL)) as url:
            with httpx.Client(base_url=url, timeout=30) as http:
                with http.stream("POST", "/v1/chat/completions", json=body) as first:
                    assert first.status_code == 200
                    # keep the iterator: a discarded one closes the connection (httpcore closes a stream whose
                    # iterator is dropped), the server cancels, and a busy request could be admitted in the race
                    lines = first.iter_lines()
                    next(lines)
                    assert not strategy.cancelled.wait(0.3)
                    # a stream here too, but read only when refused: an admitted one would tick forever
                    with http.stream("POST", "/v1/chat/completions", json=body) as busy:
                        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
                        assert json.loads(busy.read())["error"]["type"] == "server_overloaded"
                # the first client has gone: its generation must stop and free the slot
                assert strategy.cancelled.wait(10)
                deadline = time.time() + 10
                while engine.load["running"] and time.time() < deadline:
                    time.sleep(0.02)
                assert engine.load == {"running": 0, "waiting": 0, "capacity": 1}
                strategy.release.set()
                ok = http.post("/v1/chat/completions", json={**body, "stream": False})
                assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"].endswith("done")
    finally:  # a failed check must not leave the worker ticking (pytest would wait for it at exit)
        strategy.release.set()
        engine.close()


def test_the_choices_of_one_prompt_read_it_once(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    engine = Engine(tiny_llama, tiny_strategy(tiny_llama), parallel=3, max_queue=0)
    prompt, other = list(range(5, 45)), list(range(50, 70))
    greedy = GenerationConfig(max_new_tokens=8)

    async def collect() -> dict[int, GenerationResult]:
        return {i: item async for i, item in engine.streams([prompt, prompt, other], [greedy] * 3)
                if isinstance(item, GenerationResult)}

    try:
        results = asyncio.run(collect())
    finally:
        engine.close()
    # one of the two choices of `prompt` read it, the other copied all of it; `other` was read on its own
    assert sorted(results[i].reused_prompt_tokens for i in (0, 1)) == [0, len(prompt)]
    assert results[2].reused_prompt_tokens == 0
    want = vanilla(tiny_llama, prompt, 8).token_ids  # the copy answers as a read would
    assert results[0].token_ids == results[1].token_ids == want
    assert results[2].token_ids == vanilla(tiny_llama, other, 8).token_ids


def test_n_choices_are_admitted_together_or_not_at_all(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    strategy = Controlled()
    engine = Engine(tiny_llama, strategy, parallel=1, max_queue=1)  # type: ignore[arg-type]
    body = {"model": MODEL, "messages": MESSAGES}
    try:
        with running(create_app(engine, MODEL)) as url:
            with httpx.Client(base_url=url, timeout=30) as http:
                with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as first:
                    lines = first.iter_lines()
                    next(lines)
                    assert strategy.started.acquire(timeout=10)
                    many = http.post("/v1/chat/completions", json={**body, "n": 2})  # one place free, two needed
                    assert many.status_code == 503 and "capacity" in many.json()["error"]["message"]
                    assert engine.load == {"running": 1, "waiting": 0, "capacity": 2}  # nothing of it stayed
                    strategy.release.set()
                    list(lines)
                ok = http.post("/v1/chat/completions", json={**body, "n": 2}).json()
                assert [c["message"]["content"] for c in ok["choices"]] == ["done", "done"]
                assert ok["usage"]["completion_tokens"] == 2
    finally:
        strategy.release.set()
        engine.close()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_during_a_long_prefill_frees_the_slot_within_a_chunk(tiny_llama, slow_prefill, stream: bool) -> None:  # type: ignore[no-untyped-def]
    """A long prompt's prefill is abandoned within one chunk of its client leaving, before any text was sent
    (streaming) or while the response waits (not streaming), so the next request need not wait for it
    (docs/experiments/2026-11-29-abandoned-prefill.md: 24 s of one slot before)."""
    engine = Engine(tiny_llama, tiny_strategy(tiny_llama), parallel=1, max_queue=0)
    prompt = [5 + i % 200 for i in range(240)]  # 120 chunks: 6 s of prefill
    try:
        with running(create_app(engine, MODEL)) as url:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "stream": stream}
            with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url, timeout=0.6) as http:
                http.post("/v1/completions", json=body)
            deadline = time.time() + 5
            while engine.load["running"] and time.time() < deadline:
                time.sleep(0.02)
            assert engine.load["running"] == 0 and 0 < len(slow_prefill) < 60
            with httpx.Client(base_url=url, timeout=30) as http:  # the slot is free for the next client at once
                ok = http.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    finally:
        engine.close()


def test_a_taken_port_is_a_clear_error() -> None:
    from moaspec.errors import MoaspecError
    from moaspec.serving import listen

    first = listen("127.0.0.1", 0)
    try:
        with pytest.raises(MoaspecError, match="cannot listen on 127.0.0.1"):
            listen("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()


def test_connections_accepted_by_the_server_send_without_nagle_delay() -> None:
    """asyncio (under uvicorn) turns Nagle off only on sockets that say TCP; with it on, each
    two-piece response waits ~40 ms for the client's delayed ACK (measured: 44 ms vs 0.6 ms)."""
    import socket

    from moaspec.serving import listen

    async def nodelay_of_accepted() -> int:
        accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listen("127.0.0.1", 0))
        _, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        try:
            return await asyncio.wait_for(accepted, 5)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(nodelay_of_accepted()) != 0


@pytest.mark.parametrize("alone", [True, False])
def test_a_prefill_that_runs_alone_takes_every_core(tiny_llama, monkeypatch, alone: bool) -> None:  # type: ignore[no-untyped-def]
    """A CPU server's decoders each get a share of the cores; a prompt read while nothing else runs gets them all,
    chunk by chunk, and its decoding goes back to the share."""
    from contextlib import nullcontext

    from moaspec.cores import Cores
    from moaspec.models import transformer

    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 8)
    model, seen = tiny_llama.model, []
    monkeypatch.setattr(model, "run_blocks", lambda h, *a, _run=model.run_blocks, **k:
                        seen.append((h.shape[1], torch.get_num_threads())) or _run(h, *a, **k))
    cores, own = Cores(total=2, share=1), torch.get_num_threads()
    engine = Engine(tiny_llama, Strategy(), parallel=2, cores=cores)

    async def generate_one() -> None:
        async for _ in engine.stream(list(range(5, 35)), GenerationConfig(max_new_tokens=4, ignore_eos=True)):
            pass

    try:
        with nullcontext() if alone else cores.busy():  # another request decoding meanwhile
            asyncio.run(generate_one())
    finally:
        engine.close()
        torch.set_num_threads(own)
    chunks, steps = [t for n, t in seen if n > 1], [t for n, t in seen if n == 1]
    assert len(chunks) == 4 and len(steps) == 3
    assert chunks == [2 if alone else 1] * 4 and steps == [1] * 3
