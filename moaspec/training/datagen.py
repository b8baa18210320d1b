"""A distillation set written by the target itself (Magpie), sharded and resumable.

No dataset can be downloaded here, and a drafter should learn the target's own
distribution anyway. So the instruct model writes the user prompts: given its chat
template up to the start of a user turn (after a system message that steers it to a
task family), it samples what a user would say. It then answers each prompt with the
deployment template (no system message), greedily or by sampling. Some conversations
get a second, model-written user turn and its answer (multi-turn).

Each record is one assistant turn: ``prompt_ids`` (the conversation as the model saw
it) and ``answer_ids`` (the target's tokens; the loss applies to these). Shards are
JSONL files written atomically; ``manifest.json`` lists finished shards, so an
interrupted run resumes at the next shard and produces exactly the same data.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moaspec.chat import encode_chat
from moaspec.decoding.batched import Request, generate_many
from moaspec.decoding.sampling import SamplingParams
from moaspec.decoding.vanilla import stop_token_ids
from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_text
from moaspec.models.loading import LoadedModel

# System messages that steer the model towards a task family when it writes a user prompt.
TASKS: dict[str, str] = {
    "code": "You are an AI assistant for programmers. Users ask you to write, explain or fix code, mostly in Python.",
    "math": "You are an AI assistant for math. Users ask arithmetic questions and word problems to solve step by step.",
    "summarisation": "You are an AI assistant that summarises text. Users paste a news story or a paragraph and ask for a short summary.",
    "passage_qa": "You are an AI assistant for reading comprehension. Users paste a passage from an article, a report or a manual and ask questions about it.",
    "open_qa": "You are an AI assistant that answers factual questions about history, science, geography and daily life.",
    "writing": "You are an AI assistant for writing. Users ask for stories, poems, emails, essays and blog posts.",
    "advice": "You are an AI assistant that gives practical advice, explanations and step-by-step instructions.",
}
# Families whose users paste a text: their prompts get the longer query budget, so the data
# holds long contexts (summaries and questions about a document) and not only short chats.
PASTED_TEXT = ("summarisation", "passage_qa")
PLACEHOLDER = "\u2063QUERY\u2063"
# The batching scheme changes which random numbers each row draws, hence the data; a
# directory is only extended by the scheme that began it (1: fixed batches per sampling
# rule; 2: mixed rules per batch, refill by recompute).
GENERATOR = 2


@dataclass(frozen=True)
class DataConfig:
    examples: int = 2000  # stop once this many records (assistant turns) exist
    shard_size: int = 64  # conversations started per shard
    batch_size: int = 32
    max_query_tokens: int = 96
    max_pasted_query_tokens: int = 512  # for the task families in PASTED_TEXT
    max_answer_tokens: int = 384
    multi_turn: float = 0.2  # fraction of conversations that get a second user turn
    greedy_fraction: float = 0.5  # answers decoded greedily; the rest are sampled
    answer_temperature: float = 0.7
    query_temperature: float = 1.0
    seed: int = 0


def pre_query_prefix(tokenizer: Any, history: list[dict[str, str]]) -> str:
    """The chat template rendered up to the start of the next user message (Magpie)."""
    text = tokenizer.apply_chat_template(history + [{"role": "user", "content": PLACEHOLDER}], tokenize=False)
    return text[: text.index(PLACEHOLDER)]


def normalise(query: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", query.lower()).strip()


def usable_query(query: str) -> bool:
    """Reject fragments, template debris and prompts that are mostly not words."""
    words = query.split()
    return 3 <= len(words) <= 600 and "<|" not in query and sum(c.isalpha() for c in query) > 0.5 * len(query.replace(" ", ""))


class DataWriter:
    """Owns an output directory: its manifest, its shards, and the dedup set."""

    def __init__(self, out: Path, identity: dict[str, Any]) -> None:
        self.out = out
        self.manifest_path = out / "manifest.json"
        if self.manifest_path.exists():
            manifest = json.loads(self.manifest_path.read_text())
            if manifest["identity"] != identity:
                raise MoaspecError(
                    f"{out} holds data made with other settings, another model or an older moaspec; "
                    "choose a new --output directory"
                )
            self.manifest = manifest
        else:
            out.mkdir(parents=True, exist_ok=True)
            self.manifest = {"identity": identity, "shards": []}
        self.seen: set[str] = set()
        for shard in self.manifest["shards"]:
            for rec in read_shard(out / shard["file"]):
                if rec["turn"] == 0:
                    self.seen.add(normalise(rec["query"]))

    @property
    def records(self) -> int:
        return sum(s["records"] for s in self.manifest["shards"])

    @property
    def next_shard(self) -> int:
        return len(self.manifest["shards"])

    def add_shard(self, records: list[dict[str, Any]]) -> None:
        name = f"shard-{self.next_shard:05d}.jsonl"
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        atomic_write_text(self.out / name, text)
        self.manifest["shards"].append({
            "file": name, "records": len(records),
            "answer_tokens": sum(len(r["answer_ids"]) for r in records),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        })
        atomic_write_text(self.manifest_path, json.dumps(self.manifest, indent=1))


def read_shard(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]


def make_shard(model: LoadedModel, cfg: DataConfig, shard: int, seen: set[str]) -> list[dict[str, Any]]:
    """Generate one shard's conversations; deterministic given (seed, shard)."""
    tok = model.tokenizer
    stop = stop_token_ids(model.model, tok)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + shard)
    rng = torch.Generator().manual_seed(cfg.seed * 7_919 + shard)
    tasks = list(TASKS)
    picks = torch.randint(0, len(tasks), (cfg.shard_size,), generator=rng).tolist()
    query_params = SamplingParams(temperature=cfg.query_temperature)
    answer_params = SamplingParams(temperature=cfg.answer_temperature)

    # 1. user prompts, steered per task
    prefixes = [tok(pre_query_prefix(tok, [{"role": "system", "content": TASKS[tasks[t]]}]),
                    add_special_tokens=False)["input_ids"] for t in picks]
    budgets = [cfg.max_pasted_query_tokens if tasks[t] in PASTED_TEXT else cfg.max_query_tokens for t in picks]
    queries = generate_many(model.model, [Request(p, n, query_params) for p, n in zip(prefixes, budgets)], stop, gen,
                            batch_size=cfg.batch_size)
    convs: list[dict[str, Any]] = []
    for t, (ids, finished) in zip(picks, queries):
        q = tok.decode(ids, skip_special_tokens=True).strip()
        key = normalise(q)
        if finished and usable_query(q) and key not in seen:
            seen.add(key)
            convs.append({"task": tasks[t], "messages": [{"role": "user", "content": q}]})

    # 2. answers; 3. follow-up user turns for some; 4. their answers
    records: list[dict[str, Any]] = []
    greedy = torch.rand(len(convs), generator=rng) < cfg.greedy_fraction
    follow = torch.rand(len(convs), generator=rng) < cfg.multi_turn
    active = list(range(len(convs)))
    for turn in range(2):
        prompts = [encode_chat(tok, convs[i]["messages"]) for i in active]
        requests = [Request(p, cfg.max_answer_tokens, SamplingParams() if greedy[i] else answer_params)
                    for p, i in zip(prompts, active)]
        answers = generate_many(model.model, requests, stop, gen, batch_size=cfg.batch_size)
        for k, (ids, finished) in enumerate(answers):
            c = convs[active[k]]
            records.append({
                "id": f"{shard}-{active[k]}-{turn}", "task": c["task"], "turn": turn,
                "query": c["messages"][-1]["content"],
                "sampling": "greedy" if greedy[active[k]] else f"t{cfg.answer_temperature}",
                "prompt_ids": prompts[k], "answer_ids": ids, "finished": finished,
            })
            c["messages"].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})
        if turn == 1:
            break
        active = [i for i in active if bool(follow[i])]
        if not active:
            break
        prefixes = [tok(pre_query_prefix(tok, convs[i]["messages"]), add_special_tokens=False)["input_ids"] for i in active]
        followups = generate_many(model.model, [Request(p, cfg.max_query_tokens, query_params) for p in prefixes], stop,
                                  gen, batch_size=cfg.batch_size)
        kept = []
        for i, (ids, finished) in zip(active, followups):
            q = tok.decode(ids, skip_special_tokens=True).strip()
            if finished and usable_query(q):
                convs[i]["messages"].append({"role": "user", "content": q})
                kept.append(i)
        active = kept
        if not active:
            break
    return records


def generate_dataset(model: LoadedModel, out: Path, cfg: DataConfig, progress: bool = True) -> dict[str, Any]:
    """Fill ``out`` with shards until ``cfg.examples`` records exist; resume where a previous run stopped."""
    from tqdm import tqdm

    identity = {"model": model.fingerprint, "config": {k: v for k, v in asdict(cfg).items() if k != "examples"},
                "generator": GENERATOR}
    writer = DataWriter(out, identity)
    bar = tqdm(total=cfg.examples, initial=min(writer.records, cfg.examples), unit="turn", disable=not progress,
               desc="moaspec data")
    while writer.records < cfg.examples:
        records = make_shard(model, cfg, writer.next_shard, writer.seen)
        writer.add_shard(records)
        bar.update(min(len(records), cfg.examples - bar.n))
    bar.close()
    return writer.manifest
