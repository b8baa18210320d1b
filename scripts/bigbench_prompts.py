"""Human-written prompts and news articles for `moaspec data`, from the `bigbench` package on PyPI.

No dataset hub is reachable here, but the BIG-bench source distribution on PyPI
(`pip download --no-deps bigbench==1.0.0`, 342 MB) holds its tasks' examples. This
writes a prompt file of human-written questions and requests (StrategyQA, general
knowledge, the helpful/harmless/honest assistant requests, MathQA word problems,
Python snippets to explain, passages with questions from DROP and CosmosQA, ...) and a
directory of articles (XSum's BBC news, WikiLingua's how-to guides) for `--passages`:

    pip download --no-deps -d /tmp/bigbench bigbench==1.0.0
    python scripts/bigbench_prompts.py /tmp/bigbench/bigbench-1.0.0.tar.gz OUT
    moaspec data --prompts OUT/prompts.jsonl --passages OUT/passages --pasted-fraction 0.3 ...

With `--factual` it writes short factual questions instead, and no articles: Wikidata facts
asked as questions ("What is the capital of Kenya?") and QASC's science questions, the
shape of the short questions SpecBench's qa category asks. With `--more` it writes a second set
from tasks the default one leaves out (everyday situations from Social IQa, physics and moral
questions, riddles, claims to check, sentences to write from words, facts or restaurant
attributes, stories around a scientific paragraph) and Quoref's Wikipedia passages as articles.

None of it comes from SpecBench's sources (MT-bench, Alpaca, GSM8K, HumanEval, Natural
Questions, CNN/DailyMail); the script refuses to write a prompt or article that shares
its first 60 characters with a turn of the SpecBench files, if it finds them.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import tarfile
from collections.abc import Iterable
from pathlib import Path

from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_dir
from moaspec.specbench import load_questions

# task -> how many examples to take (None: all) and the instruction put before each (None: the input as it is)
PROMPT_TASKS: dict[str, tuple[int | None, str | None]] = {
    "strategyqa": (1500, None),
    "general_knowledge": (None, None),
    "known_unknowns": (None, None),
    "physical_intuition": (None, None),
    "simple_ethical_questions": (None, None),
    "novel_concepts": (None, None),
    "understanding_fables": (None, None),
    "auto_debugging": (None, None),
    "hhh_alignment/harmless": (None, None),
    "hhh_alignment/helpful": (None, None),
    "hhh_alignment/other": (None, None),
    "hhh_alignment/honest": (None, None),
    "elementary_math_qa/question_only": (800, None),
    "code_line_description": (None, "Explain what this Python code does:\n\n"),
    "natural_instructions/subtask028_drop_answer_generation": (300, None),
    "natural_instructions/subtask024_cosmosqa_answer_generation": (300, None),
}
# --factual: short questions about a named thing or a fact, the shape of Natural Questions (SpecBench's qa),
# which the prompts above hardly have
WIKIDATA_RELATIONS = frozenset({
    "capital", "continent", "country", "currency", "developer", "genre", "headquarters location", "instrument",
    "language", "manufacturer", "military branch", "native language", "official language", "operating system",
    "original broadcaster", "publisher", "record label", "religion", "team position"})
FACTUAL_PER_TASK = 1500
# --more: a second set, of tasks the first leaves out: everyday situations, physics and moral questions, riddles,
# claims to check, sentences to write from words, facts or restaurant attributes, stories to write around a
# scientific paragraph; and Quoref's Wikipedia passages for --passages
MORE_PROMPT_TASKS: dict[str, tuple[int | None, str | None]] = {
    "social_iqa": (600, None),
    "physics_questions": (None, None),
    "moral_permissibility": (None, None),
    "causal_judgment": (None, None),
    "riddle_sense": (None, None),
    "sufficient_information": (None, None),
    "date_understanding": (None, None),
    "fact_checker/fever": (400, None),
    "misconceptions": (None, "Is this statement true or false? Explain briefly.\n\n"),
    "mathematical_induction": (None, "Is this argument valid? Explain.\n\n"),
    "gem/common_gen": (400, "Write one sentence that uses all of these words: "),
    "gem/e2e_nlg": (300, "Write a short description of a restaurant with these attributes: "),
    "gem/webnlg_en": (400, "Write a short paragraph that states these facts in plain English: "),
    "gem/asset": (None, "Rewrite this sentence in simpler words: "),
    "natural_instructions/subtask059_ropes_story_generation": (400, "Write a short story that uses the idea in this "
                                                                    "paragraph.\n\n"),
}


def wikidata_question(statement: str) -> str | None:
    """'The capital of Kenya is' -> 'What is the capital of Kenya?', for the relations that read well so."""
    m = re.fullmatch(r"The (.+?) of (.+) is", statement)
    return f"What is the {m.group(1)} of {m.group(2)}?" if m and m.group(1) in WIKIDATA_RELATIONS else None


def qasc_question(text: str) -> str | None:
    """QASC's 'Fact: ... Question: ...' -> the question alone: the fact above it would give the answer away."""
    m = re.search(r"Question:\s*(.+\?)", text)
    return m.group(1).strip() if m else None


# task -> how to turn an example's input into a question (None: leave the example out)
FACTUAL_TASKS = {"qa_wikidata": wikidata_question,
                 "natural_instructions/subtask041_qasc_answer_generation": qasc_question}
PASSAGE_TASKS = ("gem/xsum", "gem/wikilingua_en")
MORE_PASSAGE_TASKS = ("natural_instructions/subtask002_quoref_answer_generation",)
MIN_PASSAGE_CHARS = 400  # shorter articles are left out
DEFAULT_SPECBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "specbench"


