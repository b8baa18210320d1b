"""``moaspec train``: distil a drafter (MoA, or the EAGLE baseline) from its target with HF Accelerate.

The same command runs on one CPU, under ``torchrun``/``accelerate launch`` with several
processes (gloo on CPUs), or on GPUs with mixed precision. Every process holds the
frozen target and computes its features on the fly for its own share of the batches
(on this CPU that is cheaper than reading ~23 KB of cached K/V per token back from
disk; see BENCHMARKS.md). Progress is resumable exactly: Accelerate's state (drafter,
optimizer, scheduler, RNGs) plus ``progress.json`` are saved atomically, and batch
order is a pure function of the seed and epoch. Data still being written by
``moaspec data`` joins the run at the next epoch (``progress.json`` records how many
shards each epoch used, so a resumed run replays the same epochs).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import pickle
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from moaspec.drafters.base import Drafter
from moaspec.drafters.checkpoint import kind_of, save_drafter, target_identity
from moaspec.drafters.eagle import EagleConfig, EagleDrafter
from moaspec.drafters.independent import IndependentConfig, IndependentDrafter
from moaspec.drafters.moa import MoAConfig, MoADrafter
from moaspec.errors import MoaspecError, brief
from moaspec.fileio import atomic_write_text
from moaspec.models.loading import LoadedModel
from moaspec.models.packed_linear import bf16_kernels
from moaspec.progress import progress_bar
from moaspec.training.compiled import compile_training_forward
from moaspec.training.dataset import (
    Batch,
    DamagedFile,
    Example,
    batch_stream,
    collate,
    data_sources,
    describe_data,
    draft_vocabulary,
    load_examples,
    make_batches,
    read_json,
    read_manifest,
)
from moaspec.training.distill import (
    acceptance_by_offset,
    accepted_runs,
    build_masks,
    drafter_loss,
    full_argmax,
    simulate_chain,
    step_accuracy,
    step_matches,
)
from moaspec.training.features import FeatureStore, TargetOut, room_warning
from moaspec.training.losses import FEATURE_WEIGHT, KL_WEIGHT
from moaspec.training.masks import epoch_staircase_probability, staircase_probability
from moaspec.validation import real_number, whole_number


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "moa"  # moa | eagle | independent
    steps: int = 1000  # optimizer updates
    tokens_per_batch: int = 4096  # per micro-batch and process, padding included
    grad_accum: int = 1
    lr: float = 5e-4
    warmup: int = 50
    min_lr_ratio: float = 0.1  # cosine decay ends at lr · this
    weight_decay: float = 0.0
    clip: float = 1.0
    max_len: int = 1024
    segment_min: int = 5
    segment_max: int = 15
    segment_long_max: int = 0  # with segment_long_fraction > 0: that share of segments is segment_max+1..this long
    segment_long_fraction: float = 0.0
    staircase: bool = True
    kl_weight: float = KL_WEIGHT  # the paper's 0.1 · KL + 1.0 · SmoothL1 unless changed
    feature_weight: float = FEATURE_WEIGHT
    val_fraction: float = 0.02
    val_batches: int = 8
    eval_every: int = 100
    save_every: int = 50
    draft_vocab: int = 8192  # 0 = full vocabulary
    tli_layers: int = 0
    seed: int = 0
    mixed_precision: str = "auto"  # auto | no | fp16 | bf16
    cache_features: bool = True  # keep the target's features on disk after their first computation
    init_from: str = ""  # start from this exported drafter instead of random weights
    same_data_as: str = ""  # replay this run's shards per epoch and draft vocabulary (a like-for-like comparison)
    # the authors' recipe (huawei-noah/HEBO, branch mixture-of-attentions), each off by default:
    segment_start_in_memory: bool = False  # MoA: a segment start reads its own memory entry (their CA mask)
    segment_periodic: bool = False  # MoA: one segment length per sequence, starts at its multiples (their `every`)
    pseudo_epoch: int = 0  # > 0: their staircase and peak-then-constant LR over pseudo-epochs of this many updates
    norm_init_std: float = 0.0  # > 0: MoA from random weights starts its norm gains ~ N(0, std²) instead of 1
    embedding_noise: float = 0.0  # EAGLE: U(−a, a) on its training input embeddings, besides the features'
    log_every: int = 1  # a train_log.csv row every this many updates: the losses are read back from the device then


# with --pseudo-epoch, the learning rate peaks at --lr and settles at --lr / this (the authors' 20 × 3e-5 → 3e-5)
PEAK_TO_BASE_LR = 20.0


# what a run directory holds: progress.json makes it resumable; the logs and state may come before it
RUN_MARKER = "progress.json"
RUN_FILES = ("train_log.csv", "val_log.csv", "train_config.json", "state", "state.tmp", "state.old", "drafter")


def shard_counts(saved: dict[str, Any]) -> dict[int, list[int]]:
    """``epoch_shards`` as saved in progress.json; runs from before multi-directory data saved one count per epoch."""
    return {int(k): [int(v)] if isinstance(v, int) else [int(x) for x in v] for k, v in saved.items()}


def read_progress(run: Path) -> dict[str, Any]:
    """``run``'s progress.json, checked to hold what resuming or replaying the run reads.

    Raises :class:`DamagedFile` naming the file and what is wrong with it.
    """
    path = run / "progress.json"
    saved = read_json(path, dict)
    numbers = all(real_number(saved.get(k)) and saved[k] >= 0 for k in ("step", "tokens", "wall_s")) \
        and whole_number(saved["step"]) and whole_number(saved["tokens"])
    if numbers and isinstance(saved.get("config"), dict) and whole_number(steps := saved["config"].get("steps")) \
            and saved["step"] > steps:
        raise DamagedFile(f"{path} is at update {saved['step']} of a run of {steps}")
    try:
        shard_counts(saved.get("epoch_shards", {}))
        readable = numbers and isinstance(saved.get("config"), dict)
    except (AttributeError, TypeError, ValueError):
        readable = False
    if not readable:
        raise DamagedFile(f"{path} lacks the step, token, time (numbers >= 0), config or shard counts a run saves")
    return saved


def lr_lambda(cfg: TrainConfig, calls_per_update: int = 1):  # type: ignore[no-untyped-def]
    """The learning rate's factor on ``cfg.lr`` at each scheduler call.

    Default: linear warm-up over ``cfg.warmup`` updates, then a cosine decay to ``min_lr_ratio``.
    With ``cfg.pseudo_epoch`` (the authors' schedule, compressed): warm-up to ``cfg.lr``, the
    peak, a linear fall to ``cfg.lr / PEAK_TO_BASE_LR`` by the end of the first pseudo-epoch,
    then that base to the end. Accelerate calls the scheduler once per process and update
    (``calls_per_update``); the pseudo-epoch schedule counts updates, so that it steps down
    with the staircase it pairs with on any number of processes.
    """
    if cfg.pseudo_epoch:
        base = 1 / PEAK_TO_BASE_LR

        def peak_then_base(call: int) -> float:
            step = call // calls_per_update
            if step < cfg.warmup:
                return (step + 1) / cfg.warmup
            return max(base, 1 - (1 - base) * (step - cfg.warmup) / (cfg.pseudo_epoch - cfg.warmup))
        return peak_then_base

    def f(step: int) -> float:
        if step < cfg.warmup:
            return (step + 1) / cfg.warmup
        progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
        return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


def resolve_precision(choice: str, cpu: bool) -> str:
    """The mixed precision ``--mixed-precision choice`` means on this machine (``cpu``: training on the CPU).

    "auto" is bf16 autocast (fp32 master weights) wherever it is quick: a GPU with bf16, fp16 on an older
    one, and a CPU whose oneDNN has bf16 kernels, where one update of the MoA drafter took two thirds of
    fp32's time for the same loss (docs/experiments/2026-12-04-cpu-training-precision.md, "Training in bf16 on the
    CPU"). Other CPUs train in fp32.
    """
    if choice != "auto":
        return choice
    if not cpu and torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if bf16_kernels() else "no"


def fused_if_supported(device: torch.device) -> dict[str, bool]:
    """AdamW's options on ``device``: on a GPU its fused kernel, one launch for every parameter instead of a
    dozen per tensor (the same arithmetic); on a CPU torch's default."""
    return {"fused": True} if device.type == "cuda" else {}


def _forget_previous_run_precision() -> None:
    """Accelerate keeps one process-wide state and refuses a second ``Accelerator`` with another precision, so a
    program (a notebook, a sweep) that trains twice would fail on its second run. Only that per-run state is
    dropped; the process group of a multi-process launch (``PartialState``) is kept."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=False)


def inherited_lineage(drafter_dir: Path) -> list[str]:
    """The lineage an exported drafter records: its ``training.lineage``, or else one line for the run that
    wrote it (checkpoints written before lineages were kept), or nothing if it records no training."""
    from moaspec.drafters.checkpoint import read_meta

    training = read_meta(drafter_dir).get("training")  # load_drafter has already accepted this checkpoint
    if not isinstance(training, dict):
        return []
    if isinstance(training.get("lineage"), list):
        return [str(x) for x in training["lineage"]]
    if training.get("steps"):
        return [f"{training['steps']:,} updates ({training.get('tokens', 0):,} loss tokens) on "
                f"{', '.join(map(str, training.get('data', [])))}"]
    return []


def check_recipe_options(cfg: TrainConfig) -> None:
    """Refuse a combination of the authors'-recipe options that cannot train what it says (MoaspecError)."""
    if cfg.kind != "moa" and (cfg.segment_start_in_memory or cfg.segment_periodic or cfg.norm_init_std):
        raise MoaspecError("--segment-start-in-memory, --segment-periodic and --norm-init-std apply to MoA drafters only")
    if cfg.segment_start_in_memory and cfg.segment_min < 2:
        raise MoaspecError("--segment-start-in-memory needs --segment-min >= 2: a segment's start reads its own memory "
                           "entry, so a one-position segment would train no draft that inference makes")
    if cfg.segment_periodic and cfg.segment_long_fraction:
        raise MoaspecError("--segment-periodic draws one length per sequence; it cannot mix in --segment-long-fraction")
    if cfg.pseudo_epoch < 0 or (cfg.pseudo_epoch and cfg.warmup >= cfg.pseudo_epoch):
        raise MoaspecError(f"--pseudo-epoch ({cfg.pseudo_epoch} updates) must be longer than --warmup ({cfg.warmup}): "
                           "the learning rate falls from its peak to the base over the rest of the first pseudo-epoch")
    if not (math.isfinite(cfg.norm_init_std) and 0 <= cfg.norm_init_std <= 1):
        raise MoaspecError(f"--norm-init-std must be in [0, 1], got {cfg.norm_init_std}")
    if cfg.norm_init_std and cfg.init_from:
        raise MoaspecError("--norm-init-std sets how a drafter from random weights starts; an --init-from drafter "
                           "keeps its trained norms")
    if not (math.isfinite(cfg.embedding_noise) and 0 <= cfg.embedding_noise <= 1):
        raise MoaspecError(f"--embedding-noise must be in [0, 1], got {cfg.embedding_noise}")
    if cfg.embedding_noise and cfg.kind != "eagle":
        raise MoaspecError("--embedding-noise applies to EAGLE drafters only")


# What decides the batches and the target's features: arms trained together must agree on these
SHARED_FIELDS = ("max_len", "tokens_per_batch", "grad_accum", "seed", "val_fraction", "tli_layers", "mixed_precision",
                 "cache_features", "same_data_as")


class TrainingData:
    """What every drafter of a run trains on: the data directories, their train/held-out split, the shards
    each epoch used, and the frozen target's features for each batch.

    One instance serves several drafters (:func:`train_together`): each batch is drawn once and the
    target runs over it once, then every drafter learns from the same tensors, so the drafters stay on
    identical data by construction and the target's forward is paid once, not once per drafter.
    ``cfg`` gives the fields of :data:`SHARED_FIELDS`; the drafters' other settings are their own.
    """

    def __init__(self, target: LoadedModel, data: Path | Sequence[Path], cfg: TrainConfig) -> None:
        from accelerate import PartialState

        self.target, self.cfg = target, cfg
        on_cpu = target.model.device.type == "cpu"
        self.state = PartialState(cpu=on_cpu)  # the process group: every drafter's Accelerator joins it
        if target.model.device != self.state.device and not on_cpu:  # one GPU per process
            target.model.to(self.state.device)
        if not on_cpu:
            # TF32 matmuls for an fp32 target on a GPU: its features are rounded through fp16
            # (same 10-bit mantissa) before the drafter sees them, so TF32 loses nothing they keep
            torch.backends.cuda.matmul.allow_tf32 = True
        self.data_dirs = [data] if isinstance(data, Path) else list(data)
        if len({d.resolve() for d in self.data_dirs}) < len(self.data_dirs):
            raise MoaspecError("the same data directory was given twice")
        self.train_set, self.val_set = load_examples(self.data_dirs, target.fingerprint, cfg.max_len, cfg.val_fraction)
        self.feature_dirs = [d / "features" / f"{target.fingerprint}-len{cfg.max_len}-tli{cfg.tli_layers}"
                             for d in self.data_dirs] if cfg.cache_features else None
        self.features = FeatureStore(target.model, cfg.tli_layers)
        self.epoch_shards: dict[int, list[int]] = {}  # shards of each data directory that each epoch used
        self._vocabularies: dict[int, torch.Tensor] = {}
        if self.feature_dirs is not None and self.state.is_main_process:
            self._warn_if_the_cache_will_not_fit()

    def check_shared(self, cfg: TrainConfig) -> None:
        """Refuse a drafter whose settings would batch the data, or compute the target's features, otherwise."""
        differ = [name for name in SHARED_FIELDS if getattr(cfg, name) != getattr(self.cfg, name)]
        if differ:
            raise MoaspecError("drafters trained together share their batches and the target's features, so they need "
                               "the same " + ", ".join(f"--{n.replace('_', '-')} ({getattr(self.cfg, n)!r} against "
                                                       f"{getattr(cfg, n)!r})" for n in differ))

    def adopt_epoch_shards(self, saved: dict[int, list[int]], whose: Path) -> None:
        """Take the shards a resumed or replayed run used in each epoch; another drafter of this run must agree."""
        for epoch, counts in saved.items():
            if self.epoch_shards.setdefault(epoch, counts) != counts:
                raise MoaspecError(f"{whose} trained epoch {epoch} on {counts} shards where another drafter of this "
                                   f"run used {self.epoch_shards[epoch]}: they were not trained together")

    def draft_vocabulary(self, size: int) -> torch.Tensor:
        """The ``size`` tokens the target emits most in the training set (computed once for every drafter)."""
        if size not in self._vocabularies:
            cfg, tok = self.target.cfg, self.target.tokenizer
            eos = [*cfg.eos_token_ids, *cfg.generation_eos_ids, *(getattr(tok, "all_special_ids", []) or [])]
            self._vocabularies[size] = draft_vocabulary(self.train_set, size, eos, cfg.vocab_size)
        return self._vocabularies[size].clone()

    def shards_available(self) -> list[int]:
        return [len(read_manifest(d)["shards"]) for d in self.data_dirs]

    def examples_for(self, epoch: int) -> list[Example]:
        """The training examples of ``epoch``: every shard finished when it began (the same on every process)."""
        from accelerate.utils import broadcast_object_list

        if epoch not in self.epoch_shards:
            counts = [self.shards_available()]
            broadcast_object_list(counts)  # processes could see different manifests mid-write
            self.epoch_shards[epoch] = counts[0]
        held = {(ex.source, ex.key) for ex in self.val_set}
        train, _ = load_examples(self.data_dirs, self.target.fingerprint, self.cfg.max_len, self.cfg.val_fraction,
                                 self.epoch_shards[epoch])
        return [ex for ex in train if (ex.source, ex.key) not in held]

    def batches(self, skip: int) -> Iterator[Batch]:
        """This process's micro-batches, epoch after epoch, after the first ``skip``."""
        return batch_stream(self.examples_for, self.cfg.tokens_per_batch, self.cfg.seed, self.state.process_index,
                            self.state.num_processes, skip=skip)

    def _warn_if_the_cache_will_not_fit(self) -> None:
        """Say before the first update when the features still to cache outgrow a data directory's disk
        (a large target's are several times SmolLM2's 23.6 KiB a token), not hours later."""
        assert self.feature_dirs is not None
        todo = [0] * len(self.feature_dirs)
        for ex in (*self.train_set, *self.val_set):
            if not self._feature_file(ex.source, ex.key).is_file():
                todo[ex.source] += len(ex.tokens)
        for directory, tokens in zip(self.feature_dirs, todo):
            warning = room_warning(directory, tokens, self.target.cfg, self.cfg.tli_layers)
            if warning:
                print(f"moaspec train: {warning}", file=sys.stderr)

    def _feature_file(self, source: int, key: str) -> Path:
        """Where an example's cached features live: beside the data directory it came from."""
        assert self.feature_dirs is not None
        return self.feature_dirs[source] / f"{key}.safetensors"

    def target_features(self, batch: Batch) -> TargetOut:
        """The target's features for ``batch``, cached beside the data each example came from."""
        files = [None if self.feature_dirs is None else self._feature_file(s, k) for s, k in zip(batch.sources, batch.keys)]
        return self.features.features(batch.tokens, batch.lengths, files)


class RandomState:
    """A drafter's own stream of torch's global random numbers (CPU, and its GPU's), kept apart from other
    drafters trained in the same process.

    Random numbers drawn inside a drafter's pass (EAGLE's feature noise) come from torch's global
    generator; with its own stream, a drafter trained beside others draws what it would draw alone.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.capture()

    def capture(self) -> None:
        """Keep the global generators' state as this stream's."""
        self.cpu = torch.random.get_rng_state()
        self.gpu = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None

    @contextmanager
    def active(self) -> Iterator[None]:
        """Draw from this stream within the block; what the block leaves is kept for the next one."""
        torch.random.set_rng_state(self.cpu)
        if self.gpu is not None:
            torch.cuda.set_rng_state(self.gpu, self.device)
        try:
            yield
        finally:
            self.capture()


class Trainer:
    """One drafter's training: its weights, optimizer, schedule, random stream, logs and run directory.

    :meth:`train` trains it alone; :func:`train_together` trains several on the same batches, the
    target's features computed once per batch for all of them. A drafter alone is the case of one.
    """

    def __init__(self, target: LoadedModel, data: Path | Sequence[Path] | TrainingData, out: Path, cfg: TrainConfig,
                 sizes: dict[str, Any] | None = None, progress: bool = True, compile: bool = False) -> None:
        """``data``: one directory made by ``moaspec data``, or several to train on together, or the
        :class:`TrainingData` another drafter trains on (trained together with it by :func:`train_together`).
        ``compile``: the drafter's training pass through ``torch.compile`` (:mod:`moaspec.training.compiled`);
        it changes how updates run, not what they compute, so a run may be resumed with or without it."""
        from accelerate import Accelerator

        self.cfg, self.out, self.progress = cfg, out, progress
        check_recipe_options(cfg)
        if cfg.same_data_as and cfg.init_from:
            raise MoaspecError("--same-data-as and --init-from each decide the draft vocabulary: give one of them")
        if isinstance(data, TrainingData):
            data.check_shared(cfg)
        else:
            _forget_previous_run_precision()  # a new run, not a drafter joining one
            data = TrainingData(target, data, cfg)
        self.data = data
        on_cpu = target.model.device.type == "cpu"
        self.acc = Accelerator(cpu=on_cpu, gradient_accumulation_steps=cfg.grad_accum,
                               mixed_precision=resolve_precision(cfg.mixed_precision, on_cpu))
        self.target = target
        torch.manual_seed(cfg.seed)
        drafter: Drafter
        self.inherited_lineage: list[str] = []  # what made the --init-from drafter, oldest first
        if cfg.init_from:
            drafter = self._warm_start(target, Path(cfg.init_from), sizes or {})
            self.inherited_lineage = inherited_lineage(Path(cfg.init_from))
        elif cfg.kind == "moa":
            # Cross-Attention's reach: the longest query-to-memory distance these segments show (a segment
            # of n positions whose start reads its own entry reaches n − 1 past it, otherwise n)
            drafter = MoADrafter(MoAConfig.for_target(target.cfg, tli_layers=cfg.tli_layers, draft_vocab_size=cfg.draft_vocab,
                                                      ca_reach=cfg.segment_max - int(cfg.segment_start_in_memory),
                                                      **(sizes or {})))
        elif cfg.kind == "eagle":
            drafter = EagleDrafter(EagleConfig.for_target(target.cfg, draft_vocab_size=cfg.draft_vocab, **(sizes or {})))
        elif cfg.kind == "independent":
            drafter = IndependentDrafter(IndependentConfig.for_target(target.cfg, draft_vocab_size=cfg.draft_vocab,
                                                                      **(sizes or {})))
            drafter.copy_target_layers(target.model)
        else:
            raise MoaspecError(f"unknown drafter kind {cfg.kind!r}: choose moa, eagle or independent")
        if cfg.same_data_as:
            vocab = self._reference_data(target, Path(cfg.same_data_as))
            if vocab is not None:
                drafter.set_draft_vocab(vocab)
        elif cfg.draft_vocab and not cfg.init_from:
            drafter.set_draft_vocab(data.draft_vocabulary(cfg.draft_vocab))
        if isinstance(drafter, MoADrafter) and not cfg.init_from:
            drafter.start_out_norm_from(target.model)
            if cfg.norm_init_std:  # drawn after every other weight: with the same seed those start as without it
                drafter.start_norms_near_zero(cfg.norm_init_std)
        if isinstance(drafter, EagleDrafter):
            drafter.embedding_noise = cfg.embedding_noise
        drafter = drafter.to(target.model.device)
        drafter.attach(target.model)
        drafter.train()
        if compile:
            compile_training_forward(drafter)
        self.raw = drafter
        optim = torch.optim.AdamW(drafter.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay,
                                  **fused_if_supported(self.acc.device))
        sched = torch.optim.lr_scheduler.LambdaLR(optim, lr_lambda(cfg, self.acc.num_processes))
        self.model, self.optim, self.sched = self.acc.prepare(drafter, optim, sched)
        self.step, self.tokens, self.wall = 0, 0, 0.0
        self.random = RandomState(self.acc.device)
        with self.random.active():
            self._resume()
        self._masks = torch.Generator()  # segment starts, reseeded every update
        self._pending = torch.zeros(3, device=self.acc.device)  # loss, KL, feature: summed since the last log row
        self._pending_tokens, self._pending_updates, self._pending_wall = 0, 0, 0.0

    @property
    def data_dirs(self) -> list[Path]:
        return self.data.data_dirs

    @property
    def epoch_shards(self) -> dict[int, list[int]]:
        return self.data.epoch_shards

    def _warm_start(self, target: LoadedModel, path: Path, sizes: dict[str, Any]) -> Drafter:
        """Continue from an exported drafter (its architecture and draft vocabulary), e.g. on more data.

        A MoA drafter may change its N, gain the final state in its memory (``sizes["memory_source"]``),
        start reading the newest memory entry (``sizes["newest_entry"]``) or keys without their rotation
        (``sizes["derotate_keys"]``); other sizes are its own.
        """
        from moaspec.drafters.checkpoint import load_drafter

        drafter = load_drafter(path, target, dtype=torch.float32)  # fp32 master weights, the checkpoint's bits kept
        if kind_of(drafter) != self.cfg.kind:
            raise MoaspecError(f"--init-from {path} is not {'an' if self.cfg.kind[0] in 'aeiou' else 'a'} {self.cfg.kind} drafter")
        if drafter.cfg.draft_vocab_size != self.cfg.draft_vocab:
            raise MoaspecError(f"--init-from {path} has draft vocabulary {drafter.cfg.draft_vocab_size}; "
                               "pass the same --draft-vocab")
        if isinstance(drafter, MoADrafter):  # an option not given (None) stays the checkpoint's
            try:  # e.g. try N = 1 from a trained N = 0
                drafter = drafter.adapted(self.cfg.tli_layers, sizes.get("memory_source"), sizes.get("newest_entry"),
                                          sizes.get("derotate_keys"))
            except ValueError as e:
                raise MoaspecError(f"--init-from {path}: {e}") from e
        return drafter.requires_grad_(True)  # fp32 already: loaded so, and adapted() keeps the dtype

    def _reference_data(self, target: LoadedModel, run: Path) -> torch.Tensor | None:
        """Replay the shards each epoch of ``run`` used; return its draft vocabulary.

        Batch order is a pure function of (examples, seed, epoch), so with the same seed,
        batch size and these, a second drafter trains on exactly the same batches in the
        same order as the first, even if the data set has grown since.
        """
        from moaspec.drafters.checkpoint import load_drafter

        try:
            progress = read_progress(run)
            shards = shard_counts(progress["epoch_shards"])
        except (DamagedFile, KeyError) as e:
            raise MoaspecError(f"--same-data-as {run}: not a training run directory with progress.json ({e})") from None
        ref_cfg = progress["config"]
        for name in ("max_len", "tokens_per_batch", "seed", "val_fraction"):  # what else decides the batches
            if name in ref_cfg and ref_cfg[name] != getattr(self.cfg, name):
                raise MoaspecError(f"--same-data-as {run} used --{name.replace('_', '-')} {ref_cfg[name]}; pass the same")
        available = self.data.shards_available()
        for used in shards.values():
            if len(used) != len(available):
                raise MoaspecError(f"--same-data-as {run} trained on {len(used)} data directories; pass as many to --data")
            for d, n, have in zip(self.data_dirs, used, available):
                if n > have:
                    raise MoaspecError(f"--same-data-as {run} used {n} shards of its data; {d} has {have}")
        ref = load_drafter(run / "drafter", target)
        if ref.cfg.draft_vocab_size != self.cfg.draft_vocab:
            raise MoaspecError(f"--same-data-as {run} has draft vocabulary {ref.cfg.draft_vocab_size}; "
                               f"pass --draft-vocab {ref.cfg.draft_vocab_size}")
        self.data.adopt_epoch_shards(shards, run)
        return None if ref.draft_vocab is None else ref.draft_vocab.clone()

    # --- persistence ------------------------------------------------------------------

    @property
    def state_dir(self) -> Path:
        return self.out / "state"

    def _resume(self) -> None:
        """Continue the run in ``out`` if it holds one (a progress.json); a fresh run writes nothing here.

        Nothing goes into ``out`` before the first training step, so a run that fails
        before it (too little data, a bad option) leaves no directory behind to be
        mistaken for a run.
        """
        if not (self.out / RUN_MARKER).is_file():
            return
        try:
            saved = read_progress(self.out)
        except DamagedFile as exc:
            raise self._cannot_resume(str(exc)) from None
        # a setting added after the run began was then at its default
        before, now = {**asdict(TrainConfig()), **saved["config"]}, asdict(self.cfg)
        if before != now:
            changed = ", ".join(f"{k} {before.get(k)!r} -> {now[k]!r}" for k in now if before.get(k) != now[k])
            raise MoaspecError(f"{self.out} holds a run with other settings ({changed}); resume it with the same "
                               "options, or choose a new --output (to train a finished drafter further: --init-from "
                               f"{self.out / 'drafter'})")
        if not self.state_dir.is_dir():
            raise self._cannot_resume(f"{self.state_dir}, its saved state, is missing")
        try:
            self.acc.load_state(str(self.state_dir))
        except (OSError, ValueError, RuntimeError, KeyError, EOFError, pickle.UnpicklingError, SafetensorError) as exc:
            raise self._cannot_resume(f"{self.state_dir}, its saved state, is damaged "
                                      f"({type(exc).__name__}: {brief(exc, 160)})") from None
        self.step, self.tokens, self.wall = saved["step"], saved["tokens"], saved["wall_s"]
        self.data.adopt_epoch_shards(shard_counts(saved.get("epoch_shards", {})), self.out)
        began = saved.get("mixed_precision")  # what "auto" meant where the run began (runs since 2026-12-04 say)
        if began not in (None, self.acc.mixed_precision) and self.acc.is_main_process:
            print(f"moaspec train: {self.out} ran its first {self.step} updates with mixed precision {began!r}; "
                  f"--mixed-precision {self.cfg.mixed_precision} means {self.acc.mixed_precision!r} on this machine, "
                  "so the updates from here on are rounded differently (the resume is not bit-exact)", file=sys.stderr)

    def _cannot_resume(self, problem: str) -> MoaspecError:
        """The error for a run directory whose progress or saved state is damaged: only starting afresh helps."""
        return MoaspecError(f"{self.out} cannot be resumed: {problem}; remove the directory (or pass another --output) to start afresh")

    def _diverged(self, what: str) -> MoaspecError:
        """The error that ends a run whose weights or loss went non-finite; what was saved before stays."""
        saved = f"{self.out} keeps update {read_progress(self.out)['step']}" if (self.out / RUN_MARKER).is_file() \
            else "nothing was saved"
        return MoaspecError(f"{what}: training diverged; {saved}. Train again with a lower --lr")

    def save(self, final: bool = False) -> None:
        """Save resumable state, then the exported drafter; both atomically (temp + rename).

        Weights that are not finite are never saved (every process holds the same weights,
        so all of them stop here together)."""
        if not bool(torch.stack([torch.isfinite(w).all() for w in self.model.parameters()]).all()):
            raise self._diverged(f"the drafter's weights are not finite (NaN or inf) after update {self.step}")
        self.acc.wait_for_everyone()
        tmp = self.out / "state.tmp"
        if self.acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)  # before any process writes its RNG state into it
            atomic_write_text(self.out / "train_config.json", json.dumps(asdict(self.cfg), indent=1))
        self.acc.wait_for_everyone()
        try:
            with self.random.active():  # the state saved holds this drafter's random stream
                self.acc.save_state(str(tmp))
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)  # a full disk, an interrupt: the saved state before stays whole
            raise
        self.acc.wait_for_everyone()
        if self.acc.is_main_process:
            old = self.out / "state.old"
            shutil.rmtree(old, ignore_errors=True)
            if self.state_dir.exists():
                os.replace(self.state_dir, old)
            os.replace(tmp, self.state_dir)
            shutil.rmtree(old, ignore_errors=True)
            atomic_write_text(self.out / RUN_MARKER, json.dumps(
                {"step": self.step, "tokens": self.tokens, "wall_s": self.wall, "config": asdict(self.cfg),
                 "mixed_precision": self.acc.mixed_precision, "epoch_shards": self.epoch_shards}, indent=1))
            save_drafter(self.acc.unwrap_model(self.model), self.out / "drafter", target_identity(self.target),
                         self.summary(final))
        self.acc.wait_for_everyone()

    def summary(self, final: bool) -> dict[str, Any]:
        return {
            "data": [describe_data(d) for d in self.data_dirs],
            "data_sources": [data_sources(d) for d in self.data_dirs], "first_epoch_train_examples": len(self.data.train_set),
            "val_examples": len(self.data.val_set), "epoch_shards": self.epoch_shards,
            "steps": self.step, "tokens": self.tokens, "wall_s": round(self.wall, 1), "finished": final,
            "processes": self.acc.num_processes, "mixed_precision": self.acc.mixed_precision,
            "config": asdict(self.cfg), "last_val": getattr(self, "last_val", None),
            "lineage": self.inherited_lineage + [self.lineage_entry()],
        }

    def lineage_entry(self) -> str:
        """This run in one line, for the drafter's lineage (a drafter continued several times keeps them all)."""
        start = "+" if self.cfg.init_from else "from random weights: "
        return (f"{start}{self.step:,} updates at lr {self.cfg.lr:g} ({self.tokens:,} loss tokens) on "
                f"{', '.join(str(d) for d in self.data_dirs)}; {self.acc.num_processes} process(es) on "
                f"{self.acc.device.type}, {time.strftime('%Y-%m-%d')}")

    def log(self, name: str, row: dict[str, Any]) -> None:
        """Append ``row`` to a CSV log; one begun by a moaspec that logged fewer columns is widened first."""
        if not self.acc.is_main_process:
            return
        path = self.out / name
        header: list[str] = []
        if path.exists():
            with path.open(newline="") as f:
                header = next(csv.reader(f), [])
        fields = header + [k for k in row if k not in header]
        if fields != header:  # a new log, or one to widen
            old: list[dict[str, str]] = []
            if header:
                with path.open(newline="") as f:
                    old = list(csv.DictReader(f))
            buf = io.StringIO()
            w = csv.DictWriter(buf, fieldnames=fields)
            w.writeheader()
            w.writerows(old)
            atomic_write_text(path, buf.getvalue())
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=fields).writerow(row)

    # --- the loop ---------------------------------------------------------------------

    def begin_update(self) -> None:
        """Seed this update's segment starts: they depend only on (seed, process, update), so a resumed run draws
        the same ones."""
        self._masks.manual_seed(self.cfg.seed * 1_000_003 + self.acc.process_index * 10_007 + self.step)

    def micro_batch(self, batch: Batch, tgt: TargetOut) -> None:
        """Forward and backward over one micro-batch (the target's features ``tgt`` given), and the optimizer's
        update after the last of an update's ``grad_accum``. The losses stay on the device until a log row."""
        cfg = self.cfg
        p = 0.0
        if cfg.staircase:
            p = epoch_staircase_probability(self.step, cfg.pseudo_epoch) if cfg.pseudo_epoch else \
                staircase_probability(self.step, cfg.steps)
        local = torch.rand(batch.tokens.shape[0], generator=self._masks) < p
        masks = build_masks(batch, self._masks, local, cfg.segment_min, cfg.segment_max, self.acc.device,
                            cfg.segment_long_max, cfg.segment_long_fraction, cfg.segment_start_in_memory,
                            cfg.segment_periodic)
        with self.random.active(), self.acc.accumulate(self.model):
            with self.acc.autocast():
                out = drafter_loss(self.raw, self.target.model, batch, masks, tgt, wrapped=self.model,
                                   kl_weight=cfg.kl_weight, feature_weight=cfg.feature_weight)
            self.acc.backward(out.loss.total)
            if self.acc.sync_gradients:
                self.acc.clip_grad_norm_(self.model.parameters(), cfg.clip)
            self.optim.step()
            self.sched.step()
            self.optim.zero_grad()
        parts = torch.stack([out.loss.total, out.loss.kl, out.loss.feature]).detach().float()
        self._pending += parts / cfg.grad_accum
        self._pending_tokens += int(masks.loss.sum())  # counted on the CPU: no wait for the device

    def end_update(self, last: int) -> bool:
        """Count the update; at a log row (every ``log_every`` updates, at saves and at the last), read the losses
        back from the device and check that they are finite. Returns whether a row is due."""
        self.step += 1
        self._pending_updates += 1
        cfg = self.cfg
        due = (self.step % cfg.log_every == 0 or self.step % cfg.save_every == 0 or self.step % cfg.eval_every == 0
               or self.step in (last, cfg.steps))
        if due:
            # one gather for every process's tokens and losses: a loss that is not finite stops them all together
            totals = self.acc.gather(torch.cat([torch.tensor([float(self._pending_tokens)], device=self.acc.device),
                                                self._pending])[None])
            self._row = totals.sum(0).tolist()
            if not all(math.isfinite(v) for v in self._row):
                n = self._pending_updates
                when = f"at update {self.step}" if n == 1 else f"in updates {self.step - n + 1}-{self.step}"
                raise self._diverged(f"the training loss is not finite (NaN or inf) {when}")
        return due

    def after_update(self, dt: float, due: bool, last: int, bar: Any) -> None:
        """Add the update's time; write the log row if due; evaluate and save when their turn comes."""
        cfg = self.cfg
        self.wall += dt
        self._pending_wall += dt
        if due:
            tokens, loss, kl, feature = self._row
            n = self._pending_updates * self.acc.num_processes  # each process's losses are its own batches' means
            self.tokens += int(tokens)
            self.log("train_log.csv", {"step": self.step, "tokens": self.tokens, "lr": self.sched.get_last_lr()[0],
                                       "loss": round(loss / n, 5), "kl": round(kl / n, 5), "feature": round(feature / n, 5),
                                       "tokens_per_s": round(tokens / self._pending_wall, 1),
                                       "wall_s": round(self.wall, 1)})
            bar.set_postfix({f"{self.out.name}_loss": f"{loss / n:.3f}", f"{self.out.name}_tok_s":
                             f"{tokens / self._pending_wall:.0f}"}, refresh=False)
            self._pending.zero_()
            self._pending_tokens, self._pending_updates, self._pending_wall = 0, 0, 0.0
        if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
            self.last_val = self.evaluate()
            self.log("val_log.csv", {"step": self.step, "tokens": self.tokens, **self.last_val})
        if self.step % cfg.save_every == 0 or self.step == last:
            self.save(final=self.step == cfg.steps)

    def train(self, until: int | None = None) -> dict[str, Any]:
        """Run to ``cfg.steps`` updates (or stop after update ``until``, saved, to resume later)."""
        return train_together([self], until)[0]

    @torch.no_grad()
    def evaluate(self) -> dict[str, float | None]:
        """Held-out loss, top-1 agreement with the target's greedy token, and chain acceptance (MoA).

        ``val_tau_chain6`` counts leading accepted drafts from the starts of the random
        5..15 training segments. Real decoding starts each cycle right after the last
        miss, where drafting tends to be harder, so this overstates it.
        ``val_tau_decode`` is what greedy chain-6 decoding of the held-out greedy answers
        gets, cycle for cycle (:func:`~moaspec.training.distill.step_matches`,
        :func:`simulate_chain`), for every kind of drafter, so MoA and EAGLE runs compare
        on it; ``val_first_draft`` is the top-1 of those cycles' first drafts, the step
        where MoA trails EAGLE (BENCHMARKS.md). ``val_tau_chain6`` is left out for EAGLE,
        which teacher forcing feeds the target's true features inside segments.
        All of them use inference's masks (a cycle's first draft reads memory up to one token
        back), whatever masks training uses (``segment_start_in_memory``, ``segment_periodic``).
        """
        cfg = self.cfg
        self.model.eval()
        gen = torch.Generator().manual_seed(12345)
        val_set = self.data.val_set
        batches = make_batches(val_set, cfg.tokens_per_batch, cfg.seed, epoch=0)[: cfg.val_batches]
        mine = batches[self.acc.process_index :: self.acc.num_processes]
        # loss·n, kl·n, feature·n, n, accepted drafts, segments, top-1 matches, decoded tokens, cycles, first-draft hits, cases
        sums = torch.zeros(11)
        raw = self.acc.unwrap_model(self.model)
        for idx in mine:
            batch = collate([val_set[i] for i in idx])
            masks = build_masks(batch, gen, torch.zeros(len(idx), dtype=torch.bool), cfg.segment_min, cfg.segment_max,
                                self.acc.device)
            tgt = self.data.target_features(batch)
            with self.acc.autocast():
                out = drafter_loss(raw, self.target.model, batch, masks, tgt, kl_weight=cfg.kl_weight,
                                   feature_weight=cfg.feature_weight)
            greedy = full_argmax(self.target.model, tgt.final[masks.loss.to(tgt.final.device)])
            accepted, segments = acceptance_by_offset(out.draft_logits, greedy, raw.to_target_ids, masks)
            matches = float((raw.to_target_ids(out.draft_logits.argmax(-1)) == greedy).sum())
            n = float(masks.loss.sum())
            decoded = self.decode_greedy_answers(raw, batch, tgt, greedy)
            sums += torch.tensor([float(out.loss.total) * n, float(out.loss.kl) * n, float(out.loss.feature) * n,
                                  n, float(accepted), float(segments), matches, *decoded])
        sums = self.acc.reduce(sums.to(self.acc.device), reduction="sum").cpu()
        self.model.train()
        n = max(float(sums[3]), 1.0)
        return {"val_loss": round(float(sums[0]) / n, 5), "val_kl": round(float(sums[1]) / n, 5),
                "val_feature": round(float(sums[2]) / n, 5), "val_top1": round(float(sums[6]) / n, 4),
                "val_tau_chain6": round(1 + float(sums[4]) / max(float(sums[5]), 1.0), 4) if cfg.kind == "moa" else None,
                "val_tau_decode": round(float(sums[7]) / float(sums[8]), 4) if sums[8] else None,
                "val_first_draft": round(float(sums[9]) / float(sums[10]), 4) if sums[10] else None}

    def decode_greedy_answers(self, drafter: Drafter, batch: Batch, tgt: TargetOut, greedy: torch.Tensor,
                              depth: int = 6) -> list[float]:
        """[tokens, verifications] of greedy chain-``depth`` decoding replayed along the batch's greedy answers,
        then [hits, cases] of the first drafts of all cycles along them."""
        with self.acc.autocast():
            matches = step_matches(drafter, self.target.model, batch, tgt, greedy, depth)
        runs = accepted_runs(matches, batch)
        tokens = cycles = 0
        for b in (b for b, is_greedy in enumerate(batch.greedy) if is_greedy):
            p, n = int(batch.prompt_lens[b]), int(batch.lengths[b])
            added = simulate_chain(runs[b].tolist(), p, n - p, depth)
            tokens, cycles = tokens + sum(added), cycles + len(added)
        hits, cases = step_accuracy(matches, batch, torch.tensor(batch.greedy, dtype=torch.bool))
        return [tokens, cycles, float(hits[0]), float(cases[0])]


