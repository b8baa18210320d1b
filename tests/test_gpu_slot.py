"""What a fixed slot of GPU time runs, tried on the CPU with a tiny model: drafters packed into files of bounded
size and back, training that stops at its time limit, the throughput probe, and `scripts/gpu_slot.sh` end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from moaspec.drafters.checkpoint import save_drafter, target_identity
from moaspec.drafters.eagle import EagleConfig, EagleDrafter
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.errors import MoaspecError
from moaspec.training.carry import pack, unpack
from moaspec.training.trainer import Trainer, read_progress, train_together
from test_training import read_log, small

REPO = Path(__file__).resolve().parent.parent


def tiny_drafters(target, root: Path) -> dict[str, Path]:  # type: ignore[no-untyped-def]
    """Untrained MoA and EAGLE drafters for ``target``, exported as training exports them."""
    torch.manual_seed(3)
    return {"moa": save_drafter(MoADrafter(MoAConfig.for_target(target.cfg)), root / "moa", target_identity(target)),
            "eagle": save_drafter(EagleDrafter(EagleConfig.for_target(target.cfg)), root / "eagle",
                                  target_identity(target))}


def test_a_packed_drafter_is_split_under_the_limit_and_unpacks_to_the_same(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    drafter = tiny_drafters(tiny_llama, tmp_path / "d")["moa"]
    weights = load_file(str(drafter / "model.safetensors"))
    limit = 64 * 1024 + max(t.numel() * t.element_size() for t in weights.values())
    files = pack(drafter, tmp_path / "out" / "moa", max_bytes=limit)
    assert len(files) > 1 and all(f.stat().st_size <= limit for f in files)
    assert [f.name for f in files][0] == f"moa.part1-of-{len(files)}.safetensors"
    back = unpack(tmp_path / "out" / "moa", tmp_path / "back")
    assert (back / "config.json").read_text() == (drafter / "config.json").read_text()
    again = load_file(str(back / "model.safetensors"))
    assert again.keys() == weights.keys() and all(torch.equal(again[k], weights[k]) for k in weights)
    assert [f.name for f in pack(drafter, tmp_path / "out" / "moa")] == ["moa.safetensors"]  # the parts replaced
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["moa.safetensors"]
    files = pack(drafter, tmp_path / "out2" / "moa", max_bytes=limit)
    files[-1].unlink()
    with pytest.raises(MoaspecError, match="incomplete"):
        unpack(tmp_path / "out2" / "moa", tmp_path / "never")
    with pytest.raises(MoaspecError, match="more than a packed file may hold"):
        pack(drafter, tmp_path / "out3" / "moa", max_bytes=limit - 1)


def test_training_stops_at_its_time_limit_saved_and_resumes(tiny_llama, tiny_data: Path, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Out of time, the update under way is the last: every drafter saved and exported where it stopped, and the
    same command resumes them (a slot of machine time ends; the next one goes on)."""
    cfg = small(steps=6, save_every=100, eval_every=100)
    moa = Trainer(tiny_llama, tiny_data, tmp_path / "moa", cfg, progress=False)
    eagle = Trainer(tiny_llama, moa.data, tmp_path / "eagle", small(kind="eagle", steps=6, save_every=100,
                                                                    eval_every=100), progress=False)
    summaries = train_together([moa, eagle], time_limit=1e-9)
    assert [s["steps"] for s in summaries] == [1, 1] and not any(s["finished"] for s in summaries)
    for name in ("moa", "eagle"):
        assert read_progress(tmp_path / name)["step"] == 1
        assert json.loads((tmp_path / name / "drafter" / "config.json").read_text())["training"]["steps"] == 1
    moa = Trainer(tiny_llama, tiny_data, tmp_path / "moa", cfg, progress=False)
    assert moa.step == 1 and moa.train()["finished"]


