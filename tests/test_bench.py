"""`moaspec bench` on a tiny model: every method answers every turn, the summary has what the issue asks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from moaspec.cli import main
from moaspec.drafters.checkpoint import save_drafter, target_identity
from moaspec.drafters.eagle import EagleConfig, EagleDrafter
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.drafters.moa import MoAConfig, MoADrafter


@pytest.fixture()
def setup(tiny_llama, tmp_path: Path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    qdir = tmp_path / "questions"
    qdir.mkdir()
    (qdir / "mt_bench.jsonl").write_text(
        json.dumps({"question_id": 1, "category": "writing", "turns": ["Write a line.", "Now shorter."]}) + "\n")
    (qdir / "qa.jsonl").write_text("".join(json.dumps({"question_id": i, "turns": [f"What is {i}?"]}) + "\n" for i in range(3)))
    torch.manual_seed(0)
    moa = MoADrafter(MoAConfig.for_target(tiny_llama.cfg))
    eagle = EagleDrafter(EagleConfig.for_target(tiny_llama.cfg))
    independent = IndependentDrafter(IndependentConfig.for_target(tiny_llama.cfg, layers=2))
    independent.copy_target_layers(tiny_llama.model)
    return {
        "questions": qdir,
        "moa": save_drafter(moa, tmp_path / "moa", target_identity(tiny_llama)),
        "eagle": save_drafter(eagle, tmp_path / "eagle", target_identity(tiny_llama)),
        "independent": save_drafter(independent, tmp_path / "independent", target_identity(tiny_llama)),
    }


ALL = ("vanilla", "default", "moa", "moa-cost", "moa-chain", "moa-pld", "moa-chain-pld", "pld", "eagle2", "independent", "hf", "hf-pld", "hf-assisted")


def test_bench_writes_summary_answers_and_plots(tiny_dirs, setup, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "bench"
    rc = main(["bench", "--model", str(tiny_dirs["llama"]), "--questions", str(setup["questions"]),
               "--methods", ",".join(ALL), "--max-new-tokens", "12", "--limit", "2",
               "--output", str(out), "--drafter", str(setup["moa"]), "--eagle-drafter", str(setup["eagle"]),
               "--independent-drafter", str(setup["independent"]), "--no-progress"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    # what the figures were measured on: the resolved dtypes and device, not "auto"
    assert summary["settings"]["target_dtype"] == "float32" and summary["settings"]["target_device"] == "cpu"
    assert summary["settings"]["target_products"] == "dense"  # a model directory: no GGUF blocks
    assert summary["settings"]["drafter_dtype"] in ("float32", "bfloat16", "int8")
    res = summary["results"]
    assert set(res) == set(ALL)
    for m, per in res.items():
        assert set(per) == {"mt_bench", "qa", "overall"}
        o = per["overall"]
        assert set(o) >= {"tokens_per_s", "speedup", "tau", "target_calls", "new_tokens", "wall_s", "greedy_mismatches"}
        assert o["greedy_mismatches"] == 0, m  # every method is greedy-lossless, transformers' included
        assert o["prompts"] == 3 and o["new_tokens"] > 0
        assert o["verify_ms_per_call"] > 0
        # only this project's drafters are timed apart from the target (transformers' assistant is not); the
        # methods by cost draft or not as this host's costs say
        if m not in ("default", "moa-cost"):
            assert (o["draft_ms_per_call"] > 0) == (m in ("moa", "moa-chain", "moa-pld", "moa-chain-pld", "pld", "eagle2", "independent")), m
    assert res["vanilla"]["overall"]["speedup"] == 1.0
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert len(rows) == 3 * len(ALL)
    assert all(len(r["turns"]) == (2 if r["category"] == "mt_bench" else 1) for r in rows)
    assert (out / "speedup.png").stat().st_size > 0 and (out / "accepted_lengths.png").stat().st_size > 0
    assert "moa-chain" in capsys.readouterr().out


def test_an_interrupted_bench_resumes_where_it_stopped(tiny_dirs, setup, tmp_path: Path, capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import moaspec.bench.run as bench_run

    out = tmp_path / "bench"
    argv = ["bench", "--model", str(tiny_dirs["llama"]), "--questions", str(setup["questions"]), "--methods", "vanilla,moa",
            "--max-new-tokens", "8", "--limit", "2", "--output", str(out), "--drafter", str(setup["moa"]), "--no-progress"]
    real = bench_run.answer_question
    calls: list[str] = []

    def interrupted(target, method, q, max_new):  # type: ignore[no-untyped-def]
        if len(calls) == 2:  # both methods answered the first question; stop in the second
            raise KeyboardInterrupt
        calls.append(str(q.question_id))
        return real(target, method, q, max_new)

    monkeypatch.setattr(bench_run, "answer_question", interrupted)
    assert main(argv) == 130
    journal = out / "answers.partial.jsonl"
    assert not (out / "summary.json").exists() and len(journal.read_text().splitlines()) == 2  # header + one question
    with journal.open("a") as f:
        f.write('{"key": "1", "value": [{"meth')  # a line torn by the interruption
    first = [json.loads(line) for line in journal.read_text().splitlines()[1:2]][0]["value"]

    calls.clear()
    monkeypatch.setattr(bench_run, "answer_question", lambda *a: (calls.append(str(a[2].question_id)), real(*a))[1])
    assert main(argv) == 0
    assert "resuming; 1 of 3 questions already done" in capsys.readouterr().err
    assert len(calls) == 4  # only the two questions still missing, by both methods
    summary = json.loads((out / "summary.json").read_text())
    assert summary["resumed_questions"] == 1 and summary["results"]["moa"]["overall"]["prompts"] == 3
    assert summary["results"]["moa"]["overall"]["greedy_mismatches"] == 0
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    assert rows[:2] == first and len(rows) == 6
    assert not journal.exists()

    # a journal left by a run with other options is not mixed in
    (out / "answers.partial.jsonl").write_text(json.dumps({"run": {"methods": ["vanilla"]}}) + "\n")
    calls.clear()
    assert main(argv) == 0
    assert "other settings; starting afresh" in capsys.readouterr().err and len(calls) == 6


@pytest.mark.parametrize("argv, message", [
    (["--methods", "vanilla,warp"], "unknown method"),
    (["--methods", "vanilla,vanilla"], "distinct"),
    (["--methods", "eagle2"], "needs --eagle-drafter"),
    (["--methods", "hf-assisted"], "needs --independent-drafter"),
    (["--limit", "0"], ">= 1"),
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--temperature", "0.7", "--top-p", "0"], "top_p must be in (0, 1]"),
])
def test_bench_rejects_bad_options(tiny_dirs, setup, tmp_path: Path, capsys, argv, message) -> None:  # type: ignore[no-untyped-def]
    rc = main(["bench", "--model", str(tiny_dirs["llama"]), "--questions", str(setup["questions"]),
               "--output", str(tmp_path / "b"), *argv])
    assert rc == 2 and message in capsys.readouterr().err


def _answers(out: Path) -> dict[tuple[str, str, int], list[list[int]]]:
    rows = [json.loads(line) for line in (out / "answers.jsonl").read_text().splitlines()]
    return {(r["method"], r["category"], r["question_id"]): [t["token_ids"] for t in r["turns"]] for r in rows}


def test_bench_samples_every_method_reproducibly(tiny_dirs, setup, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    def run(out: Path, *sampling: str) -> dict:  # type: ignore[type-arg]
        assert main(["bench", "--model", str(tiny_dirs["llama"]), "--questions", str(setup["questions"]),
                     "--methods", ",".join(ALL), "--max-new-tokens", "10", "--limit", "2", "--output", str(out),
                     "--drafter", str(setup["moa"]), "--eagle-drafter", str(setup["eagle"]),
                     "--independent-drafter", str(setup["independent"]), "--no-progress", *sampling]) == 0
        return json.loads((out / "summary.json").read_text())

    greedy = run(tmp_path / "greedy")
    sampled = run(tmp_path / "t1", "--temperature", "1.0", "--top-k", "40", "--seed", "5")
    run(tmp_path / "t2", "--temperature", "1.0", "--top-k", "40", "--seed", "5")
    assert greedy["greedy"] and not sampled["greedy"]
    for m in ALL:
        o = sampled["results"][m]["overall"]
        assert o["greedy_mismatches"] is None and o["new_tokens"] > 0 and o["tau"] >= 1.0, m
    a, b, g = _answers(tmp_path / "t1"), _answers(tmp_path / "t2"), _answers(tmp_path / "greedy")
    assert a == b  # the same seed repeats every answer, transformers' included
    for m in ALL:  # and every method really sampled: its answers are not the greedy ones
        assert any(a[k] != g[k] for k in a if k[0] == m), m


def test_prompt_seeds_differ_by_prompt_and_run_seed() -> None:
    from moaspec.bench.methods import prompt_seed

    assert prompt_seed(5, [1, 2, 3]) == prompt_seed(5, [1, 2, 3])
    assert len({prompt_seed(5, [1, 2, 3]), prompt_seed(5, [1, 2, 4]), prompt_seed(6, [1, 2, 3])}) == 3


def _chain_tau_output(path: Path, taus: dict[tuple[str, int], list[int]]) -> Path:
    """A stand-in for ``chain_tau.py --output``: one row per prompt with its accepted lengths."""
    rows = [{"category": c, "question": str(q), "tau": sum(a) / len(a), "accepted": a} for (c, q), a in taus.items()]
    path.write_text(json.dumps({"args": {}, "summary": {}, "rows": rows}))
    return path


def test_compare_tau_pools_pairs_and_sign_tests(tmp_path: Path) -> None:
    """benchmarks/compare_tau.py: τ pooled over cycles, prompts higher/lower/equal and the exact two-sided sign
    test, per category and overall, several pairs pooled; prompts that differ, odd or bad files get a clear error."""
    import subprocess
    import sys

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "compare_tau.py"
    sys.path.insert(0, str(script.parent))
    try:
        import compare_tau
    finally:
        sys.path.remove(str(script.parent))
    assert compare_tau.sign_test(0, 0) == 1.0 and compare_tau.sign_test(3, 3) == 1.0
    assert compare_tau.sign_test(5, 0) == pytest.approx(2 / 32) and compare_tau.sign_test(0, 5) == pytest.approx(2 / 32)
    assert compare_tau.sign_test(7, 1) == pytest.approx(2 * 9 / 256)

    base = _chain_tau_output(tmp_path / "base.json", {("qa", 0): [1, 1], ("qa", 1): [2, 2], ("sum", 0): [3]})
    new = _chain_tau_output(tmp_path / "new.json", {("qa", 0): [2, 2, 2], ("qa", 1): [2], ("sum", 0): [1]})
    base2 = _chain_tau_output(tmp_path / "base2.json", {("qa", 5): [1]})
    new2 = _chain_tau_output(tmp_path / "new2.json", {("qa", 5): [4]})
    result = compare_tau.compare([(compare_tau.load_rows(base), compare_tau.load_rows(new)),
                                  (compare_tau.load_rows(base2), compare_tau.load_rows(new2))])
    assert result["qa"] == {"prompts": 3, "base_tau": 7 / 5, "new_tau": 2.4, "higher": 2, "lower": 0, "equal": 1,
                            "sign_test_p": 0.5}
    assert result["overall"]["prompts"] == 4 and result["overall"]["base_tau"] == round(10 / 6, 3)
    assert (result["overall"]["higher"], result["overall"]["lower"], result["overall"]["equal"]) == (2, 1, 1)
    assert list(result) == ["qa", "sum", "overall"]

    def run(*files: Path | str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(script), *map(str, files)], capture_output=True, text=True, timeout=120)

    proc = run(base, new, base2, new2, "--output", tmp_path / "out.json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "out.json").read_text())["comparison"] == result
    (tmp_path / "bad.json").write_text("{not json")
    for files, says in (((base,), "in pairs"), ((base, new2), "3 only in the first file, 1 only in the second"),
                        ((base, tmp_path / "none.json"), "no file"), ((base, tmp_path / "bad.json"), "not the output")):
        proc = run(*files)
        assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr


def test_rss_summary_tells_a_plateau_from_growth() -> None:
    """benchmarks/rss.py: quarters partition the samples in order; a rising series has rising quarter maxima and
    medians, a plateau flat ones after the first; the halves' maxima; no samples give None; this process's RSS reads."""
    import os
    import sys

    folder = Path(__file__).resolve().parent.parent / "benchmarks"
    sys.path.insert(0, str(folder))
    try:
        import rss
    finally:
        sys.path.remove(str(folder))
    samples = [float(x) for x in range(10)]
    assert rss.quarters(samples) == [[0.0, 1.0], [2.0, 3.0, 4.0], [5.0, 6.0, 7.0], [8.0, 9.0]]
    assert rss.quarters([1.0, 2.0]) == [[1.0], [2.0]]
    rising = rss.rss_summary(samples)
    assert rising is not None
    assert rising["max_by_quarter"] == [1.0, 4.0, 7.0, 9.0] and rising["median_by_quarter"] == [0.5, 3.0, 6.0, 8.5]
    assert (rising["first"], rising["max"], rising["last"]) == (0.0, 9.0, 9.0)
    assert (rising["max_first_half"], rising["max_second_half"]) == (4.0, 9.0)
    plateau = rss.rss_summary([100.0, 150.0] + [200.0] * 10)
    assert plateau is not None and plateau["max_by_quarter"][1:] == [200.0, 200.0, 200.0]
    assert rss.rss_summary([]) is None
    assert rss.rss_mb(os.getpid()) > 1