def clean(text: str) -> str:
    """An example's input without BIG-bench's "Q:" / "A:" scaffolding."""
    text = re.sub(r"^(Q|Question):\s*", "", text.strip())
    return re.sub(r"\n?A:\s*$", "", text).strip()


def normalised(text: str) -> str:
    return re.sub(r"\W+", " ", text.lower()).strip()


def task_inputs(tar: tarfile.TarFile, members: dict[str, tarfile.TarInfo], task: str) -> list[str]:
    """The inputs of a task's examples, stripped."""
    member = members.get(task)
    if member is None:
        sys.exit(f"bigbench_prompts: the archive has no task {task}")
    data = json.load(tar.extractfile(member))  # type: ignore[arg-type]
    return [e.get("input", "").strip() for e in data.get("examples", [])]


def passage(text: str) -> str:
    """An example's passage: Quoref's "Passage: ...\nQuestion: ..." without the question; other inputs as they are."""
    return re.sub(r"^Passage:\s*", "", text.split("\nQuestion:")[0]).strip()


def specbench_openings(specbench: Path) -> set[str]:
    """The first 60 normalised characters of every SpecBench turn (empty where the files are absent)."""
    if not any(specbench.glob("*.jsonl")):
        return set()
    turns = (normalised(t) for q in load_questions(specbench) for t in q.turns)
    return {t[:60] for t in turns if len(t) > 30}


def refuse_specbench_overlap(specbench: Path, texts: Iterable[str]) -> int:
    """Raise if the opening of any SpecBench turn appears in the texts; returns how many turns were checked."""
    banned = specbench_openings(specbench)
    corpus = normalised(" ".join(texts))
    shared = [b for b in banned if b in corpus]
    if shared:
        raise MoaspecError(f"{len(shared)} SpecBench turns appear in the text, e.g. {shared[0]!r}; nothing written")
    return len(banned)


def read_archive(archive: Path, factual: bool = False, more: bool = False) -> tuple[list[str], dict[str, str]]:
    """The prompts (in task order) and the passages (file name -> text) that the archive yields; with `factual`,
    FACTUAL_TASKS' questions and no passages; with `more`, the second set (MORE_PROMPT_TASKS, MORE_PASSAGE_TASKS)."""
    with tarfile.open(archive) as tar:
        members = {m.name.split("/benchmark_tasks/")[1].removesuffix("/task.json"): m for m in tar.getmembers()
                   if "/benchmark_tasks/" in m.name and m.name.endswith("/task.json")}
        prompts: list[str] = []
        if factual:
            for task, question in FACTUAL_TASKS.items():
                questions = list(dict.fromkeys(q for q in map(question, task_inputs(tar, members, task)) if q))
                random.Random(task).shuffle(questions)
                prompts.extend(questions[:FACTUAL_PER_TASK])
            return prompts, {}
        for task, (limit, instruction) in (MORE_PROMPT_TASKS if more else PROMPT_TASKS).items():
            inputs = [x for x in map(clean, task_inputs(tar, members, task)) if x]
            if more:  # the second set's tasks repeat inputs; the first set's sample stays as it was drawn
                inputs = list(dict.fromkeys(inputs))
            random.Random(task).shuffle(inputs)
            prompts.extend((instruction or "") + x for x in inputs[:limit])
        passages = {f"{task.split('/')[-1]}-{i:04d}.txt": x for task in (MORE_PASSAGE_TASKS if more else PASSAGE_TASKS)
                    for i, x in enumerate(dict.fromkeys(map(passage, task_inputs(tar, members, task))))
                    if len(x) > MIN_PASSAGE_CHARS}
    return prompts, passages


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path, help="bigbench-1.0.0.tar.gz, as pip downloads it")
    ap.add_argument("output", help="directory for prompts.jsonl and passages/")
    ap.add_argument("--seed", type=int, default=27, help="order of the prompts (each task's sample is fixed)")
    ap.add_argument("--specbench", type=Path, default=DEFAULT_SPECBENCH,
                    help="SpecBench's JSONL files, whose turns must not appear in the output")
    ap.add_argument("--factual", action="store_true",
                    help="short factual questions (Wikidata facts asked as questions, QASC's science questions) "
                         "instead of the mixed prompts and articles")
    ap.add_argument("--more", action="store_true",
                    help="a second set of prompts and passages, from tasks the default set leaves out")
    args = ap.parse_args()
    if args.factual and args.more:
        sys.exit("bigbench_prompts: --factual and --more are two different sets; choose one")
    if not args.archive.is_file():
        sys.exit(f"bigbench_prompts: no file {args.archive}; pip download --no-deps bigbench==1.0.0 fetches it")
    try:
        prompts, passages = read_archive(args.archive, args.factual, args.more)
    except (tarfile.TarError, OSError, EOFError, ValueError) as e:  # JSONDecodeError is a ValueError
        sys.exit(f"bigbench_prompts: {args.archive} is not a readable BIG-bench archive ({e})")
    prompts = list(dict.fromkeys(prompts))
    random.Random(args.seed).shuffle(prompts)
    try:
        checked = refuse_specbench_overlap(args.specbench, [*prompts, *passages.values()])
    except MoaspecError as e:
        sys.exit(f"bigbench_prompts: {e}")

    def write(tmp: Path) -> None:
        (tmp / "passages").mkdir()  # empty with --factual, so that --passages OUT/passages still reads
        for name, text in passages.items():
            (tmp / "passages" / name).write_text(text + "\n")
        (tmp / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))

    try:
        atomic_write_dir(args.output, write, marker="prompts.jsonl")
    except MoaspecError as e:
        sys.exit(f"bigbench_prompts: {e}")
    print(f"{args.output}: {len(prompts)} prompts, {len(passages)} passages "
          f"(checked against {checked} SpecBench turns: none shared)")


if __name__ == "__main__":
    main()
