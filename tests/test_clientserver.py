"""Client–server speculative decoding over real sockets, on a tiny random target.

The server is the real FastAPI app under uvicorn; the client is the real HTTP client;
between them, for the disconnection tests, the emulated network link.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
import torch
from safetensors.torch import load_file

from moaspec.clientserver import codec
from moaspec.clientserver.client import RemoteTarget, ServerRefused, SplitGeneration
from moaspec.clientserver.netem import PROFILES, NetworkProxy, parse_profile
from moaspec.clientserver.sessions import Limits, SessionError, SessionStore
from moaspec.decoding import GenerationConfig, SamplingParams, generate
from moaspec.decoding.prefill import PromptCache
from moaspec.decoding.tree import TreeShape
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.models.transformer import Call
from moaspec.serving import Engine, create_app
from moaspec.strategy import Strategy
from servers import running

KEY = "cs-key"
PROMPT = [5, 17, 42, 7, 99, 3, 12]


@pytest.fixture(scope="module")
def drafter(tiny_moa) -> MoADrafter:  # type: ignore[no-untyped-def]
    return tiny_moa


def make_app(tiny_llama, drafter, prompt_cache=None, **limits):  # type: ignore[no-untyped-def]
    store = SessionStore(tiny_llama, drafter, Limits(**{"max_draft": 8, **limits}), prompt_cache=prompt_cache)
    engine = Engine(tiny_llama, Strategy(drafter), parallel=1)
    return create_app(engine, "tiny", api_key=KEY, max_body_bytes=8192, sessions=store)


@pytest.fixture(scope="module")
def tli_drafter(tiny_llama) -> MoADrafter:  # type: ignore[no-untyped-def]
    """A MoA drafter with Target Layer Inference (N = 1): its client runs the target's last layer.

    It also reads the newest memory entry in Cross-Attention's input (at random weights, not zero), which its
    client keeps from the entries the server sends.
    """
    torch.manual_seed(4)
    d = MoADrafter(MoAConfig.for_target(tiny_llama.cfg, tli_layers=1, newest_entry=True))
    torch.nn.init.normal_(d.newest_proj.weight, std=0.05)
    d.attach(tiny_llama.model)
    return d.eval()


@pytest.fixture(scope="module")
def server(tiny_llama, drafter) -> Iterator[str]:  # type: ignore[no-untyped-def]
    with running(make_app(tiny_llama, drafter)) as url:
        yield url


def vanilla(tiny_llama, max_new: int) -> list[int]:  # type: ignore[no-untyped-def]
    cfg = GenerationConfig(max_new_tokens=max_new, ignore_eos=True)
    return generate(tiny_llama.model, tiny_llama.tokenizer, PROMPT, cfg).token_ids


def split(tiny_llama, drafter, url: str, max_new: int, **kw):  # type: ignore[no-untyped-def]
    remote = RemoteTarget(url, KEY, timeout=kw.pop("timeout", 10.0), retries=kw.pop("retries", 1), backoff=0.01)
    sampling = kw.pop("sampling", SamplingParams())
    prompt = kw.pop("prompt", PROMPT)
    logprobs = kw.pop("logprobs", None)
    gen = SplitGeneration(drafter, tiny_llama.tokenizer, remote, set(), max_draft=8, **kw)
    cfg = GenerationConfig(max_new_tokens=max_new, ignore_eos=True, sampling=sampling, logprobs=logprobs)
    result = gen.run(prompt, cfg, tiny_llama.cfg.max_position_embeddings)
    remote.shutdown()
    return result


# --- the pure parts -------------------------------------------------------------------------

@pytest.mark.parametrize("fmt, tol", [("fp16", 1e-3), ("int8", 1 / 254 + 1e-3)])
def test_codec_round_trip(fmt: str, tol: float) -> None:
    x = torch.randn(5, 64) * 3
    y = codec.decode(codec.encode(x, fmt))
    assert y.shape == x.shape
    assert ((y - x).abs() / x.abs().amax(-1, keepdim=True)).max() <= tol
    assert codec.payload_bytes(codec.encode(x, fmt)) == (5 * 64 * 2 if fmt == "fp16" else 5 * 64 + 5 * 2)


@pytest.mark.parametrize("payload", [
    {"format": "fp16", "shape": [2, 4], "data": "AAAA"},
    {"format": "fp16", "shape": [2, 4], "data": "not base64!"},
    {"format": "bf16", "shape": [1, 1], "data": ""},
    {"format": "int8", "shape": [1, 2], "data": "AAA=", "scales": ""},
    {"shape": [1, 1]},
])
def test_codec_rejects_bad_payloads(payload) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(codec.CodecError):
        codec.decode(payload)


def test_profiles_parse() -> None:
    assert parse_profile("4g") == (PROFILES["4g"], None)
    assert parse_profile("5g+offline-after:32") == (PROFILES["5g"], 32)
    assert parse_profile("offline-after:8") == (PROFILES["lan"], 8)
    for bad in ("3g", "offline-after:x", "offline-after:-1"):
        with pytest.raises(ValueError):
            parse_profile(bad)


# --- lossless over the network --------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["fp16", "int8"])
@pytest.mark.parametrize("draft_len", [1, 4])
@pytest.mark.parametrize("pipeline", [True, False])
def test_split_greedy_equals_the_targets_greedy(tiny_llama, drafter, server, fmt, draft_len, pipeline) -> None:  # type: ignore[no-untyped-def]
    result = split(tiny_llama, drafter, server, 40, draft_len=draft_len, fmt=fmt, pipeline=pipeline)
    assert result.token_ids == vanilla(tiny_llama, 40)
    assert result.unverified == 0 and result.server_calls == len(result.accepted_lengths) + 1 + 1  # + open, close
    assert result.state_bytes == (len(PROMPT) + sum(result.accepted_lengths)) * tiny_llama.cfg.hidden_size * (2 if fmt == "fp16" else 1) \
        + (0 if fmt == "fp16" else (len(PROMPT) + sum(result.accepted_lengths)) * 2)


@pytest.mark.parametrize("kind", ["moa", "eagle"])
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=1.0, seed=3)])
def test_chains_cut_short_by_confidence_pipeline_on(tiny_llama, drafter, eagle, server, kind, sampling,  # type: ignore[no-untyped-def]
                                                    monkeypatch) -> None:
    """A chain that ends below ``confidence`` has fed its last draft to decide against the next: the drafts
    made while it is verified continue from that draft's output (they once fed nothing and crashed)."""
    from moaspec.drafters.proposers import DrafterProposer

    continued = []  # drafting that began where the drafter had already fed every token
    original = DrafterProposer._continue
    monkeypatch.setattr(DrafterProposer, "_continue", lambda self, tokens: (
        continued.append(len(tokens) == self._own_length()), original(self, tokens))[1])
    mine = drafter if kind == "moa" else eagle
    result = split(tiny_llama, mine, server, 40, draft_len=4, pipeline=True, confidence=0.99, sampling=sampling)
    assert len(result.token_ids) == 40 and result.unverified == 0
    if sampling.greedy:
        assert result.token_ids == vanilla(tiny_llama, 40)
    assert any(continued)


@pytest.mark.parametrize("pipeline", [True, False])
def test_prompt_lookup_copies_are_sent_and_greedy_output_is_unchanged(tiny_llama, drafter, server, pipeline) -> None:  # type: ignore[no-untyped-def]
    plain = split(tiny_llama, drafter, server, 60, draft_len=1, pipeline=pipeline)
    copied = split(tiny_llama, drafter, server, 60, draft_len=1, pipeline=pipeline, lookup=6)
    assert copied.token_ids == plain.token_ids == vanilla(tiny_llama, 60)
    # the drafter sends one draft, so more than two tokens per verification means a copy was accepted
    assert max(copied.accepted_lengths) > 2 and copied.server_calls < plain.server_calls


def test_the_memory_from_the_server_is_what_the_drafter_computes_locally(tiny_llama, drafter, server) -> None:  # type: ignore[no-untyped-def]
    remote = RemoteTarget(server, KEY)
    answer = remote.open(PROMPT, "moa", "fp16", 8)
    cache = tiny_llama.model.new_cache(64)
    tiny_llama.model(torch.tensor([PROMPT]), cache)
    local = drafter.memory(cache.token_kv(0, len(PROMPT)), None)[0]
    assert torch.allclose(codec.decode(answer["state"]), local, atol=2e-3 * local.abs().max().item())
    remote.close(answer["session"])


# --- draft trees across the network ----------------------------------------------------------

@pytest.mark.parametrize("kind, lookup", [("moa", 0), ("moa", 4), ("tli", 0), ("eagle", 0), ("independent", 0)])
def test_draft_trees_over_the_network_are_lossless(tiny_llama, request, kind, lookup) -> None:  # type: ignore[no-untyped-def]
    """The server verifies a whole tree under a tree mask and keeps the accepted branch; the client
    drafts what it would draft next to the target, for every kind of drafter."""
    from moaspec.decoding.tree import generate_tree
    from moaspec.drafters.proposers import proposer_for

    d = request.getfixturevalue({"moa": "drafter", "tli": "tli_drafter"}.get(kind, kind))
    shape = TreeShape(depth=3, top_k=2, total=6)
    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    alone = generate_tree(tiny_llama.model, tiny_llama.tokenizer, proposer_for(d), PROMPT, cfg, shape)
    with running(make_app(tiny_llama, d if isinstance(d, MoADrafter) else request.getfixturevalue("drafter"))) as url:
        result = split(tiny_llama, d, url, 30, tree=shape, lookup=lookup)
    assert result.token_ids == alone.token_ids == vanilla(tiny_llama, 30)
    if not lookup:
        assert result.accepted_lengths == alone.accepted_lengths  # the same trees, the same branches taken
    assert result.server_calls == len(result.accepted_lengths) + 2


