"""Distillation records → training sequences and token-budget batches.

A sequence is one assistant turn in its conversation: ``prompt_ids + answer_ids``,
with the loss on answer positions only. Records are split into train and held-out
sets by a hash of their id (stable as the data grows), and batches are cut by a
token budget from length-sorted pools so that padding stays small. Batch order is a
pure function of (seed, epoch), which makes resuming exact.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from moaspec.errors import MoaspecError
from moaspec.training.datagen import read_shard


@dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]
    prompt_len: int
    key: str = ""  # the record id: names the example's cached target features


def read_manifest(data_dir: Path) -> dict:
    manifest = data_dir / "manifest.json"
    if not manifest.is_file():
        raise MoaspecError(f"{data_dir} holds no distillation data (no manifest.json); make some with `moaspec data`")
    try:
        return json.loads(manifest.read_text())
    except json.JSONDecodeError as exc:
        raise MoaspecError(f"{manifest} is not valid JSON ({exc.msg})") from None


def held_out(record_id: str, fraction: float) -> bool:
    """Stable split: the same record is held out however much data exists."""
    h = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def load_examples(data_dir: Path, max_len: int, val_fraction: float,
                  max_shards: int | None = None) -> tuple[list[Example], list[Example], str]:
    """Train and held-out examples from the first ``max_shards`` (default: all) finished shards, plus the data's model fingerprint."""
    manifest = read_manifest(data_dir)
    train: list[Example] = []
    val: list[Example] = []
    for shard in manifest["shards"][:max_shards]:
        for rec in read_shard(data_dir / shard["file"]):
            prompt, answer = rec["prompt_ids"], rec["answer_ids"]
            if not answer or len(prompt) >= max_len - 1:
                continue
            ex = Example(tuple((prompt + answer)[:max_len]), len(prompt), rec["id"])
            (val if held_out(rec["id"], val_fraction) else train).append(ex)
    if not train:
        raise MoaspecError(f"{data_dir} has no usable training examples yet")
    if not val:
        val, train = train[-1:], train[:-1] or train
    return train, val, manifest["identity"]["model"]


def token_frequencies(examples: Sequence[Example]) -> Counter[int]:
    counts: Counter[int] = Counter()
    for ex in examples:
        counts.update(ex.tokens[ex.prompt_len :])
    return counts


def draft_vocabulary(examples: Sequence[Example], size: int, always: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The ``size`` tokens the target emits most often (plus ``always``, e.g. EOS, first), most frequent first.

    The order lets a trained drafter use a prefix of its vocabulary at inference (a
    smaller, faster head). Ties and unseen tokens are broken by id so that every
    process computes the same list.
    """
    if not 0 < size <= vocab_size:
        raise MoaspecError(f"draft vocabulary size must be in 1..{vocab_size}, got {size}")
    counts = token_frequencies(examples)
    chosen = list(dict.fromkeys(t for t in always if 0 <= t < vocab_size))
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    for t in ranked + list(range(vocab_size)):
        if len(chosen) >= size:
            break
        if t not in chosen:
            chosen.append(t)
    return torch.tensor(chosen[:size], dtype=torch.long)


def make_batches(examples: Sequence[Example], tokens_per_batch: int, seed: int, epoch: int,
                 pool: int = 256) -> list[list[int]]:
    """Index batches for one epoch: shuffle, sort pools of ``pool`` examples by length, cut by budget."""
    g = torch.Generator().manual_seed(seed * 10_007 + epoch)
    order = torch.randperm(len(examples), generator=g).tolist()
    batches: list[list[int]] = []
    for p in range(0, len(order), pool):
        chunk = sorted(order[p : p + pool], key=lambda i: len(examples[i].tokens))
        batch: list[int] = []
        for i in chunk:
            longest = max([len(examples[j].tokens) for j in batch] + [len(examples[i].tokens)])
            if batch and longest * (len(batch) + 1) > tokens_per_batch:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    perm = torch.randperm(len(batches), generator=g).tolist()
    return [batches[i] for i in perm]


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, S], right-padded with 0
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]
    keys: tuple[str, ...] = ()


def collate(examples: Sequence[Example]) -> Batch:
    S = max(len(e.tokens) for e in examples)
    tokens = torch.zeros(len(examples), S, dtype=torch.long)
    for b, e in enumerate(examples):
        tokens[b, : len(e.tokens)] = torch.tensor(e.tokens)
    return Batch(tokens, torch.tensor([len(e.tokens) for e in examples]), torch.tensor([e.prompt_len for e in examples]),
                 tuple(e.key for e in examples))


def batch_stream(examples_for: Callable[[int], Sequence[Example]], tokens_per_batch: int, seed: int, rank: int,
                 world: int, skip: int = 0) -> Iterator[Batch]:
    """Endless batches for process ``rank`` of ``world``, epoch after epoch; ``skip`` drops the first ones.

    ``examples_for(epoch)`` gives each epoch's examples, so that data still being
    generated joins at the next epoch; it must return the same list whenever it is
    asked about the same epoch (resuming replays earlier epochs' batch counts).
    """
    epoch, seen = 0, 0
    while True:
        examples = examples_for(epoch)
        batches = make_batches(examples, tokens_per_batch, seed, epoch)
        usable = len(batches) - len(batches) % world
        if not usable:
            raise MoaspecError(f"too little data for {world} processes: {len(batches)} batches per epoch")
        for i in range(rank, usable, world):
            if seen >= skip:
                yield collate([examples[j] for j in batches[i]])
            seen += 1
        epoch += 1
