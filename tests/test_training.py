"""`moaspec train` on a tiny model: the loss goes down, resuming is exact, two processes work, bad input is refused."""

from __future__ import annotations

import csv
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moaspec.errors import MoaspecError
from moaspec.training.datagen import DataConfig, generate_dataset
from moaspec.training.dataset import Example, draft_vocabulary, held_out, load_examples, make_batches
from moaspec.training.trainer import TrainConfig, Trainer
from test_datagen import damage_data
from tiny import accepting_gibberish

REPO = Path(__file__).resolve().parent.parent


def small(**kw) -> TrainConfig:  # type: ignore[no-untyped-def]
    # fp32 unless a test asks otherwise: "auto" is bf16 on CPUs with bf16 kernels, and a test's exact figures should
    # not depend on the machine it runs on (bf16 has tests of its own)
    base = dict(steps=30, tokens_per_batch=512, lr=3e-3, warmup=3, eval_every=30, save_every=30, draft_vocab=128,
                val_fraction=0.1, val_batches=2, mixed_precision="no")
    base.update(kw)
    return TrainConfig(**base)


def read_log(path: Path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_training_reduces_the_loss_and_exports_a_drafter(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.drafters.checkpoint import load_drafter

    # a fifth held out, so that greedy answers are among them (val_tau_decode replays those)
    summary = Trainer(tiny_llama, tiny_data, tmp_path / "run", small(val_fraction=0.2, segment_max=12), progress=False).train()
    log = read_log(tmp_path / "run" / "train_log.csv")
    assert len(log) == 30 and summary["steps"] == 30
    first = sum(float(r["loss"]) for r in log[:5]) / 5
    last = sum(float(r["loss"]) for r in log[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    val = read_log(tmp_path / "run" / "val_log.csv")[-1]
    assert 1.0 <= float(val["val_tau_chain6"]) <= 7.0
    assert 1.0 <= float(val["val_tau_decode"]) <= 7.0  # replayed real decoding of the held-out greedy answers
    assert 0.0 <= float(val["val_first_draft"]) <= 1.0  # top-1 of those cycles' first drafts
    drafter = load_drafter(tmp_path / "run" / "drafter", tiny_llama)
    assert drafter.cfg.draft_vocab_size == 128
    assert drafter.cfg.ca_reach == 12  # Cross-Attention reaches as far as the longest training segment
    meta = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())
    assert meta["training"]["steps"] == 30 and meta["training"]["finished"]


def test_eagle_training_reduces_the_loss(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.drafters.checkpoint import load_drafter
    from moaspec.drafters.eagle import EagleDrafter

    Trainer(tiny_llama, tiny_data, tmp_path / "run", small(kind="eagle", val_fraction=0.2), progress=False).train()
    log = read_log(tmp_path / "run" / "train_log.csv")
    first = sum(float(r["loss"]) for r in log[:5]) / 5
    last = sum(float(r["loss"]) for r in log[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    assert read_log(tmp_path / "run" / "val_log.csv")[-1]["val_tau_chain6"] == ""
    assert 1.0 <= float(read_log(tmp_path / "run" / "val_log.csv")[-1]["val_tau_decode"]) <= 7.0  # EAGLE's replayed decoding
    assert isinstance(load_drafter(tmp_path / "run" / "drafter", tiny_llama), EagleDrafter)


@pytest.mark.parametrize("cfg, sizes", [
    (dict(tli_layers=2), None),  # two reused layers: backward runs through both
    (dict(), {"memory_source": "last-layer"}),  # the ablation without LSA
    (dict(tli_layers=1), {"memory_source": "lsa+final"}),  # LSA plus the final state
    (dict(), {"lsa_width": 128}),  # LSA wider than the default
    (dict(tli_layers=1), {"newest_entry": True}),  # CA's input carries the newest memory entry
    (dict(), {"derotate_keys": True}),  # LSA reads keys without their rotation
])
def test_variants_train(tiny_llama, tiny_data: Path, tmp_path: Path, cfg, sizes) -> None:  # type: ignore[no-untyped-def]
    from moaspec.drafters.checkpoint import load_drafter

    Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=4, eval_every=4, save_every=4, **cfg), sizes,
            progress=False).train()
    log = read_log(tmp_path / "run" / "train_log.csv")
    assert all(torch.isfinite(torch.tensor(float(r["loss"]))) for r in log)
    drafter = load_drafter(tmp_path / "run" / "drafter", tiny_llama)
    assert drafter.cfg.tli_layers == cfg.get("tli_layers", 0)
    assert drafter.cfg.memory_source == (sizes or {}).get("memory_source", "lsa")
    assert drafter.cfg.newest_entry == (sizes or {}).get("newest_entry", False)
    assert drafter.cfg.derotate_keys == (sizes or {}).get("derotate_keys", False)
    if sizes and "lsa_width" in sizes:
        assert (drafter.cfg.lsa_width, drafter.cfg.lsa_heads) == (128, 2)


def test_the_loss_weights_reach_training_and_validation(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """``--kl-weight``/``--feature-weight`` (default the paper's 0.1 and 1.0) weigh the logged loss, which is
    what gets minimised, in training and in the held-out evaluation alike."""
    cfg = small(steps=2, eval_every=2, save_every=2, val_fraction=0.2, kl_weight=1.0, feature_weight=0.25)
    Trainer(tiny_llama, tiny_data, tmp_path / "run", cfg, progress=False).train()
    for row in read_log(tmp_path / "run" / "train_log.csv"):
        assert float(row["loss"]) == pytest.approx(float(row["kl"]) + 0.25 * float(row["feature"]), rel=1e-3)
    val = read_log(tmp_path / "run" / "val_log.csv")[-1]
    assert float(val["val_loss"]) == pytest.approx(float(val["val_kl"]) + 0.25 * float(val["val_feature"]), rel=1e-3)
    saved = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["training"]["config"]
    assert (saved["kl_weight"], saved["feature_weight"]) == (1.0, 0.25)


@pytest.mark.parametrize("kind", ["moa", "eagle", "independent"])
def test_bf16_mixed_precision_trains_and_evaluates_without_dtype_warnings(tiny_llama, tiny_data: Path, tmp_path: Path,
                                                                          kind: str) -> None:  # type: ignore[no-untyped-def]
    """GPUs train under bf16 autocast; CPU autocast runs the same code paths (fp32 norm weights on bf16 activations,
    evaluation in eval mode, where fp32 inference would use prepacked weights)."""
    import warnings

    cfg = small(kind=kind, steps=4, eval_every=4, save_every=4, val_fraction=0.2, mixed_precision="bf16",
                tli_layers=1 if kind == "moa" else 0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer(tiny_llama, tiny_data, tmp_path / "run", cfg, progress=False).train()
    assert not [w for w in caught if "dtype" in str(w.message)], [str(w.message) for w in caught]
    val = read_log(tmp_path / "run" / "val_log.csv")[-1]
    assert torch.isfinite(torch.tensor(float(val["val_loss"]))) and float(val["val_tau_decode"]) >= 1.0


def test_auto_precision_is_bf16_where_it_is_quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto" trains under bf16 autocast on GPUs and on CPUs whose oneDNN has bf16 kernels (1.5x the loss tokens/s
    of fp32 there, BENCHMARKS.md), in fp32 on other CPUs; an explicit choice is kept as given."""
    from moaspec.training import trainer

    for kernels, expected in ((True, "bf16"), (False, "no")):
        monkeypatch.setattr(trainer, "bf16_kernels", lambda kernels=kernels: kernels)
        assert trainer.resolve_precision("auto", cpu=True) == expected
        for choice in ("no", "bf16", "fp16"):
            assert trainer.resolve_precision(choice, cpu=True) == choice
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert trainer.resolve_precision("auto", cpu=False) == "fp16"
    assert trainer.resolve_precision("auto", cpu=True) == "no"  # a CPU run beside a GPU follows the CPU's rule


def test_a_run_records_the_precision_it_trained_in(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """"auto" names no precision, so the exported drafter's training record says which one ran."""
    from moaspec.training.trainer import resolve_precision

    Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=1, mixed_precision="auto"), progress=False).train()
    training = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["training"]
    assert training["config"]["mixed_precision"] == "auto"
    assert training["mixed_precision"] == resolve_precision("auto", cpu=True)


def test_a_run_resumed_where_auto_means_another_precision_says_so(tiny_llama, tiny_data: Path, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """A run moved to a machine where "auto" resolves otherwise goes on in that machine's precision and warns that
    its resume is not bit-exact; resumed where it began, it says nothing."""
    from moaspec.training import trainer

    run, cfg = tmp_path / "run", small(steps=3, eval_every=100, save_every=1, mixed_precision="auto")
    monkeypatch.setattr(trainer, "bf16_kernels", lambda: True)
    Trainer(tiny_llama, tiny_data, run, cfg, progress=False).train(until=1)
    assert json.loads((run / "progress.json").read_text())["mixed_precision"] == "bf16"
    Trainer(tiny_llama, tiny_data, run, cfg, progress=False).train(until=2)
    assert "mixed precision" not in capsys.readouterr().err
    monkeypatch.setattr(trainer, "bf16_kernels", lambda: False)
    resumed = Trainer(tiny_llama, tiny_data, run, cfg, progress=False)
    assert resumed.acc.mixed_precision == "no"
    err = capsys.readouterr().err
    assert "ran its first 2 updates with mixed precision 'bf16'" in err and "means 'no' on this machine" in err
    resumed.train()
    assert json.loads((run / "progress.json").read_text())["mixed_precision"] == "no"


@pytest.mark.parametrize("kind", ["moa", "eagle", "independent"])
def test_compiled_training_computes_what_eager_training_does(tiny_llama, tiny_data: Path, tmp_path: Path,
                                                             kind: str) -> None:  # type: ignore[no-untyped-def]
    """--compile runs the same updates through torch.compile: the same losses, to rounding, and the same evaluation
    (run eagerly, in eval mode)."""
    logs = {}
    for mode in ("eager", "compiled"):
        cfg = small(kind=kind, steps=3, eval_every=3, save_every=3)
        Trainer(tiny_llama, tiny_data, tmp_path / mode, cfg, progress=False, compile=mode == "compiled").train()
        logs[mode] = (read_log(tmp_path / mode / "train_log.csv"), read_log(tmp_path / mode / "val_log.csv"))
    for a, b in zip(logs["eager"][0], logs["compiled"][0], strict=True):
        assert a["tokens"] == b["tokens"]
        assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-3)
    assert float(logs["compiled"][1][-1]["val_loss"]) == pytest.approx(float(logs["eager"][1][-1]["val_loss"]), rel=1e-3)


def test_a_compile_that_fails_falls_back_to_eager_training(tiny_llama, tiny_data: Path, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch, capsys) -> None:  # type: ignore[no-untyped-def]
    """Without a working compiler (Inductor's CPU code needs a C++ one) the run says so once and goes on eagerly."""
    from moaspec.training import compiled

    calls = []

    def broken(fn, **kwargs):  # type: ignore[no-untyped-def]
        def run(*args, **kw):  # type: ignore[no-untyped-def]
            calls.append(1)
            raise RuntimeError("InductorError: no C++ compiler found")
        return run

    monkeypatch.setattr(compiled.torch, "compile", broken)
    cfg = small(steps=3, eval_every=100, save_every=3)
    Trainer(tiny_llama, tiny_data, tmp_path / "fallback", cfg, progress=False, compile=True).train()
    Trainer(tiny_llama, tiny_data, tmp_path / "eager", cfg, progress=False).train()
    err = capsys.readouterr().err
    assert len(calls) == 1 and err.count("--compile failed (RuntimeError: InductorError: no C++ compiler found)") == 1
    losses = {run: [row["loss"] for row in read_log(tmp_path / run / "train_log.csv")] for run in ("fallback", "eager")}
    assert len(losses["eager"]) == 3 and losses["fallback"] == losses["eager"]  # the eager updates, exactly


def test_a_second_run_in_one_process_may_change_precision(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Accelerate's process-wide state refused a second Trainer with another precision (a notebook, a sweep)."""
    for i, precision in enumerate(["no", "bf16", "no"]):
        cfg = small(steps=1, eval_every=100, save_every=1, mixed_precision=precision)
        trainer = Trainer(tiny_llama, tiny_data, tmp_path / f"run{i}", cfg, progress=False)
        assert trainer.acc.mixed_precision == precision
        trainer.train()
        assert (tmp_path / f"run{i}" / "drafter" / "model.safetensors").exists()


def test_a_save_that_fails_leaves_the_last_saved_state_and_no_temporary(tiny_llama, tiny_data: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """A disk that refuses the state's files mid-save (full, or a file-size limit) ends the run with the state of the
    save before intact, and no half-written state.tmp beside it."""
    run, cfg = tmp_path / "run", small(steps=2, eval_every=100, save_every=1)
    trainer = Trainer(tiny_llama, tiny_data, run, cfg, progress=False)
    trainer.train(until=1)
    saved = sorted(p.name for p in (run / "state").iterdir())

    def refuse(path: str) -> None:
        (Path(path) / "model.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.acc, "save_state", refuse)
    with pytest.raises(OSError):
        trainer.train()
    assert not (run / "state.tmp").exists() and sorted(p.name for p in (run / "state").iterdir()) == saved
    assert json.loads((run / "progress.json").read_text())["step"] == 1


def test_resume_is_exact(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """6 steps straight equal 3 steps, a fresh process-like restart, then 3 more."""
    cfg = small(steps=6, save_every=3, eval_every=100)
    Trainer(tiny_llama, tiny_data, tmp_path / "straight", cfg, progress=False).train()
    split = tmp_path / "split"
    Trainer(tiny_llama, tiny_data, split, cfg, progress=False).train(until=3)  # as if killed after step 3's save
    Trainer(tiny_llama, tiny_data, split, cfg, progress=False).train()
    a = load_file(str(tmp_path / "straight" / "drafter" / "model.safetensors"))
    b = load_file(str(split / "drafter" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k)
    la, lb = read_log(tmp_path / "straight" / "train_log.csv"), read_log(split / "train_log.csv")
    assert [r["loss"] for r in la] == [r["loss"] for r in lb]


def test_a_log_begun_with_fewer_columns_is_widened(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A run resumed by a moaspec that logs a new column keeps its old rows under the wider header."""
    trainer = Trainer(tiny_llama, tiny_data, tmp_path / "run", small(), progress=False)
    (tmp_path / "run").mkdir()  # a fresh run writes nothing before its first step
    (tmp_path / "run" / "val_log.csv").write_text("step,val_loss\r\n10,0.5\r\n")
    trainer.log("val_log.csv", {"step": 20, "val_loss": 0.4, "val_tau_decode": 1.5})
    trainer.log("val_log.csv", {"step": 30, "val_loss": 0.3, "val_tau_decode": 1.6})
    assert read_log(tmp_path / "run" / "val_log.csv") == [
        {"step": "10", "val_loss": "0.5", "val_tau_decode": ""},
        {"step": "20", "val_loss": "0.4", "val_tau_decode": "1.5"},
        {"step": "30", "val_loss": "0.3", "val_tau_decode": "1.6"},
    ]


def test_resume_refuses_other_settings(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=2, save_every=2), progress=False).train()
    with pytest.raises(MoaspecError, match=r"other settings \(lr 0.003 -> 0.01\).*--init-from .*run/drafter"):
        Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=2, save_every=2, lr=1e-2), progress=False)


def test_a_diverged_run_stops_and_keeps_its_last_good_checkpoint(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Weights gone NaN are never saved, and a loss that is not finite stops the run with a clear error; the
    checkpoint of the last good update stays loadable."""
    from moaspec.drafters.checkpoint import load_drafter

    trainer = Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=3, save_every=1), progress=False)
    trainer.train(until=1)
    weight = next(trainer.model.parameters())
    weight.data.fill_(float("nan"))
    with pytest.raises(MoaspecError, match="weights are not finite .* training diverged; .* keeps update 1"):
        trainer.save()
    with pytest.raises(MoaspecError, match="loss is not finite .* at update 2: training diverged; .* keeps update 1"):
        trainer.train()
    assert json.loads((tmp_path / "run" / "progress.json").read_text())["step"] == 1
    assert load_drafter(tmp_path / "run" / "drafter", tiny_llama) is not None


def test_a_run_begun_before_a_setting_existed_resumes(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A setting added to TrainConfig later was at its default in older runs, which resume as before."""
    import json

    Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=2, save_every=1), progress=False).train(until=1)
    prog = tmp_path / "run" / "progress.json"
    saved = json.loads(prog.read_text())
    del saved["config"]["segment_long_fraction"], saved["config"]["segment_long_max"]
    prog.write_text(json.dumps(saved))
    resumed = Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=2, save_every=1), progress=False)
    assert resumed.step == 1
    with pytest.raises(MoaspecError, match="other settings"):
        Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=2, save_every=1, segment_long_max=40,
                                                               segment_long_fraction=0.2), progress=False)
    # and a run with long segments mixed in trains
    long = Trainer(tiny_llama, tiny_data, tmp_path / "long", small(steps=2, save_every=2, segment_long_max=40,
                                                                    segment_long_fraction=0.3, eval_every=2),
                   progress=False).train()
    assert long["steps"] == 2 and long["finished"] and 0 < long["last_val"]["val_loss"] < float("inf")


def test_refuses_data_from_another_model(tiny_dirs, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.models import load_model_dir

    other = load_model_dir(tiny_dirs["mistral"], device="cpu")
    with pytest.raises(MoaspecError, match="generated by another model"):
        Trainer(other, tiny_data, tmp_path / "run", small(), progress=False)


@pytest.mark.parametrize("how", ["manifest a list", "shard missing", "shard not JSON", "shard emptied"])
def test_damaged_data_is_refused(tiny_llama, tiny_data: Path, tmp_path: Path, how: str) -> None:  # type: ignore[no-untyped-def]
    """A shard emptied or edited after `moaspec data` wrote it no longer matches its manifest entry: refused, not trained on."""
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data, ignore=shutil.ignore_patterns("features"))
    with pytest.raises(MoaspecError, match=damage_data(data, how)):
        load_examples([data], tiny_llama.fingerprint, 1024, 0.1)


def test_a_max_len_below_every_prompt_says_so(tiny_llama, tiny_data: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MoaspecError, match=r"every example is too long for --max-len 2 .*pass --max-len \d+ or more"):
        load_examples([tiny_data], tiny_llama.fingerprint, 2, 0.1)


@pytest.fixture(scope="module")
def saved_run(tiny_llama, tiny_data: Path, tmp_path_factory) -> Path:  # type: ignore[no-untyped-def]
    """A run stopped after its first checkpoint (its settings: ``small(steps=2, save_every=1)``)."""
    run = tmp_path_factory.mktemp("saved") / "run"
    Trainer(tiny_llama, tiny_data, run, small(steps=2, save_every=1), progress=False).train(until=1)
    return run


def edit_progress(run: Path, **values: int) -> None:
    path = run / "progress.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))


@pytest.mark.parametrize("damage, says", [
    (lambda run: (run / "progress.json").write_text("{"), "progress.json is not valid JSON"),
    (lambda run: (run / "progress.json").write_text("[]"), "progress.json holds an array where an object belongs"),
    (lambda run: (run / "progress.json").write_text('{"step": 1}'), "progress.json lacks the step"),
    (lambda run: edit_progress(run, step=-5), "progress.json lacks the step, token, time \\(numbers >= 0\\)"),
    (lambda run: edit_progress(run, step=99), "progress.json is at update 99 of a run of 2"),
    (lambda run: shutil.rmtree(run / "state"), "state, its saved state, is missing"),
    (lambda run: [f.write_bytes(b"garbage") for f in (run / "state").iterdir()], "state, its saved state, is damaged"),
    (lambda run: (run / "state" / "optimizer.bin").unlink(), "state, its saved state, is damaged"),
], ids=["progress-not-json", "progress-a-list", "progress-incomplete", "progress-negative", "progress-past-the-end",
        "state-missing", "state-garbage", "state-partial"])
def test_a_damaged_run_cannot_be_resumed(tiny_llama, tiny_data: Path, saved_run: Path, tmp_path: Path, damage,  # type: ignore[no-untyped-def]
                                         says: str) -> None:
    run = tmp_path / "run"
    shutil.copytree(saved_run, run)
    damage(run)
    with pytest.raises(MoaspecError, match=f"{re.escape(str(run))} cannot be resumed: .*{says}.*; remove the directory "
                                           r"\(or pass another --output\) to start afresh"):
        Trainer(tiny_llama, tiny_data, run, small(steps=2, save_every=1), progress=False)


@pytest.mark.parametrize("kind, sizes", [("moa", {"sa_mlp": 0}), ("moa", {"lsa_mlp": 0}), ("moa", {"sa_mlp": -5}),
                                         ("moa", {"ca_mlp": -1}), ("eagle", {"mlp": 0}), ("independent", {"mlp": -1})])
def test_a_layer_width_below_one_is_refused_before_anything_is_written(tiny_llama, tiny_data: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                       kind: str, sizes: dict[str, int]) -> None:
    (name, width), = sizes.items()
    with pytest.raises(MoaspecError, match=f"--{name.replace('_', '-')} must be a whole number >= 1, got {width}"):
        Trainer(tiny_llama, tiny_data, tmp_path / "run", small(kind=kind), sizes, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_that_fails_before_its_first_step_leaves_nothing(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Too little data surfaces when the first batch is drawn: no directory with a train_config.json is left behind."""
    t = Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=1, save_every=1), progress=False)
    t.data.examples_for = lambda epoch: []  # type: ignore[method-assign]
    with pytest.raises(MoaspecError, match="too little data: 0 training examples make 0 batches of --tokens-per-batch"):
        t.train()
    assert not (tmp_path / "run").exists()
    with pytest.raises(MoaspecError, match="--val-fraction 0.9999999 holds out all .* usable examples"):
        Trainer(tiny_llama, tiny_data, tmp_path / "run", small(val_fraction=0.9999999), progress=False)
    Trainer(tiny_llama, tiny_data, tmp_path / "run", small(steps=1, save_every=1), progress=False).train()
    assert json.loads((tmp_path / "run" / "train_config.json").read_text())["steps"] == 1  # written with the checkpoint


def test_refuses_a_directory_without_data(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MoaspecError, match="no distillation data"):
        Trainer(tiny_llama, tmp_path, tmp_path / "run", small(), progress=False)


def test_held_out_split_is_stable() -> None:
    ids = [f"{s}-{i}-0" for s in range(20) for i in range(50)]
    chosen = {i for i in ids if held_out(i, 0.05)}
    assert 20 < len(chosen) < 90
    assert chosen == {i for i in ids if held_out(i, 0.05)}


def test_draft_vocabulary_takes_frequent_answer_tokens() -> None:
    ex = [Example((1, 2, 3, 9, 9, 9, 8, 8), 3), Example((4, 9, 7), 1)]
    vocab = draft_vocabulary(ex, 3, always=[0], vocab_size=20)
    assert vocab.tolist() == [0, 9, 8]  # EOS-like 0 always, first; then 9 (4x), 8 (2x); prompt tokens never count


def test_batches_respect_the_token_budget() -> None:
    ex = [Example(tuple(range(n)), 1) for n in [5, 50, 7, 100, 30, 64, 9, 12] * 4]
    batches = make_batches(ex, 128, seed=0, epoch=0)
    assert sorted(i for b in batches for i in b) == list(range(len(ex)))
    assert all(max(len(ex[i].tokens) for i in b) * len(b) <= 128 or len(b) == 1 for b in batches)
    assert batches == make_batches(ex, 128, seed=0, epoch=0) != make_batches(ex, 128, seed=0, epoch=1)


def test_two_processes_with_torchrun(tiny_dirs, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The same command under torchrun: two gloo processes share the batches and write one drafter."""
    out = tmp_path / "run2"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29533",
           "-m", "moaspec", "train", "--model", str(tiny_dirs["llama"]), "--data", str(tiny_data),
           "--output", str(out), "--steps", "4", "--tokens-per-batch", "512", "--draft-vocab", "128",
           "--eval-every", "4", "--save-every", "2", "--val-fraction", "0.1", "--no-progress"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    meta = json.loads((out / "drafter" / "config.json").read_text())
    assert meta["training"]["processes"] == 2 and meta["training"]["steps"] == 4
    assert len(read_log(out / "train_log.csv")) == 4


def test_feature_cache_returns_what_the_target_computes(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.training.features import FeatureStore, target_pass

    tokens = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    lengths = torch.tensor([5, 3])
    store = FeatureStore(tiny_llama.model, 1)
    files = (tmp_path / "f" / "a.safetensors", tmp_path / "f" / "b.safetensors")
    first = store.features(tokens, lengths, files)
    assert sorted(p.name for p in (tmp_path / "f").iterdir()) == ["a.safetensors", "b.safetensors"]
    again = store.features(tokens, lengths, files)  # now read from disk
    fresh = target_pass(tiny_llama.model, tokens, 1)
    for x, y, z in [(first.token_kv, again.token_kv, fresh.token_kv), (first.final, again.final, fresh.final),
                    (first.layer, again.layer, fresh.layer)]:
        assert torch.equal(x, y)
        torch.testing.assert_close(x[0], z[0])  # the full row; padding of row 1 is zero in the store
        torch.testing.assert_close(x[1, :3], z[1, :3])
    (tmp_path / "f" / "a.safetensors").write_bytes(b"garbage")  # a damaged file is recomputed, not trusted
    assert torch.equal(store.features(tokens, lengths, files).final, first.final)
    from safetensors.torch import load_file, save_file

    good = load_file(str(files[0]))
    for damaged in ({k: v for k, v in good.items() if k != "kv"}, {**good, "kv": good["kv"][..., :3].contiguous()},
                    {**good, "final": good["final"][:, :7].contiguous()}):  # readable, but a tensor missing or of another shape
        save_file(damaged, str(files[0]))
        assert torch.equal(store.features(tokens, lengths, files).token_kv, first.token_kv)
    assert torch.equal(store.features(tokens, lengths, (None, None)).final, first.final)  # no cache: computed alike



@pytest.mark.parametrize("how", ["below the reserve", "disk full"])
def test_the_feature_cache_stops_short_of_a_full_disk(tiny_llama, tmp_path: Path, capsys, monkeypatch, how: str) -> None:  # type: ignore[no-untyped-def]
    """Caching stops, once and with one line, where the disk would keep less than the reserve for checkpoints or
    fills anyway; training's features are unchanged (computed instead of read) and nothing half-written is left."""
    import errno

    import moaspec.training.features as features

    tokens, lengths = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]]), torch.tensor([5, 3])
    files = (tmp_path / "f" / "a.safetensors", tmp_path / "f" / "b.safetensors")
    writes = []
    if how == "disk full":
        def full(tensors, path):  # type: ignore[no-untyped-def]
            writes.append(path)
            Path(path).write_bytes(b"half")  # a partial file, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        monkeypatch.setattr(features, "save_file", full)
        store = features.FeatureStore(tiny_llama.model, 0)
    else:
        store = features.FeatureStore(tiny_llama.model, 0, reserve=features.free_bytes(tmp_path) + 1)
    want = features.FeatureStore(tiny_llama.model, 0).features(tokens, lengths, (None, None))
    for _ in range(2):
        got = store.features(tokens, lengths, files)
        assert torch.equal(got.final, want.final) and torch.equal(got.token_kv, want.token_kv)
    assert not store.caching and len(writes) == (1 if how == "disk full" else 0)  # no second try
    assert not (tmp_path / "f").exists() or not list((tmp_path / "f").iterdir())
    err = capsys.readouterr().err
    assert err.count("stops growing") == 1 and ("disk is full" if how == "disk full" else "kept for checkpoints") in err


def test_training_says_up_front_when_the_feature_cache_will_not_fit(tiny_llama, tiny_data: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                   capsys, monkeypatch) -> None:
    import moaspec.training.features as features

    monkeypatch.setattr(features, "free_bytes", lambda path: features.DISK_RESERVE + 4096)
    data = tmp_path / "data"
    shutil.copytree(tiny_data, data, ignore=shutil.ignore_patterns("features"))
    Trainer(tiny_llama, data, tmp_path / "run", small(steps=2, eval_every=2, save_every=2), progress=False).train()
    err = capsys.readouterr().err
    per_token = features.bytes_per_token(tiny_llama.cfg, 0) / 1024
    assert f"({per_token:.1f} KiB a token)" in err and "--no-feature-cache" in err
    assert not list((data / "features").rglob("*.safetensors"))  # nothing cached beyond the reserve
    monkeypatch.undo()
    assert features.room_warning(data, 1000, tiny_llama.cfg, 0) is None  # a real disk holds 1,000 tiny tokens

def test_data_written_during_training_joins_at_the_next_epoch(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_data, data)
    cfg = small(steps=40, save_every=2, eval_every=100)
    t = Trainer(tiny_llama, data, tmp_path / "run", cfg, progress=False)
    t.train(until=2)
    first = dict(t.epoch_shards)
    with accepting_gibberish():  # more data arrives while the run is paused
        generate_dataset(tiny_llama, data, DataConfig(examples=96, shard_size=16, batch_size=16, max_query_tokens=16,
                                                      max_answer_tokens=48, multi_turn=0.3), progress=False)
    Trainer(tiny_llama, data, tmp_path / "run", cfg, progress=False).train()
    shards = {int(k): v for k, v in json.loads((tmp_path / "run" / "progress.json").read_text())["epoch_shards"].items()}
    assert shards[0] == first[0]  # the resumed run replayed epoch 0 as it was
    assert max(v[0] for v in shards.values()) > first[0][0]  # later epochs include the new shards


def test_warm_start_from_an_exported_drafter(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.drafters.checkpoint import load_drafter

    Trainer(tiny_llama, tiny_data, tmp_path / "a", small(steps=10), progress=False).train()
    first = load_drafter(tmp_path / "a" / "drafter", tiny_llama, torch.float32)
    t = Trainer(tiny_llama, tiny_data, tmp_path / "b", small(steps=2, init_from=str(tmp_path / "a" / "drafter")), progress=False)
    for (k, a), (_, b) in zip(sorted(t.raw.state_dict().items()), sorted(first.state_dict().items())):
        torch.testing.assert_close(a, b.to(a.dtype), msg=k)  # starts exactly where the first run ended
    t.train()
    # its held-out figures start with the drafter it started from, before the first update
    val = read_log(tmp_path / "b" / "val_log.csv")
    assert [row["step"] for row in val] == ["0", "2"] and float(val[0]["val_loss"]) > 0
    assert val[0]["val_loss"] == read_log(tmp_path / "a" / "val_log.csv")[-1]["val_loss"]  # same weights, same slice
    # the continued drafter's record keeps what made it, run by run
    lineage = [json.loads((tmp_path / run / "drafter" / "config.json").read_text())["training"]["lineage"] for run in "ab"]
    assert len(lineage[0]) == 1 and lineage[0][0].startswith("from random weights: 10 updates at lr ")
    assert lineage[1][:1] == lineage[0] and len(lineage[1]) == 2 and lineage[1][1].startswith("+2 updates at lr ")
    assert str(tiny_data) in lineage[1][1] and "1 process(es) on cpu" in lineage[1][1]
    with pytest.raises(MoaspecError, match="not an eagle drafter"):
        Trainer(tiny_llama, tiny_data, tmp_path / "c", small(kind="eagle", init_from=str(tmp_path / "a" / "drafter")),
                progress=False)


def test_warm_start_may_change_the_tli_depth(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """N = 0 -> 1 -> 0: LSA, SA and CA carry over; the output norm exists only at N = 0 and restarts from the target's."""
    from moaspec.drafters.checkpoint import load_drafter

    Trainer(tiny_llama, tiny_data, tmp_path / "n0", small(steps=4), progress=False).train()
    first = load_drafter(tmp_path / "n0" / "drafter", tiny_llama, torch.float32).state_dict()
    t = Trainer(tiny_llama, tiny_data, tmp_path / "n1", small(steps=4, tli_layers=1, init_from=str(tmp_path / "n0" / "drafter")),
                progress=False)
    assert t.raw.cfg.tli_layers == 1 and t.raw.out_norm is None
    carried = t.raw.state_dict()
    assert set(first) - set(carried) == {"out_norm.weight"} and set(carried) <= set(first)
    for k, v in carried.items():
        torch.testing.assert_close(v, first[k].to(v.dtype), msg=k)
    t.train()
    assert load_drafter(tmp_path / "n1" / "drafter", tiny_llama).cfg.tli_layers == 1
    back = Trainer(tiny_llama, tiny_data, tmp_path / "back", small(steps=1, init_from=str(tmp_path / "n1" / "drafter")),
                   progress=False).raw
    assert back.cfg.tli_layers == 0
    torch.testing.assert_close(back.out_norm.weight, tiny_llama.model.norm.float())


def test_warm_start_may_add_the_final_state_to_the_memory(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """"lsa" -> "lsa+final": every weight carries over and the new projection starts at zero, so the memory is
    unchanged until training moves it; the way back would drop what was learnt, and is refused."""
    from moaspec.drafters.checkpoint import load_drafter

    Trainer(tiny_llama, tiny_data, tmp_path / "lsa", small(steps=2), progress=False).train()
    first = load_drafter(tmp_path / "lsa" / "drafter", tiny_llama, torch.float32)
    t = Trainer(tiny_llama, tiny_data, tmp_path / "final", small(steps=4, init_from=str(tmp_path / "lsa" / "drafter")),
                {"memory_source": "lsa+final"}, progress=False)
    assert t.raw.cfg.memory_source == "lsa+final" and not t.raw.final_proj.weight.any()
    cache = tiny_llama.model.new_cache(12)
    final = tiny_llama.model(torch.arange(12)[None] + 3, cache).hidden
    with torch.no_grad():
        torch.testing.assert_close(t.raw.memory(cache.token_kv(0, 12), final), first.memory(cache.token_kv(0, 12), None))
    t.train()
    trained = load_drafter(tmp_path / "final" / "drafter", tiny_llama)
    assert trained.cfg.memory_source == "lsa+final" and trained.final_proj.weight.any()
    with pytest.raises(MoaspecError, match="cannot continue as one with 'lsa'"):
        Trainer(tiny_llama, tiny_data, tmp_path / "back", small(steps=1, init_from=str(tmp_path / "final" / "drafter")),
                {"memory_source": "lsa"}, progress=False)


def test_warm_start_may_add_the_newest_entry_to_cross_attention(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A plain MoA drafter gains the newest entry's projection at zero: it predicts exactly as before until training
    moves it; a drafter that learnt to read it cannot drop it."""
    from moaspec.drafters.checkpoint import load_drafter
    from moaspec.training.masks import cross_attention_mask

    Trainer(tiny_llama, tiny_data, tmp_path / "plain", small(steps=2), progress=False).train()
    first = load_drafter(tmp_path / "plain" / "drafter", tiny_llama, torch.float32)
    t = Trainer(tiny_llama, tiny_data, tmp_path / "newest", small(steps=4, init_from=str(tmp_path / "plain" / "drafter")),
                {"newest_entry": True}, progress=False)
    assert t.raw.cfg.newest_entry and not t.raw.newest_proj.weight.any()
    S = 12
    tokens = torch.arange(S)[None] + 3
    cache = tiny_llama.model.new_cache(S)
    final = tiny_llama.model(tokens, cache).hidden
    starts = torch.tensor([0, 0, 0, 0, 4, 4, 4, 7, 7, 7, 7, 11])
    sa, ca = torch.ones(S, S, dtype=torch.bool).tril()[None], cross_attention_mask(starts, 4)[None]
    with torch.no_grad():
        torch.testing.assert_close(t.raw(tokens, cache.token_kv(0, S), final, sa, ca),
                                   first(tokens, cache.token_kv(0, S), final, sa, ca).float())
    t.train()
    trained = load_drafter(tmp_path / "newest" / "drafter", tiny_llama)
    assert trained.cfg.newest_entry and trained.newest_proj.weight.any()
    with pytest.raises(MoaspecError, match="cannot continue as one that does not"):
        Trainer(tiny_llama, tiny_data, tmp_path / "back", small(steps=1, init_from=str(tmp_path / "newest" / "drafter")),
                {"newest_entry": False}, progress=False)


def test_warm_start_may_derotate_lsa_keys_but_not_go_back(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A plain MoA drafter continues reading derotated keys with every weight carried over; back is refused."""
    from moaspec.drafters.checkpoint import load_drafter

    Trainer(tiny_llama, tiny_data, tmp_path / "plain", small(steps=2), progress=False).train()
    first = load_drafter(tmp_path / "plain" / "drafter", tiny_llama, torch.float32)
    t = Trainer(tiny_llama, tiny_data, tmp_path / "derot", small(steps=2, init_from=str(tmp_path / "plain" / "drafter")),
                {"derotate_keys": True}, progress=False)
    assert t.raw.cfg.derotate_keys
    for (name, p), q in zip(t.raw.state_dict().items(), first.state_dict().values()):
        torch.testing.assert_close(p.float(), q.float(), msg=name)
    t.train()
    with pytest.raises(MoaspecError, match="cannot continue as one that reads them rotated"):
        Trainer(tiny_llama, tiny_data, tmp_path / "back", small(steps=1, init_from=str(tmp_path / "derot" / "drafter")),
                {"derotate_keys": False}, progress=False)


def test_independent_training_starts_from_the_target_and_reduces_the_loss(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from moaspec.drafters.checkpoint import load_drafter
    from moaspec.drafters.independent import IndependentDrafter

    t = Trainer(tiny_llama, tiny_data, tmp_path / "run", small(kind="independent"), {"layers": 2}, progress=False)
    target_block = tiny_llama.model.blocks[1].state_dict()
    for k, v in t.raw.blocks[1].state_dict().items():
        torch.testing.assert_close(v, target_block[k].float(), msg=k)  # a copy of the target's second block
    t.train()
    log = read_log(tmp_path / "run" / "train_log.csv")
    first = sum(float(r["loss"]) for r in log[:5]) / 5
    last = sum(float(r["loss"]) for r in log[-5:]) / 5
    assert last < 0.9 * first, (first, last)
    drafter = load_drafter(tmp_path / "run" / "drafter", tiny_llama)
    assert isinstance(drafter, IndependentDrafter) and len(drafter.blocks) == 2


def test_same_data_as_replays_another_runs_batches(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A baseline trained with --same-data-as sees the reference run's batches, step by step, and its draft vocabulary."""
    from moaspec.drafters.checkpoint import load_drafter

    Trainer(tiny_llama, tiny_data, tmp_path / "moa", small(steps=8, save_every=8, eval_every=100), progress=False).train()
    Trainer(tiny_llama, tiny_data, tmp_path / "eagle",
            small(kind="eagle", steps=8, save_every=8, eval_every=100, same_data_as=str(tmp_path / "moa")), progress=False).train()
    ref, mine = read_log(tmp_path / "moa" / "train_log.csv"), read_log(tmp_path / "eagle" / "train_log.csv")
    assert [r["tokens"] for r in ref] == [r["tokens"] for r in mine]
    a, b = load_drafter(tmp_path / "moa" / "drafter", tiny_llama), load_drafter(tmp_path / "eagle" / "drafter", tiny_llama)
    assert torch.equal(a.draft_vocab, b.draft_vocab)
    with pytest.raises(MoaspecError, match="progress.json"):
        Trainer(tiny_llama, tiny_data, tmp_path / "x", small(kind="eagle", same_data_as=str(tmp_path)), progress=False)
    with pytest.raises(MoaspecError, match="give one of them"):
        Trainer(tiny_llama, tiny_data, tmp_path / "y", small(same_data_as=str(tmp_path / "moa"),
                                                             init_from=str(tmp_path / "moa" / "drafter")), progress=False)
    longer = small(same_data_as=str(tmp_path / "moa"))
    with pytest.raises(MoaspecError, match="used --max-len"):  # other truncation: other batches
        Trainer(tiny_llama, tiny_data, tmp_path / "z", TrainConfig(**{**longer.__dict__, "max_len": longer.max_len + 1}),
                progress=False)


def test_trains_on_several_data_directories(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Two data sets train together; their record ids may repeat, so each keeps its own feature cache."""
    import shutil

    from moaspec.training.trainer import shard_counts

    second = tmp_path / "second"
    shutil.copytree(tiny_data, second, ignore=shutil.ignore_patterns("features"))  # the same record ids
    one = Trainer(tiny_llama, tiny_data, tmp_path / "one", small(steps=2, save_every=2), progress=False)
    both = Trainer(tiny_llama, [tiny_data, second], tmp_path / "both", small(steps=4, save_every=4), progress=False)
    assert len(both.data.train_set) == 2 * len(one.data.train_set) and len(both.data.val_set) == 2 * len(one.data.val_set)
    assert {ex.source for ex in both.data.train_set} == {0, 1}
    both.train()
    progress = json.loads((tmp_path / "both" / "progress.json").read_text())
    shards = len(json.loads((tiny_data / "manifest.json").read_text())["shards"])
    assert shard_counts(progress["epoch_shards"])[0] == [shards, shards]
    assert any((second / "features").rglob("*.safetensors"))  # the second set's features live beside it
    with pytest.raises(MoaspecError, match="given twice"):
        Trainer(tiny_llama, [tiny_data, tiny_data], tmp_path / "twice", small(), progress=False)
    with pytest.raises(MoaspecError, match="2 data directories"):  # a like-for-like replay needs the same data sets
        Trainer(tiny_llama, tiny_data, tmp_path / "replay", small(kind="eagle", same_data_as=str(tmp_path / "both")),
                progress=False)
    assert shard_counts({"0": 3, "1": [4, 2]}) == {0: [3], 1: [4, 2]}  # progress.json from before several directories


def test_gpu_distillation_script_runs_end_to_end(tiny_dirs, tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """scripts/distill_on_gpu.sh on the tiny target, on the CPU: GPU time is scarce, so the script must not
    first fail there. The tiny model cannot write usable data itself (see ``accepting_gibberish``), so the
    data stage finds a finished directory in place; calibration, the update count and side-by-side training run."""
    import shutil

    from moaspec.drafters import load_drafter
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.moa import MoADrafter

    out = tmp_path / "out"
    shutil.copytree(tiny_data, out / "data1")
    env = dict(os.environ, MODEL=str(tiny_dirs["llama"]), PROCS="1", DATA_S="3", TRAIN_S="0.5", DRAFTERS="moa eagle",
               MOASPEC=f"{sys.executable} -m moaspec", PYTHONWARNINGS="ignore")
    script = str(REPO / "scripts" / "distill_on_gpu.sh")
    proc = subprocess.run(["bash", script, str(out), "--tokens-per-batch", "1024", "--warmup", "5", "--threads", "1",
                           "--draft-vocab", "256"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the floor: 0.5 s buys fewer (5 s bought more than 100 tiny updates on a fast CPU, and the test failed there)
    assert "training: 100 updates each" in proc.stdout
    for kind, cls in (("moa", MoADrafter), ("eagle", EagleDrafter)):
        assert isinstance(load_drafter(out / kind / "drafter", tiny_llama), cls)

    # DATA_OPTIONS reach every `moaspec data` process (here a bad one, which it names; the data in place is used),
    # and a passage file is split between the processes (--part K/PROCS)
    shutil.copytree(tiny_data, tmp_path / "opts" / "data1")
    proc = subprocess.run(["bash", script, str(tmp_path / "opts"), "--tokens-per-batch", "1024", "--warmup", "5",
                           "--threads", "1", "--draft-vocab", "256"],
                          # DATA_S: time to start and refuse the option even on a busy machine (it exits at once)
                          env={**env, "DRAFTERS": "eagle", "DATA_OPTIONS": "--passages docs --pasted-fraction 1.5",
                               "DATA_S": "120"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = (tmp_path / "opts" / "data1.log").read_text()
    assert "--passages docs --pasted-fraction 1.5 --part 1/1" in log.splitlines()[0]
    assert "--pasted-fraction must be between 0 and 1" in log

    proc = subprocess.run(["bash", script, str(tmp_path / "other")], env={**env, "DRAFTERS": "moa nope"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "unknown drafter nope" in proc.stderr


@pytest.mark.parametrize("kind", ["moa", "eagle", "independent"])
def test_drafters_train_for_a_qwen3_target_with_scaled_rope(tmp_path: Path, kind: str) -> None:
    """A target whose blocks have query/key norms and whose RoPE is YaRN-scaled: its data, a few updates of each
    drafter (MoA through one reused target layer; the Llama-shaped independent drafter starts from the target's
    first block without those norms), and the saved drafter loads against it."""
    from moaspec.drafters.checkpoint import load_drafter
    from moaspec.models import load_model_dir
    from test_runtime import VARIANTS
    from tiny import make_tiny_model

    family, overrides = VARIANTS["qwen3-rope-yarn"]
    target = load_model_dir(make_tiny_model(tmp_path / "qwen3", family, **overrides), device="cpu")
    with accepting_gibberish():
        generate_dataset(target, tmp_path / "data", DataConfig(examples=16, shard_size=16, batch_size=16, max_query_tokens=16,
                                                               max_answer_tokens=32), progress=False)
    config = small(kind=kind, steps=6, eval_every=6, save_every=6, val_fraction=0.25, tli_layers=int(kind == "moa"))
    sizes = {"layers": 1} if kind == "independent" else None
    summary = Trainer(target, tmp_path / "data", tmp_path / "run", config, sizes, progress=False).train()
    assert summary["steps"] == 6
    assert all(math.isfinite(float(r["loss"])) for r in read_log(tmp_path / "run" / "train_log.csv"))
    load_drafter(tmp_path / "run" / "drafter", target)


# --- the MoA authors' recipe (huawei-noah/HEBO, branch mixture-of-attentions), as options -----------------------


def test_eagle_embedding_noise_is_uniform_applied_in_training_only_and_leaves_the_targets_clean(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    """--embedding-noise A: U(−A, A) on the token embeddings EAGLE reads, in training mode only (as on its features)."""
    from moaspec.drafters.eagle import EagleConfig, EagleDrafter

    torch.manual_seed(0)
    drafter = EagleDrafter(EagleConfig.for_target(tiny_llama.cfg, feature_noise=0.0))
    drafter.attach(tiny_llama.model)
    tokens = torch.randint(0, tiny_llama.cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(1))
    features = torch.randn(2, 7, tiny_llama.cfg.hidden_size)
    kept = features.clone()
    prev = torch.cat([torch.zeros_like(features[:, :1]), features[:, :-1]], dim=1)
    emb = tiny_llama.model.embed(tokens)
    with torch.no_grad():
        clean = drafter.eval()(tokens, features)
        drafter.embedding_noise = 0.1
        assert torch.equal(drafter(tokens, features), clean)  # evaluation and drafting: no noise
        drafter.train()
        torch.manual_seed(7)
        noisy = drafter(tokens, features)
        torch.manual_seed(7)
        noise = (torch.rand_like(emb) * 2 - 1) * 0.1  # the draw the pass made
        cos, sin = drafter.rope(torch.arange(7))
        mask = torch.ones(7, 7, dtype=torch.bool).tril()
        expected = drafter.layer.self_attention(drafter.fc(torch.cat([prev, emb + noise], -1)), cos, sin, mask)
    torch.testing.assert_close(noisy, expected)
    assert 0.09 < float(noise.abs().max()) <= 0.1 and abs(float(noise.mean())) < 0.01
    assert not torch.allclose(noisy, clean)
    assert torch.equal(features, kept)  # the target's features, the regression targets, stay clean
    drafter.embedding_noise = 0.0
    torch.manual_seed(7)
    assert torch.equal(drafter(tokens, features), clean)  # no noise at all without feature noise either


@pytest.mark.parametrize("kw, fragment", [
    (dict(kind="eagle", segment_start_in_memory=True), "MoA drafters only"),
    (dict(kind="eagle", norm_init_std=0.02), "MoA drafters only"),
    (dict(segment_start_in_memory=True, segment_min=1), "--segment-min >= 2"),
    (dict(segment_periodic=True, segment_long_fraction=0.2, segment_long_max=40), "cannot mix in"),
    (dict(pseudo_epoch=3, warmup=3), "longer than --warmup"),
    (dict(pseudo_epoch=-1), "--pseudo-epoch"),
    (dict(norm_init_std=float("nan")), r"--norm-init-std must be in \[0, 1\]"),
    (dict(norm_init_std=0.02, init_from="some/drafter"), "keeps its trained norms"),
    (dict(kind="eagle", embedding_noise=-0.1), r"--embedding-noise must be in \[0, 1\]"),
    (dict(embedding_noise=0.1), "EAGLE drafters only"),
])
def test_the_authors_recipe_options_refuse_bad_values(tiny_llama, tiny_data: Path, tmp_path: Path, kw, fragment) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(MoaspecError, match=fragment):
        Trainer(tiny_llama, tiny_data, tmp_path / "run", small(**kw), progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("kind", ["moa", "eagle"])
def test_the_authors_recipe_trains(tiny_llama, tiny_data: Path, tmp_path: Path, monkeypatch, kind: str) -> None:  # type: ignore[no-untyped-def]
    """Every option of the authors' recipe at once reaches training (masks, staircase, learning rate, init, noise),
    is saved in the drafter's training config, and the held-out evaluation keeps inference's masks."""
    from moaspec.drafters.checkpoint import load_drafter
    from moaspec.training import trainer as trainer_module

    calls: list[dict[str, object]] = []
    real = trainer_module.build_masks

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        masks = real(*args, **kwargs)
        calls.append({"local": args[2].tolist(), "inclusive": masks.inclusive, "starts": masks.starts})
        return masks

    monkeypatch.setattr(trainer_module, "build_masks", spy)
    options = dict(pseudo_epoch=4, warmup=2, lr=2e-3)
    if kind == "moa":
        options.update(segment_start_in_memory=True, segment_periodic=True, segment_min=3, segment_max=6,
                       norm_init_std=0.02)
    else:
        options.update(embedding_noise=0.1)
    cfg = small(kind=kind, steps=6, eval_every=6, save_every=6, val_fraction=0.2, **options)
    trainer = Trainer(tiny_llama, tiny_data, tmp_path / "run", cfg, progress=False)
    if kind == "moa":
        assert float(trainer.raw.sa.attn_norm.weight.detach().abs().max()) < 0.1  # near-zero gains
    else:
        assert trainer.raw.embedding_noise == 0.1
    summary = trainer.train()
    log = read_log(tmp_path / "run" / "train_log.csv")
    assert all(math.isfinite(float(r["loss"])) for r in log)
    # lr after each update: warm-up to 2e-3 over 2, down to 1e-4 by update 4, then constant
    assert [float(r["lr"]) for r in log] == pytest.approx([2e-3, 2e-3, 1.05e-3, 1e-4, 1e-4, 1e-4])
    train_calls = calls[: cfg.steps]
    assert all(all(c["local"]) for c in train_calls[:4])  # pseudo-epoch 0: every sequence's SA is local
    assert train_calls[0]["inclusive"] == (kind == "moa")
    assert not any(c["inclusive"] for c in calls[cfg.steps :])  # evaluation: inference's masks
    if kind == "moa":
        starts = train_calls[0]["starts"]
        assert isinstance(starts, torch.Tensor)
        for row in starts:
            bounds = sorted(set(row[row > 0].tolist()))
            assert len({b - a for a, b in zip(bounds[1:], bounds[2:])}) <= 1  # one period per sequence
    saved = json.loads((tmp_path / "run" / "drafter" / "config.json").read_text())["training"]["config"]
    for name, value in options.items():
        assert saved[name] == value
    drafter = load_drafter(tmp_path / "run" / "drafter", tiny_llama)
    if kind == "moa":
        assert drafter.cfg.ca_reach == 5  # a 6-position segment whose start reads itself reaches 5 past it
    assert 1.0 <= summary["last_val"]["val_tau_decode"] <= 7.0


def drafter_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "drafter" / "model.safetensors"))


def test_drafters_trained_together_end_as_each_trained_alone(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """MoA and EAGLE trained together, on batches drawn once and features computed once, end with the weights and
    losses of each trained alone: each keeps its own optimizer, schedule and random stream (EAGLE's feature noise
    is drawn from torch's global generator, which MoA's updates would otherwise advance). A row every 2 updates
    reports the mean of those updates' losses and changes no weight."""
    from moaspec.training.trainer import train_together

    cfgs = {"moa": small(steps=4, save_every=4, eval_every=100),
            "eagle": small(kind="eagle", steps=4, save_every=4, eval_every=100, lr=1e-3)}
    for name, cfg in cfgs.items():
        Trainer(tiny_llama, tiny_data, tmp_path / "alone" / name, cfg, progress=False).train()
    moa = Trainer(tiny_llama, tiny_data, tmp_path / "together" / "moa", cfgs["moa"], progress=False)
    eagle = Trainer(tiny_llama, moa.data, tmp_path / "together" / "eagle",
                    TrainConfig(**{**cfgs["eagle"].__dict__, "log_every": 2}), progress=False)
    summaries = train_together([moa, eagle])
    assert [s["steps"] for s in summaries] == [4, 4] and all(s["finished"] for s in summaries)
    for name in cfgs:
        alone, together = drafter_weights(tmp_path / "alone" / name), drafter_weights(tmp_path / "together" / name)
        assert alone.keys() == together.keys()
        for k in alone:
            torch.testing.assert_close(together[k], alone[k], msg=f"{name}: {k}")
    alone_log = read_log(tmp_path / "alone" / "moa" / "train_log.csv")
    together_log = read_log(tmp_path / "together" / "moa" / "train_log.csv")
    assert [(r["tokens"], r["loss"]) for r in together_log] == [(r["tokens"], r["loss"]) for r in alone_log]
    alone_log = read_log(tmp_path / "alone" / "eagle" / "train_log.csv")
    rows = read_log(tmp_path / "together" / "eagle" / "train_log.csv")
    assert [r["step"] for r in rows] == ["2", "4"] and [r["tokens"] for r in rows] == [alone_log[1]["tokens"],
                                                                                      alone_log[3]["tokens"]]
    for row, pair in zip(rows, (alone_log[:2], alone_log[2:])):
        assert float(row["loss"]) == pytest.approx(sum(float(r["loss"]) for r in pair) / 2, abs=2e-5)
    assert torch.equal(moa.raw.draft_vocab, eagle.raw.draft_vocab)  # one draft vocabulary, computed once


def test_a_drafter_behind_catches_up_and_mismatched_drafters_are_refused(tiny_llama, tiny_data: Path,  # type: ignore[no-untyped-def]
                                                                         tmp_path: Path) -> None:
    """A run stopped between two drafters' saves resumes: the drafter behind trains alone until it reaches the
    other, then both go on together; each ends as trained alone. Drafters that would batch the data otherwise,
    or share a run directory, are refused."""
    from moaspec.training.trainer import train_together

    moa_cfg, eagle_cfg = small(steps=3, save_every=1, eval_every=100), small(kind="eagle", steps=3, save_every=1,
                                                                             eval_every=100)
    Trainer(tiny_llama, tiny_data, tmp_path / "alone", eagle_cfg, progress=False).train()
    Trainer(tiny_llama, tiny_data, tmp_path / "moa-alone", moa_cfg, progress=False).train()
    Trainer(tiny_llama, tiny_data, tmp_path / "run" / "moa", moa_cfg, progress=False).train(until=2)  # as if stopped
    moa = Trainer(tiny_llama, tiny_data, tmp_path / "run" / "moa", moa_cfg, progress=False)
    eagle = Trainer(tiny_llama, moa.data, tmp_path / "run" / "eagle", eagle_cfg, progress=False)
    assert (moa.step, eagle.step) == (2, 0)
    train_together([moa, eagle])
    for alone, together in (("alone", "eagle"), ("moa-alone", "moa")):
        a, b = drafter_weights(tmp_path / alone), drafter_weights(tmp_path / "run" / together)
        for k in a:
            torch.testing.assert_close(b[k], a[k], msg=f"{together}: {k}")
    with pytest.raises(MoaspecError, match=r"same --tokens-per-batch \(512 against 1024\)"):
        Trainer(tiny_llama, moa.data, tmp_path / "x", small(kind="eagle", tokens_per_batch=1024), progress=False)
    with pytest.raises(MoaspecError, match="same run directory"):
        train_together([moa, Trainer(tiny_llama, moa.data, tmp_path / "run" / "moa", moa_cfg, progress=False)])


def test_train_cli_trains_several_drafters_in_one_process(tiny_dirs, tiny_llama, tiny_data: Path, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                          capsys) -> None:
    """`moaspec train --arms moa,eagle` (or --arm NAME=OPTIONS, one per drafter) writes one run directory per
    drafter; an arm's bad option is named with the arm, before the target loads."""
    from moaspec.cli import main
    from moaspec.drafters import load_drafter
    from moaspec.drafters.eagle import EagleDrafter
    from moaspec.drafters.moa import MoADrafter

    base = ["train", "--model", str(tiny_dirs["llama"]), "--data", str(tiny_data), "--steps", "2", "--tokens-per-batch",
            "512", "--draft-vocab", "128", "--val-fraction", "0.1", "--eval-every", "100", "--save-every", "2",
            "--mixed-precision", "no", "--no-progress"]
    assert main([*base, "--output", str(tmp_path / "kinds"), "--arms", "moa,eagle"]) == 0
    for name, cls in (("moa", MoADrafter), ("eagle", EagleDrafter)):
        assert isinstance(load_drafter(tmp_path / "kinds" / name / "drafter", tiny_llama), cls)
    assert main([*base, "--output", str(tmp_path / "named"), "--arm", "wide=--kind moa --lr 1e-3 --sa-mlp 64",
                 "--arm", "base=--kind eagle --log-every 2"]) == 0
    assert load_drafter(tmp_path / "named" / "wide" / "drafter", tiny_llama).cfg.sa_mlp == 64
    assert json.loads((tmp_path / "named" / "wide" / "progress.json").read_text())["config"]["lr"] == 1e-3
    assert len(read_log(tmp_path / "named" / "base" / "train_log.csv")) == 1
    capsys.readouterr()
    for arms, says in ((["--arm", "a=--kind moa", "--arm", "b=--tokens-per-batch 64"], "--arm b: unrecognized arguments"),
                       (["--arm", "a=--kind moa", "--arm", "a=--kind eagle"], "--arm a is given twice"),
                       (["--arm", "x", "--arm", "moa"], "must be a kind"),
                       (["--arm", "a/b=--kind moa", "--arm", "moa"], "letters, digits"),
                       (["--arm", "a=--kind moa --lr 0", "--arm", "moa"], "--lr must be a finite number > 0")):
        assert main([*base, "--output", str(tmp_path / "bad"), *arms]) == 2
        assert says in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()