@pytest.mark.parametrize("kind", ["drafter", "tli_drafter"])
def test_a_tree_client_generates_alone_and_is_lossless_once_the_server_is_back(tiny_llama, request, kind) -> None:  # type: ignore[no-untyped-def]

    drafter = request.getfixturevalue(kind)
    with running(make_app(tiny_llama, drafter)) as url:
        proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
        try:
            result = split(tiny_llama, drafter, proxy.url, 40, tree=TreeShape(2, 2, 4), timeout=2.0, retry_every=2,
                           on_piece=cut_after(proxy, 5, restore_after=4))
        finally:
            proxy.stop()
    assert result.offline_tokens > 0 and result.resyncs >= 1 and result.unverified == 0
    assert result.token_ids == vanilla(tiny_llama, 40)


# --- Target Layer Inference on the client --------------------------------------------------

def recording_steps(drafter: MoADrafter, monkeypatch) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    """Every draft step's logits, in call order."""
    seen: list[torch.Tensor] = []
    step = drafter.step

    def record(*args, **kw):  # type: ignore[no-untyped-def]
        out = step(*args, **kw)
        seen.append(out.clone())
        return out
    monkeypatch.setattr(drafter, "step", record)
    return seen


def test_a_tli_client_drafts_what_one_device_drafts(tiny_llama, tli_drafter, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """With N = 1 the client runs the target's last layer over K/V the server sends: every draft step sees
    what it would see next to the target (up to fp16 transfer), and the output is the target's."""
    from moaspec.decoding.speculative import generate_chain
    from moaspec.drafters.proposers import MoAProposer

    cfg = GenerationConfig(max_new_tokens=30, ignore_eos=True)
    local = recording_steps(tli_drafter, monkeypatch)
    alone = generate_chain(tiny_llama.model, tiny_llama.tokenizer, MoAProposer(tli_drafter), PROMPT, cfg, draft_len=3)
    local = local[:]  # the recorder below calls this one, which would record the client's steps too
    remote = recording_steps(tli_drafter, monkeypatch)
    with running(make_app(tiny_llama, tli_drafter)) as url:
        result = split(tiny_llama, tli_drafter, url, 30, draft_len=3, pipeline=False)
    assert result.token_ids == alone.token_ids == vanilla(tiny_llama, 30)
    assert len(remote) == len(local) > 30
    for a, b in zip(local, remote):
        assert torch.allclose(a, b, atol=2e-2 * a.abs().max().item())
    kv = 2 * tiny_llama.cfg.kv_dim  # one layer's K and V per verified token, besides the memory entry
    assert result.state_bytes == (len(PROMPT) + sum(result.accepted_lengths)) * (tiny_llama.cfg.hidden_size + kv) * 2


@pytest.mark.parametrize("lookup", [0, 4])
def test_a_tli_client_generates_alone_and_is_lossless_once_the_server_is_back(tiny_llama, tli_drafter, lookup) -> None:  # type: ignore[no-untyped-def]
    with running(make_app(tiny_llama, tli_drafter)) as url:
        proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
        try:
            result = split(tiny_llama, tli_drafter, proxy.url, 40, draft_len=3, timeout=2.0, retry_every=2,
                           lookup=lookup, on_piece=cut_after(proxy, 5, restore_after=4))
        finally:
            proxy.stop()
    assert result.offline_tokens > 0 and result.resyncs >= 1 and result.unverified == 0
    assert result.token_ids == vanilla(tiny_llama, 40)


def test_one_server_serves_clients_of_several_moa_drafters(tiny_llama, drafter, tli_drafter) -> None:  # type: ignore[no-untyped-def]
    """An N = 0 and an N = 1 client share one server; each session's memory comes from its own drafter's LSA."""
    with running(make_app(tiny_llama, [drafter, tli_drafter])) as url:
        for d in (drafter, tli_drafter):
            assert split(tiny_llama, d, url, 24, draft_len=3).token_ids == vanilla(tiny_llama, 24)
        remote = RemoteTarget(url, KEY, retries=0)
        assert set(remote.info()["moa_drafters"]) == {drafter.fingerprint(), tli_drafter.fingerprint()}
        answer = remote.open(PROMPT, "moa", "fp16", 8, drafter=tli_drafter.fingerprint())
        cache = tiny_llama.model.new_cache(64)
        tiny_llama.model(torch.tensor([PROMPT]), cache)
        local = tli_drafter.memory(cache.token_kv(0, len(PROMPT)), None)[0]
        assert torch.allclose(codec.decode(answer["state"]), local, atol=2e-3 * local.abs().max().item())
        with pytest.raises(ServerRefused, match="several MoA drafters"):
            remote.open(PROMPT, "moa", "fp16", 8)
        with pytest.raises(ServerRefused, match="does not hold the MoA drafter"):
            remote.open(PROMPT, "moa", "fp16", 8, drafter="0123456789abcdef")
        remote.shutdown()


def test_a_tli_client_runs_from_its_bundle(tiny_llama, tiny_dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The bundle of an N = 1 drafter carries the target's last block and final norm, and nothing of the rest."""
    import json as jsonlib

    from moaspec.chat import chat_messages, encode_chat
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import load_drafter, save_drafter, target_identity

    torch.manual_seed(7)
    path = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg, tli_layers=1)), tmp_path / "moa",
                        target_identity(tiny_llama))
    bundle = tmp_path / "bundle"
    assert main(["export-client", "--model", str(tiny_dirs["llama"]), "--drafter", str(path), "--output", str(bundle)]) == 0
    capsys.readouterr()
    last = tiny_llama.cfg.num_layers - 1
    names = set(load_file(str(bundle / "target.safetensors")))
    assert {n.split(".")[1] for n in names if n.startswith("blocks.")} == {str(last)}
    assert {"embed.weight", "norm"} <= names and jsonlib.loads((bundle / "bundle.json").read_text())["target_layers"] == 1
    # an N = 0 drafter's bundle holds no block: the N = 1 drafter cannot run from it
    flat = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "flat", target_identity(tiny_llama))
    assert main(["export-client", "--model", str(tiny_dirs["llama"]), "--drafter", str(flat), "--output",
                 str(tmp_path / "flat-bundle")]) == 0
    capsys.readouterr()
    with running(make_app(tiny_llama, load_drafter(path, tiny_llama))) as url:
        assert main(["client", "--server", url, "--api-key", KEY, "--bundle", str(tmp_path / "flat-bundle"),
                     "--drafter", str(path), "hi"]) == 2
        assert "export one for this one" in capsys.readouterr().err
        assert main(["client", "--server", url, "--api-key", KEY, "--bundle", str(bundle), "--max-new-tokens", "12",
                     "--json", "The quick brown fox"]) == 0
    out = jsonlib.loads(capsys.readouterr().out)
    ids = encode_chat(tiny_llama.tokenizer, chat_messages("The quick brown fox"))
    assert out["text"] == generate(tiny_llama.model, tiny_llama.tokenizer, ids, GenerationConfig(max_new_tokens=12)).text
    info = jsonlib.loads((bundle / "bundle.json").read_text())
    (bundle / "bundle.json").write_text(jsonlib.dumps({**info, "format": "moaspec-client-bundle/1"}))
    assert main(["client", "--server", "http://127.0.0.1:9", "--bundle", str(bundle), "hi"]) == 2
    assert "export it again" in capsys.readouterr().err


# --- disconnection ---------------------------------------------------------------------------

def cut_after(proxy: NetworkProxy, k: int, restore_after: int | None = None):  # type: ignore[no-untyped-def]
    """An on_piece callback that kills the link after k pieces (and restores it after more)."""
    seen = [0]

    def piece(text: str, kind: str) -> None:
        seen[0] += 1
        if seen[0] == k:
            proxy.cut()
        if restore_after is not None and seen[0] == k + restore_after:
            proxy.restore()
    return piece


def test_the_client_keeps_generating_alone_when_the_link_dies(tiny_llama, drafter, server) -> None:  # type: ignore[no-untyped-def]
    proxy = NetworkProxy(("127.0.0.1", int(server.rsplit(":", 1)[1])), PROFILES["lan"]).start()
    try:
        events: list[str] = []
        result = split(tiny_llama, drafter, proxy.url, 40, draft_len=3, timeout=2.0,
                       on_piece=cut_after(proxy, 6), on_event=events.append)
    finally:
        proxy.stop()
    want = vanilla(tiny_llama, 40)
    verified = len(result.token_ids) - result.unverified
    assert len(result.token_ids) == 40 and result.unverified > 0 and result.offline_tokens >= result.unverified
    assert result.token_ids[:verified] == want[:verified]  # what the server verified is the target's
    assert any("unreachable" in e for e in events)


@pytest.mark.parametrize("expire, lookup", [(False, 0), (True, 0), (False, 4)])
def test_generation_is_lossless_again_once_the_server_is_back(tiny_llama, drafter, expire, lookup) -> None:  # type: ignore[no-untyped-def]
    with running(make_app(tiny_llama, drafter, ttl_s=0.3 if expire else 300)) as url:
        proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
        try:
            def slow_restore(text: str, kind: str, piece=cut_after(proxy, 5, restore_after=4)) -> None:
                piece(text, kind)
                if expire and kind == "unverified":
                    time.sleep(0.2)  # long enough offline for the session to expire
            events: list[str] = []
            result = split(tiny_llama, drafter, proxy.url, 40, draft_len=3, timeout=2.0, retry_every=2, lookup=lookup,
                           on_piece=slow_restore, on_event=events.append)
        finally:
            proxy.stop()
    assert result.offline_tokens > 0 and result.resyncs >= 1 and result.unverified == 0
    assert result.token_ids == vanilla(tiny_llama, 40)
    assert any("reachable again" in e for e in events)


