"""The server under hostile or careless clients, over real loopback sockets: requests too large to
prepare on the event loop, clients that leave the queue, half-sent headers, unbounded echoes, routes
open without the key, secrets in URLs, and client–server sessions nobody closes."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from urllib.parse import urlsplit

import httpx
import pytest

from moaspec.clientserver.sessions import Limits, SessionStore
from moaspec.serving import Engine, create_app
from servers import running
from test_serving import MESSAGES, MODEL, Controlled, tiny_strategy

KEY = "sk-hostile"
AUTH = {"Authorization": f"Bearer {KEY}"}
JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def store(tiny_llama) -> SessionStore:  # type: ignore[no-untyped-def]
    return SessionStore(tiny_llama, limits=Limits(max_draft=8, ttl_s=0.4))


@pytest.fixture(scope="module")
def server(tiny_llama, store) -> Iterator[str]:  # type: ignore[no-untyped-def]
    engine = Engine(tiny_llama, tiny_strategy(tiny_llama), parallel=1, max_queue=1)
    with running(create_app(engine, MODEL, api_key=KEY, default_max_tokens=8, sessions=store),
                 header_timeout=0.5, idle_timeout=1.0) as url:
        yield url
    engine.close()


def address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or 80


def closed_after(sock: socket.socket, limit: float) -> float | None:
    """Seconds until the server closed ``sock`` (reading nothing from it), or None if it stayed open ``limit`` s."""
    began = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return time.monotonic() - began


def test_prompts_beyond_capacity_are_refused_before_any_is_read(server: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moaspec.serving import openai_api

    read: list[str] = []
    monkeypatch.setattr(openai_api, "encode_text", lambda tokenizer, text: read.append(text) or [1])
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as http:
        for prompt in (["x"] * 20_000, [[1]] * 10_000):
            r = http.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 1})
            assert r.status_code == 400 and "more than this server decodes and queues at once" in r.text
    assert read == []


def test_bodies_of_too_many_arrays_and_objects_are_refused_unparsed(server: str) -> None:
    """262,128 one-id prompts in 1 MiB held the event loop for 1.5 s while JSON and pydantic built and checked
    their lists (a chat of 34,950 messages: 0.1 s), before the count could be checked; they are refused from
    their bytes now, before they are parsed."""
    bodies = {"/v1/completions": {"model": MODEL, "prompt": [[1]] * 262_128, "max_tokens": 1},
              "/v1/chat/completions": {"model": MODEL, "max_tokens": 1,
                                       "messages": [{"role": "user", "content": "x"}] * 34_950},
              "/cs/v1/sessions/x/verify": {"verified": 1, "draft": [1], "dists": [{"ids": [1], "probs": [1.0]}] * 20_000}}
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as http:
        for path, body in bodies.items():
            r = http.post(path, content=json.dumps(body, separators=(",", ":")), headers=JSON)
            assert r.status_code == 400 and "JSON arrays and objects" in r.text, (path, r.text[:300])
        # brackets inside strings are text, not structure: this prompt is read (and is too long for the model)
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": '[{"a": "\\"}]' * 20_000, "max_tokens": 1})
        assert r.status_code == 400 and "JSON arrays" not in r.text and r.json()["error"]["code"] == "context_length_exceeded"


def test_containers_are_counted_outside_strings() -> None:
    from moaspec.serving.json_limits import MAX_CONTAINERS, containers

    # quotes and backslashes escaped inside strings, and a string that ends in an escaped backslash
    text = json.dumps({"prompt": ["[", '{"', '"]', "\\", '\\"['] * MAX_CONTAINERS, "stop": ["]"]}).encode()
    assert containers(text) == 3  # the object and the two arrays
    assert containers(json.dumps([[1]] * (MAX_CONTAINERS + 1)).encode()) == MAX_CONTAINERS + 2


def test_prompts_are_read_off_the_event_loop(server: str, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Tokenising (and rendering a chat template) runs on a worker thread: the event loop, which answers every
    other client and /health, never waits for it (a chat of 34,950 messages held it for 1.1 s)."""
    from moaspec.serving import openai_api

    loops: list[object] = []

    def spy(real):  # type: ignore[no-untyped-def]
        def call(*args):  # type: ignore[no-untyped-def]
            try:
                loops.append(asyncio.get_running_loop())
            except RuntimeError:
                loops.append(None)
            return real(*args)
        return call

    monkeypatch.setattr(openai_api, "encode_chat", spy(openai_api.encode_chat))
    monkeypatch.setattr(openai_api, "encode_text", spy(openai_api.encode_text))
    with httpx.Client(base_url=server, headers=AUTH, timeout=60) as http:
        chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
        text = http.post("/v1/completions", json={"model": MODEL, "prompt": "The quick brown", "max_tokens": 2})
    assert chat.status_code == text.status_code == 200
    assert loops == [None, None]


