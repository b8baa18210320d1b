"""A distillation set written by the target itself (Magpie), sharded and resumable.

No dataset can be downloaded here, and a drafter should learn the target's own
distribution anyway. So the instruct model writes the user prompts: given its chat
template up to the start of a user turn (after a system message that steers it to a
task family, where the template takes one), it samples what a user would say. It then answers each prompt with the
deployment template (no system message), greedily or by sampling. Summarisation and
questions about a passage paste one of those answers under an instruction, so the set
holds long contexts too. Some conversations get a second, model-written user turn and
its answer (multi-turn).

With ``--prompts`` the user turns come from the user's own files instead (the target
still answers every turn, so the set stays the target's own distribution), and with
``--passages`` the pasted texts are the user's documents (see ``user_text``). Prompts
that name their category are taken, with ``balance``, category by category so that each
category's answers hold about as many tokens as any other's (a summary's answer is long,
a factual answer short); the manifest counts what each file and category gave.

Each record is one assistant turn: ``prompt_ids`` (the conversation as the model saw
it) and ``answer_ids`` (the target's tokens; the loss applies to these). Shards are
JSONL files written atomically; ``manifest.json`` lists finished shards (and, with
``--prompts``, how many conversations and answer tokens each file and category has given
so far, which is all the balancing reads), so an interrupted run resumes at the next
shard and produces exactly the same data.
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from moaspec.chat import encode_chat, render_chat
from moaspec.decoding.batched import Request, generate_many
from moaspec.decoding.opening import stop_token_ids
from moaspec.decoding.sampling import SamplingParams
from moaspec.errors import MoaspecError, PromptError
from moaspec.fileio import atomic_write_text
from moaspec.models.loading import LoadedModel
from moaspec.progress import progress_bar
from moaspec.training.dataset import damaged_data, read_manifest, shard_records
from moaspec.training.user_text import UserText

# System messages that steer the model towards a task family when it writes a user prompt.
TASKS: dict[str, str] = {
    "code": "You are an AI assistant for programmers. Users ask you to write, explain or fix code, mostly in Python.",
    "math": "You are an AI assistant for math. Users ask arithmetic questions and word problems to solve step by step.",
    "open_qa": "You are an AI assistant that answers factual questions about history, science, geography and daily life.",
    "writing": "You are an AI assistant for writing. Users ask for stories, poems, emails, essays and blog posts.",
    "advice": "You are an AI assistant that gives practical advice, explanations and step-by-step instructions.",
}
# Families whose user pastes a text. A small model asked (Magpie-style) to paste an article
# writes hundreds of tokens of drift and rarely ends it, so the text is instead one or two
# of the target's own answers from the same shard, under an instruction. This
# puts long contexts (summaries, questions about a document) in the set.
MIN_PASSAGE_TOKENS = 48
PASTED_TEXT: dict[str, tuple[str, ...]] = {
    "summarisation": (
        "Summarize the following text in a few sentences.\n\n{text}",
        "{text}\n\nSummarize the text above.",
        "Write a one-paragraph summary of this:\n\n{text}",
        "{text}\n\nGive me the gist of this in two sentences.",
    ),
    "passage_qa": (
        "Read the passage below and explain its main point.\n\n{text}",
        "{text}\n\nWhat are the key facts stated in this passage?",
        "Based on the following text, list three things it says.\n\n{text}",
        "{text}\n\nIs anything in the text above doubtful or unclear? Explain.",
    ),
}
USER_TASK = "user"  # the task family of a conversation from --prompts
PLACEHOLDER = "\u2063QUERY\u2063"
# The batching scheme changes which random numbers each row draws, hence the data; a
# directory is only extended by the scheme that began it (1: fixed batches per sampling
# rule; 2: mixed rules per batch, refill by recompute, pasted-text task families; 3: continuous
# batching, each sequence in a cache of its own).
GENERATOR = 3
# `moaspec data` gives up after this many shards in a row without a record, and at least this many tries
STALL_SHARDS, STALL_CONVERSATIONS = 3, 64
COUNTS = ("started", "answered", "turns", "answer_tokens")  # what the manifest counts per prompt file and category


@dataclass(frozen=True)
class DataConfig:
    examples: int = 2000  # stop once this many records (assistant turns) exist
    shard_size: int = 64  # conversations started per shard
    batch_size: int = 32
    max_query_tokens: int = 96
    max_passage_tokens: int = 512  # the pasted text of a PASTED_TEXT prompt
    max_answer_tokens: int = 384
    multi_turn: float = 0.2  # fraction of conversations that get a second user turn
    greedy_fraction: float = 0.5  # answers decoded greedily; the rest are sampled
    answer_temperature: float = 0.7
    query_temperature: float = 1.0
    seed: int = 0
    pasted_fraction: float | None = None  # share of conversations that paste a text (None: 2 of 7, as many as a family)
    balance: str | None = None  # "answer-tokens": --prompts taken by category (see balanced_choice); None: file order
    max_turns: int | None = None  # user turns answered per --prompts conversation at most (None: all)


def pre_query_prefix(tokenizer: Any, history: list[dict[str, str]]) -> str:
    """The chat template rendered up to the start of the next user message (Magpie)."""
    text = render_chat(tokenizer, history + [{"role": "user", "content": PLACEHOLDER}], add_generation_prompt=False)
    return text[: text.index(PLACEHOLDER)]


def steering(tokenizer: Any, task: str) -> list[dict[str, str]]:
    """The history a user prompt of ``task`` is written after: a system message that asks for one, or nothing
    where the template refuses system messages (the model then chooses its prompts' subjects itself)."""
    history = [{"role": "system", "content": TASKS[task]}]
    try:
        pre_query_prefix(tokenizer, history)
    except PromptError:
        return []
    return history


def normalise(query: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", query.lower()).strip()


def usable_query(query: str) -> bool:
    """Reject fragments, template debris and prompts that are mostly not words."""
    words = query.split()
    return 3 <= len(words) <= 300 and "<|" not in query and sum(c.isalpha() for c in query) > 0.5 * len(query.replace(" ", ""))


# what a `moaspec data` directory holds: the manifest that makes it resumable, and what is written before
# it (shards) or beside it later (the trainer's cached target features); anything else is someone else's
OUTPUT_MARKER = "manifest.json"
OUTPUT_FILES = ("shard-*.jsonl", "features")


class DataWriter:
    """Owns an output directory: its manifest, its shards, and the dedup set."""

    def __init__(self, out: Path, identity: dict[str, Any]) -> None:
        self.out = out
        self.manifest_path = out / OUTPUT_MARKER
        if self.manifest_path.exists():
            manifest = read_manifest(out)  # a damaged one is refused, naming the file
            if manifest["identity"] != identity:
                differ = identity_difference(manifest["identity"], identity)
                hint = ("; a directory begun before --balance existed resumes with --balance none"
                        if differ == ["config.balance"] and "balance" not in manifest["identity"].get("config", {}) else
                        "; choose a new --output directory")
                raise MoaspecError(f"{out} holds data made with other settings, another model or an older moaspec "
                                   f"(what differs: {', '.join(differ)}){hint}")
            self.manifest = manifest
        else:
            out.mkdir(parents=True, exist_ok=True)
            self.manifest = {"identity": identity, "shards": []}
        self.seen: set[str] = set()
        for rec in shard_records(out, self.manifest["shards"]):
            if rec["turn"] == 0:
                self.seen.add(normalise(rec["query"]))

    @property
    def records(self) -> int:
        return sum(s["records"] for s in self.manifest["shards"])

    @property
    def next_shard(self) -> int:
        return len(self.manifest["shards"])

    def add_shard(self, records: list[dict[str, Any]], prompts: dict[str, Any] | None = None) -> None:
        """Write a shard, then the manifest that lists it (with ``prompts``, the prompts' counts that include it)."""
        name = f"shard-{self.next_shard:05d}.jsonl"
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
        atomic_write_text(self.out / name, text)
        self.manifest["shards"].append({
            "file": name, "records": len(records),
            "answer_tokens": sum(len(r["answer_ids"]) for r in records),
            "sha256": hashlib.sha256(text.encode()).hexdigest(),
        })
        if prompts is not None:
            self.manifest["prompts"] = prompts
        atomic_write_text(self.manifest_path, json.dumps(self.manifest, indent=1))


def identity_difference(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """The keys (``config.seed``, ``prompts.sha256``...) whose values differ between two identities."""
    differ: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            differ += identity_difference(a, b, f"{prefix}{key}.")
        elif a != b:
            differ.append(f"{prefix}{key}")
    return differ


def pick_families(cfg: DataConfig, shard: int) -> tuple[torch.Generator, list[str]]:
    """The task family of each conversation a shard starts, and the generator that drew them (the shard goes on
    drawing from it); deterministic given (seed, shard)."""
    rng = torch.Generator().manual_seed(cfg.seed * 7_919 + shard)
    tasks, pastes = list(TASKS), list(PASTED_TEXT)
    if cfg.pasted_fraction is None:  # every family alike
        families = tasks + pastes
        return rng, [families[i] for i in torch.randint(0, len(families), (cfg.shard_size,), generator=rng).tolist()]
    pasted = (torch.rand(cfg.shard_size, generator=rng) < cfg.pasted_fraction).tolist()
    written = torch.randint(0, len(tasks), (cfg.shard_size,), generator=rng).tolist()
    kind = torch.randint(0, len(pastes), (cfg.shard_size,), generator=rng).tolist()
    return rng, [pastes[k] if p else tasks[w] for p, w, k in zip(pasted, written, kind)]


def slots_before(cfg: DataConfig, shard: int) -> tuple[int, int]:
    """How many written-prompt and pasted-text conversations the shards before ``shard`` started: where a shard
    continues in the user's prompt file and passage list, without reading the shards written so far."""
    pasted = sum(t in PASTED_TEXT for s in range(shard) for t in pick_families(cfg, s)[1])
    return shard * cfg.shard_size - pasted, pasted


def category_queues(user: UserText, seed: int) -> dict[str, list[int]]:
    """Each category's conversations (indices into ``user.prompts``) in the order a balanced run takes them:
    shuffled, deterministic given ``seed``, so that a run stopped early has sampled every file of a category."""
    members: dict[str, list[int]] = {}
    for k, category in enumerate(user.categories):
        members.setdefault(category, []).append(k)
    rng = torch.Generator().manual_seed(seed * 6_007 + 11)
    return {c: [members[c][i] for i in torch.randperm(len(members[c]), generator=rng).tolist()] for c in sorted(members)}


def balanced_choice(queues: dict[str, list[int]], counts: dict[str, dict[str, int]], n: int, prior: float,
                    fits: Callable[[int], bool] = lambda k: True) -> tuple[list[int], list[int]]:
    """The next ``n`` conversations of ``queues`` (each category's, in order), each from the category whose
    answers hold the fewest tokens, counting those of the conversations chosen before it; and those passed over
    on the way because they do not ``fit`` the model's context (a category that never fits is used up, not
    chosen forever).

    ``counts[c]`` holds how many of category ``c``'s conversations were taken so far
    (``started``, answered or passed over), how many were answered (``answered``) and the
    tokens their answers hold (``answer_tokens``). The answers of this shard's
    conversations are not written yet, so each adds its category's mean per answered
    conversation so far, smoothed towards the mean of all categories (``prior`` before
    any): the lagging category gets the most of the shard, not all of it. Ties go to the
    first name; a category used up drops out. A pure function of its arguments, so a
    resumed run makes the same choices.
    """
    started = {c: counts.get(c, {}).get("started", 0) for c in queues}
    answered = {c: counts.get(c, {}).get("answered", 0) for c in queues}
    expected = {c: float(counts.get(c, {}).get("answer_tokens", 0)) for c in queues}
    everyone = sum(answered.values())
    overall = max(sum(expected.values()) / everyone, 1.0) if everyone else prior
    mean = {c: (expected[c] + overall) / (answered[c] + 1) for c in queues}
    chosen: list[int] = []
    passed: list[int] = []
    while len(chosen) < n:
        left = [c for c in queues if started[c] < len(queues[c])]
        if not left:
            break
        c = min(left, key=lambda c: (expected[c], c))
        k = queues[c][started[c]]
        started[c] += 1
        if fits(k):
            chosen.append(k)
            expected[c] += mean[c]
        else:
            passed.append(k)
    return chosen, passed


def conversations_for(cfg: DataConfig, shard: int, user: UserText, counts: dict[str, dict[str, int]] | None = None,
                      fits: Callable[[int], bool] = lambda k: True) -> tuple[list[int], list[int]]:
    """Which conversations of ``user.prompts`` shard ``shard`` starts, one per written-prompt slot, and which it
    passes over: the next ones in file order (none passed over: one that does not fit is started and
    not answered), or with ``cfg.balance`` the :func:`balanced_choice` given the categories' ``counts`` so far."""
    slots = sum(t in TASKS for t in pick_families(cfg, shard)[1])
    if cfg.balance is None:
        first = slots_before(cfg, shard)[0]
        return list(range(first, min(first + slots, len(user.prompts)))), []
    if not user.categories:
        raise MoaspecError("--balance needs the prompts' categories")
    return balanced_choice(category_queues(user, cfg.seed), counts or {}, slots, cfg.max_answer_tokens / 2, fits)


def make_shard(model: LoadedModel, cfg: DataConfig, shard: int, seen: set[str],
               user: UserText = UserText(), chosen: Sequence[int] | None = None) -> list[dict[str, Any]]:
    """Generate one shard's conversations; deterministic given (seed, shard) and ``user``'s text. ``chosen``: the
    conversations of ``user.prompts`` it starts (default: the next ones in file order)."""
    tok = model.tokenizer
    stop = stop_token_ids(model.model, tok)
    # sampling draws on the logits' device (a CPU generator cannot drive CUDA sampling); the
    # data is reproducible per device type, and CPU-made data is unchanged
    gen = torch.Generator(device=model.model.device).manual_seed(cfg.seed * 1_000_003 + shard)
    rng, picks = pick_families(cfg, shard)
    pasted_before = slots_before(cfg, shard)[1] if user.passages else 0
    query_params = SamplingParams(temperature=cfg.query_temperature)
    answer_params = SamplingParams(temperature=cfg.answer_temperature)
    records: list[dict[str, Any]] = []
    convs: list[dict[str, Any]] = []
    context = model.cfg.max_position_embeddings  # a request must fit with its whole budget

    def origin_of(k: int | None) -> dict[str, str]:
        """What a record of conversation ``k`` of ``user.prompts`` says of where it came from."""
        if k is None or not user.files:
            return {}
        return {"category": user.categories[k], "prompt_file": user.files[user.origins[k]].path}

    def add_conversation(task: str, query: str, later: tuple[str, ...] = (), origin: int | None = None) -> None:
        key = normalise(query)
        if key not in seen:
            seen.add(key)
            convs.append({"task": task, "messages": [{"role": "user", "content": query}], "later": list(later),
                          "origin": origin,
                          "greedy": bool(torch.rand(1, generator=rng) < cfg.greedy_fraction),
                          "follow": bool(torch.rand(1, generator=rng) < cfg.multi_turn)})

    def write_queries(histories: list[list[dict[str, str]]]) -> list[str | None]:
        """Magpie: the user turn the model writes after each history (None when unusable)."""
        prefixes = [tok(pre_query_prefix(tok, h), add_special_tokens=False)["input_ids"] for h in histories]
        fits = [k for k, p in enumerate(prefixes) if len(p) + cfg.max_query_tokens <= context]
        out = generate_many(model.model, [Request(prefixes[k], cfg.max_query_tokens, query_params) for k in fits], stop,
                            gen, batch_size=cfg.batch_size)
        queries: list[str | None] = [None] * len(histories)
        for k, (ids, finished) in zip(fits, out):
            q = tok.decode(ids, skip_special_tokens=True).strip()
            queries[k] = q if finished and usable_query(q) else None
        return queries

    def answer(active: list[int], turn: int) -> None:
        prompts = [encode_chat(tok, convs[i]["messages"]) for i in active]
        fits = [k for k, p in enumerate(prompts) if len(p) + cfg.max_answer_tokens <= context]
        active, prompts = [active[k] for k in fits], [prompts[k] for k in fits]
        requests = [Request(p, cfg.max_answer_tokens, SamplingParams() if convs[i]["greedy"] else answer_params)
                    for p, i in zip(prompts, active)]
        for i, prompt, (ids, finished) in zip(active, prompts, generate_many(model.model, requests, stop, gen,
                                                                               batch_size=cfg.batch_size)):
            c = convs[i]
            records.append({
                "id": f"{shard}-{i}-{turn}", "task": c["task"], "turn": turn, "query": c["messages"][-1]["content"],
                "sampling": "greedy" if c["greedy"] else f"t{cfg.answer_temperature}",
                "prompt_ids": prompt, "answer_ids": ids, "finished": finished, **origin_of(c["origin"]),
            })
            c["messages"].append({"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)})

    # 1. user prompts, steered per task family, and their answers: the model writes them (Magpie), or they are
    #    the next conversations of the user's --prompts file
    written = [t for t in picks if t in TASKS]
    if user.prompts:
        for k in conversations_for(cfg, shard, user)[0] if chosen is None else chosen:
            turns = user.prompts[k]
            add_conversation(USER_TASK, turns[0], turns[1:cfg.max_turns], k)
    else:
        for task, query in zip(written, write_queries([steering(tok, t) for t in written])):
            if query is not None:
                add_conversation(task, query)
    answer(list(range(len(convs))), 0)

    # 2. prompts that paste a text under an instruction: the user's --passages, else the target's own answers
    longest = min(cfg.max_passage_tokens, context - cfg.max_answer_tokens - 64)  # 64: template and instruction
    pasted = [t for t in picks if t in PASTED_TEXT]

    def texts_to_paste() -> list[list[int]]:
        """The token ids each pasted conversation quotes: the user's passages in turn (each once before any
        repeats, across shards too), else one or two of this shard's answers (each once before any repeats)."""
        if user.passages:
            perm = torch.randperm(len(user.passages), generator=torch.Generator().manual_seed(cfg.seed)).tolist()
            return [tok(user.passages[perm[(pasted_before + k) % len(perm)]], add_special_tokens=False)["input_ids"]
                    for k in range(len(pasted))] if longest >= MIN_PASSAGE_TOKENS else []
        answers = [r["answer_ids"][:longest] for r in records
                   if len(r["answer_ids"]) >= MIN_PASSAGE_TOKENS and longest >= MIN_PASSAGE_TOKENS]
        order = torch.randperm(len(answers), generator=rng).tolist()
        texts = []
        for k in range(len(pasted) if answers else 0):
            i, j = order[2 * k % len(order)], order[(2 * k + 1) % len(order)]
            one, two = answers[i], answers[j]
            texts.append(one + (tok("\n\n", add_special_tokens=False)["input_ids"] + two
                                if len(one) + len(two) < longest and i != j else []))
        return texts

    first_pasted = len(convs)
    for task, ids in zip(pasted, texts_to_paste()):
        templates = PASTED_TEXT[task]
        template = templates[int(torch.randint(0, len(templates), (1,), generator=rng))]
        add_conversation(task, template.format(text=tok.decode(ids[:longest], skip_special_tokens=True).strip()))
    answer(list(range(first_pasted, len(convs))), 0)

    # 3. later user turns: a --prompts conversation's own, each answered in turn while it fits the context
    turn = 1
    while active := [i for i, c in enumerate(convs)
                     if len(c["later"]) >= turn and c["messages"][-1]["role"] == "assistant"]:
        for i in active:
            convs[i]["messages"].append({"role": "user", "content": convs[i]["later"][turn - 1]})
        answer(active, turn)
        turn += 1

    # 4. a model-written follow-up turn for some of the other conversations, and its answer
    active = [i for i, c in enumerate(convs) if c["follow"] and c["task"] != USER_TASK]
    followups = write_queries([convs[i]["messages"] for i in active]) if active else []
    kept = []
    for i, query in zip(active, followups):
        if query is not None:
            convs[i]["messages"].append({"role": "user", "content": query})
            kept.append(i)
    if kept:
        answer(kept, 1)
    return records


def generate_dataset(model: LoadedModel, out: Path, cfg: DataConfig, progress: bool = True,
                     user: UserText = UserText()) -> dict[str, Any]:
    """Fill ``out`` with shards until ``cfg.examples`` records exist, or every conversation of ``user``'s prompt
    files has been started; resume where a previous run stopped."""
    config = {k: v for k, v in asdict(cfg).items() if k != "examples" and v is not None}
    identity = {"model": model.fingerprint, "config": config, "generator": GENERATOR, **dict(user.identity)}
    if cfg.balance and not user.files:
        raise MoaspecError("--balance takes the conversations of --prompts files by category; give --prompts")
    writer = DataWriter(out, identity)
    tally = PromptTally(user, cfg, writer) if user.files else None
    room = model.cfg.max_position_embeddings - cfg.max_answer_tokens

    def fits(k: int) -> bool:  # the first turn and its answer fit the context (as make_shard asks)
        return len(encode_chat(model.tokenizer, [{"role": "user", "content": user.prompts[k][0]}])) <= room
    bar = progress_bar(total=cfg.examples, initial=min(writer.records, cfg.examples), unit="turn", disable=not progress,
                       desc="moaspec data")
    while writer.records < cfg.examples:
        counts = tally.block["categories"] if tally else {}
        if user.prompts and len(user.prompts) <= (sum(c["started"] for c in counts.values()) if cfg.balance
                                                  else slots_before(cfg, writer.next_shard)[0]):
            break  # the prompt files are used up
        chosen, passed = conversations_for(cfg, writer.next_shard, user, counts, fits) if user.prompts else ([], [])
        check_not_stalled(writer.manifest["shards"], cfg,
                          model.cfg.max_position_embeddings if user.prompts else None)
        records = make_shard(model, cfg, writer.next_shard, writer.seen, user, chosen)
        writer.add_shard(records, tally.count([*chosen, *passed], records) if tally else None)
        bar.update(min(len(records), cfg.examples - bar.n))
    bar.close()
    return writer.manifest


class PromptTally:
    """The manifest's account of the prompt files: each file and category as read (``user.about``), with how many
    of its conversations were started and answered, the turns answered and the tokens the answers hold."""

    def __init__(self, user: UserText, cfg: DataConfig, writer: DataWriter) -> None:
        self.user = user
        block = copy.deepcopy(user.about)
        block["balance"] = cfg.balance or "none"
        old = writer.manifest.get("prompts")
        if isinstance(old, dict) and old.get("counted_from_shard") is not None:  # resumed: its counts go on
            block["counted_from_shard"] = old["counted_from_shard"]
            for new_rows, old_rows in ((block["files"], old.get("files", [])),
                                       (list(block["categories"].values()), list(old.get("categories", {}).values()))):
                for row, was in zip(new_rows, old_rows):
                    row.update({k: was.get(k, 0) for k in COUNTS})
        else:
            if cfg.balance and writer.next_shard:
                raise damaged_data(writer.out, f"{writer.manifest_path} lacks the counts of the prompts that the "
                                               "balancing reads")
            block["counted_from_shard"] = writer.next_shard  # a directory begun before the counts were kept: from here
            for row in block["files"] + list(block["categories"].values()):
                row.update(dict.fromkeys(COUNTS, 0))
        self.block = block
        self.by_path = {row["path"]: row for row in block["files"]}

    def count(self, chosen: Sequence[int], records: list[dict[str, Any]]) -> dict[str, Any]:
        """The block, counting a shard that started ``chosen`` and wrote ``records``."""
        for k in chosen:
            self.block["files"][self.user.origins[k]]["started"] += 1
            self.block["categories"][self.user.categories[k]]["started"] += 1
        for r in records:
            if "prompt_file" in r:
                for row in (self.by_path[r["prompt_file"]], self.block["categories"][r["category"]]):
                    row["answered"] += r["turn"] == 0
                    row["turns"] += 1
                    row["answer_tokens"] += len(r["answer_ids"])
        return self.block


def check_not_stalled(shards: list[dict[str, Any]], cfg: DataConfig, user_prompts_context: int | None = None) -> None:
    """Stop with an explanation when the newest shards hold no record at all.

    Every record starts from a user prompt the model writes itself; a model that never
    finishes a usable one within ``max_query_tokens`` (not a chat model, a chat template
    without a user turn, a budget too small) would otherwise write empty shards forever.
    With the user's own prompts (``user_prompts_context``: the model's context), the cause
    is prompts too long for the context. Empty shards stay in the manifest, so a resumed
    run stops here again at once.
    """
    empty = 0
    for shard in reversed(shards):
        if shard["records"]:
            break
        empty += 1
    if empty < STALL_SHARDS or empty * cfg.shard_size < STALL_CONVERSATIONS:
        return
    if user_prompts_context is not None:
        raise MoaspecError(
            f"no conversation of the last {empty} shards was answered: a prompt and --max-answer-tokens "
            f"({cfg.max_answer_tokens}) must fit the model's context ({user_prompts_context} tokens); "
            "use shorter prompts or a smaller --max-answer-tokens"
        )
    raise MoaspecError(
        f"the model wrote no usable user prompt in the last {empty} shards ({empty * cfg.shard_size} tries): "
        f"each must end within --max-query-tokens ({cfg.max_query_tokens}) and be at least 3 words of text. "
        "Magpie data needs an instruction-tuned chat model whose chat template has a user turn; "
        "with such a model, raise --max-query-tokens"
    )