@pytest.mark.parametrize("tree", [False, True])
def test_a_sampling_client_repeats_with_its_seed_even_through_a_cut(tiny_llama, drafter, tree) -> None:  # type: ignore[no-untyped-def]
    """The server samples the target's tokens (the distribution itself is tested on the session
    store, test_sampling_distribution.py); the client drafts greedily online and samples offline."""
    hot = SamplingParams(temperature=0.6, seed=11)
    shape = TreeShape(depth=2, top_k=2, total=4) if tree else None
    with running(make_app(tiny_llama, drafter)) as url:
        first = split(tiny_llama, drafter, url, 40, draft_len=3, sampling=hot, tree=shape)
        again = split(tiny_llama, drafter, url, 40, draft_len=3, sampling=hot, tree=shape)
        other = split(tiny_llama, drafter, url, 40, draft_len=3, sampling=SamplingParams(temperature=0.6, seed=12),
                      tree=shape)
        proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
        try:
            # back as soon as the client notices (sampled text may come out in few pieces)
            cut = split(tiny_llama, drafter, proxy.url, 40, draft_len=3, timeout=2.0, retry_every=2, sampling=hot,
                        tree=shape, on_piece=cut_after(proxy, 5),
                        on_event=lambda text: proxy.restore() if "unreachable" in text else None)
        finally:
            proxy.stop()
    assert first.token_ids == again.token_ids != other.token_ids  # the seed decides every draw
    assert first.token_ids != vanilla(tiny_llama, 40)  # it sampled
    assert sum(first.accepted_lengths) - len(first.accepted_lengths) > 0  # greedy drafts are accepted sometimes
    assert len(cut.token_ids) == 40 and cut.offline_tokens > 0 and cut.resyncs >= 1 and cut.unverified == 0


def test_the_client_cannot_start_without_a_server(tiny_llama, drafter) -> None:  # type: ignore[no-untyped-def]
    from moaspec.errors import MoaspecError

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there
    with pytest.raises(MoaspecError, match="cannot reach the server"):
        split(tiny_llama, drafter, f"http://127.0.0.1:{port}", 8, timeout=1.0)


# --- a hostile or broken client gets a 4xx and the server keeps serving ----------------------

def test_malformed_and_hostile_requests(tiny_llama, drafter, server) -> None:  # type: ignore[no-untyped-def]
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server + "/cs/v1", headers=auth, timeout=30) as http:
        def status(method: str, path: str, **kw) -> tuple[int, str]:  # type: ignore[no-untyped-def]
            r = http.request(method, path, **kw)
            return r.status_code, (r.json()["error"]["message"] if r.status_code >= 400 else "")

        opened = http.post("/sessions", json={"prompt": PROMPT}).json()
        sid, n = opened["session"], opened["verified"]
        vocab = tiny_llama.cfg.vocab_size
        cases = [
            (("POST", "/sessions"), {"json": {"prompt": [1, vocab]}}, 400, "outside the vocabulary"),
            (("POST", "/sessions"), {"json": {"prompt": [-1]}}, 400, "outside the vocabulary"),
            (("POST", "/sessions"), {"json": {"prompt": []}}, 400, "empty"),
            (("POST", "/sessions"), {"json": {"prompt": "hello"}}, 400, "prompt"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "state": "kv"}}, 400, "state"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "bogus": 1}}, 400, "bogus"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "target_layers": tiny_llama.cfg.num_layers}}, 400,
             "target_layers must be in 0.."),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "target_layers": -1}}, 400, "target_layers"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"temperature": -1}}}, 400, "temperature"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"temperature": 1, "top_p": 0}}}, 400, "top_p"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"temperature": 1, "seed": 2**64}}}, 400, "seed"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"temp": 1}}}, 400, "temp"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"presence_penalty": 3}}}, 400,
             "presence_penalty"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"logit_bias": {"abc": 1}}}}, 400,
             "logit_bias keys are token ids"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"logit_bias": {str(vocab): 1}}}}, 400,
             f"[0, {vocab})"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "sampling": {"logit_bias": {"5": 101}}}}, 400,
             "logit_bias"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "answer_start": len(PROMPT) + 1}}, 400,
             "answer_start must be in"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "logprobs": 21}}, 400, "logprobs"),
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "logprobs": True}}, 400, "logprobs"),
            (("POST", "/sessions"), {"json": {"prompt": [1, True]}}, 400, "prompt"),  # JSON's true is no token id
            (("POST", "/sessions"), {"json": {"prompt": PROMPT, "max_new_tokens": 2.5}}, 400, "max_new_tokens"),
            (("POST", "/sessions"), {"content": b"{oops", "headers": {"Content-Type": "application/json"}}, 400, "JSON"),
            (("POST", "/sessions"), {"json": {"prompt": [1] * 5000}}, 413, "limit"),
            (("POST", "/sessions"), {"json": {"prompt": [1] * 300}}, 413, "at most"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n, "draft": [1] * 9}}, 413, "at most 8"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n, "draft": [vocab + 5]}}, 400, "outside"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n + 3, "draft": [1]}}, 409, "assumes"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n, "draft": [1.0]}}, 400, "draft"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n}}, 400, "draft"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n, "draft": [1, 2], "parents": [0]}}, 400, "parents"),
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n, "draft": [1, 2], "parents": [0, 2]}}, 400,
             "earlier node"),
            (("POST", "/sessions/nope/verify"), {"json": {"verified": n, "draft": [1]}}, 404, "unknown or expired"),
            (("DELETE", "/sessions/nope"), {}, 404, "unknown"),
            (("GET", "/info"), {"headers": {"Authorization": "Bearer wrong"}}, 401, "Incorrect API key"),
            (("GET", "/info"), {"headers": {"Authorization": ""}}, 401, "didn't provide"),
            # the key is checked before the body is read: without it, a malformed body says nothing
            (("POST", "/sessions"), {"content": b"{oops", "headers": {"Authorization": "Bearer wrong",
                                                                     "Content-Type": "application/json"}},
             401, "Incorrect API key"),
        ]
        hot = http.post("/sessions", json={"prompt": PROMPT, "sampling": {"temperature": 1.0, "seed": 1}}).json()
        hn, verify = hot["verified"], f"/sessions/{hot['session']}/verify"
        one = {"ids": [1, 2], "probs": [0.5, 0.5]}
        cases += [
            (("POST", f"/sessions/{sid}/verify"), {"json": {"verified": n, "draft": [1], "dists": [one]}}, 400,
             "sampling session"),
            (("POST", verify), {"json": {"verified": hn, "draft": [1, 2], "dists": [one]}}, 400, "one entry"),
            (("POST", verify), {"json": {"verified": hn, "draft": [3], "dists": [one]}}, 400, "no probability"),
            (("POST", verify), {"json": {"verified": hn, "draft": [1], "dists": [{"ids": [1, 2], "probs": [0.9, 0.9]}]}},
             400, "summing to at most 1"),
            (("POST", verify), {"json": {"verified": hn, "draft": [1], "dists": [{"ids": [1, 1], "probs": [0.5, 0.5]}]}},
             400, "distinct"),
            (("POST", verify), {"json": {"verified": hn, "draft": [1], "dists": [{"ids": [1, vocab], "probs": [0.5, 0.5]}]}},
             400, "outside the vocabulary"),
            (("POST", verify), {"json": {"verified": hn, "draft": [1], "dists": [{"ids": list(range(65)),
                                                                                  "probs": [0.01] * 65}]}}, 400, "ids"),
            (("POST", verify), {"json": {"verified": hn, "draft": [1, 2], "parents": [0, 1], "dists": [None, None]}},
             400, "chain only"),
        ]
        for (method, path), kw, want, words in cases:
            got, message = status(method, path, **kw)
            assert (got, words in message) == (want, True), (method, path, kw, got, message)
        ok = http.post(verify, json={"verified": hn, "draft": [1, 5], "dists": [one, None]})
        assert ok.status_code == 200 and ok.json()["verified"] > hn  # a distribution, then a point mass
        # a retried verification gets the same answer and does not advance the session twice
        first = http.post(f"/sessions/{sid}/verify", json={"verified": n, "draft": [3, 4]}).json()
        again = http.post(f"/sessions/{sid}/verify", json={"verified": n, "draft": [3, 4]}).json()
        assert first == again
        assert http.post(f"/sessions/{sid}/verify", json={"verified": first["verified"], "draft": []}).status_code == 200
        # a client vanishing mid-request: half a request, then the socket closes
        host, port = server.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:
            raw.sendall(b"POST /cs/v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: 500\r\n\r\n{\"prompt\": [1, 2")
        assert http.delete(f"/sessions/{sid}").status_code == 204
        assert http.get("/info").json()["open_sessions"] >= 0
        conflict = http.post(verify, json={"verified": 1, "draft": [1]})
        assert conflict.status_code == 409 and conflict.json()["error"]["type"] == "invalid_request_error"
        # a session opened for 2 new tokens verifies once more at most (its first verification may accept a
        # whole draft), then says its budget is used
        small = http.post("/sessions", json={"prompt": PROMPT, "max_new_tokens": 2}).json()
        done = http.post(f"/sessions/{small['session']}/verify", json={"verified": small["verified"], "draft": [1, 2, 3]})
        assert done.status_code == 200
        got, message = status("POST", f"/sessions/{small['session']}/verify",
                              json={"verified": done.json()["verified"], "draft": [1]})
        assert got == 400 and "budget" in message
        # a temperature so small that logits / T overflow samples as greedy, instead of failing
        cold = http.post("/sessions", json={"prompt": PROMPT, "sampling": {"temperature": 1e-45, "seed": 0}})
        assert cold.status_code == 200


