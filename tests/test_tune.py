"""``moaspec tune``: the fastest setting measured here is saved, and decoding uses it only where nothing was asked for."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from moaspec.api import decoding_strategy
from moaspec.bench.tune import GPU_TREES, PROMPTS, grid
from moaspec.decoding.tree import TreeShape
from moaspec.errors import MoaspecError
from moaspec.specbench import load_questions
from moaspec.tuned import PLAIN, Decoding, load_tuned, machine_key, save_tuned, tuned_file


@pytest.fixture()
def tuned_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("MOASPEC_TUNED", str(tmp_path / "tuned"))
    return tmp_path / "tuned"


def test_the_grid_covers_chains_trees_and_lookup_and_grows_on_a_gpu() -> None:
    cpu, gpu = grid("cpu"), grid("cuda")
    names = [d.name() for d in cpu]
    assert len(set(names)) == len(names)
    assert {"chain-1", "chain-4", "tree-2x2-4", "lookup-10+chain-2", "lookup-10+tree-3x3-10"} <= set(names)
    assert Decoding() in cpu  # the built-in default competes
    assert all(Decoding(tree=t, lookup=0) in gpu and Decoding(tree=t, lookup=0) not in cpu for t in GPU_TREES)
    assert all(d.lookup == 0 for d in grid("cpu", lookup=0))
    assert "lookup-4+chain-2" in names and not any(d.lookup == 4 for d in gpu)  # a CPU verifies many tokens dearly


def test_the_built_in_prompts_are_varied_and_fit_the_default_model() -> None:
    questions = load_questions(PROMPTS)
    assert len(questions) == 12 and all(len(q.turns) == 1 for q in questions)
    kinds = {json.loads(line)["category"] for line in PROMPTS.read_text().splitlines()}
    assert kinds == {"writing", "code", "math", "summary", "qa", "advice"}


def test_a_saved_setting_applies_only_where_no_decoding_was_asked_for(tiny_llama, tiny_moa_dir, tuned_dir) -> None:  # type: ignore[no-untyped-def]
    assert decoding_strategy(tiny_llama, tiny_moa_dir).tuned_from is None  # nothing saved yet: the built-in default
    strategy = decoding_strategy(tiny_llama, tiny_moa_dir)
    best = Decoding(tree=TreeShape(3, 2, 6), lookup=0)
    saved = save_tuned(machine_key(tiny_llama, tiny_moa_dir, strategy.drafter), best, {})
    assert saved.parent == tuned_dir
    tuned = decoding_strategy(tiny_llama, tiny_moa_dir)
    assert (tuned.tree, tuned.lookup, tuned.tuned_from) == (TreeShape(3, 2, 6), 0, str(saved))
    for asked in ({"chain": 2}, {"lookup": 10}, {"confidence": 0.0}, {"tree": TreeShape()}, {"tuned": False}):
        assert decoding_strategy(tiny_llama, tiny_moa_dir, **asked).tuned_from is None, asked
    save_tuned(machine_key(tiny_llama, tiny_moa_dir, strategy.drafter), PLAIN, {})  # where nothing that drafts was faster
    plain = decoding_strategy(tiny_llama, tiny_moa_dir)
    assert (plain.describe(), plain.tuned_from) == ("vanilla", str(saved))
    assert Decoding.from_json({"chain": 2, "tree": None, "lookup": 10}).drafts  # saved before plain decoding could win
    assert decoding_strategy(tiny_llama, None).describe() == "vanilla"  # no drafter: nothing to tune
    weights = tiny_moa_dir / "model.safetensors"  # a new drafter file: the measurement no longer holds
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        assert decoding_strategy(tiny_llama, tiny_moa_dir).tuned_from is None
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_an_unreadable_saved_setting_is_a_clear_error(tiny_llama, tiny_moa_dir, tuned_dir) -> None:  # type: ignore[no-untyped-def]
    key = machine_key(tiny_llama, tiny_moa_dir, decoding_strategy(tiny_llama, tiny_moa_dir).drafter)
    path = tuned_file(key)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(MoaspecError, match="cannot read the tuned decoding settings .*run `moaspec tune` again"):
        load_tuned(key)
    path.write_text(json.dumps({"format": "moaspec-tuned", "key": key, "decoding": {"chain": 0, "tree": None, "lookup": 1}}))
    with pytest.raises(MoaspecError, match="not a tuned decoding setting"):
        load_tuned(key)
    path.write_text(json.dumps({"format": "moaspec-tuned", "key": {**key, "threads": 99}, "decoding": {}}))
    assert load_tuned(key) is None  # written for another setting (by hand): ignored


def test_tune_saves_the_fastest_setting_and_generate_then_decodes_with_it(tiny_dirs, tiny_moa_dir, tuned_dir, tmp_path,  # type: ignore[no-untyped-def]
                                                                          capsys) -> None:
    from moaspec.cli import main

    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question_id": i, "turns": [t]}) + "\n"
                         for i, t in enumerate(["the cat sat on the mat", "one two three four"])))
    model = ["--model", str(tiny_dirs["llama"]), "--drafter", str(tiny_moa_dir)]
    assert main(["tune", *model, "--questions", str(q), "--max-new-tokens", "12", "--no-progress",
                 "--output", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())["results"]
    speeds = {name: r["overall"]["tokens_per_s"] for name, r in summary.items()}  # plain decoding may win too
    fastest = max(speeds, key=speeds.__getitem__)
    assert f"{fastest}" in out and "<- fastest" in out and "saved to" in out
    assert all(r["overall"]["greedy_mismatches"] == 0 for r in summary.values())
    [saved] = tuned_dir.glob("*.json")
    record = json.loads(saved.read_text())
    assert record["name"] == fastest and set(record["results"]) == set(summary)

    def generate(*extra: str) -> dict:  # type: ignore[type-arg]
        assert main(["generate", "the cat sat", *model, "--json", "--max-new-tokens", "16", *extra]) == 0
        return json.loads(capsys.readouterr().out)

    plain, tuned = generate("--no-draft"), generate()
    assert tuned["tuned_from"] == str(saved) and tuned["text"] == plain["text"]
    best = Decoding.from_json(record["decoding"])
    assert tuned["decoding"].endswith(f"+lookup({best.lookup})") == bool(best.lookup)
    for extra in (("--no-tuned",), ("--chain", "3"), ("--lookup", "0"), ("--tree",)):
        assert generate(*extra)["tuned_from"] is None, extra
    assert main(["tune", *model, "--questions", str(q), "--max-new-tokens", "4", "--no-progress", "--no-save",
                 "--output", str(tmp_path / "run2")]) == 0
    assert "saved to" not in capsys.readouterr().out and len(list(tuned_dir.glob("*.json"))) == 1


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


def test_serve_names_its_tuned_setting_or_how_to_measure_one(tiny_dirs, tiny_moa_dir, tiny_llama, tuned_dir,  # type: ignore[no-untyped-def]
                                                             monkeypatch, capsys) -> None:
    """A server's decoders each get a share of the cores, so a setting tuned on all of them does not apply: say so."""
    import moaspec.serving
    from moaspec.cli import main

    monkeypatch.setattr(moaspec.serving, "run_server", lambda app, sock, **kw: sock.close())
    serve = ["serve", "--model", str(tiny_dirs["llama"]), "--drafter", str(tiny_moa_dir), "--port", "0", "--threads", "2"]
    assert main(serve) == 0
    assert "the built-in default: `moaspec tune --threads 2`" in capsys.readouterr().err
    assert main([*serve, "--chain", "3"]) == 0
    assert "moaspec tune" not in capsys.readouterr().err  # the decoding was asked for: nothing to tune
    strategy = decoding_strategy(tiny_llama, tiny_moa_dir)
    saved = save_tuned(machine_key(tiny_llama, tiny_moa_dir, strategy.drafter), Decoding(chain=1, tree=None, lookup=0), {})
    assert main(serve) == 0
    assert f"tuned in {saved}" in capsys.readouterr().err
