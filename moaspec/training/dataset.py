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
from typing import Any, TypeVar

import torch

from moaspec.errors import MoaspecError

T = TypeVar("T")


@dataclass(frozen=True)
class Example:
    tokens: tuple[int, ...]
    prompt_len: int
    key: str = ""  # the record id: names the example's cached target features
    source: int = 0  # which of the run's data directories it came from
    greedy: bool = False  # the answer is the target's greedy output (what real decoding is evaluated on)


class DamagedFile(MoaspecError):
    """A file that moaspec wrote itself (a manifest, a shard, a run's progress) is missing or no longer as written.

    The message names the file and what is wrong with it; a caller that knows the remedy
    (make the data set again, start the run afresh) catches it and adds that.
    """


JSON_TYPES = {dict: "an object", list: "an array", str: "a string", int: "a number", float: "a number",
              bool: "true or false", type(None): "null"}


def read_json(path: Path, kind: type[T]) -> T:
    """The JSON value in ``path``, which must be of type ``kind`` (``dict`` for an object).

    A file cut short, emptied or edited by hand raises :class:`DamagedFile` naming it,
    not the JSONDecodeError, or the TypeError of indexing a value of another type, that
    would otherwise surface deep inside whatever reads it.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DamagedFile(f"{path} is missing") from None
    except OSError as exc:
        raise DamagedFile(f"{path} cannot be read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise DamagedFile(f"{path} is not valid JSON (not UTF-8 text)") from None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise DamagedFile(f"{path} is empty" if not text.strip() else
                          f"{path} is not valid JSON ({exc.msg}: line {exc.lineno}, column {exc.colno})") from None
    if not isinstance(value, kind):
        raise DamagedFile(f"{path} holds {JSON_TYPES.get(type(value), type(value).__name__)} "
                          f"where {JSON_TYPES[kind]} belongs")
    return value


def damaged_data(data_dir: Path, problem: DamagedFile | str) -> MoaspecError:
    """The error for a data directory whose manifest or shards are not as `moaspec data` wrote them."""
    return MoaspecError(f"the data directory {data_dir} is damaged: {problem}; "
                        "remove the directory and run `moaspec data` again to start afresh")


def read_manifest(data_dir: Path) -> dict[str, Any]:
    """``data_dir``'s manifest.json, checked to hold what `moaspec data` writes: an identity and a shard list."""
    path = data_dir / "manifest.json"
    if not path.is_file():
        raise MoaspecError(f"{data_dir} holds no distillation data (no manifest.json); make some with `moaspec data`")
    try:
        manifest = read_json(path, dict)
    except DamagedFile as exc:
        raise damaged_data(data_dir, exc) from None
    shards = manifest.get("shards")
    if not (isinstance(manifest.get("identity"), dict) and isinstance(shards, list)
            and all(isinstance(s, dict) and isinstance(s.get("file"), str) and isinstance(s.get("records"), int)
                    for s in shards)):
        raise damaged_data(data_dir, f"{path} lacks the identity or the shard list that `moaspec data` writes")
    return manifest


def data_sources(data_dir: Path) -> dict[str, Any] | None:
    """Where ``data_dir``'s prompts came from, as its manifest records them (``moaspec data --prompts``): the paths
    given, each file's path relative to them, sha256 and size, and the conversations started (taken, answered or
    passed over as too long for the context) and answered, turns and answer tokens each file and each category
    gave; what ``--exclude-questions`` left out. None for data whose
    prompts the target wrote itself, or made before moaspec recorded them."""
    prompts = read_manifest(data_dir).get("prompts")
    return prompts if isinstance(prompts, dict) else None


def describe_data(data_dir: Path) -> str:
    """``data_dir`` in one line, for a drafter's ``training.data``: its path, its size, and where its prompts came
    from (the files that gave answers, the answer tokens of each category)."""
    manifest = read_manifest(data_dir)
    turns = sum(s["records"] for s in manifest["shards"])
    tokens = sum(s.get("answer_tokens", 0) for s in manifest["shards"])
    line = f"{data_dir} ({turns:,} turns, {tokens / 1e6:.2f} M answer tokens"
    prompts = data_sources(data_dir)
    if prompts is None:
        return line + ")"
    files = [f["path"] for f in prompts.get("files", []) if f.get("answered")]
    shares = ", ".join(f"{name} {c.get('answer_tokens', 0) / 1e6:.2f} M"
                       for name, c in prompts.get("categories", {}).items() if c.get("answered"))
    line += (f"; answering prompts of {len(files)} file(s) of {', '.join(prompts.get('given', []))}: "
             f"{', '.join(files)}; by category: {shares}")
    if prompts.get("counted_from_shard"):
        line += f" (counted from shard {prompts['counted_from_shard']} on)"
    if "excluded_by" in prompts:
        line += (f"; {prompts.get('excluded_conversations', 0)} overlapping a question of "
                 f"{prompts['excluded_by'].get('path')} left out")
    return line + ")"