def test_the_protocol_document_matches_the_server(tiny_llama, drafter, server) -> None:  # type: ignore[no-untyped-def]
    """docs/client-server-protocol.md's JSON examples: its requests are served (token ids folded into the tiny
    vocabulary) and its answers name the fields a real answer has."""
    import json as jsonlib
    import re
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "client-server-protocol.md").read_text()
    examples = []
    for block in re.findall(r"```json\n(.*?)```", doc, re.S):
        try:
            examples.append(jsonlib.loads(block))
        except ValueError:  # payload shapes with placeholders, fragments
            continue
    vocab = tiny_llama.cfg.vocab_size

    def fold(body):  # type: ignore[no-untyped-def]
        ids = {k: [t % vocab for t in v] for k, v in body.items() if k in ("prompt", "draft")}
        return {**body, **ids}

    with httpx.Client(base_url=server + "/cs/v1", headers={"Authorization": f"Bearer {KEY}"}, timeout=30) as http:
        info = http.get("/info").json()
        opens = [e for e in examples if "prompt" in e]
        verifies = [e for e in examples if "draft" in e and "dists" not in e]
        answers = {"info": [e for e in examples if "moa_drafters" in e], "open": [e for e in examples if "session" in e],
                   "verify": [e for e in examples if "accepted" in e]}
        assert opens and verifies and all(answers.values())
        assert set(answers["info"][0]) == set(info)
        for body in opens:
            opened = http.post("/sessions", json=fold(body))
            assert opened.status_code == 200, opened.text
            assert set(answers["open"][0]) == set(opened.json())
        for body in verifies:
            opened = http.post("/sessions", json={"prompt": fold(opens[0])["prompt"]}).json()
            got = http.post(f"/sessions/{opened['session']}/verify", json={**fold(body), "verified": opened["verified"]})
            assert got.status_code == 200, got.text
            want = next(a for a in answers["verify"] if ("path" in a) == ("parents" in body))
            assert set(want) == set(got.json())


def test_a_client_that_gives_up_on_opening_a_session_stops_its_prefill(tiny_llama, drafter, slow_prefill) -> None:  # type: ignore[no-untyped-def]
    """A client whose open times out (and would retry) leaves no prefill running for nobody and no session behind:
    the server stops within a chunk, and the next open is served at once."""
    with running(make_app(tiny_llama, drafter)) as url:
        auth = {"Authorization": f"Bearer {KEY}"}
        prompt = [5 + i % 200 for i in range(240)]  # 120 chunks: 6 s of prefill
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=url + "/cs/v1", headers=auth, timeout=0.6) as http:
            http.post("/sessions", json={"prompt": prompt})
        with httpx.Client(base_url=url + "/cs/v1", headers=auth, timeout=30) as http:
            seen, deadline = -1, time.time() + 5
            while len(slow_prefill) != seen and time.time() < deadline:  # until no chunk ran for 0.3 s
                seen = len(slow_prefill)
                time.sleep(0.3)
            assert 0 < len(slow_prefill) < 60 and http.get("/info").json()["open_sessions"] == 0
            t0 = time.perf_counter()
            assert http.post("/sessions", json={"prompt": PROMPT}).status_code == 200
            assert time.perf_counter() - t0 < 3


