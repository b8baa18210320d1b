"""``moaspec tune`` and the costs the cost-aware policy keeps per host: measured once, saved, read back, refreshed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moaspec.api import decoding_strategy
from moaspec.bench.tune import PROMPTS
from moaspec.costs import FORMAT, costs_file, load_costs, machine_key, save_costs
from moaspec.decoding.policy import MAX_NEW, Costs
from moaspec.errors import MoaspecError
from moaspec.specbench import load_questions


@pytest.fixture()
def tuned_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOASPEC_TUNED", str(tmp_path / "tuned"))
    return tmp_path / "tuned"


def test_the_built_in_prompts_are_varied_and_fit_the_default_model() -> None:
    questions = load_questions(PROMPTS)
    assert len(questions) == 12 and all(len(q.turns) == 1 for q in questions)
    kinds = {json.loads(line)["category"] for line in PROMPTS.read_text().splitlines()}
    assert kinds == {"writing", "code", "math", "summary", "qa", "advice"}


def test_costs_are_measured_at_first_use_kept_and_read_back_for_the_same_setting_only(  # type: ignore[no-untyped-def]
        tiny_llama, tiny_moa_dir, tuned_dir) -> None:
    from moaspec import costs as costs_module

    costs_module._policies.clear()
    strategy = decoding_strategy(tiny_llama, tiny_moa_dir)
    assert strategy.policy is not None and "by-cost" in strategy.describe()
    key = machine_key(tiny_llama, tiny_moa_dir, strategy.drafter)
    saved = costs_file(key)
    assert saved.parent == tuned_dir and strategy.policy.source == str(saved)
    record = json.loads(saved.read_text())
    assert record["format"] == FORMAT and len(record["target_s"]) == MAX_NEW and min(record["target_s"]) > 0
    assert decoding_strategy(tiny_llama, tiny_moa_dir).policy is strategy.policy  # one per setting and process
    costs_module._policies.clear()
    mine = Costs([0.001 * (k + 1) for k in range(MAX_NEW)], 0.0005, 0.0002)
    save_costs(key, mine, "by hand")
    assert decoding_strategy(tiny_llama, tiny_moa_dir).policy.costs.target == pytest.approx(mine.target)  # read back
    for asked in ({"chain": 2}, {"lookup": 10}, {"by_cost": False}):
        assert decoding_strategy(tiny_llama, tiny_moa_dir, **asked).policy is None, asked  # a fixed decoding was asked for
    assert decoding_strategy(tiny_llama, None).policy is None  # no drafter: plain decoding, nothing to decide
    weights = tiny_moa_dir / "model.safetensors"  # a new drafter file: the costs no longer hold
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert load_costs(machine_key(tiny_llama, tiny_moa_dir, strategy.drafter)) is None
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        costs_module._policies.clear()


def test_drafter_costs_are_saved_in_the_frame_of_the_targets_as_measured(tiny_llama, tiny_moa_dir, tuned_dir,  # type: ignore[no-untyped-def]
                                                                          monkeypatch) -> None:
    """A run on a busy host times the target and the drafter slower alike: the drafter's costs are saved divided by
    the target's slowdown, so that the next process, on a quiet host, does not find the drafter too dear to use."""
    from moaspec import costs as costs_module

    key = machine_key(tiny_llama, tiny_moa_dir)
    measured = [0.005 * (k + 1) for k in range(MAX_NEW)]
    monkeypatch.setattr(costs_module, "SAVE_EVERY_S", 0.0)
    keep = costs_module._keeper(key, measured)
    busy = Costs(list(measured), 0.006, 0.003, scale=3.0)  # every timing three times the quiet one
    keep(busy)
    saved = load_costs(key)
    assert saved is not None and saved.target == pytest.approx(measured)
    assert (saved.draft_first, saved.draft_next) == pytest.approx((0.002, 0.001))


def test_unreadable_saved_costs_are_a_clear_error(tiny_llama, tiny_moa_dir, tuned_dir) -> None:  # type: ignore[no-untyped-def]
    key = machine_key(tiny_llama, tiny_moa_dir)
    path = costs_file(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(MoaspecError, match="cannot read the measured decoding costs .*run `moaspec tune` again"):
        load_costs(key)
    path.write_text(json.dumps({"format": FORMAT, "key": key, "target_s": "x"}))
    with pytest.raises(MoaspecError, match="not a file of decoding costs"):
        load_costs(key)
    path.write_text(json.dumps({"format": FORMAT, "key": {**key, "threads": 99}, "target_s": []}))
    assert load_costs(key) is None  # written for another setting (by hand): ignored


def test_tune_measures_decodes_by_cost_beside_plain_and_saves_the_costs(tiny_dirs, tiny_moa_dir, tuned_dir, tmp_path,  # type: ignore[no-untyped-def]
                                                                        capsys) -> None:
    from moaspec import costs as costs_module
    from moaspec.cli import main

    costs_module._policies.clear()
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n"
                         for i, t in enumerate(["the cat sat on the mat", "one two three four"])))
    model = ["--model", str(tiny_dirs["llama"]), "--drafter", str(tiny_moa_dir)]
    assert main(["tune", *model, "--questions", str(q), "--max-new-tokens", "12", "--no-progress",
                 "--output", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["results"]
    assert set(summary) == {"vanilla", "by-cost"} and summary["by-cost"]["overall"]["greedy_mismatches"] == 0
    assert "target forward, ms by new tokens" in out and "saved to" in out
    [saved] = tuned_dir.glob("*.costs.json")
    assert json.loads(saved.read_text())["how"] == "moaspec tune"

    def generate(*extra: str) -> dict:  # type: ignore[type-arg]
        assert main(["generate", "the cat sat", *model, "--json", "--max-new-tokens", "16", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain, by_cost = generate("--no-draft"), generate()
    assert by_cost["costs_from"] == str(saved) and by_cost["text"] == plain["text"]
    for extra in (("--policy", "fixed"), ("--chain", "3"), ("--tree",)):
        assert generate(*extra)["costs_from"] is None, extra
    assert main(["tune", *model, "--questions", str(q), "--max-new-tokens", "4", "--no-progress", "--no-save",
                 "--output", str(tmp_path / "run2")]) == 0
    assert "saved to" not in capsys.readouterr().out
    costs_module._policies.clear()


def test_tune_and_tree_options_refuse_what_cannot_work(tiny_dirs, tmp_path, tuned_dir, capsys) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main

    model = ["--model", str(tiny_dirs["llama"])]
    assert main(["tune", *model, "--max-new-tokens", "4", "--output", str(tmp_path / "r")]) == 2
    assert "the prompt is" in capsys.readouterr().err  # the built-in prompts do not fit the tiny model's window
    q = tmp_path / "q.jsonl"
    q.write_text(json.dumps({"turns": ["hello there"]}) + "\n")
    assert main(["tune", *model, "--questions", str(q), "--max-new-tokens", "4", "--output", str(tmp_path / "r")]) == 2
    assert "no drafter ships for" in capsys.readouterr().err
    assert main(["tune", *model, "--questions", str(q), "--max-new-tokens", "0"]) == 2
    assert main(["generate", "hi", *model, "--tree-depth", "3"]) == 2
    assert "add --tree" in capsys.readouterr().err
    assert not tuned_dir.exists()