def read_shard(path: Path, entry: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The records of the shard at ``path``; with its manifest ``entry``, refuse content that is not what was written.

    The manifest keeps each shard's sha256 (and record count). Hashing costs little
    beside parsing, and catches a shard that was emptied, cut short or edited, which
    would otherwise train on less or other data without a word.
    """
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DamagedFile(f"{path}, a shard its manifest.json lists, is missing") from None
    except OSError as exc:
        raise DamagedFile(f"{path} cannot be read ({exc.strerror})") from None
    if entry is not None and "sha256" in entry and hashlib.sha256(raw).hexdigest() != entry["sha256"]:
        lines = sum(1 for line in raw.splitlines() if line.strip())
        how = (f"it held {entry['records']} records and now holds {lines} line{'s' * (lines != 1)}"
               if lines != entry["records"] else "its sha256 is not the one manifest.json records")
        raise DamagedFile(f"{path} has changed since it was written ({how})")
    try:
        records = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line]
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise DamagedFile(f"{path} is not valid JSON lines") from None
    if not all(isinstance(r, dict) for r in records):
        raise DamagedFile(f"{path} holds lines that are not records (JSON objects)")
    return records


def shard_records(data_dir: Path, shards: Sequence[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every record of ``shards`` (manifest entries) of ``data_dir``, each shard checked against its entry."""
    for shard in shards:
        try:
            records = read_shard(data_dir / shard["file"], shard)
        except DamagedFile as exc:
            raise damaged_data(data_dir, exc) from None
        yield from records


def held_out(record_id: str, fraction: float) -> bool:
    """Stable split: the same record is held out however much data exists."""
    h = int.from_bytes(hashlib.sha256(record_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def load_examples(data_dirs: Sequence[Path], model: str, max_len: int, val_fraction: float,
                  max_shards: Sequence[int] | None = None) -> tuple[list[Example], list[Example]]:
    """Train and held-out examples from the first ``max_shards[i]`` (default: all) finished shards of each directory.

    Several directories are trained on together, e.g. a first data set and a later
    one made with other settings; each must come from ``model`` (a fingerprint).
    """
    train: list[Example] = []
    val: list[Example] = []
    answered = 0  # records with an answer
    shortest: int | None = None  # the shortest prompt among them
    for source, data_dir in enumerate(data_dirs):
        manifest = read_manifest(data_dir)
        if manifest["identity"].get("model") != model:
            raise MoaspecError(f"{data_dir} was generated by another model (fingerprint {manifest['identity'].get('model')}); "
                               f"the target loaded is {model}")
        for rec in shard_records(data_dir, manifest["shards"][: None if max_shards is None else max_shards[source]]):
            prompt, answer = rec["prompt_ids"], rec["answer_ids"]
            if answer:
                answered += 1
                shortest = len(prompt) if shortest is None else min(shortest, len(prompt))
            if not answer or len(prompt) >= max_len - 1:
                continue
            ex = Example(tuple((prompt + answer)[:max_len]), len(prompt), rec["id"], source, rec.get("sampling") == "greedy")
            (val if held_out(rec["id"], val_fraction) else train).append(ex)
    if not train:
        where = ", ".join(map(str, data_dirs))
        if shortest is not None and shortest >= max_len - 1:  # not a shortage of data: --max-len cuts every prompt
            raise MoaspecError(f"{where}: every example is too long for --max-len {max_len} (the shortest prompt has "
                               f"{shortest} tokens, and --max-len must leave room for it and 2 answer tokens); "
                               f"pass --max-len {shortest + 2} or more")
        if val:  # every usable example fell in the held-out share
            raise MoaspecError(f"--val-fraction {val_fraction} holds out all {len(val)} usable examples of {where} for "
                               "validation, leaving none to train on: lower it, or let `moaspec data` write more")
        raise MoaspecError(f"{where}: no usable training examples yet ({answered} answered records); "
                           "let `moaspec data` write more")
    if not val:
        val, train = train[-1:], train[:-1] or train
    return train, val


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
    sources: tuple[int, ...] = ()
    greedy: tuple[bool, ...] = ()


def collate(examples: Sequence[Example]) -> Batch:
    S = max(len(e.tokens) for e in examples)
    tokens = torch.zeros(len(examples), S, dtype=torch.long)
    for b, e in enumerate(examples):
        tokens[b, : len(e.tokens)] = torch.tensor(e.tokens)
    return Batch(tokens, torch.tensor([len(e.tokens) for e in examples]), torch.tensor([e.prompt_len for e in examples]),
                 tuple(e.key for e in examples), tuple(e.source for e in examples), tuple(e.greedy for e in examples))


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
            raise MoaspecError(f"too little data: {len(examples)} training examples make {len(batches)} batches of "
                               f"--tokens-per-batch {tokens_per_batch} per epoch, and {world} process(es) need at least "
                               f"{world}; let `moaspec data` write more")
        for i in range(rank, usable, world):
            if seen >= skip:
                yield collate([examples[j] for j in batches[i]])
            seen += 1
        epoch += 1