def test_opening_a_session_waits_longer_for_a_longer_prompt(tiny_llama, drafter, slow_prefill, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """An open waits for the server to read the prompt: the timeout grows with its length, so a prompt the server
    accepts is not lost on every retry for taking longer to read than a verification takes."""
    from moaspec.clientserver import client
    from moaspec.clientserver.client import ServerUnreachable

    prompt = [5 + i % 200 for i in range(40)]  # 20 chunks of 50 ms: 1 s to read
    with running(make_app(tiny_llama, drafter)) as url:
        remote = RemoteTarget(url, KEY, timeout=0.4, retries=0)
        monkeypatch.setattr(client, "OPEN_S_PER_PROMPT_TOKEN", 0.0)
        with pytest.raises(ServerUnreachable):
            remote.open(prompt, "moa", "fp16", 4)
        monkeypatch.setattr(client, "OPEN_S_PER_PROMPT_TOKEN", 0.05)  # 0.4 + 2 s
        assert remote.open(prompt, "moa", "fp16", 4)["verified"] == len(prompt) + 1
        remote.shutdown()


def test_repeated_ngrams_measure_loops() -> None:
    from moaspec.clientserver.bench import repeated_ngrams

    assert repeated_ngrams(list(range(20))) == 0.0
    assert repeated_ngrams([1, 2, 3, 4] * 5, n=4) == 13 / 17  # a loop of 4: its 4 rotations are new, the rest repeat
    assert repeated_ngrams([1, 2, 3]) == 0.0  # shorter than one 4-gram
    assert repeated_ngrams([7, 7, 7, 7, 7], n=2) == 3 / 4


def test_sessions_are_limited_and_expire(tiny_llama, drafter) -> None:  # type: ignore[no-untyped-def]
    with running(make_app(tiny_llama, drafter, max_sessions=2, ttl_s=0.5)) as url:
        remote = RemoteTarget(url, KEY, retries=0)
        a, b = remote.open(PROMPT, "moa", "fp16", 8), remote.open(PROMPT, "none", "int8", 8)
        assert b["state"] is None
        with httpx.Client() as http:
            r = http.post(url + "/cs/v1/sessions", json={"prompt": PROMPT}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        time.sleep(0.7)
        with pytest.raises(ServerRefused) as err:
            remote.verify(a["session"], a["verified"], [1])
        assert err.value.status == 404
        assert remote.open(PROMPT, "moa", "fp16", 8)["session"]  # expired sessions freed their places
        remote.shutdown()


def test_a_client_that_fails_mid_answer_frees_its_session(tiny_llama, drafter, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moaspec.drafters.proposers import DrafterProposer

    def broken(self, tokens, n, sampling, generator):  # type: ignore[no-untyped-def]
        raise RuntimeError("a bug in drafting")

    with running(make_app(tiny_llama, drafter, max_sessions=1, ttl_s=600)) as url:
        with monkeypatch.context() as m:
            m.setattr(DrafterProposer, "propose", broken)
            with pytest.raises(RuntimeError, match="a bug in drafting"):
                split(tiny_llama, drafter, url, 20, draft_len=2)
        # the one place is free again at once, not after ttl_s
        assert split(tiny_llama, drafter, url, 20, draft_len=2).token_ids == vanilla(tiny_llama, 20)


def token_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("ended, kind", [("closed", "moa"), ("expired", "eagle"), ("closed", "eagle")])
def test_a_session_leaves_its_verified_text_to_the_next_one(tiny_llama, drafter, ended, kind, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A conversation's next turn (or a client reopening after its session expired) reads only what is new: the
    ended session's prompt and every token it verified, chains and a tree's compacted path alike. MoA's memory
    entries of the reused positions are the ended session's (LSA runs on the new ones only), EAGLE's state
    comes from the reused final states."""
    lsa: list[tuple[int, int]] = []
    monkeypatch.setattr(drafter, "memory_entries",
                        lambda cache, start, end, hidden, _run=drafter.memory_entries: lsa.append((start, end)) or
                        _run(cache, start, end, hidden))
    reuse = PromptCache(1 << 30, min_tokens=8)
    limits = Limits(max_draft=8, ttl_s=0.3 if ended == "expired" else 300)
    store, plain = SessionStore(tiny_llama, drafter, limits, prompt_cache=reuse), SessionStore(tiny_llama, drafter, limits)
    prompt = token_ids(30, 1)
    want = generate(tiny_llama.model, tiny_llama.tokenizer, prompt, GenerationConfig(max_new_tokens=12, ignore_eos=True)).token_ids
    a = store.open(prompt, kind, "fp16", 20)
    assert a["cached_tokens"] == 0 and a["token"] == want[0]
    v = store.verify(a["session"], a["verified"], want[1:4])  # a chain, all accepted
    wrong = (want[5] + 1) % 300 + 3
    v = store.verify(a["session"], v["verified"], [want[5], wrong, want[6]], parents=[0, 0, 1])  # a tree: path 1, 3
    assert v["path"] == [1, 3] and v["token"] == want[7]
    {"closed": lambda: store.close(a["session"]), "expired": lambda: time.sleep(0.4)}[ended]()
    text = prompt + want[:7]  # what the session's cache held: every verified token but the newest (want[7])
    nxt = text + [want[7]] + token_ids(5, 2)
    lsa.clear()
    b, fresh = store.open(nxt, kind, "fp16", 4), plain.open(nxt, kind, "fp16", 4)  # opening expires the old one
    assert b["cached_tokens"] == len(text) and fresh["cached_tokens"] == 0
    assert lsa == ([(len(text), len(nxt)), (0, len(nxt))] if kind == "moa" else [])
    assert b["token"] == fresh["token"]
    torch.testing.assert_close(codec.decode(b["state"]), codec.decode(fresh["state"]), atol=2e-3, rtol=0)


def test_a_session_prefill_alone_takes_every_core_and_verifies_on_its_share(tiny_llama, drafter, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cores import Cores
    from moaspec.models import transformer

    monkeypatch.setitem(transformer.PREFILL_CHUNKS, "cpu", 8)
    model, seen = tiny_llama.model, []
    monkeypatch.setattr(model, "run_blocks", lambda h, *a, _run=model.run_blocks, **k:
                        seen.append((h.shape[1], torch.get_num_threads())) or _run(h, *a, **k))
    cores, own = Cores(total=2, share=1), torch.get_num_threads()
    store = SessionStore(tiny_llama, drafter, Limits(max_draft=8), cores=cores)
    try:
        a = store.open(token_ids(20, 5), "moa", "fp16", 8)
        store.verify(a["session"], a["verified"], [7, 8])
        with cores.busy():  # something else runs: the next prefill keeps to its share
            store.open(token_ids(20, 6), "moa", "fp16", 8)
    finally:
        torch.set_num_threads(own)
    assert seen == [(8, 2), (8, 2), (4, 2), (3, 1), (8, 1), (8, 1), (4, 1)]


@pytest.mark.parametrize("kind", ["drafter", "tli_drafter", "eagle", "independent"])
def test_a_conversation_over_the_network_reads_and_sends_each_turn_once(tiny_llama, drafter, tli_drafter, kind, request,
                                                                        monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One client holding a conversation: each next turn the server reads only what is new (its prompt cache), and
    the client begins from its drafter's state of the last turn, so the server sends only the new tokens' state
    (and an EAGLE or independent drafter reads only the new tokens); the answer is the target's own, drafted
    exactly as a fresh client drafts it."""
    d = request.getfixturevalue(kind)
    fed: list[int] = []  # tokens an EAGLE or independent drafter reads, per call
    if kind in ("eagle", "independent"):
        monkeypatch.setattr(d, "step", lambda own, tokens, *a, _step=d.step: fed.append(tokens.shape[1]) or _step(own, tokens, *a))
    reuse = PromptCache(1 << 30, min_tokens=8)
    cfg = GenerationConfig(max_new_tokens=16, ignore_eos=True)
    context = tiny_llama.cfg.max_position_embeddings

    def client() -> SplitGeneration:
        return SplitGeneration(d, tiny_llama.tokenizer, RemoteTarget(url, KEY, retries=0), set(), draft_len=3, max_draft=8)

    turn1 = token_ids(24, 3)
    with running(make_app(tiny_llama, [drafter, tli_drafter], reuse)) as url:
        gen = client()
        first = gen.run(turn1, cfg, context)
        turn2 = turn1 + first.token_ids + token_ids(6, 4)
        fed.clear()
        second = gen.run(turn2, cfg, context)
        read_carried, fed[:] = sum(fed), []
        afresh = client().run(turn2, cfg, context)
    assert first.cached_tokens == first.carried_tokens == 0
    assert len(turn1) + len(first.token_ids) - 1 <= second.cached_tokens < len(turn2)
    assert len(turn1) <= second.carried_tokens < len(turn2) and afresh.carried_tokens == 0
    want = generate(tiny_llama.model, tiny_llama.tokenizer, turn2, cfg).token_ids
    assert second.token_ids == afresh.token_ids == want
    assert second.accepted_lengths == afresh.accepted_lengths
    if kind == "independent":  # no state travels: the client reads fewer tokens instead
        assert second.state_bytes == afresh.state_bytes == 0
        assert sum(fed) - read_carried == second.carried_tokens
    else:
        assert second.state_bytes < afresh.state_bytes and second.bytes_received < afresh.bytes_received
    if kind == "eagle":
        assert sum(fed) - read_carried == second.carried_tokens


def test_a_client_that_holds_a_prompts_state_is_sent_only_the_rest(tiny_llama, tli_drafter, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = SessionStore(tiny_llama, tli_drafter, Limits(max_draft=8))
    prompt = token_ids(20, 7)
    rows: list[int] = []
    lsa = tli_drafter.memory_entries

    def counted(cache, start, end, hidden):  # type: ignore[no-untyped-def]
        rows.append(end - start)
        return lsa(cache, start, end, hidden)

    monkeypatch.setattr(tli_drafter, "memory_entries", counted)
    whole, rest = store.open(prompt, "moa", "fp16", 4, layers=1), store.open(prompt, "moa", "fp16", 4, layers=1, have_state=15)
    assert rows == [20, 5]  # without a prompt cache to fill, LSA skips what the client holds
    assert whole["state_start"] == 0 and rest["state_start"] == 15
    for key, per_token in (("state", 1), ("layers", 1)):
        a, b = codec.decode(whole[key]), codec.decode(rest[key])
        assert b.shape[0] == 5 * per_token and torch.equal(a[15 * per_token:], b)
    assert store.info()["have_state"] is True
    for bad in (20, 21, -1):
        with pytest.raises(SessionError, match="have_state must be in 0..19"):
            store.open(prompt, "moa", "fp16", 4, have_state=bad)


@pytest.fixture(scope="module")
def eagle(tiny_llama):  # type: ignore[no-untyped-def]
    from moaspec.drafters.eagle import EagleConfig, EagleDrafter

    torch.manual_seed(4)
    d = EagleDrafter(EagleConfig.for_target(tiny_llama.cfg))
    d.attach(tiny_llama.model)
    return d.eval()


@pytest.fixture(scope="module")
def independent(tiny_llama):  # type: ignore[no-untyped-def]
    from moaspec.drafters.independent import IndependentConfig, IndependentDrafter

    d = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=1))
    d.copy_target_layers(tiny_llama.model)
    d.attach(tiny_llama.model)
    return d.eval()


@pytest.mark.parametrize("pipeline", [True, False])
@pytest.mark.parametrize("kind", ["eagle", "independent"])
def test_feature_and_independent_clients_are_lossless_and_resync_after_a_cut(tiny_llama, eagle, independent, drafter, kind,
                                                                              pipeline) -> None:  # type: ignore[no-untyped-def]
    mine = eagle if kind == "eagle" else independent
    with running(make_app(tiny_llama, drafter)) as url:
        assert split(tiny_llama, mine, url, 30, draft_len=3, pipeline=pipeline).token_ids == vanilla(tiny_llama, 30)
        proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
        try:
            result = split(tiny_llama, mine, proxy.url, 30, draft_len=3, timeout=2.0, retry_every=2, pipeline=pipeline,
                           on_piece=cut_after(proxy, 4, restore_after=4))
        finally:
            proxy.stop()
    assert result.offline_tokens > 0 and result.resyncs >= 1
    assert result.token_ids == vanilla(tiny_llama, 30)


# --- penalties, a logit bias and log-probabilities ------------------------------------------

REPEATING = [200, 3, 3, 3, 3, 9, 3, 3, 3]  # a prompt the tiny target continues with repeats: penalties bite
ADJUSTED = SamplingParams(presence_penalty=0.7, frequency_penalty=0.9, logit_bias=((3, -100.0), (9, 1.5)))


@pytest.fixture(scope="module")
def twin(tiny_llama):  # type: ignore[no-untyped-def]
    """The target's own blocks as an independent drafter: it drafts the plain argmax, which the adjustments overrule."""
    from moaspec.drafters.independent import IndependentConfig, IndependentDrafter

    d = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=tiny_llama.cfg.num_layers))
    d.copy_target_layers(tiny_llama.model)
    d.attach(tiny_llama.model)
    return d.eval()


@pytest.mark.parametrize("how", ["chain", "tree", "lookup", "cut", "expire"])
def test_penalties_and_a_logit_bias_over_the_network_equal_plain_decoding(tiny_llama, twin, drafter, how) -> None:  # type: ignore[no-untyped-def]
    """The server adjusts each verified row by the answer and the drafts on its path, as one device does; a session
    reopened after it expired (while the client wrote alone) counts the answer from where it began."""
    want = generate(tiny_llama.model, tiny_llama.tokenizer, REPEATING,
                    GenerationConfig(max_new_tokens=40, ignore_eos=True, sampling=ADJUSTED)).token_ids
    unadjusted = generate(tiny_llama.model, tiny_llama.tokenizer, REPEATING,
                          GenerationConfig(max_new_tokens=40, ignore_eos=True)).token_ids
    assert want != unadjusted and 3 not in want  # the adjustments change the answer; the bias bans token 3
    kw = {"tree": TreeShape(depth=3, top_k=2, total=6)} if how == "tree" else {"lookup": 4} if how == "lookup" else {}
    with running(make_app(tiny_llama, drafter, ttl_s=0.3 if how == "expire" else 300)) as url:
        if how in ("cut", "expire"):
            proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
            cut = cut_after(proxy, 4, restore_after=4)

            def piece(text: str, kind: str) -> None:
                cut(text, kind)
                if how == "expire" and kind == "unverified":
                    time.sleep(0.2)  # long enough offline for the session to expire

            try:
                result = split(tiny_llama, twin, proxy.url, 40, prompt=REPEATING, sampling=ADJUSTED, draft_len=3,
                               timeout=2.0, retry_every=2, on_piece=piece)
            finally:
                proxy.stop()
            assert result.offline_tokens > 0 and result.resyncs >= 1
        else:
            result = split(tiny_llama, twin, url, 40, prompt=REPEATING, sampling=ADJUSTED, draft_len=3, **kw)
    assert result.token_ids == want and result.unverified == 0
    assert any(n > 1 for n in result.accepted_lengths)  # drafts were accepted: rows past the first were adjusted
    assert any(n == 1 for n in result.accepted_lengths)  # and some refused: the adjustments overruled the drafter


def test_a_tree_row_is_penalised_by_its_own_path_not_its_siblings(tiny_llama, drafter) -> None:  # type: ignore[no-untyped-def]
    """Root's children [c, b]: the target takes b, then c. Counting the sibling c before c's own row would
    penalise the very token the target takes there."""
    harsh = SamplingParams(presence_penalty=2.0, frequency_penalty=2.0)
    plain = generate(tiny_llama.model, tiny_llama.tokenizer, PROMPT,
                     GenerationConfig(max_new_tokens=3, ignore_eos=True, sampling=harsh)).token_ids
    first, b, c = plain
    assert len({first, b, c}) == 3
    store = SessionStore(tiny_llama, drafter)
    opened = store.open(PROMPT, "none", sampling=harsh)
    assert opened["token"] == first
    answer = store.verify(opened["session"], opened["verified"], [c, b], parents=[0, 0])
    assert (answer["path"], answer["token"]) == ([2], c)


@pytest.mark.parametrize("how", ["chain", "tree", "cut"])
def test_the_server_sends_the_targets_own_logprobs(tiny_llama, twin, drafter, how) -> None:  # type: ignore[no-untyped-def]
    """Each verified token's log-probability and alternatives, as one device reports them (a tail written
    alone gets its entries once it is verified)."""
    local = generate(tiny_llama.model, tiny_llama.tokenizer, PROMPT,
                     GenerationConfig(max_new_tokens=30, ignore_eos=True, logprobs=3))
    with running(make_app(tiny_llama, drafter)) as url:
        if how == "cut":
            proxy = NetworkProxy(("127.0.0.1", int(url.rsplit(":", 1)[1])), PROFILES["lan"]).start()
            try:
                result = split(tiny_llama, twin, proxy.url, 30, draft_len=3, timeout=2.0, retry_every=2, logprobs=3,
                               on_piece=cut_after(proxy, 4, restore_after=4))
            finally:
                proxy.stop()
            assert result.offline_tokens > 0 and result.resyncs >= 1
        else:
            tree = TreeShape(depth=3, top_k=2, total=6) if how == "tree" else None
            result = split(tiny_llama, twin, url, 30, draft_len=3, tree=tree, logprobs=3)
            assert split(tiny_llama, twin, url, 4, tree=tree).logprobs is None  # none unless asked
    assert result.token_ids == local.token_ids and any(n > 1 for n in result.accepted_lengths)
    assert result.logprobs is not None and local.logprobs is not None and len(result.logprobs) == 30
    for got, ref in zip(result.logprobs, local.logprobs, strict=True):
        assert got.token == ref.token and got.logprob == pytest.approx(ref.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in ref.top]
        assert [lp for _, lp in got.top] == pytest.approx([lp for _, lp in ref.top], abs=1e-4)


def test_the_client_command(tiny_llama, tiny_dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json as jsonlib

    from moaspec.chat import chat_messages, encode_chat
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import load_drafter, save_drafter, target_identity

    torch.manual_seed(5)
    fresh = MoADrafter(MoAConfig.for_target(tiny_llama.cfg))
    path = save_drafter(fresh, tmp_path / "moa", target_identity(tiny_llama))
    other = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "other", target_identity(tiny_llama))
    served = load_drafter(path, tiny_llama)
    with running(make_app(tiny_llama, served)) as url:
        args = ["client", "--server", url, "--api-key", KEY, "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "12"]
        assert main([*args, "--drafter", str(path), "--json", "The quick brown fox"]) == 0
        out = jsonlib.loads(capsys.readouterr().out)
        ids = encode_chat(tiny_llama.tokenizer, chat_messages("The quick brown fox"))
        assert out["text"] == generate(tiny_llama.model, tiny_llama.tokenizer, ids, GenerationConfig(max_new_tokens=12)).text
        assert out["server_calls"] >= 3 and out["bytes_per_token"] > 0
        # the same from a client bundle: no target layers on the client
        bundle = tmp_path / "bundle"
        assert main(["export-client", "--model", str(tiny_dirs["llama"]), "--drafter", str(path), "--output", str(bundle)]) == 0
        assert "client bundle" in capsys.readouterr().out
        assert set(load_file(str(bundle / "target.safetensors"))) == {"embed.weight", "norm"}  # tied lm_head, N = 0
        no_model = [a for a in args if a not in ("--model", str(tiny_dirs["llama"]))]
        assert main([*no_model, "--bundle", str(bundle), "--json", "The quick brown fox"]) == 0
        assert jsonlib.loads(capsys.readouterr().out)["text"] == out["text"]
        assert main([*no_model, "--bundle", str(tmp_path), "hi"]) == 2
        assert "not a client bundle" in capsys.readouterr().err
        assert main([*args, "--drafter", str(path), "--network", "lan+offline-after:4", "--json", "The quick brown fox"]) == 0
        cut = jsonlib.loads(capsys.readouterr().out)
        assert cut["unverified"] > 0 and cut["new_tokens"] == 12 and cut["offline_tokens"] >= cut["unverified"]
        # streamed into a pipe (capsys is no terminal): the text and the note hold no colour codes
        assert main([*args, "--drafter", str(path), "--network", "lan+offline-after:4", "The quick brown fox"]) == 0
        streamed = capsys.readouterr()
        assert "were never verified" in streamed.err and "\033[" not in streamed.out + streamed.err
        assert main([*args, "--drafter", str(path), "--lookup", "0", "--json", "The quick brown fox"]) == 0
        assert jsonlib.loads(capsys.readouterr().out)["text"] == out["text"]  # lookup on (the default) or off
        assert main([*args, "--drafter", str(path), "--tree", "--tree-depth", "3", "--json", "The quick brown fox"]) == 0
        assert jsonlib.loads(capsys.readouterr().out)["text"] == out["text"]  # trees instead of chains
        hot = ["--temperature", "0.8", "--top-p", "0.95", "--seed", "3", "--json", "The quick brown fox"]
        assert main([*args, "--drafter", str(path), *hot]) == 0
        sampled = jsonlib.loads(capsys.readouterr().out)
        assert main([*args, "--drafter", str(path), *hot]) == 0
        assert jsonlib.loads(capsys.readouterr().out)["text"] == sampled["text"] and sampled["new_tokens"] == 12
        penalised = ["--presence-penalty", "-2", "--frequency-penalty", "-1.5", "--logprobs", "2"]  # repeats, favoured
        assert main([*args, "--drafter", str(path), *penalised, "--json", "The quick brown fox"]) == 0
        adjusted = jsonlib.loads(capsys.readouterr().out)
        local = generate(tiny_llama.model, tiny_llama.tokenizer, ids, GenerationConfig(
            max_new_tokens=12, sampling=SamplingParams(presence_penalty=-2, frequency_penalty=-1.5), logprobs=2))
        assert adjusted["text"] == local.text != out["text"]
        assert len(adjusted["logprobs"]) == adjusted["new_tokens"] and len(adjusted["logprobs"][0]["top_logprobs"]) == 2
        assert main([*args, "--drafter", str(path), "--logprobs", "2", "hi"]) == 2
        assert "give --json too" in capsys.readouterr().err
        assert main([*args, "--drafter", str(path), "--presence-penalty", "5", "hi"]) == 2
        assert "presence_penalty must be a number in [-2, 2]" in capsys.readouterr().err
        assert main([*args, "--drafter", str(path), "--temperature", "0.8", "--seed", "-1", "hi"]) == 2
        assert "seed must be a whole number in" in capsys.readouterr().err
        assert main([*args, "--drafter", str(path), "--lookup", "-1", "hi"]) == 2
        assert "--lookup" in capsys.readouterr().err
        assert main([*args, "--drafter", str(path), "--network", "3g", "hi"]) == 2
        assert "unknown network profile" in capsys.readouterr().err
        assert main([*args, "--drafter", str(other), "hi"]) == 2
        assert "different MoA drafter" in capsys.readouterr().err
        assert main([*args[:3], "--api-key", "wrong", *args[5:], "--drafter", str(path), "hi"]) == 2
        assert "401" in capsys.readouterr().err
    assert main(["client", "--server", "http://127.0.0.1:9", "--model", str(tiny_dirs["llama"]), "--retries", "0", "hi"]) == 2
    assert "cannot reach" in capsys.readouterr().err


def test_the_client_command_holds_a_conversation(tiny_llama, tiny_dirs, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``client --chat``: each line of stdin is the next turn of one conversation, answered as the target answers the
    whole conversation; the server reads only what is new and sends only the new tokens' state."""
    import io

    from moaspec.chat import encode_chat
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import load_drafter, save_drafter, target_identity

    torch.manual_seed(5)
    path = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "moa", target_identity(tiny_llama))
    opens: list[dict] = []
    original = RemoteTarget.open
    monkeypatch.setattr(RemoteTarget, "open", lambda self, *a, **k: opens.append(k) or original(self, *a, **k))
    reuse = PromptCache(1 << 30, min_tokens=8)
    with running(make_app(tiny_llama, load_drafter(path, tiny_llama), reuse)) as url:
        monkeypatch.setattr("sys.stdin", io.StringIO("and then?\n"))
        args = ["client", "--server", url, "--api-key", KEY, "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "8",
                "--drafter", str(path), "--chat", "The quick brown fox"]
        assert main(args) == 0
    cfg = GenerationConfig(max_new_tokens=8)
    history = [{"role": "user", "content": "The quick brown fox"}]
    first = generate(tiny_llama.model, tiny_llama.tokenizer, encode_chat(tiny_llama.tokenizer, history), cfg).text
    history += [{"role": "assistant", "content": first}, {"role": "user", "content": "and then?"}]
    second = generate(tiny_llama.model, tiny_llama.tokenizer, encode_chat(tiny_llama.tokenizer, history), cfg).text
    assert capsys.readouterr().out == f"{first}\n{second}\n"
    assert [k.get("have_state", 0) > 0 for k in opens] == [False, True]
    assert main(["client", "--server", "http://127.0.0.1:9", "--chat", "--json", "hi"]) == 2
    assert "--chat streams a conversation" in capsys.readouterr().err


def test_bench_cs_command(tiny_llama, tiny_dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import json as jsonlib

    from moaspec.cli import main
    from moaspec.drafters.checkpoint import save_drafter, target_identity
    from moaspec.drafters.independent import IndependentConfig, IndependentDrafter

    torch.manual_seed(6)
    path = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "moa", target_identity(tiny_llama))
    small = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=1))
    small.copy_target_layers(tiny_llama.model)
    independent = save_drafter(small, tmp_path / "independent", target_identity(tiny_llama))
    (tmp_path / "q.jsonl").write_text(jsonlib.dumps({"question_id": 1, "turns": ["The quick brown fox"]}) + "\n")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    args = ["bench-cs", "--questions", str(tmp_path / "q.jsonl"), "--model", str(tiny_dirs["llama"]), "--drafter", str(path),
            "--profiles", "lan,5g", "--max-new-tokens", "8", "--disconnect-after", "3", "--continue-tokens", "4",
            "--port", str(port), "--output", str(tmp_path / "out"), "--no-progress"]
    tli = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg, tli_layers=1)), tmp_path / "tli",
                       target_identity(tiny_llama))
    assert main([*args, "--methods", "moa,moa-pld,independent,api", "--independent-drafter", str(independent),
                 "--lookup", "4", "--disconnect-drafters", str(tli)]) == 0
    summary = jsonlib.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["disconnect"]["moa"]["N=1"]["perplexity"] > 1  # the N = 1 drafter, on the same server
    assert summary["setup"]["moa_tli_layers"] == 0 and summary["setup"]["moa_drafter"] == str(path)
    assert summary["disconnect"]["independent"]["chain"]["perplexity"] > 1
    assert "moa-pld" not in summary["disconnect"] and summary["setup"]["lookup"] == 4  # offline, moa-pld is moa
    for profile in ("lan", "5g"):
        for method in ("moa", "moa-pld", "independent", "api"):
            row = summary["profiles"][profile][method]
            assert row["new_tokens"] > 0 and row["tokens_per_s"] > 0 and row["bytes_per_token"] > 0
            assert row["server_calls_per_100_tokens"] > 0 and row["ttft_s"] > 0
    d = summary["disconnect"]["moa"]["N=0"]
    assert d["perplexity"] > 1 and d["per_question"][0]["verified_before_cut"] >= 3
    assert 0 <= d["repeated_4grams"] <= 1 and 0 <= d["target_greedy_repeated_4grams"] <= 1
    assert main([*args[:-3], "--methods", "moa,eagle2", "--output", str(tmp_path / "o2")]) == 2
    assert "--eagle-drafter" in capsys.readouterr().err
    assert main([*args[:-3], "--methods", "independent", "--independent-drafter", str(path), "--output", str(tmp_path / "o4")]) == 2
    assert "not a drafter of the kind independent needs" in capsys.readouterr().err
    assert main([*args[:-3], "--profiles", "3g", "--output", str(tmp_path / "o3")]) == 2
    assert main([*args[:-3], "--methods", "moa,moa-tree", "--tree-depth", "3", "--disconnect-after", "0",
                 "--output", str(tmp_path / "o7")]) == 0
    trees = jsonlib.loads((tmp_path / "o7" / "summary.json").read_text())
    assert trees["setup"]["tree"]["depth"] == 3 and trees["profiles"]["lan"]["moa-tree"]["new_tokens"] > 0
    hot = ["--temperature", "0.9", "--top-p", "0.9", "--seed", "2", "--disconnect-after", "0", "--profiles", "lan"]
    assert main([*args[:-3], "--methods", "moa,api", *hot, "--output", str(tmp_path / "o8")]) == 0
    sampled = jsonlib.loads((tmp_path / "o8" / "summary.json").read_text())
    assert sampled["setup"]["sampling"] == {"temperature": 0.9, "top_p": 0.9, "seed": 2}
    assert all(sampled["profiles"]["lan"][m]["new_tokens"] > 0 for m in ("moa", "api"))
    assert main([*args[:-3], "--temperature", "-1", "--output", str(tmp_path / "o9")]) == 2
    assert "temperature must be a finite number >= 0" in capsys.readouterr().err
    assert main([*args[:-3], "--disconnect-drafters", str(path), "--output", str(tmp_path / "o6")]) == 2
    assert "one MoA drafter per N" in capsys.readouterr().err
    assert main([*args[:-3], "--lookup", "0", "--output", str(tmp_path / "o5")]) == 2
    assert "--lookup" in capsys.readouterr().err


