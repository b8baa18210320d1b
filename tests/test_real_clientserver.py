"""Client–server decoding on the real default target with the shipped drafter, over an emulated LAN."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from moaspec.chat import chat_messages, encode_chat
from moaspec.clientserver.client import RemoteTarget, SplitGeneration
from moaspec.clientserver.netem import PROFILES, NetworkProxy
from moaspec.clientserver.sessions import SessionStore
from moaspec.decoding import GenerationConfig, generate
from moaspec.decoding.opening import stop_token_ids
from moaspec.drafters import load_drafter, shipped_drafter
from moaspec.serving import Engine, create_app
from moaspec.strategy import Strategy
from servers import running

pytestmark = pytest.mark.real
PROMPTS = ["Explain in three sentences why the sky is blue.", "List three uses of a paperclip."]


@pytest.fixture(scope="module")
def setup(real_model) -> Iterator[tuple[str, object, object]]:  # type: ignore[no-untyped-def]
    """A server holding the shipped drafter's LSA half and that of an N = 1 copy of it (untrained for N = 1)."""
    drafter = load_drafter(shipped_drafter(real_model), real_model)
    tli = drafter.adapted(tli_layers=1)
    tli.attach(real_model.model)
    tli.eval()
    app = create_app(Engine(real_model, Strategy()), "smollm2", sessions=SessionStore(real_model, [drafter, tli]))
    with running(app) as url:
        proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
        yield proxy.url, drafter, tli
        proxy.stop()


def split_run(url: str, drafter, real_model, prompt: str, fmt: str = "fp16", tree=None):  # type: ignore[no-untyped-def]
    ids = encode_chat(real_model.tokenizer, chat_messages(prompt))
    want = generate(real_model.model, real_model.tokenizer, ids, GenerationConfig(max_new_tokens=48)).token_ids
    remote = RemoteTarget(url)
    gen = SplitGeneration(drafter, real_model.tokenizer, remote, stop_token_ids(real_model.model, real_model.tokenizer),
                          draft_len=2, fmt=fmt, tree=tree)
    result = gen.run(ids, GenerationConfig(max_new_tokens=48), real_model.cfg.max_position_embeddings)
    remote.shutdown()
    return result, want


@pytest.mark.parametrize("fmt", ["fp16", "int8"])
def test_client_server_greedy_equals_the_targets_greedy(setup, real_model, fmt: str) -> None:  # type: ignore[no-untyped-def]
    url, drafter, _ = setup
    hits = 0
    for prompt in PROMPTS:
        result, want = split_run(url, drafter, real_model, prompt, fmt)
        assert result.token_ids == want
        assert result.tau > 1 and result.unverified == 0
        hits += result.pipeline_hits
    assert hits > 0  # some answers found their next drafts already made


def test_a_client_with_target_layer_inference_is_lossless(setup, real_model) -> None:  # type: ignore[no-untyped-def]
    """N = 1 on the real target: the client runs SmolLM2's last layer over the K/V the server sends."""
    url, _, tli = setup
    result, want = split_run(url, tli, real_model, PROMPTS[0])
    assert result.token_ids == want and result.unverified == 0


def test_a_tree_client_is_lossless(setup, real_model) -> None:  # type: ignore[no-untyped-def]
    from moaspec.decoding.tree import TreeShape

    url, drafter, _ = setup
    result, want = split_run(url, drafter, real_model, PROMPTS[1], tree=TreeShape())
    assert result.token_ids == want and result.tau > 1
