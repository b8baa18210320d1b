"""The CLI end to end on tiny models, and its one-line errors for bad input."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "moaspec", *args], capture_output=True, text=True, input=stdin,
                          env=env, timeout=300)


def assert_one_line_error(proc: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("moaspec: error:")]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr


def test_generate_json(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("generate", "The quick brown", "--model", str(tiny_dirs["llama"]), "--json", "--max-new-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["prompt_tokens"] > 0 and 0 < out["new_tokens"] <= 5
    assert {"text", "finish_reason", "tokens_per_s", "total_s", "prefill_s", "target_calls"} <= out.keys()


@pytest.mark.parametrize("json_out", [True, False])
def test_a_reader_that_leaves_gets_no_traceback(tiny_dirs, json_out: bool) -> None:  # type: ignore[no-untyped-def]
    """`moaspec generate ... | head -c 1`: the output's reader is gone before it is written (stdout closed here)."""
    proc = subprocess.Popen([sys.executable, "-m", "moaspec", "generate", "The quick brown", "--model",
                             str(tiny_dirs["llama"]), "--max-new-tokens", "5", *(["--json"] if json_out else [])],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=300) == 141, err
    assert "Traceback" not in err and "Exception ignored" not in err, err


def test_generate_json_with_logprobs(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("generate", "The quick brown", "--model", str(tiny_dirs["llama"]), "--json", "--max-new-tokens", "6",
                   "--logprobs", "2", "--chain", "3")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert len(out["logprobs"]) == out["new_tokens"]
    for entry in out["logprobs"]:  # greedy: each token is the most likely of its position
        assert entry["logprob"] <= 0 and [t["bytes"] for t in entry["top_logprobs"]][0] == entry["bytes"]
        assert len(entry["top_logprobs"]) == 2
    assert "logprobs" not in json.loads(run_cli("generate", "The quick brown", "--model", str(tiny_dirs["llama"]),
                                                "--json", "--max-new-tokens", "2").stdout)


def test_generate_with_prompt_lookup_alone_matches_plain_decoding(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    common = ("--model", str(tiny_dirs["llama"]), "--max-new-tokens", "24", "--json", "--no-draft")
    plain = json.loads(run_cli("generate", "the the the", *common).stdout)
    proc = run_cli("generate", "the the the", *common, "--lookup", "6")
    assert proc.returncode == 0, proc.stderr
    lookup = json.loads(proc.stdout)
    assert lookup["text"] == plain["text"]
    assert lookup["target_calls"] <= plain["target_calls"]


def test_dtype_option_picks_the_targets_precision(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    """``--dtype`` reaches the loader (fp32 targets on a GPU make data exactly as the CPU target would);
    a value outside the choices is refused by the parser, without a traceback."""
    import torch

    from moaspec.cli import build_parser
    from moaspec.cli.options import load_target

    for name, dtype in (("auto", torch.float32), ("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        args = build_parser().parse_args(["data", "--output", "x", "--model", str(tiny_dirs["llama"]),
                                          "--device", "cpu", "--dtype", name])
        assert load_target(args).model.embed.weight.dtype == dtype
    proc = run_cli("generate", "hi", "--model", str(tiny_dirs["llama"]), "--dtype", "float64")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_drafter_dtype_option_reaches_every_drafter_load(tiny_dirs, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """``--drafter-dtype`` is carried by an environment variable, so that a server process a benchmark starts
    drafts in the same precision; a bad value of the variable is a clear error, a bad option a parser error."""
    import torch

    from moaspec.cli import build_parser
    from moaspec.cli.options import load_target
    from moaspec.drafters.checkpoint import DTYPE_VARIABLE, drafting_precision
    from moaspec.errors import MoaspecError
    from moaspec.models.block_kernel import kernel
    from moaspec.models.packed_linear import bf16_kernels, int8_kernels

    monkeypatch.setenv(DTYPE_VARIABLE, "auto")  # restored after the test, whatever load_target sets
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        args = build_parser().parse_args(["generate", "hi", "--model", str(tiny_dirs["llama"]), "--drafter-dtype", name])
        loaded = load_target(args)
        assert os.environ[DTYPE_VARIABLE] == name and drafting_precision(loaded) == (dtype, False)
        assert loaded.model.dtype == torch.float32  # the target keeps its own
    args = build_parser().parse_args(["generate", "hi", "--model", str(tiny_dirs["llama"]), "--drafter-dtype", "int8"])
    # 8-bit weights take bf16 activations where the CPU has bf16 kernels or no block kernel, fp32 ones with the
    # block kernel (named_precision's documented rule)
    aten = bf16_kernels() or kernel() is None
    assert drafting_precision(load_target(args)) == ((torch.bfloat16, int8_kernels()) if aten else (torch.float32, True))
    monkeypatch.setenv(DTYPE_VARIABLE, "float64")
    with pytest.raises(MoaspecError, match="MOASPEC_DRAFTER_DTYPE='float64'"):
        drafting_precision(loaded)
    proc = run_cli("generate", "hi", "--model", str(tiny_dirs["llama"]), "--drafter-dtype", "int4")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_streams_and_matches_json(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    common = ("--model", str(tiny_dirs["qwen2"]), "--max-new-tokens", "12", "--temperature", "0.7", "--seed", "3")
    streamed = run_cli("generate", "hello", *common)
    as_json = run_cli("generate", "hello", *common, "--json")
    assert streamed.returncode == 0 and as_json.returncode == 0
    assert streamed.stdout == json.loads(as_json.stdout)["text"] + "\n"


def test_messages_file_and_stdin(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    msgs = tmp_path / "conv.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                                {"role": "user", "content": "again"}]))
    proc = run_cli("generate", "--messages", str(msgs), "--model", str(tiny_dirs["llama"]), "--json", "--max-new-tokens", "3")
    assert proc.returncode == 0, proc.stderr
    proc = run_cli("generate", "-", "--model", str(tiny_dirs["llama"]), "--json", "--max-new-tokens", "3", stdin="from stdin")
    assert proc.returncode == 0, proc.stderr


def test_empty_prompt(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    assert_one_line_error(run_cli("generate", "  ", "--model", str(tiny_dirs["llama"])), "prompt is empty")
    assert_one_line_error(run_cli("generate", "--model", str(tiny_dirs["llama"])), "prompt is empty")


def test_prompt_over_context(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("generate", "the quick brown fox " * 200, "--model", str(tiny_dirs["llama"]))
    assert_one_line_error(proc, "context window")


def test_a_full_context_window_is_said(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    """Generation that stops because the context is full says so: finish_reason "length" before max_new_tokens in
    --json, a note on stderr when streaming."""
    args = ("generate", "--raw", "fox " * 100, "--max-new-tokens", "250", "--no-draft", "--model", str(tiny_dirs["llama"]))
    out = json.loads(run_cli(*args, "--json").stdout)
    assert out["finish_reason"] == "length" and 0 < out["new_tokens"] < 250
    proc = run_cli(*args)
    assert proc.returncode == 0 and f"stopped after {out['new_tokens']} tokens: the model's context window" in proc.stderr


def test_missing_model_path() -> None:
    assert_one_line_error(run_cli("generate", "hi", "--model", "/no/such/model"), "does not exist")


@pytest.mark.parametrize("content,fragment", [(b"", "not a GGUF file"), (b"hello, world", "not a GGUF file"),
                                              (b"GGUF\x03\x00\x00\x00", "truncated GGUF file (8 bytes)")])
def test_a_file_that_is_not_gguf_is_named_before_converting(tmp_path: Path, content: bytes, fragment: str) -> None:
    bad = tmp_path / "m.gguf"
    bad.write_bytes(content)
    proc = run_cli("generate", "hi", "--model", str(bad), "--max-new-tokens", "2")
    assert_one_line_error(proc, fragment)
    assert "converting" not in proc.stderr


def test_unsupported_architecture(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    assert_one_line_error(run_cli("generate", "hi", "--model", str(tmp_path)), "unsupported architecture 'gpt2'")


def test_directory_without_config(tmp_path: Path) -> None:
    assert_one_line_error(run_cli("generate", "hi", "--model", str(tmp_path)), "config.json is missing")


@pytest.mark.parametrize("damage", ["no-weights", "corrupt-weights", "no-tokenizer", "bad-json"])
def test_damaged_model_directory(tiny_dirs, tmp_path: Path, damage: str) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"], bad)
    if damage == "no-weights":
        (bad / "model.safetensors").unlink()
        fragment = "no *.safetensors"
    elif damage == "corrupt-weights":
        (bad / "model.safetensors").write_bytes(b"\x00garbage" * 10)
        fragment = "cannot read weights"
    elif damage == "no-tokenizer":
        for f in bad.glob("tokenizer*"):
            f.unlink()
        fragment = "tokenizer"
    else:
        (bad / "config.json").write_text("{not json")
        fragment = "not valid JSON"
    assert_one_line_error(run_cli("generate", "hi", "--model", str(bad)), fragment)


@pytest.mark.parametrize("change,fragment", [
    ({"num_hidden_layers": "thirty"}, "'num_hidden_layers' must be a whole number >= 1, got 'thirty'"),
    ({"num_hidden_layers": 2.5}, "'num_hidden_layers' must be a whole number"),
    ({"num_hidden_layers": -3}, "'num_hidden_layers' must be a whole number >= 1, got -3"),
    ({"vocab_size": "big"}, "'vocab_size' must be a whole number"),
    ({"max_position_embeddings": 0}, "'max_position_embeddings' must be a whole number >= 1, got 0"),
    ({"rms_norm_eps": "tiny"}, "'rms_norm_eps' must be a number above 0"),
    ({"rope_parameters": "x"}, "'rope_parameters' (or 'rope_scaling') must be an object"),
    ({"eos_token_id": "x"}, "'eos_token_id' must be a whole number >= 0"),
    ({"num_key_value_heads": 3}, "must be a multiple of 'num_key_value_heads' (3)"),
    (None, "must hold a JSON object, not list"),
])
def test_a_config_with_a_field_of_the_wrong_kind_is_named(tiny_dirs, tmp_path: Path, change, fragment) -> None:  # type: ignore[no-untyped-def]
    """A hand-edited or foreign config.json names the field it cannot use instead of failing deep in the runtime."""
    from moaspec.errors import ModelLoadError
    from moaspec.models.config import ModelConfig

    bad = tmp_path / "m"
    bad.mkdir()
    raw = json.loads((tiny_dirs["llama"] / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps([raw] if change is None else {**raw, **change}))
    with pytest.raises(ModelLoadError) as err:
        ModelConfig.from_model_dir(bad)
    assert fragment in str(err.value) and str(bad / "config.json") in str(err.value)


def test_a_config_with_fewer_layers_than_the_weights_is_refused(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Loading the first layers of a model and dropping the rest wrote garbage without a word."""
    bad = tmp_path / "m"
    shutil.copytree(tiny_dirs["llama"], bad)
    raw = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": raw["num_hidden_layers"] - 1}))
    assert_one_line_error(run_cli("generate", "hi", "--model", str(bad), "--no-draft"),
                          f"the weights hold {raw['num_hidden_layers']} layers and the config {raw['num_hidden_layers'] - 1}")


@pytest.mark.parametrize("opts,fragment", [(["--temperature", "-1"], "temperature"), (["--top-p", "2"], "top_p"),
                                           (["--max-new-tokens", "0"], "max_new_tokens"), (["--lookup", "-2"], "--lookup"),
                                           (["--logprobs", "2"], "--json"), (["--json", "--logprobs", "21"], "logprobs"),
                                           (["--presence-penalty", "3"], "presence_penalty")])
def test_bad_options(tiny_dirs, opts, fragment) -> None:  # type: ignore[no-untyped-def]
    assert_one_line_error(run_cli("generate", "hi", "--model", str(tiny_dirs["llama"]), *opts), fragment)


def test_bad_messages_file(tmp_path: Path) -> None:
    f = tmp_path / "m.json"
    f.write_text("{oops")
    assert_one_line_error(run_cli("generate", "--messages", str(f)), "not valid JSON")
    assert_one_line_error(run_cli("generate", "--messages", str(tmp_path / "none.json")), "cannot read")


@pytest.mark.parametrize("opts,fragment", [(["--examples", "0"], "--examples"), (["--multi-turn", "2"], "--multi-turn"),
                                           (["--pasted-fraction", "1.5"], "--pasted-fraction"),
                                           (["--prompts", "/nonexistent/p.jsonl"], "does not exist"),
                                           (["--passages", "/nonexistent/docs"], "do not exist"),
                                           (["--part", "1/2"], "give one of them"),
                                           (["--prompts", "/nonexistent/p.jsonl", "--part", "3/2"], "K/N")])
def test_data_bad_options(tiny_dirs, tmp_path: Path, opts, fragment) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("data", "--output", str(tmp_path / "d"), "--model", str(tiny_dirs["llama"]), *opts)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "d").exists()


def test_data_from_your_own_prompts_ends_when_they_are_used_up(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Tell me about {k}.", "Why?"]}) + "\n" for k in range(5))
                       + json.dumps({"turns": ["word " * 400]}) + "\n")  # beyond the tiny model's 256 positions
    proc = run_cli("data", "--output", str(tmp_path / "d"), "--model", str(tiny_dirs["llama"]), "--no-progress",
                   "--prompts", str(prompts), "--pasted-fraction", "0", "--max-answer-tokens", "8", "--shard-size", "4")
    assert proc.returncode == 0, proc.stderr
    assert "10 assistant turns" in proc.stdout and "all 5 conversations of" in proc.stdout and "that fit" in proc.stdout
    assert "1 of the 6 conversations of" in proc.stderr and "were skipped" in proc.stderr  # not a silent drop


def test_data_from_a_model_that_writes_no_prompts_ends_with_an_error(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("data", "--output", str(tmp_path / "d"), "--model", str(tiny_dirs["llama"]), "--no-progress",
                   "--max-query-tokens", "1", "--shard-size", "32", "--batch-size", "32")
    assert_one_line_error(proc, "raise --max-query-tokens")


@pytest.mark.parametrize("opts,fragment", [(["--lsa-width", "100"], "--lsa-width"), (["--tli-layers", "99"], "--tli-layers"),
                                           (["--draft-vocab", "1000000000"], "at most the target's vocabulary"),
                                           (["--kind", "eagle", "--lsa-width", "128"], "MoA drafters only"),
                                           (["--no-lsa", "--derotate-keys"], "which --no-lsa removes"),
                                           (["--segment-long-fraction", "0.2"], "--segment-long-max > --segment-max"),
                                           (["--segment-long-fraction", "1.5", "--segment-long-max", "40"], "[0, 1)")])
def test_train_bad_options(tiny_dirs, tmp_path: Path, opts, fragment) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("train", "--data", str(tmp_path / "data"), "--output", str(tmp_path / "run"),
                   "--model", str(tiny_dirs["llama"]), *opts)
    assert_one_line_error(proc, fragment)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("opts,fragment", [(["generate", "hi", "--threads", "-1"], "not a whole number >= 1"),
                                           (["generate", "hi", "--threads", "0"], "not a whole number >= 1"),
                                           (["generate", "hi", "--draft-confidence", "1"], "not a probability"),
                                           (["train", "--data", "d", "--output", "o", "--lsa-width", "wide"],
                                            "neither a whole number nor 'full'")])
def test_options_checked_by_the_parser(tiny_dirs, capsys, opts, fragment) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*opts, "--model", str(tiny_dirs["llama"])])
    assert exit_.value.code == 2 and fragment in capsys.readouterr().err


@pytest.mark.parametrize("device,fragment", [("bogus", "not a torch device"), ("cuda", "no usable CUDA GPU"),
                                             ("meta", "runs on cpu or cuda")])
def test_an_unusable_device_is_refused(tiny_dirs, capsys, device, fragment) -> None:  # type: ignore[no-untyped-def]
    import torch

    from moaspec.cli import main

    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["generate", "hi", "--model", str(tiny_dirs["llama"]), "--device", device]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.parametrize("content,fragment", [
    ('{"turns": "Say hi."}\n', "must be a list of strings"),
    ('{"turns": ["Hi", 5]}\n', "must be a list of strings, got a list holding int"),
    ('{"turns": ["  "]}\n', "an empty one"),
    ("", "no questions"),
    (b"\xff\xfe\x00garbage", "UTF-8"),
    ('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2, "turns": ["b"]}\n{"question_id": 1, "turns": ["c"]}\n',
     "q.jsonl:3 repeats question_id 1 of line 1"),  # results are kept per id: the second would count as the first
])
def test_bad_question_files(tmp_path: Path, content, fragment) -> None:  # type: ignore[no-untyped-def]
    from moaspec.errors import MoaspecError
    from moaspec.specbench import load_questions

    f = tmp_path / "q.jsonl"
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(MoaspecError, match=fragment):
        load_questions(f)


def test_questions_per_file_after_skipping(tmp_path: Path) -> None:
    """``skip`` then ``per_file`` select the same slice of every file: the second ten measure what the first did not."""
    from moaspec.errors import MoaspecError
    from moaspec.specbench import load_questions

    for name in ("a", "b"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"question_id": i, "turns": [f"{name}{i}?"]}) + "\n"
                                                        for i in range(5)))
    picked = load_questions(tmp_path, per_file=2, skip=2)
    assert [(q.category, q.question_id) for q in picked] == [("a", "2"), ("a", "3"), ("b", "2"), ("b", "3")]
    assert [q.question_id for q in load_questions(tmp_path, skip=4)] == ["4", "4"]
    with pytest.raises(MoaspecError, match="no questions"):
        load_questions(tmp_path, skip=5)
    with pytest.raises(MoaspecError, match="negative"):
        load_questions(tmp_path, skip=-1)


def test_bench_refuses_bad_questions_and_outputs_before_measuring(tiny_dirs, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main

    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"question_id": 7, "turns": ["word " * 400]}) + "\n")  # beyond the tiny model's 256 positions
    base = ["--questions", str(q), "--model", str(tiny_dirs["llama"]), "--methods", "vanilla", "--max-new-tokens", "2"]
    assert main(["bench", *base, "--output", str(tmp_path / "b")]) == 2
    assert "question 7 of q: the prompt is" in capsys.readouterr().err
    plain = tmp_path / "plain.txt"
    plain.write_text("mine")
    for command in ("bench", "bench-cs", "data", "train"):
        argv = {"bench": ["bench", *base], "bench-cs": ["bench-cs", *base], "data": ["data"],
                "train": ["train", "--data", str(tmp_path)]}[command]
        assert main([*argv, "--output", str(plain)]) == 2
        assert "is a file" in capsys.readouterr().err and plain.read_text() == "mine"
    assert main(["bench-cs", *base[:-4], "--methods", ",", "--output", str(tmp_path / "c")]) == 2
    assert "distinct methods" in capsys.readouterr().err
    assert main(["bench-cs", *base[:-4], "--methods", "moa,moa", "--output", str(tmp_path / "c")]) == 2
    import socket

    with socket.socket() as taken:  # the port its server would take: refused before anything is loaded or written
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        capsys.readouterr()
        assert main(["bench-cs", *base[:-4], "--port", str(port), "--output", str(tmp_path / "c")]) == 2
        assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_outputs_that_cannot_be_made_or_hold_other_files_are_refused_before_any_work(tiny_dirs, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                                    capsys) -> None:
    """An --output under a file, or where nothing may be created, is one line before the model loads; `data`,
    `train`, `bench`, `bench-cs` and `tune` do not write into a directory of other files (one they wrote, they resume)."""
    from moaspec.cli import main

    plain = tmp_path / "plain.txt"
    plain.write_text("mine")
    locked = tmp_path / "locked"
    locked.mkdir()
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"turns": ["Hello"]}) + "\n")
    model = ["--model", str(tiny_dirs["llama"])]
    argvs = {"bench": ["bench", "--questions", str(q), "--methods", "vanilla", *model],
             "bench-cs": ["bench-cs", "--questions", str(q), *model], "data": ["data", *model],
             "train": ["train", "--data", str(tmp_path), *model], "export-client": ["export-client", *model],
             "tune": ["tune", "--questions", str(q), *model]}
    for argv in argvs.values():
        assert main([*argv, "--output", str(plain / "sub")]) == 2
        assert f"cannot create --output {plain / 'sub'}: {plain} is a file" in capsys.readouterr().err
        assert main([*argv, "--output", str(plain)]) == 2
        assert f"--output {plain} is a file" in capsys.readouterr().err
        if os.geteuid() != 0:  # root writes anywhere
            locked.chmod(0o500)
            assert main([*argv, "--output", str(locked / "new")]) == 2
            assert "cannot create --output" in capsys.readouterr().err
            locked.chmod(0o700)
    assert list(tmp_path.rglob(".moaspec-probe*")) == []
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    for command in ("data", "train", "bench", "bench-cs", "tune"):
        assert main([*argvs[command], "--output", str(theirs)]) == 2
        assert "holds files this command did not write (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in theirs.iterdir()) == ["notes.txt"]


@pytest.mark.parametrize("argv,fragment", [
    (["train", "--data", "d", "--output", "o", "--lr", "nan"], "--lr must be a finite number > 0, got nan"),
    (["train", "--data", "d", "--output", "o", "--lr", "inf"], "--lr must be a finite number > 0, got inf"),
    (["train", "--data", "d", "--output", "o", "--val-fraction", "1"], "--val-fraction must be in (0, 1), got 1"),
    (["train", "--data", "d", "--output", "o", "--kl-weight", "-1"], "--kl-weight must be a finite number >= 0, got -1"),
    (["train", "--data", "d", "--output", "o", "--feature-weight", "nan"], "--feature-weight must be a finite number >= 0"),
    (["train", "--data", "d", "--output", "o", "--kl-weight", "0", "--feature-weight", "0"], "cannot both be 0"),
    (["client", "--server", "http://127.0.0.1:9", "--timeout", "nan", "hi"], "--timeout must be a finite number > 0"),
    (["client", "--server", "http://127.0.0.1:9", "--retries", "-1", "hi"], "--retries must be >= 0, got -1"),
    (["bench", "--questions", "q", "--output", "o", "--limit", "0"], "--limit must be >= 1, got 0"),
    (["serve", "--session-ttl", "nan"], "--session-ttl must be a finite number > 0"),
    (["serve", "--api-key", ""], "--api-key is empty (an unset shell variable?)"),
    (["generate", "hi", "--tree", "--chain", "3"], "--chain and --tree are two ways to draft"),
    (["generate", "hi", "--stop", ""], "a stop string must not be empty"),
    (["generate", "hi", "--raw", "--system", "Be brief."], "give the system message or raw, not both"),
    (["serve", "--api-key", "  "], "--api-key is empty"),
    (["generate", "hi", "--temperature", "inf"], "temperature must be a finite number >= 0"),
])
def test_a_bad_option_is_named_with_its_value(tiny_dirs, tmp_path: Path, capsys, monkeypatch, argv, fragment) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main

    monkeypatch.chdir(tmp_path)
    assert main([*argv, "--model", str(tiny_dirs["llama"])]) == 2
    assert fragment in capsys.readouterr().err


def test_serving_every_interface_without_a_key_is_warned_about(tiny_dirs, monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A server open to the network with no key serves anyone: it says so; on loopback, or with a key, it does not."""
    import moaspec.serving
    from moaspec.cli import main

    monkeypatch.setattr(moaspec.serving, "run_server", lambda app, sock, **kw: sock.close())
    monkeypatch.delenv("MOASPEC_API_KEY", raising=False)
    serve = ["serve", "--model", str(tiny_dirs["llama"]), "--no-draft", "--port", "0", "--threads", "1"]
    for extra, warned in ((["--host", "0.0.0.0"], True), (["--host", "0.0.0.0", "--api-key", "k"], False), ([], False)):
        assert main([*serve, *extra]) == 0
        assert ("serving on 0.0.0.0 without a key" in capsys.readouterr().err) == warned


def test_more_threads_than_cores_are_warned_about(tiny_dirs, capsys) -> None:  # type: ignore[no-untyped-def]
    """1000 threads on 2 cores ran 8x slower without a word."""
    from moaspec.cli import main

    cores = len(os.sched_getaffinity(0))
    args = ["generate", "hi", "--model", str(tiny_dirs["llama"]), "--no-draft", "--max-new-tokens", "1"]
    assert main([*args, "--threads", str(cores + 1)]) == 0
    assert f"--threads {cores + 1} is more than the {cores} cores" in capsys.readouterr().err
    assert main([*args, "--threads", str(cores)]) == 0
    assert "more than the" not in capsys.readouterr().err


def test_an_option_a_command_does_not_take_is_reported_with_that_commands_usage(capsys) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main

    for command in (["generate", "hi"], ["client", "--server", "http://127.0.0.1:9", "hi"]):
        with pytest.raises(SystemExit) as exit_:
            main([*command, "--bogus"])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"moaspec {command[0]}: error: unrecognized arguments: --bogus" in err
        assert f"usage: moaspec {command[0]} " in err


def test_text_that_is_not_utf8_is_refused(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Bytes that are not UTF-8 on the command line, on stdin or in a --messages file: one line, no traceback."""
    model = ["--model", str(tiny_dirs["llama"]), "--max-new-tokens", "2"]
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    for extra, stdin in (([os.fsdecode(b"caf\xe9")], b""), (["-"], b"caf\xe9 au lait")):
        proc = subprocess.run([sys.executable, "-m", "moaspec", "generate", *extra, *model], input=stdin,
                              capture_output=True, env=env, timeout=300)
        err = proc.stderr.decode()
        assert proc.returncode == 2 and "Traceback" not in err and "the prompt is not valid UTF-8" in err, err
    messages = tmp_path / "m.json"
    messages.write_bytes(b"\xff\xfe[")
    assert_one_line_error(run_cli("generate", "--messages", str(messages), *model), "is not UTF-8 text")


def test_bench_cs_stops_a_server_that_did_not_start(tiny_dirs, tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The server child must not outlive the failure (it used to keep running, holding the port). The port is taken
    after bench-cs's own check (here: the check is skipped), so that the child is the one to find it taken."""
    import socket

    import moaspec.serving
    from moaspec.cli import main

    monkeypatch.setattr(moaspec.serving, "listen", lambda host, port: socket.socket())
    from moaspec.drafters.checkpoint import save_drafter, target_identity
    from moaspec.drafters.moa import MoAConfig, MoADrafter
    from moaspec.models import load_model_dir

    target = load_model_dir(tiny_dirs["llama"], device="cpu")
    drafter = save_drafter(MoADrafter(MoAConfig.for_target(target.cfg)), tmp_path / "moa", target_identity(target))
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"turns": ["Hello"]}) + "\n")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["bench-cs", "--questions", str(q), "--model", str(tiny_dirs["llama"]), "--drafter", str(drafter),
                     "--methods", "api", "--profiles", "none", "--disconnect-after", "0", "--max-new-tokens", "2",
                     "--port", str(port), "--output", str(tmp_path / "o"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"did not start on port {port}" in err and "error: moaspec: error" not in err
    assert main(["bench-cs", "--questions", str(q), "--port", "70000", "--output", str(tmp_path / "o")]) == 2


def test_an_oversized_tree_is_refused() -> None:
    from moaspec.decoding.tree import TreeShape
    from moaspec.errors import MoaspecError

    for shape in ({"depth": 1000}, {"top_k": 33}, {"total": 100_000}):
        with pytest.raises(MoaspecError, match="a draft tree may have"):
            TreeShape(**shape)


@pytest.mark.parametrize(("code", "says"), [(errno.ENOSPC, "free some space and run the command again"),
                                            (errno.EROFS, "the file system is read-only")])
def test_a_full_or_read_only_disk_is_one_line_not_a_traceback(monkeypatch, capsys, code: int, says: str) -> None:  # type: ignore[no-untyped-def]
    """What the machine refuses mid-run (every write is atomic, so nothing half-written stays) is named with the
    file and what to do; other OS errors are bugs and keep their traceback."""
    from moaspec import cli

    def refuse(args):  # type: ignore[no-untyped-def]
        raise OSError(code, os.strerror(code), "/data/run/train_log.csv")

    monkeypatch.setitem(cli.COMMANDS, "generate", refuse)
    assert cli.main(["generate", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("moaspec: error: ") and "/data/run/train_log.csv" in err and says in err and "\n" not in err

    def reset(args):  # type: ignore[no-untyped-def]
        raise OSError(errno.ECONNRESET, "reset")

    monkeypatch.setitem(cli.COMMANDS, "generate", reset)
    with pytest.raises(OSError):
        cli.main(["generate", "hi"])


def test_a_safetensors_write_the_disk_refuses_is_one_line(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """safetensors reports a refused write as its own error, with the OS error in its text: a full disk or a file
    too large for the file system is named as any other refused write; its other errors stay tracebacks."""
    from safetensors import SafetensorError

    from moaspec import cli

    for text, raised in (("Error while serializing: I/O error: File too large (os error 27)", False),
                         ("Error while serializing: I/O error: No space left on device (os error 28)", False),
                         ("Error while deserializing header: HeaderTooLarge", True)):
        def refuse(args, text=text):  # type: ignore[no-untyped-def]
            raise SafetensorError(text)

        monkeypatch.setitem(cli.COMMANDS, "generate", refuse)
        if raised:
            with pytest.raises(SafetensorError):
                cli.main(["generate", "hi"])
            continue
        assert cli.main(["generate", "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("moaspec: error: writing a safetensors file failed") and "\n" not in err
        assert ("ulimit -f" in err) if "27" in text else ("free some space" in err)


def test_a_long_prompt_is_read_under_a_progress_bar_on_a_terminal_only(monkeypatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """The bar follows the prefill chunk by chunk and is gone when the answer starts; off a terminal (pipes,
    logs, --json) and for short prompts there is none."""
    from moaspec.cli import generate

    class Terminal:
        def __init__(self) -> None:
            self.text = ""

        def isatty(self) -> bool:
            return True

        def write(self, text: str) -> None:
            self.text += text

        def flush(self) -> None:
            pass

    assert generate._prefill_bar(10_000) is None  # stderr is pytest's capture here, not a terminal
    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    assert generate._prefill_bar(generate.PREFILL_BAR_TOKENS - 1) is None
    update = generate._prefill_bar(3000)
    assert update is not None
    update(2048, 3000)
    assert "reading the prompt" in term.text and "2048/3000" in term.text
    update(3000, 3000)
    assert term.text.endswith("\r") and term.text.rstrip("\r").split("\r")[-1].strip() == ""  # then cleared


def test_generate_chat_holds_a_conversation(tiny_dirs, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``--chat`` answers a prompt, then each line of stdin as the next turn of one conversation (each answer the one
    generate gives for the whole conversation), starts over at /reset, and ends at the end of input."""
    common = ("--model", str(tiny_dirs["llama"]), "--max-new-tokens", "6")
    proc = run_cli("generate", "hi", "--chat", *common, stdin="again\n\n/rest\n/reset\nhi\n")
    assert proc.returncode == 0, proc.stderr
    first = json.loads(run_cli("generate", "hi", *common, "--json").stdout)["text"]
    msgs = tmp_path / "conv.json"
    msgs.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "assistant", "content": first},
                                {"role": "user", "content": "again"}]))
    second = json.loads(run_cli("generate", "--messages", str(msgs), *common, "--json").stdout)["text"]
    assert proc.stdout == f"{first}\n{second}\n{first}\n"  # the blank line is no turn, nor is a mistyped command
    assert "(no command /rest: /reset starts over" in proc.stderr
    assert_one_line_error(run_cli("generate", "hi", "--chat", "--json", *common), "--chat")


def test_generate_chat_survives_a_message_too_long_for_the_context(tiny_dirs) -> None:  # type: ignore[no-untyped-def]
    proc = run_cli("generate", "--chat", "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "4",
                   stdin="word " * 5000 + "\nhi\n/exit\nnever read\n")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    hi = json.loads(run_cli("generate", "hi", "--model", str(tiny_dirs["llama"]), "--max-new-tokens", "4", "--json").stdout)
    assert "/reset starts a new conversation" in proc.stderr and proc.stdout == hi["text"] + "\n"