def test_an_interrupted_bench_cs_resumes_where_it_stopped(tiny_llama, tiny_dirs, tmp_path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import json as jsonlib

    import moaspec.clientserver.bench as bench_cs
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import save_drafter, target_identity

    torch.manual_seed(6)
    path = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "moa", target_identity(tiny_llama))
    (tmp_path / "q.jsonl").write_text("".join(jsonlib.dumps({"question_id": i, "turns": [text]}) + "\n"
                                              for i, text in enumerate(["The quick brown fox", "Once upon a time"])))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    out = tmp_path / "out"
    argv = ["bench-cs", "--questions", str(tmp_path / "q.jsonl"), "--model", str(tiny_dirs["llama"]), "--drafter", str(path),
            "--profiles", "lan", "--methods", "moa,api", "--max-new-tokens", "6", "--disconnect-after", "3",
            "--continue-tokens", "4", "--port", str(port), "--output", str(out), "--no-progress"]
    real_split, real_api, real_disconnect = bench_cs._split, bench_cs._api, bench_cs._disconnect
    calls: list[str] = []

    def count(name, real):  # type: ignore[no-untyped-def]
        return lambda *a, **k: (calls.append(name), real(*a, **k))[1]

    def interrupted(*a, **k):  # type: ignore[no-untyped-def]
        if calls.count("disconnect") == 1:  # the first question's study is done; stop in the second
            raise KeyboardInterrupt
        return count("disconnect", real_disconnect)(*a, **k)

    monkeypatch.setattr(bench_cs, "_split", count("split", real_split))
    monkeypatch.setattr(bench_cs, "_api", count("api", real_api))
    monkeypatch.setattr(bench_cs, "_disconnect", interrupted)
    assert main(argv) == 130
    journal = out / "runs.partial.jsonl"
    assert not (out / "summary.json").exists() and len(journal.read_text().splitlines()) == 4  # header, 2 questions, 1 study

    calls.clear()
    monkeypatch.setattr(bench_cs, "_disconnect", count("disconnect", real_disconnect))
    assert main(argv) == 0
    assert "resuming; 3 of 4 runs" in capsys.readouterr().err
    assert calls == ["split", "api", "disconnect"]  # the warm-up, then only the missing study
    summary = jsonlib.loads((out / "summary.json").read_text())
    assert summary["resumed_runs"] == 3 and summary["profiles"]["lan"]["moa"]["questions"] == 2
    assert len(summary["disconnect"]["moa"]["N=0"]["per_question"]) == 2 and not journal.exists()

    calls.clear()  # other settings: a journal of them is not mixed in
    journal.write_text(jsonlib.dumps({"run": {"methods": ["api"]}}) + "\n")
    assert main([*argv, "--chain", "3"]) == 0
    assert "other settings; starting afresh" in capsys.readouterr().err and calls.count("disconnect") == 2