def test_a_queued_client_that_leaves_frees_its_place_within_a_second(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    strategy = Controlled()
    engine = Engine(tiny_llama, strategy, parallel=1, max_queue=1)  # type: ignore[arg-type]
    body = json.dumps({"model": MODEL, "messages": MESSAGES, "stream": True}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        with running(create_app(engine, MODEL)) as url, httpx.Client(base_url=url, timeout=30) as http:
            with http.stream("POST", "/v1/chat/completions", content=body, headers=JSON) as first:
                lines = first.iter_lines()
                next(lines)
                assert strategy.started.acquire(timeout=10)
                queued = socket.create_connection(address(url))
                queued.sendall(request)
                deadline = time.monotonic() + 10
                while engine.load["waiting"] != 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert engine.load["waiting"] == 1
                assert http.post("/v1/chat/completions", content=body, headers=JSON).status_code == 503  # full: 1 decoding, 1 queued
                queued.close()
                left = time.monotonic()
                while engine.load["waiting"] and time.monotonic() < left + 5:
                    time.sleep(0.01)
                assert time.monotonic() - left < 1.0 and engine.load == {"running": 1, "waiting": 0, "capacity": 2}
                # the place is free for the next client while the first still decodes: it is queued, not refused
                with socket.create_connection(address(url)) as second:
                    second.sendall(request)
                    while engine.load["waiting"] != 1 and time.monotonic() < deadline:
                        time.sleep(0.01)
                    assert engine.load["waiting"] == 1
                    strategy.release.set()
                    list(lines)
                    second.settimeout(30)
                    answer = b""
                    while b"[DONE]" not in answer and (chunk := second.recv(65536)):
                        answer += chunk
                    assert answer.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in answer
    finally:
        strategy.release.set()
        engine.close()


NINES = "9" * 5000  # written into JSON as a number: Python's int() refuses strings of over 4,300 digits


@pytest.mark.parametrize("field, status, param", [
    ('"logit_bias": {"' + NINES + '": 1.0}', 400, "logit_bias"),
    ('"model": "\\ud800"', 404, "model"),
    ('"model": "' + "m" * 100_000 + '"', 404, "model"),
    ('"prompt": [5, ' + NINES[:4000] + "]", 400, "prompt"),
    ('"prompt": [5, ' + NINES + "]", 400, ""),  # the JSON parser refuses it: not valid JSON
    ('"stop": ["' + "x" * 1001 + '"]', 400, "stop"),
    ('"stop": ["\\ud800", "a\\udfff"]', 200, None),
])
def test_hostile_values_get_a_short_4xx_never_a_500(server: str, field: str, status: int, param: str | None) -> None:
    """UTF-8 refuses lone surrogates (JSON allows them), and an error that quotes what it was sent must not send
    it all back, nor fail to write a 5,000-digit number."""
    payload = f'{{"model": "{MODEL}", "prompt": [5, 6, 7], "max_tokens": 1, {field}}}'
    with httpx.Client(base_url=server, headers={**AUTH, "Content-Type": "application/json"}, timeout=30) as http:
        r = http.post("/v1/completions", content=payload.encode())
    assert r.status_code == status, r.text[:300]
    if param is not None:
        assert (r.json()["error"]["param"] or "").startswith(param) and len(r.text) < 600, r.text[:600]


def test_a_huge_logit_bias_key_opening_a_session_gets_a_400(server: str) -> None:
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as http:
        for body in ('{"prompt": [5, 6], "state": "none", "sampling": {"logit_bias": {"' + NINES + '": 1.0}}}',
                     '{"prompt": [5, ' + NINES + '], "state": "none"}'):
            r = http.post("/cs/v1/sessions", content=body.encode(), headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and len(r.text) < 600, r.text[:600]


def test_half_sent_headers_and_silent_connections_are_closed(server: str) -> None:
    """Before authentication can run, a connection must send its request: the server closes one that sends
    nothing for the idle timeout (1 s here), or whose headers are not complete within the header timeout
    (0.5 s here), however slowly they trickle in."""
    silent = socket.create_connection(address(server))
    half = socket.create_connection(address(server))
    half.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthoriz")
    trickle = socket.create_connection(address(server))
    stop = threading.Event()

    def drip() -> None:
        for byte in b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
            if stop.wait(0.1):
                return
            try:
                trickle.send(bytes([byte]))
            except OSError:
                return

    dripping = threading.Thread(target=drip, daemon=True)
    dripping.start()
    try:
        after = {name: closed_after(sock, 5) for name, sock in (("half", half), ("trickle", trickle), ("silent", silent))}
    finally:
        stop.set()
        for sock in (silent, half, trickle):
            sock.close()
    assert all(t is not None for t in after.values()), after
    with httpx.Client(base_url=server, timeout=10) as http:  # a prompt client is served as before, kept alive
        assert http.get("/health").status_code == 200
        time.sleep(0.3)
        assert http.get("/health").status_code == 200


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/docs/oauth2-redirect", "/redoc", "/v1/nowhere",
                                  "/cs/v1/info", "/static/chat.html"])
def test_no_route_answers_without_the_key_but_the_page_and_health(server: str, path: str) -> None:
    with httpx.Client(base_url=server, timeout=10) as http:
        assert http.get(path).status_code == 401
        assert http.get(path, headers=AUTH).status_code in (200, 404)
        assert http.get("/").status_code == http.get("/health").status_code == 200
        assert "<script src" not in http.get("/").text  # the page's one script is its own, inline


def test_the_key_stays_out_of_urls_and_the_access_log(server: str) -> None:
    access = logging.getLogger("uvicorn.access")
    seen: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    handler, level = Keep(), access.level
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    try:
        with httpx.Client(base_url=server, timeout=10) as http:
            page = http.get("/?key=sk-secret&prompt=hi")
    finally:
        access.removeHandler(handler)
        access.setLevel(level)
    assert page.status_code == 200 and seen and not any("sk-secret" in line or "prompt=hi" in line for line in seen)
    assert 'fragment.get("key")' in page.text and 'params.get("key")' not in page.text  # the page reads #key=


def test_idle_sessions_are_freed_on_a_timer_and_cost_what_they_hold(server: str, store: SessionStore, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    with httpx.Client(base_url=server, headers=AUTH, timeout=30) as http:
        opened = [http.post("/cs/v1/sessions", json={"prompt": [5, 6], "state": "none"}).json() for _ in range(3)]
        assert http.get("/cs/v1/info").json()["open_sessions"] == 3
        # room for the whole context is promised, but only what the prompt and one verification need is held
        assert opened[0]["capacity"] == tiny_llama.cfg.max_position_embeddings
        assert all(s.cache.capacity <= 2 + 8 + 1 for s in store._sessions.values())
        time.sleep(0.4 + Limits(ttl_s=0.4).sweep_s + 0.3)  # no request meanwhile
        assert store._sessions == {}
        assert http.get("/cs/v1/info").json()["open_sessions"] == 0


def test_a_session_grows_its_cache_as_it_verifies(store: SessionStore, tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """A session's cache doubles as it fills, and verification answers as one that held all its room at once."""
    from moaspec.decoding import GenerationConfig, generate

    prompt = [5, 17, 42]
    want = generate(tiny_llama.model, tiny_llama.tokenizer, prompt,
                    GenerationConfig(max_new_tokens=40, ignore_eos=True)).token_ids
    opened = store.open(prompt, "none", max_new_tokens=40)
    sid, tokens = opened["session"], [opened["token"]]
    capacities = set()
    while len(tokens) < 40:
        draft = want[len(tokens): len(tokens) + 5]
        answer = store.verify(sid, len(prompt) + len(tokens), draft)
        tokens += draft[: answer["accepted"]] + [answer["token"]]
        capacities.add(store._sessions[sid].cache.capacity)
    store.close(sid)
    assert tokens[:40] == want and len(capacities) > 1