def test_the_probe_reports_answer_and_loss_tokens_per_second(tiny_dirs, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import train_throughput
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert train_throughput.main(["--model", str(tiny_dirs["llama"]), "--device", "cpu", "--tokens-per-batch", "512",
                                  "--draft-vocab", "128", "--max-len", "256", "--data-examples", "12",
                                  "--data-batch-size", "6", "--max-answer-tokens", "32", "--warmup", "1",
                                  "--max-updates", "2", "--train-seconds", "600", "--mixed-precision", "no",
                                  "--work", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["answer_tokens"] > 0 and report["answer_tokens_per_s"] > 0
    assert report["updates"] == 2 and report["s_per_update"] > 0
    assert set(report["arms"]) == {"moa", "eagle"}
    loss = [arm["loss_tokens"] for arm in report["arms"].values()]
    assert all(n > 0 for n in loss)
    assert report["loss_tokens_per_s_together"] == pytest.approx(sum(loss) / report["train_s"], rel=0.01)
    logs = {arm: read_log(tmp_path / "runs" / arm / "train_log.csv") for arm in ("moa", "eagle")}
    assert [r["step"] for r in logs["moa"]] == [r["step"] for r in logs["eagle"]] == ["1", "3"]


def test_the_gpu_slot_script_runs_end_to_end_on_the_cpu(tiny_dirs, tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A dry run of the whole slot on the CPU: probe, data from a prompt file shared by two processes, MoA and
    EAGLE continued from an earlier slot's packed results on the same batches, results packed to come back."""
    earlier = tmp_path / "earlier"
    for name, drafter in tiny_drafters(tiny_llama, tmp_path / "start").items():
        pack(drafter, earlier / name)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [f"Tell me about the number {i}."], "category": ("a", "b")[i % 2]})
                               + "\n" for i in range(16)))
    env = {**os.environ, "MODEL": str(tiny_dirs["llama"]), "DEVICE": "cpu", "BUDGET_S": "220", "PROBE_S": "90",
           "DATA_S": "60", "PROCS": "2", "DATA_BATCH": "4", "PROMPTS": str(prompts), "FROM": str(earlier),
           "TOKENS_PER_BATCH": "512", "WORK": str(tmp_path / "work"), "PYTHON": sys.executable,
           "DATA_OPTIONS": "--max-answer-tokens 32", "TRAIN_OPTIONS": "--mixed-precision no --val-fraction 0.1 --draft-vocab 0 "
                                                                      "--max-len 256",
           "PROBE_OPTIONS": "--draft-vocab 128 --max-len 256 --data-examples 8 --max-answer-tokens 32 "
                            "--max-updates 2 --mixed-precision no"}
    results = tmp_path / "results"
    done = subprocess.run(["bash", str(REPO / "scripts" / "gpu_slot.sh"), str(results)], env=env, capture_output=True,
                          text=True, timeout=900)
    log = (results / "slot.log").read_text()
    assert done.returncode == 0, log
    assert sorted(p.name for p in results.iterdir()) == ["eagle.safetensors", "logs.tar.gz", "moa.safetensors",
                                                         "slot.log"]
    assert "s_per_update" in log and "answer tokens" in log
    runs = tmp_path / "work" / "runs"
    steps = [read_progress(runs / arm)["step"] for arm in ("moa", "eagle")]
    assert steps[0] == steps[1] >= 1  # the same updates on the same batches
    for arm in ("moa", "eagle"):
        drafter = unpack(results / arm, tmp_path / "back" / arm)
        lineage = json.loads((drafter / "config.json").read_text())["training"]["lineage"]
        assert lineage[-1].startswith("+") and str(tmp_path / "work" / "data1") in lineage[-1]
        trained = load_file(str(drafter / "model.safetensors"))
        before = load_file(str(tmp_path / "start" / arm / "model.safetensors"))
        assert trained.keys() == before.keys() and any(not torch.equal(trained[k], before[k]) for k in before)
    listing = subprocess.run(["tar", "-tzf", str(results / "logs.tar.gz")], capture_output=True, text=True).stdout
    assert "runs/moa/train_log.csv" in listing and "probe.json" in listing and "data1/manifest.json" in listing