def test_a_failed_prefill_frees_its_place(tiny_llama, drafter, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = SessionStore(tiny_llama, drafter, Limits(max_sessions=1))

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory")

    with monkeypatch.context() as m:
        m.setattr(store, "_state_of", broken)
        with pytest.raises(RuntimeError):
            store.open(PROMPT)
    assert store.open(PROMPT)["session"]  # the one place is free again


def test_serve_refuses_a_remote_drafter_that_is_not_moa(tiny_llama, tiny_dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import save_drafter, target_identity
    from moaspec.drafters.independent import IndependentConfig, IndependentDrafter

    small = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=1))
    path = save_drafter(small, tmp_path / "independent", target_identity(tiny_llama))
    assert main(["serve", "--model", str(tiny_dirs["llama"]), "--port", "0", "--no-draft", "--remote-drafter", str(path)]) == 2
    assert "not a MoA drafter" in capsys.readouterr().err


# --- bad input to the client: one clear sentence, never a traceback --------------------------

@pytest.mark.parametrize("url, why", [
    ("http://[::1", "Invalid IPv6 URL"), ("http://127.0.0.1:abc", "integer"),
    ("http://127.0.0.1:99999", "out of range"),
    ("http://127.0.0.1:0", "1..65535"), ("ftp://127.0.0.1:8000", "http or https"), ("localhost:8000", "http or https"),
    ("http://:8000", "no host"),
    ("http://127.0.0.1:8000/v1", "without /v1: http://127.0.0.1:8000"),  # the OpenAI API's base URL
    ("https://example.org/moaspec/cs/v1/", "without /cs/v1: https://example.org/moaspec"),
])
def test_a_bad_server_url_is_refused_up_front(url: str, why: str) -> None:
    from moaspec.clientserver.client import parse_server_url
    from moaspec.errors import MoaspecError

    for check in (parse_server_url, RemoteTarget):
        with pytest.raises(MoaspecError, match="not a valid http\\(s\\) URL") as info:
            check(url)
        assert why in str(info.value) and "\n" not in str(info.value)