def out_of_time(acc: Any, mine: bool) -> bool:
    """Whether the run is out of time, as the main process sees it: every process stops at the same update."""
    if acc.num_processes == 1:
        return mine  # no host synchronisation for one process
    from accelerate.utils import broadcast_object_list

    decision = [mine]
    broadcast_object_list(decision)
    return bool(decision[0])


def train_together(trainers: Sequence[Trainer], until: int | None = None,
                   timings: dict[str, float] | None = None, time_limit: float | None = None) -> list[dict[str, Any]]:
    """Train several drafters on the same batches, each to its ``cfg.steps`` (or to update ``until``, saved).

    Every micro-batch is drawn once and the target's features computed once, then each drafter
    takes its forward, backward and update on those tensors in turn, with its own optimizer,
    schedule, segment draws and random stream: each ends where it would have ended trained alone
    on these batches. Drafters resumed at different updates (a run stopped between two drafters'
    saves) catch up: one ahead waits for the others. ``timings`` (a benchmark's): seconds spent on
    the target's features and on each drafter, the device synchronised between them (slower).
    ``time_limit``: seconds after which the update under way is the last, saved like ``until``'s, so that a
    run in a fixed slot of machine time keeps what it learnt (a later run resumes it).
    """
    if not trainers:
        raise MoaspecError("no drafter to train")
    data = trainers[0].data
    if any(t.data is not data for t in trainers):
        raise MoaspecError("drafters trained together must share one TrainingData")
    if len({t.out.resolve() for t in trainers}) < len(trainers):
        raise MoaspecError("two drafters trained together were given the same run directory")
    started = time.perf_counter()  # the time limit counts the evaluation of drafters continued, below
    ends = [t.cfg.steps if until is None else min(until, t.cfg.steps) for t in trainers]
    main = trainers[0].acc
    bar = progress_bar(total=max(ends), initial=min(t.step for t in trainers), unit="step", desc="moaspec train",
                       disable=not (trainers[0].progress and main.is_main_process))
    for t in trainers:
        if t.step == 0 and t.cfg.init_from:
            # the starting drafter on this run's held-out slice: the baseline a continuation is read against
            # (decided from the step alone, so that every process joins evaluate's reduction)
            t.log("val_log.csv", {"step": 0, "tokens": 0, **t.evaluate()})
    grad_accum = data.cfg.grad_accum
    step = min(t.step for t in trainers)
    stream = data.batches(skip=step * grad_accum)

    def synchronised(name: str, since: float) -> float:
        if timings is None:
            return since
        if main.device.type == "cuda":
            torch.cuda.synchronize(main.device)
        now = time.perf_counter()
        timings[name] = timings.get(name, 0.0) + now - since
        return now

    while step < max(ends):
        t0 = time.perf_counter()
        active = [(t, end) for t, end in zip(trainers, ends) if t.step == step < end]
        for t, _ in active:
            t.begin_update()
        for _ in range(grad_accum):
            batch = next(stream)
            tick = time.perf_counter()
            tgt = data.target_features(batch)
            tick = synchronised("target", tick)
            for t, _ in active:
                t.micro_batch(batch, tgt)
                tick = synchronised(t.out.name, tick)
        if time_limit is not None and out_of_time(main, time.perf_counter() - started >= time_limit):
            ends = [min(end, step + 1) for end in ends]  # this update is the last: saved, resumable
            active = [(t, min(end, step + 1)) for t, end in active]
        due = [t.end_update(end) for t, end in active]
        dt = time.perf_counter() - t0
        for (t, end), row in zip(active, due):
            t.after_update(dt, row, end, bar)
        step += 1
        bar.update(1)
    bar.close()
    return [t.summary(final=t.step == t.cfg.steps) for t in trainers]