def test_good_server_urls_give_host_and_port() -> None:
    from moaspec.clientserver.client import parse_server_url

    assert parse_server_url("http://127.0.0.1:8000/") == ("127.0.0.1", 8000)
    assert parse_server_url("https://example.org") == ("example.org", 443)
    assert parse_server_url("http://[::1]:9") == ("::1", 9)
    assert parse_server_url("https://example.org/moaspec/") == ("example.org", 443)  # behind a proxy, under a path


@pytest.mark.parametrize("info, answer", [(None, "404"), ("<html>\n<p>hello</p>\n</html>\n", "200 without JSON"),
                                          ("[]", "JSON without a fingerprint")])
def test_a_server_that_is_not_moaspec_is_named_in_one_line(tmp_path, info, answer) -> None:  # type: ignore[no-untyped-def]
    import functools
    import http.server
    import threading

    from moaspec.clientserver.client import NotAMoaspecServer

    if info is not None:
        (tmp_path / "cs" / "v1").mkdir(parents=True)
        (tmp_path / "cs" / "v1" / "info").write_text(info)

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:  # type: ignore[no-untyped-def]
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(tmp_path)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        with pytest.raises(NotAMoaspecServer) as error:
            RemoteTarget(url, retries=0).info()
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert str(error.value).startswith(f"{url}: not a moaspec server (GET /cs/v1/info answered {answer}")
    assert "\n" not in str(error.value)


def test_a_prompt_longer_than_the_context_is_refused_as_generate_refuses_it(tiny_llama, drafter, server) -> None:  # type: ignore[no-untyped-def]
    from moaspec.errors import PromptError

    context = tiny_llama.cfg.max_position_embeddings
    remote = RemoteTarget(server, KEY)
    gen = SplitGeneration(drafter, tiny_llama.tokenizer, remote, set(), max_draft=8)
    refusal = f"the prompt is {context} tokens but the model's context window is {context}: shorten it"
    with pytest.raises(PromptError, match=refusal):
        gen.run((PROMPT * context)[:context], GenerationConfig(max_new_tokens=8), context)
    assert remote.calls == 0  # refused before a session was asked for
    remote.shutdown()


@pytest.fixture(scope="module")
def client_bundle(tiny_llama, tiny_dirs, tmp_path_factory):  # type: ignore[no-untyped-def]
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import save_drafter, target_identity

    root = tmp_path_factory.mktemp("bundle")
    path = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), root / "moa", target_identity(tiny_llama))
    assert main(["export-client", "--model", str(tiny_dirs["llama"]), "--drafter", str(path), "--output",
                 str(root / "bundle")]) == 0
    return root / "bundle"


@pytest.mark.parametrize("name, damage", [
    ("bundle.json", lambda b: b"[]"), ("bundle.json", lambda b: b.replace(b'"config"', b'"konfig"')),
    ("target.safetensors", lambda b: b"garbage" * 10), ("target.safetensors", lambda b: b[: len(b) // 2]),
])
def test_a_damaged_bundle_names_its_file(client_bundle, tmp_path, name, damage) -> None:  # type: ignore[no-untyped-def]
    """Each file of a bundle that is damaged or missing is named (a missing tokenizer was taken for a hub name)."""
    import shutil

    from moaspec.clientserver.bundle import load_bundle
    from moaspec.errors import MoaspecError

    bundle = shutil.copytree(client_bundle, tmp_path / "bundle")
    (bundle / name).write_bytes(damage((bundle / name).read_bytes()))
    with pytest.raises(MoaspecError, match="is damaged .*: export the client bundle again") as error:
        load_bundle(bundle)
    assert str(error.value).startswith(str(bundle / name)) and "\n" not in str(error.value)
    shutil.rmtree(bundle / "tokenizer")
    (bundle / name).write_bytes((client_bundle / name).read_bytes())
    with pytest.raises(MoaspecError, match=f"cannot load the tokenizer: {bundle / 'tokenizer'} is missing"):
        load_bundle(bundle)


def test_a_damaged_drafter_is_not_exported_into_a_bundle(tiny_llama, tiny_dirs, tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Its weights are read before they are copied: a truncated file is named at export, not on the client device."""
    from moaspec.cli import main
    from moaspec.drafters.checkpoint import save_drafter, target_identity

    path = save_drafter(MoADrafter(MoAConfig.for_target(tiny_llama.cfg)), tmp_path / "moa", target_identity(tiny_llama))
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["export-client", "--model", str(tiny_dirs["llama"]), "--drafter", str(path), "--output",
                 str(tmp_path / "bundle")]) == 2
    assert "model.safetensors" in capsys.readouterr().err and not (tmp_path / "bundle").exists()


def test_a_tli_client_of_a_qwen3_target_with_scaled_rope_runs_from_its_bundle(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    """The bundle keeps what the client's copy of the last block needs besides its weights (the query/key norms,
    the RoPE scaling in its config): the split decoding gives the target's greedy output."""
    import json as jsonlib

    from moaspec.chat import chat_messages, encode_chat
    from moaspec.cli import main
    from moaspec.clientserver.bundle import load_bundle
    from moaspec.drafters.checkpoint import load_drafter, save_drafter, target_identity
    from moaspec.models import load_model_dir
    from test_runtime import VARIANTS
    from tiny import make_tiny_model

    family, overrides = VARIANTS["qwen3-rope-yarn"]
    model_dir = make_tiny_model(tmp_path / "qwen3", family, **overrides)
    target = load_model_dir(model_dir, device="cpu")
    torch.manual_seed(8)
    path = save_drafter(MoADrafter(MoAConfig.for_target(target.cfg, tli_layers=1)), tmp_path / "moa", target_identity(target))
    bundle = tmp_path / "bundle"
    assert main(["export-client", "--model", str(model_dir), "--drafter", str(path), "--output", str(bundle)]) == 0
    capsys.readouterr()
    client_side = load_bundle(bundle).model
    assert client_side.cfg == target.cfg
    torch.testing.assert_close(client_side.rope_cos, target.model.rope_cos)
    last = target.model.blocks[-1].state_dict()
    for name, weight in client_side.blocks[0].state_dict().items():  # the last block (in fp16), norms included
        torch.testing.assert_close(weight, last[name].half().float(), msg=name)
    assert {"attn.q_norm", "attn.k_norm"} <= set(last)
    with running(make_app(target, load_drafter(path, target))) as url:
        assert main(["client", "--server", url, "--api-key", KEY, "--bundle", str(bundle), "--max-new-tokens", "24",
                     "--json", "The quick brown fox"]) == 0
    out = jsonlib.loads(capsys.readouterr().out)
    ids = encode_chat(target.tokenizer, chat_messages("The quick brown fox"))
    assert out["text"] == generate(target.model, target.tokenizer, ids, GenerationConfig(max_new_tokens=24)).text


def test_sessions_verified_together_get_the_answers_they_get_alone(tiny_llama, drafter, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Six clients verifying at once, chains and trees, greedy and sampling: with the batcher their forwards run
    together (fewer forwards than verifications), and every answer, accepted path and state is the one the
    same client gets from a store that verifies one session at a time."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from moaspec.batching import ForwardBatcher

    model = tiny_llama.model
    run_one, run_many = model.forward, model.forward_many
    # every forward slow enough that the others line up behind it, even when the machine's threads wake late
    monkeypatch.setattr(model, "forward", lambda *args, **kwargs: time.sleep(0.02) or run_one(*args, **kwargs))
    monkeypatch.setattr(model, "forward_many", lambda calls: time.sleep(0.02) or run_many(calls))
    batcher = ForwardBatcher(model)
    together = SessionStore(tiny_llama, drafter, Limits(max_draft=8), batcher=batcher)
    alone = SessionStore(tiny_llama, drafter, Limits(max_draft=8))
    cfg = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    prompts = [token_ids(9 + 4 * k, 20 + k) for k in range(6)]
    greedy = [generate(model, tiny_llama.tokenizer, p, cfg).token_ids for p in prompts]
    lined_up = threading.Barrier(6)

    def client(store: SessionStore, k: int, wait: bool) -> list[dict]:
        sampling = SamplingParams(temperature=0.8, seed=k) if k == 5 else SamplingParams()
        a = store.open(prompts[k], "moa", "fp16", 32, sampling=sampling)
        answers, n = [a], 1  # n: answer tokens verified so far
        for _ in range(5):
            right = greedy[k][n : n + 2]  # the target's own next tokens: accepted while the session is greedy
            draft, parents = ([right[0], 7, right[1]], [0, 0, 1]) if k % 2 else ([*right, 7], None)
            if wait:
                lined_up.wait()
            answer = store.verify(a["session"], answers[-1]["verified"], draft, parents)
            n += answer["accepted"] + 1
            answers.append(answer)
        return answers

    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda k: client(together, k, True), range(6)))
    want = [client(alone, k, False) for k in range(6)]
    assert batcher.forwards == 30 and batcher.runs < 30  # every verification's forward, some run together
    for g, w in zip(got, want):
        for a, b in zip(g[1:], w[1:]):
            assert {k: a[k] for k in ("accepted", "token", "verified", "path") if k in a} == \
                   {k: b[k] for k in ("accepted", "token", "verified", "path") if k in b}
            torch.testing.assert_close(codec.decode(a["state"]), codec.decode(b["state"]), atol=2e-3, rtol=0)
    assert sum(a["accepted"] for g in got[:5] for a in g[1:]) >= 20  # the greedy sessions accepted their right drafts
    with pytest.raises(ValueError, match="cache overflow"):  # refused alone, before it could fail a batch
        full = model.new_cache(4)
        full.length = 4
        batcher.forward(Call(torch.zeros(1, 1, dtype=torch.long), full))
