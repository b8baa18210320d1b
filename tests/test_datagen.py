"""Distillation data made by the target: shards, manifest, resume, refusal of foreign directories."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from moaspec.errors import MoaspecError
from moaspec.training.datagen import DataConfig, generate_dataset, pre_query_prefix, usable_query
from moaspec.training.dataset import read_shard
from tiny import accepting_gibberish

CFG = DataConfig(examples=6, shard_size=8, batch_size=4, max_query_tokens=12, max_answer_tokens=10, multi_turn=0.5)


# ways a data directory gets damaged (a crash, a full disk, an edit), each with what the error then says
DAMAGE: dict[str, tuple[Callable[[Path, Path], object], str]] = {
    "manifest empty": (lambda manifest, shard: manifest.write_text(""), "manifest.json is empty"),
    "manifest not JSON": (lambda manifest, shard: manifest.write_text('{"identity": '), "manifest.json is not valid JSON"),
    "manifest a list": (lambda manifest, shard: manifest.write_text("[]"), "manifest.json holds an array where an object"),
    "shard not JSON": (lambda manifest, shard: shard.write_text("{bad\n"), "has changed since it was written"),
    "shard missing": (lambda manifest, shard: shard.unlink(), "a shard its manifest.json lists, is missing"),
    "shard emptied": (lambda manifest, shard: shard.write_text(""), "changed since it was written .* now holds 0 lines"),
}


def damage_data(out: Path, how: str) -> str:
    """Damage the data directory ``out`` (its manifest, or a shard that has records) as ``how`` says; return the
    pattern the error must match: the directory is named as damaged, with the file, the fault and the remedy."""
    manifest = out / "manifest.json"
    shard = out / next(s["file"] for s in json.loads(manifest.read_text())["shards"] if s["records"])
    damage, says = DAMAGE[how]
    damage(manifest, shard)
    return f"the data directory {re.escape(str(out))} is damaged: .*{says}.*; remove the directory and run `moaspec data`"


@pytest.fixture()
def permissive():  # type: ignore[no-untyped-def]
    """The mechanics tests run on a random tiny model's gibberish (see ``accepting_gibberish``)."""
    with accepting_gibberish():
        yield


def test_pre_query_prefix_stops_at_user_turn(tiny_llama) -> None:  # type: ignore[no-untyped-def]
    prefix = pre_query_prefix(tiny_llama.tokenizer, [{"role": "system", "content": "S"}])
    assert prefix == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\n"


def test_query_filter() -> None:
    assert usable_query("Write a poem about the sea.")
    assert not usable_query("hi")
    assert not usable_query("<|im_start|> what is this")
    assert not usable_query("1234 5678 9999 ++++")


def test_dataset_shards_manifest_and_resume(tiny_llama, tmp_path: Path, permissive) -> None:  # type: ignore[no-untyped-def]
    out = tmp_path / "data"
    manifest = generate_dataset(tiny_llama, out, CFG, progress=False)
    shards = manifest["shards"]
    assert sum(s["records"] for s in shards) >= CFG.examples
    records = [r for s in shards for r in read_shard(out / s["file"])]
    assert all(r["prompt_ids"] and r["turn"] in (0, 1) for r in records)
    assert all(len(r["answer_ids"]) <= CFG.max_answer_tokens for r in records)
    queries = [r["query"] for r in records if r["turn"] == 0]
    assert len(queries) == len(set(queries))  # deduplicated
    assert not list(out.glob(".*tmp"))  # nothing half-written left behind

    # resume with a larger target: earlier shards untouched, new ones appended
    first = (out / shards[0]["file"]).read_text()
    bigger = DataConfig(**{**CFG.__dict__, "examples": CFG.examples + 10})
    manifest2 = generate_dataset(tiny_llama, out, bigger, progress=False)
    assert len(manifest2["shards"]) > len(shards)
    assert (out / shards[0]["file"]).read_text() == first


def test_a_model_that_writes_no_usable_prompt_stops_with_an_explanation(tiny_llama, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """No query can finish within one token, so every shard is empty: the run must stop, not loop forever."""
    cfg = DataConfig(examples=6, shard_size=8, batch_size=8, max_query_tokens=1, max_answer_tokens=4)
    out = tmp_path / "data"
    with pytest.raises(MoaspecError, match="no usable user prompt.*--max-query-tokens"):
        generate_dataset(tiny_llama, out, cfg, progress=False)
    shards = json.loads((out / "manifest.json").read_text())["shards"]
    assert len(shards) == 8 and not any(s["records"] for s in shards)  # 3 shards and 64 tries, whichever is later
    with pytest.raises(MoaspecError, match="no usable user prompt"):  # resuming stops at once
        generate_dataset(tiny_llama, out, cfg, progress=False)
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 8


def test_pasted_text_prompts_quote_the_shards_own_answers(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Summarisation and passage questions paste finished answers of the same shard under an instruction."""
    from moaspec.training import datagen

    tok = tiny_llama.tokenizer

    def fake_generate_many(model, requests, stop, gen, batch_size):  # type: ignore[no-untyped-def]
        # a readable, distinct, finished continuation per request: the pipeline's logic is under test here
        return [(tok(f" reply {len(r.prompt)} words" * 5, add_special_tokens=False)["input_ids"][: r.max_new_tokens], True)
                for r in requests]

    monkeypatch.setattr(datagen, "generate_many", fake_generate_many)
    records = datagen.make_shard(tiny_llama, DataConfig(shard_size=40, max_query_tokens=80, max_answer_tokens=80,
                                                           max_passage_tokens=300), 0, set())
    written = [tok.decode(r["answer_ids"], skip_special_tokens=True).strip() for r in records
               if r["task"] in datagen.TASKS and r["turn"] == 0]
    pasted = [r for r in records if r["task"] in datagen.PASTED_TEXT and r["turn"] == 0]
    assert pasted and written
    assert all(len(r["prompt_ids"]) + 80 <= tiny_llama.cfg.max_position_embeddings for r in records)  # fits the context
    for r in pasted:
        assert any(t.split("{text}")[0] in r["query"] and t.split("{text}")[1] in r["query"]
                   for t in datagen.PASTED_TEXT[r["task"]])
        assert any(w in r["query"] for w in written)


def test_same_seed_same_data(tiny_llama, tmp_path: Path, permissive) -> None:  # type: ignore[no-untyped-def]
    a = generate_dataset(tiny_llama, tmp_path / "a", CFG, progress=False)
    b = generate_dataset(tiny_llama, tmp_path / "b", CFG, progress=False)
    assert [s["sha256"] for s in a["shards"]] == [s["sha256"] for s in b["shards"]]


def test_other_settings_are_refused(tiny_llama, tmp_path: Path, permissive) -> None:  # type: ignore[no-untyped-def]
    generate_dataset(tiny_llama, tmp_path, CFG, progress=False)
    with pytest.raises(MoaspecError, match="other settings, another model"):
        generate_dataset(tiny_llama, tmp_path, DataConfig(**{**CFG.__dict__, "seed": 1}), progress=False)
    assert json.loads((tmp_path / "manifest.json").read_text())["identity"]["config"]["seed"] == 0


@pytest.fixture(scope="module")
def made(tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Path:  # type: ignore[no-untyped-def]
    out = tmp_path_factory.mktemp("made") / "data"
    with accepting_gibberish():
        generate_dataset(tiny_llama, out, CFG, progress=False)
    return out


@pytest.mark.parametrize("how", DAMAGE)
def test_resuming_a_damaged_directory_says_what_is_damaged(tiny_llama, made: Path, tmp_path: Path, how: str,  # type: ignore[no-untyped-def]
                                                         permissive) -> None:
    out = tmp_path / "data"
    shutil.copytree(made, out)
    expected = damage_data(out, how)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(MoaspecError, match=expected):
        generate_dataset(tiny_llama, out, CFG, progress=False)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # left as it was found


# --- the user's own prompts and passages (--prompts, --passages) ---

from moaspec.training import user_text  # noqa: E402
from moaspec.training.user_text import UserText, load_user_text, pack_paragraphs, read_prompts  # noqa: E402


def test_prompt_files_in_every_supported_form(tmp_path: Path) -> None:
    items = [
        {"question_id": 1, "turns": ["First question?", "And a follow-up?"]},
        {"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Share GPT asks"},
                           {"from": "gpt", "value": "an old answer, thrown away"}, {"from": "human", "value": "again"}]},
        {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Chat asks"}]},
        {"prompt": "  A bare prompt  "},
        {"instruction": "Translate this.", "input": "Bonjour"},
        "Just a string",
        {"turns": ["Cut here", "", "never asked"]},
        {"turns": []},  # nothing to ask: skipped, not an error
    ]
    expected = (("First question?", "And a follow-up?"), ("Share GPT asks", "again"), ("Chat asks",),
                ("A bare prompt",), ("Translate this.\n\nBonjour",), ("Just a string",), ("Cut here",))
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(i) for i in items) + "\n\n")
    array = tmp_path / "p.json"
    array.write_text(json.dumps(items, indent=1))
    assert read_prompts(jsonl)[0] == expected
    assert read_prompts(array)[0] == expected


@pytest.mark.parametrize("content,fragment", [
    (None, "does not exist"),
    ("", "holds no prompt"),
    ('{"turns": ["ok"]}\n{oops\n', "line 2 is not valid JSON"),
    ('[{"turns": ["ok"]}', "is not valid JSON"),
    ('{"turns": ["ok"]}\n{"text": "no known key"}\n42\n', "line 2, line 3 are not a prompt"),
    ('{"turns": ["ok", 7]}\n', "line 1 is not a prompt"),
    (b"\xff\xfe\x00", "not UTF-8"),
])
def test_bad_prompt_files_are_refused_with_what_is_wrong(tmp_path: Path, content: str | bytes | None,
                                                         fragment: str) -> None:
    f = tmp_path / "p.jsonl"
    if isinstance(content, bytes):
        f.write_bytes(content)
    elif content is not None:
        f.write_text(content)
    with pytest.raises(MoaspecError, match=re.escape(fragment)):
        read_prompts(f)


def test_passages_pack_paragraphs_and_read_only_text_files_in_order(tmp_path: Path) -> None:
    text = "\n\n".join(f"Paragraph {k} " + "word " * 10 for k in range(6))  # 6 paragraphs of 67 characters
    paragraphs = [p.strip() for p in text.split("\n\n")]
    assert pack_paragraphs(text, max_chars=150, min_chars=10) == ["\n\n".join(paragraphs[k: k + 2]) for k in (0, 2, 4)]
    assert pack_paragraphs("short\n\n" + "x" * 300, max_chars=100, min_chars=20) == ["x" * 300]  # alone, kept

    docs = tmp_path / "docs"
    (docs / "sub").mkdir(parents=True)
    (docs / "b.md").write_text("B text " * 20)
    (docs / "sub" / "a.txt").write_text("A text " * 20)
    (docs / "skip.py").write_text("print('not a passage') " * 20)
    one = load_user_text(None, docs, max_passage_tokens=100, min_passage_tokens=10)
    assert one.passages == (("B text " * 20).strip(), ("A text " * 20).strip())  # b.md before sub/a.txt
    (docs / "b.md").write_text("B changed " * 20)
    two = load_user_text(None, docs, max_passage_tokens=100, min_passage_tokens=10)
    assert dict(one.identity)["passages"]["sha256"] != dict(two.identity)["passages"]["sha256"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(MoaspecError, match="holds no .txt, .md, .rst file"):
        user_text.passage_files(tmp_path / "empty")
    with pytest.raises(MoaspecError, match="do not exist"):
        user_text.passage_files(tmp_path / "nowhere")
    with pytest.raises(MoaspecError, match="no paragraph of at least 400 characters"):
        load_user_text(None, docs, max_passage_tokens=200, min_passage_tokens=100)


def test_parts_split_prompts_and_passages_between_processes(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"Question {k}?"}) + "\n" for k in range(7)))
    docs = tmp_path / "docs.txt"
    docs.write_text("\n\n".join(f"Passage {k} " + "word " * 30 for k in range(5)))
    whole = load_user_text(prompts, docs, max_passage_tokens=40, min_passage_tokens=10)
    parts = [load_user_text(prompts, docs, 40, 10, part=(k, 3)) for k in (1, 2, 3)]
    assert [len(p.prompts) for p in parts] == [3, 2, 2] and [len(p.passages) for p in parts] == [2, 2, 1]
    # every conversation and passage in exactly one part, in file order within it
    assert sorted(c for p in parts for c in p.prompts) == sorted(whole.prompts)
    assert sorted(t for p in parts for t in p.passages) == sorted(whole.passages)
    assert parts[1].prompts == whole.prompts[1::3]
    # the identity names the part and keeps the whole file's hash: a resumed run refuses another part
    ids = [dict(p.identity) for p in parts]
    assert ids[0]["part"] == [1, 3] and ids[0] != ids[1]
    assert ids[0]["prompts"]["sha256"] == ids[1]["prompts"]["sha256"] == dict(whole.identity)["prompts"]["sha256"]
    with pytest.raises(MoaspecError, match="holds only 5 passages, none for part 6"):
        load_user_text(None, docs, 40, 10, part=(6, 6))
    with pytest.raises(MoaspecError, match="give one of them"):
        load_user_text(None, None, 40, 10, part=(1, 2))
    for bad in ("0/2", "3/2", "2", "a/b", "1/2/3", "-1/2"):
        with pytest.raises(MoaspecError, match="K/N with 1 <= K <= N"):
            user_text.parse_part(bad)
    assert user_text.parse_part("2/4") == (2, 4)


@pytest.fixture()
def fake_decoding(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    """A readable, distinct, finished answer per request: the pipeline's logic is under test, not the model."""
    from moaspec.training import datagen

    tok = tiny_llama.tokenizer

    def fake_generate_many(model, requests, stop, gen, batch_size):  # type: ignore[no-untyped-def]
        return [(tok(f" reply {len(r.prompt)} words" * 5, add_special_tokens=False)["input_ids"][: r.max_new_tokens], True)
                for r in requests]

    monkeypatch.setattr(datagen, "generate_many", fake_generate_many)
    return tok


def test_a_prompt_file_is_answered_turn_by_turn_in_order_and_ends_the_run(tiny_llama, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                       fake_decoding) -> None:
    from moaspec.training import datagen

    convs = tuple((f"Question number {k} about topic {k}?",) + ((f"Follow-up {k}?", f"Last {k}?") if k % 3 == 0 else ())
                  for k in range(20))
    user = UserText(prompts=convs, identity=(("prompts", {"sha256": "x", "conversations": 20}),))
    cfg = DataConfig(examples=1000, shard_size=8, max_answer_tokens=16, pasted_fraction=0.0, multi_turn=1.0)
    out = tmp_path / "d"
    generate_dataset(tiny_llama, out, DataConfig(**{**cfg.__dict__, "examples": 5}), progress=False, user=user)
    assert len(json.loads((out / "manifest.json").read_text())["shards"]) == 1  # interrupted after one shard
    manifest = generate_dataset(tiny_llama, out, cfg, progress=False, user=user)  # resumed
    assert len(manifest["shards"]) == 3  # 8 + 8 + 4 conversations: the file is used up, the run ends
    records = [r for s in manifest["shards"] for r in read_shard(out / s["file"])]
    assert [r["query"] for r in records if r["turn"] == 0] == [c[0] for c in convs]  # in file order, each once
    assert all(r["task"] == datagen.USER_TASK for r in records)
    by_conv: dict[str, list[dict]] = {}
    for r in records:
        by_conv.setdefault(r["id"].rsplit("-", 1)[0], []).append(r)
    for turns in by_conv.values():  # every later turn of the file, answered in turn; no model-written follow-up
        k = int(turns[0]["query"].split()[2])
        assert [t["query"] for t in sorted(turns, key=lambda t: t["turn"])] == list(convs[k])
    last = max((r for r in records if r["turn"] == 2), key=lambda r: len(r["prompt_ids"]))
    assert fake_decoding.decode(last["prompt_ids"]).count("reply") == 2  # it saw both earlier answers
    assert generate_dataset(tiny_llama, out, cfg, progress=False, user=user) == manifest  # nothing left to do

    with pytest.raises(MoaspecError, match="other settings"):  # another prompt file: refused, not mixed in
        generate_dataset(tiny_llama, out, cfg, progress=False,
                         user=UserText(prompts=convs, identity=(("prompts", {"sha256": "y", "conversations": 20}),)))


def test_pasted_prompts_paste_the_users_passages_in_turn(tiny_llama, fake_decoding) -> None:  # type: ignore[no-untyped-def]
    from moaspec.training import datagen

    passages = tuple(f"Document {k}. " + "It says a thing or two. " * 2 for k in range(5))
    cfg = DataConfig(shard_size=12, max_query_tokens=80, max_answer_tokens=40, max_passage_tokens=300,
                     pasted_fraction=1.0, multi_turn=0.0)
    shards = [datagen.make_shard(tiny_llama, cfg, s, set(), UserText(passages=passages)) for s in range(2)]
    pasted = [r for records in shards for r in records if r["turn"] == 0]
    # 24 started; a passage that comes round again under the same instruction is a duplicate, dropped
    assert 20 <= len(pasted) <= 24 and all(r["task"] in datagen.PASTED_TEXT for r in pasted)
    used = [next(k for k in range(5) if f"Document {k}." in r["query"]) for r in pasted]
    assert sorted(used[:5]) == list(range(5))  # each passage once before any repeats, across shards too
    assert all(passages[k].strip() in r["query"] for k, r in zip(used, pasted))


def _bigbench_archive(path: Path, inputs: dict[str, list[str]]) -> Path:
    """A stand-in for the bigbench sdist: one task.json per task that scripts/bigbench_prompts.py reads."""
    import io
    import tarfile

    with tarfile.open(path, "w:gz") as tar:
        for task, texts in inputs.items():
            body = json.dumps({"examples": [{"input": t} for t in texts]}).encode()
            info = tarfile.TarInfo(f"bigbench-1.0.0/bigbench/benchmark_tasks/{task}/task.json")
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return path


SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


def _run_script(name: str, specbench: Path, *args: object) -> subprocess.CompletedProcess[str]:
    """One of scripts/*.py run as a user runs it, checking against the given SpecBench directory."""
    return subprocess.run([sys.executable, str(SCRIPTS / name), *map(str, args), "--specbench", str(specbench)],
                          capture_output=True, text=True, timeout=120)


def test_bigbench_prompts_script(tmp_path: Path) -> None:
    """The BIG-bench prompt builder: every task's inputs without Q:/A: scaffolding, instructions prefixed, short
    articles left out, output written whole; with --factual, Wikidata facts and QASC items as questions; with --more,
    the second set, each input once and Quoref's passages without their questions; it refuses
    an archive that shares a turn with SpecBench, and a bad file."""
    sys.path.insert(0, str(SCRIPTS))
    try:
        import bigbench_prompts
    finally:
        sys.path.remove(str(SCRIPTS))
    inputs = {task: [f"Q: Question {i} of {task}?\nA:" for i in range(3)] for task in bigbench_prompts.PROMPT_TASKS}
    inputs.update({task: ["too short", "A long article. " * 40] for task in bigbench_prompts.PASSAGE_TASKS})
    archive = _bigbench_archive(tmp_path / "bb.tar.gz", inputs)
    specbench = tmp_path / "specbench"
    specbench.mkdir()
    (specbench / "qa.jsonl").write_text(json.dumps({"turns": ["Something else entirely, asked by nobody at all here."]}) + "\n")

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        return _run_script("bigbench_prompts.py", specbench, *args)

    proc = run(archive, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "out" / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 3 * len(bigbench_prompts.PROMPT_TASKS)
    assert "Question 0 of strategyqa?" in prompts and not any(p.startswith("Q:") or p.endswith("A:") for p in prompts)
    assert "Explain what this Python code does:\n\nQuestion 1 of code_line_description?" in prompts
    assert sorted(p.name for p in (tmp_path / "out" / "passages").iterdir()) == ["wikilingua_en-0001.txt", "xsum-0001.txt"]

    inputs["qa_wikidata"] = ["The capital of Kenya is", "The capital of Kenya is", "The eye color of Anne is", "Odd"]
    inputs["natural_instructions/subtask041_qasc_answer_generation"] = [
        "Fact: earthquakes can damage buildings. \nQuestion: What can damage buildings?", "Fact: no question here."]
    proc = run(_bigbench_archive(tmp_path / "factual.tar.gz", inputs), tmp_path / "factual", "--factual")
    assert proc.returncode == 0, proc.stderr
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "factual" / "prompts.jsonl").read_text().splitlines()]
    # only the relations that read well as a question, each once; the QASC fact that gives the answer away dropped
    assert sorted(prompts) == ["What can damage buildings?", "What is the capital of Kenya?"]
    assert not any((tmp_path / "factual" / "passages").iterdir())

    more = {task: [f"Q: Question {i % 2} of {task}?\nA:" for i in range(3)] for task in bigbench_prompts.MORE_PROMPT_TASKS}
    quoref = "natural_instructions/subtask002_quoref_answer_generation"
    more[quoref] = [f"Passage: {'A long passage. ' * 40}\nQuestion: Who {i}?" for i in range(2)]
    proc = run(_bigbench_archive(tmp_path / "more.tar.gz", more), tmp_path / "more", "--more")
    assert proc.returncode == 0, proc.stderr
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "more" / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == 2 * len(bigbench_prompts.MORE_PROMPT_TASKS)  # each task's repeated input once
    assert "Write one sentence that uses all of these words: Question 1 of gem/common_gen?" in prompts
    # one passage, however many questions are asked about it, without them
    (only,) = (tmp_path / "more" / "passages").iterdir()
    assert only.read_text() == ("A long passage. " * 40).strip() + "\n"
    proc = run(archive, tmp_path / "both", "--factual", "--more")
    assert proc.returncode != 0 and "choose one" in proc.stderr and not (tmp_path / "both").exists()

    (specbench / "qa.jsonl").write_text(json.dumps({"turns": ["Question 2 of general_knowledge? And more words here."]}) + "\n")
    inputs["general_knowledge"].append("Question 2 of general_knowledge? And more words here, longer.")
    proc = run(_bigbench_archive(tmp_path / "leaky.tar.gz", inputs), tmp_path / "leaky")
    assert proc.returncode != 0 and "SpecBench turns appear in the text" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "leaky").exists()

    (tmp_path / "bad.tar.gz").write_text("not an archive")
    for bad, says in ((tmp_path / "bad.tar.gz", "not a readable BIG-bench archive"), (tmp_path / "none.tar.gz", "no file")):
        proc = run(bad, tmp_path / "never")
        assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr


def test_code_prompts_script(tmp_path: Path) -> None:
    """The code-completion prompt builder: public top-level functions with a one-line signature, a sentence of
    docstring and a body, as written (signature and docstring, no body), under an instruction; test directories,
    private functions, stubs and wrapped signatures left out; it refuses text shared with SpecBench, and bad roots."""
    root = tmp_path / "lib"
    (root / "pkg" / "tests").mkdir(parents=True)
    (root / "pkg" / "maths.py").write_text(
        "import os\n\n"
        "@staticmethod\n"
        "def clamp(x: int, lo: int, hi: int) -> int:\n"
        '    """Return x limited to the range from lo to hi, inclusive.\n\n    >>> clamp(5, 0, 3)\n    3\n    """\n'
        "    return max(lo, min(x, hi))\n\n"
        "def _hidden(x):\n    \"\"\"A private helper that nobody should be asked to write.\"\"\"\n    return x\n\n"
        "def stub(x):\n    \"\"\"A stub whose body is only this docstring, nothing to learn.\"\"\"\n\n"
        "def wrapped(\n    x,\n):\n    \"\"\"A function whose signature spans several lines here.\"\"\"\n    return x\n")
    (root / "pkg" / "tests" / "test_maths.py").write_text(
        "def test_clamp(x):\n    \"\"\"A test function, which is not a specification at all.\"\"\"\n    assert x\n")
    specbench = tmp_path / "specbench"
    specbench.mkdir()
    (specbench / "humaneval.jsonl").write_text(json.dumps({"turns": ["Something else entirely, asked by nobody at all."]}) + "\n")

    def run(*args: object) -> subprocess.CompletedProcess[str]:
        return _run_script("code_prompts.py", specbench, *args)

    proc = run(tmp_path / "prompts.jsonl", "--roots", root)
    assert proc.returncode == 0, proc.stderr
    prompts = [json.loads(line)["prompt"] for line in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    assert prompts == ["Complete this Python function.\n\ndef clamp(x: int, lo: int, hi: int) -> int:\n"
                       '    """Return x limited to the range from lo to hi, inclusive.\n\n    >>> clamp(5, 0, 3)\n    3\n    """\n']

    (specbench / "humaneval.jsonl").write_text(json.dumps({"turns": ["def clamp(x: int, lo: int, hi: int) -> int: Return x limited"]}) + "\n")
    proc = run(tmp_path / "leaky.jsonl", "--roots", root)
    assert proc.returncode != 0 and "SpecBench turns appear in the text" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "leaky.jsonl").exists()
    for args, says in (((tmp_path / "x.jsonl", "--roots", tmp_path / "none"), "not a directory"),
                       ((tmp_path / "x.jsonl", "--roots", specbench),
                        "no documented public functions")):
        proc = run(*args)
        assert proc.returncode != 0 and says in proc.stderr and "Traceback" not in proc.stderr


def test_a_template_that_refuses_system_messages(tiny_dirs, tmp_path: Path, permissive, capsys) -> None:  # type: ignore[no-untyped-def]
    """Gemma's and early Mistral's templates raise on a system message: the prompt is refused in one line naming the
    template's reason, and Magpie writes its user prompts unsteered instead of failing."""
    from moaspec.chat import chat_messages, encode_chat
    from moaspec.cli import main
    from moaspec.errors import PromptError
    from moaspec.models import load_model_dir
    from moaspec.training.datagen import steering
    from tiny import CHAT_TEMPLATE

    refusing = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
                + CHAT_TEMPLATE)
    model_dir = tmp_path / "model"
    shutil.copytree(tiny_dirs["llama"], model_dir)
    (model_dir / "chat_template.jinja").write_text(refusing)
    target = load_model_dir(model_dir, device="cpu")
    with pytest.raises(PromptError, match="chat template refuses these messages: System role not supported"):
        encode_chat(target.tokenizer, chat_messages("hi", system="Be brief."))
    assert encode_chat(target.tokenizer, chat_messages("hi"))  # without a system message it renders
    assert steering(target.tokenizer, "code") == []
    manifest = generate_dataset(target, tmp_path / "data", CFG, progress=False)
    assert sum(s["records"] for s in manifest["shards"]) >= CFG.examples
    assert main(["generate", "hi", "--system", "Be brief.", "--model", str(model_dir)]) == 2
    assert "System role not supported" in capsys.readouterr().err


# --- directories of prompt files, by category (--prompts DIR, --balance, --categories, --exclude-questions) ---

from moaspec.training.datagen import balanced_choice  # noqa: E402
from moaspec.training.dataset import data_sources, describe_data  # noqa: E402
from moaspec.training.user_text import QuestionOverlap  # noqa: E402


def _jsonl(path: Path, items: list[object]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    return path


def _prompt_dir(root: Path, short: int = 30, long: int = 12) -> Path:
    """Three files: short questions (category qa), passages to summarise (category sum, one of them multi-turn) and
    a file whose items name no category (its own: its file's name); a README that is not read."""
    _jsonl(root / "a_questions.jsonl", [{"turns": [f"Short question number {k}?"], "category": "qa", "source": "x/qa"}
                                        for k in range(short)])
    _jsonl(root / "b_articles.jsonl", [{"turns": [f"Summarise article number {k}: " + "words " * 8]
                                        + ([f"Shorter, please {k}.", f"Once more {k}."] if k == 0 else []),
                                        "category": "sum"} for k in range(long)])
    (root / "c_plain.json").write_text(json.dumps(["Plain prompt one, no category.", "Plain prompt two, none."]))
    (root / "README.md").write_text("not a prompt file")
    return root


def test_a_prompt_directory_is_read_file_by_file_with_categories(tmp_path: Path) -> None:
    root = _prompt_dir(tmp_path / "prompts")
    user = load_user_text(root, None, 100, 10)
    assert len(user.prompts) == 30 + 12 + 2 and user.categorised
    assert [f.path for f in user.files] == ["a_questions.jsonl", "b_articles.jsonl", "c_plain.json"]
    assert set(user.categories) == {"qa", "sum", "c_plain"}  # a conversation without one: its file's name
    assert user.files[0].sources == ("x/qa",) and user.files[1].conversations == 12
    files = user.about["files"]
    assert [(f["read"], f["kept"]) for f in files] == [(30, 30), (12, 12), (2, 2)] and "excluded" not in files[0]
    identity = dict(user.identity)["prompts"]
    assert identity["files"] == 3 and identity["conversations"] == 44

    # several paths: named relative to the folder they share; --categories keeps those alone; --part splits the rest
    other = _jsonl(tmp_path / "more" / "d.jsonl", [{"prompt": "Another one here?", "category": "qa"}])
    several = load_user_text([root / "b_articles.jsonl", other], None, 100, 10, categories=["qa", "sum"])
    assert [f.path for f in several.files] == ["prompts/b_articles.jsonl", "more/d.jsonl"]
    assert len(several.prompts) == 13 and dict(several.identity)["prompts"]["categories"] == ["qa", "sum"]
    halves = [load_user_text(root, None, 100, 10, part=(k, 2), categories=["qa"]) for k in (1, 2)]
    assert [len(h.prompts) for h in halves] == [15, 15] and halves[0].prompts == user.prompts[0:30:2]
    # one file alone keeps the identity a data directory made from it has always recorded
    single = load_user_text(root / "a_questions.jsonl", None, 100, 10)
    assert dict(single.identity)["prompts"] == {"sha256": single.files[0].sha256, "conversations": 30}

    (tmp_path / "empty").mkdir()
    _jsonl(tmp_path / "bad" / "no_turns.jsonl", [{"text": "no turns here"}])
    _jsonl(tmp_path / "badcat" / "p.jsonl", [{"turns": ["ok"], "category": 7}])
    for paths, says in (([tmp_path / "empty"], "holds no .jsonl or .json file"),
                        ([tmp_path / "bad"], "no_turns.jsonl: line 1 is not a prompt"),
                        ([tmp_path / "badcat"], 'the "category" of line 1 is not a name'),
                        ([root, root / "c_plain.json"], "names " + re.escape(str(root / "c_plain.json")) + " twice"),
                        ([tmp_path / "nowhere"], "does not exist")):
        with pytest.raises(MoaspecError, match=says):
            load_user_text(paths, None, 100, 10)
    with pytest.raises(MoaspecError, match="no conversation of .* is in 'code'; its categories are c_plain, qa, sum"):
        load_user_text(root, None, 100, 10, categories=["qa", "code"])


def test_balancing_takes_from_the_category_whose_answers_hold_the_fewest_tokens() -> None:
    queues = {"long": list(range(0, 50)), "short": list(range(100, 150))}
    # short answers lag: the next conversation is short's next one, and most of a shard goes to it, not all
    counts = {"long": {"started": 2, "answered": 2, "answer_tokens": 200},
              "short": {"started": 3, "answered": 2, "answer_tokens": 20}}  # one passed over: too long
    picks, passed = balanced_choice(queues, counts, 10, prior=8)
    assert picks[0] == 103 and sum(p >= 100 for p in picks) == 9 and 2 in picks and passed == []
    counts = {"long": {"started": 2, "answered": 2, "answer_tokens": 20},
              "short": {"started": 2, "answered": 2, "answer_tokens": 200}}
    assert balanced_choice(queues, counts, 1, prior=8) == ([2], [])
    # before any answer, the categories alternate (ties go to the first name); a used-up category drops out
    assert balanced_choice(queues, {}, 4, prior=8) == ([0, 100, 1, 101], [])
    assert balanced_choice({"a": [0], "b": [1, 2, 3]}, {}, 10, prior=8) == ([0, 1, 2, 3], [])
    # conversations too long for the context are passed over (and used up), not chosen
    assert balanced_choice(queues, {}, 4, prior=8, fits=lambda k: k >= 100 or k % 2) == ([1, 100, 3, 101], [0, 2])
    assert balanced_choice(queues, {}, 3, prior=8, fits=lambda k: k >= 100) == ([100, 101, 102], list(range(50)))


@pytest.fixture()
def answers_by_category(tiny_llama, monkeypatch):  # type: ignore[no-untyped-def]
    """Decoding that answers a summary at length (24 tokens) and anything else briefly (3 tokens)."""
    from moaspec.training import datagen

    tok = tiny_llama.tokenizer

    def fake_generate_many(model, requests, stop, gen, batch_size):  # type: ignore[no-untyped-def]
        out = []
        for r in requests:
            n = 24 if "Summarise" in tok.decode(r.prompt) else 3
            out.append((tok(" word" * n, add_special_tokens=False)["input_ids"][: min(n, r.max_new_tokens)], True))
        return out

    monkeypatch.setattr(datagen, "generate_many", fake_generate_many)
    return tok


def test_a_balanced_run_gives_each_category_like_answer_tokens_resumes_exactly_and_counts_each_file(  # type: ignore[no-untyped-def]
        tiny_llama, tmp_path: Path, answers_by_category) -> None:
    root = _prompt_dir(tmp_path / "prompts", short=120, long=40)
    user = load_user_text(root, None, 100, 10, categories=["qa", "sum"])
    cfg = DataConfig(examples=60, shard_size=8, max_answer_tokens=32, pasted_fraction=0.0, balance="answer-tokens",
                     max_turns=2)
    whole = generate_dataset(tiny_llama, tmp_path / "whole", cfg, progress=False, user=user)
    part = tmp_path / "resumed"
    generate_dataset(tiny_llama, part, DataConfig(**{**cfg.__dict__, "examples": 10}), progress=False, user=user)
    assert len(json.loads((part / "manifest.json").read_text())["shards"]) == 2  # interrupted after two shards
    resumed = generate_dataset(tiny_llama, part, cfg, progress=False, user=user)
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in whole["shards"]]
    assert resumed["prompts"] == {**whole["prompts"], "given": resumed["prompts"]["given"]}

    records = [r for s in whole["shards"] for r in read_shard(tmp_path / "whole" / s["file"])]
    prompts = whole["prompts"]
    assert prompts["balance"] == "answer-tokens" and prompts["counted_from_shard"] == 0
    for row in prompts["files"]:  # the manifest's counts per file are the records' own
        mine = [r for r in records if r["prompt_file"] == row["path"]]
        assert row["turns"] == len(mine) and row["answer_tokens"] == sum(len(r["answer_ids"]) for r in mine)
        assert row["answered"] == sum(r["turn"] == 0 for r in mine) <= row["started"] <= row["kept"]
    cats = prompts["categories"]
    assert prompts["files"][2]["kept"] == 0 and set(cats) == {"qa", "sum"}  # --categories left c_plain out
    assert sum(c["started"] for c in cats.values()) == len(whole["shards"]) * cfg.shard_size
    # like answer tokens, from many more short conversations than long ones
    assert 0.6 < cats["qa"]["answer_tokens"] / cats["sum"]["answer_tokens"] < 1.6
    assert cats["qa"]["answered"] > 4 * cats["sum"]["answered"]
    # what a trainer records of the data: the files that gave answers, the tokens per category
    assert data_sources(tmp_path / "whole") == prompts
    line = describe_data(tmp_path / "whole")
    assert "a_questions.jsonl, b_articles.jsonl;" in line and f"qa {cats['qa']['answer_tokens'] / 1e6:.2f} M" in line

    # a balanced run goes on until every conversation is started, then ends
    done = generate_dataset(tiny_llama, tmp_path / "all", DataConfig(**{**cfg.__dict__, "examples": 10_000}),
                            progress=False, user=user)
    assert sum(c["started"] for c in done["prompts"]["categories"].values()) == len(user.prompts) == 160
    # every turn of a multi-turn conversation answered in turn, up to --max-turns (2 of its 3 here)
    records = [r for s in done["shards"] for r in read_shard(tmp_path / "all" / s["file"])]
    (conv,) = {r["id"].rsplit("-", 1)[0] for r in records if r["query"].startswith("Summarise article number 0:")}
    assert [r["query"] for r in records if r["id"].startswith(conv + "-")][1:] == ["Shorter, please 0."]
    # a directory made in file order (as all were before --balance) is not extended by a balanced run, and says so
    generate_dataset(tiny_llama, tmp_path / "old", DataConfig(**{**cfg.__dict__, "examples": 4, "balance": None}),
                     progress=False, user=user)
    with pytest.raises(MoaspecError, match=r"\(what differs: config.balance\); a directory begun before --balance"):
        generate_dataset(tiny_llama, tmp_path / "old", cfg, progress=False, user=user)


def test_a_category_too_long_for_the_context_is_passed_over_not_chosen_forever(  # type: ignore[no-untyped-def]
        tiny_llama, tmp_path: Path, answers_by_category) -> None:
    root = _prompt_dir(tmp_path / "prompts", short=40, long=2)
    _jsonl(root / "d_huge.jsonl", [{"turns": [f"Huge {k} " + "word " * 300], "category": "huge"} for k in range(20)])
    user = load_user_text(root, None, 100, 10, categories=["qa", "huge"])
    cfg = DataConfig(examples=24, shard_size=8, max_answer_tokens=16, pasted_fraction=0.0, balance="answer-tokens")
    manifest = generate_dataset(tiny_llama, tmp_path / "d", cfg, progress=False, user=user)
    huge, qa = manifest["prompts"]["categories"]["huge"], manifest["prompts"]["categories"]["qa"]
    assert huge["started"] == 20 and huge["answered"] == 0  # all taken in the first shard, none answered
    assert qa["answered"] == qa["started"] == 24 == sum(s["records"] for s in manifest["shards"])


def test_the_overlap_guard_finds_equal_text_and_60_characters_in_common() -> None:
    import random

    rng = random.Random(0)
    shared = " ".join("".join(rng.choice("abcdefghijklm") for _ in range(rng.randint(2, 7))) for _ in range(40))
    question = "qq " + shared[:300] + " qq"
    guard = QuestionOverlap(["What is the capital of France?", question])
    assert guard.overlaps("what is the CAPITAL of   France!!") and not guard.overlaps("What is the capital of Spain?")
    for start in range(0, 40):  # wherever the run falls against the stride; "x" is in neither text
        run = shared[start : start + 60]
        assert guard.overlaps("xx" + run + "xx") and guard.overlaps(f"Some words first. {run}x")
        assert not guard.overlaps("xx" + run[:59] + "xx") and not guard.overlaps("xx" + run[1:] + "xx")
    assert not guard.overlaps("")


def test_exclude_questions_leaves_out_overlapping_prompts_and_passages(tmp_path: Path) -> None:
    questions = tmp_path / "specbench"
    article = "The committee met on a rainy Tuesday to review the budget of the harbour authority in detail."
    _jsonl(questions / "qa.jsonl", [{"question_id": 1, "turns": ["Who wrote the novel about the white whale?"]}])
    _jsonl(questions / "sum.jsonl", [{"question_id": 2, "turns": [f"Summarize: {article}"]}])
    root = tmp_path / "prompts"
    _jsonl(root / "a.jsonl", [{"turns": ["who wrote the novel about the WHITE whale"], "category": "qa"},  # equal
                              {"turns": ["Who painted the ceiling of the chapel?"], "category": "qa"}])
    _jsonl(root / "b.jsonl", [{"turns": ["Hello there, a fine day.", f"Please give me the gist: {article[5:80]}"],
                               "category": "mt_bench"},  # a later turn holds 75 characters of the article
                              {"turns": ["Summarise the harbour news in two lines."], "category": "sum"}])
    passages = tmp_path / "docs.txt"
    passages.write_text(f"{article}\n\n" + "An unrelated paragraph about gardens and their flowers. " * 2)
    user = load_user_text(root, passages, 30, 10, exclude_questions=questions)  # passages of 40-120 characters
    assert user.prompts == (("Who painted the ceiling of the chapel?",), ("Summarise the harbour news in two lines.",))
    assert [f["excluded"] for f in user.about["files"]] == [1, 1] and user.about["excluded_conversations"] == 2
    assert user.about["excluded_passages"] == 1 and len(user.passages) == 1 and "gardens" in user.passages[0]
    assert user.about["excluded_by"]["path"] == str(questions.resolve())
    assert dict(user.identity)["exclude_questions"]["questions"] == 2
    with pytest.raises(MoaspecError, match="every conversation of .* overlaps a question"):
        load_user_text(root / "a.jsonl", None, 100, 10, categories=None,
                       exclude_questions=_jsonl(tmp_path / "q2.jsonl", [{"turns": ["Who painted the ceiling of the "
                                                                                  "chapel?"]}, {"turns": ["Who wrote "
                                                                                  "the novel about the white whale"]}]))
    with pytest.raises(MoaspecError, match="no SpecBench .jsonl question files"):
        load_user_text(root, None, 100, 10, exclude_questions=tmp_path / "nowhere")


def test_data_command_over_a_prompt_directory(tiny_dirs, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from moaspec.cli import main

    root = _prompt_dir(tmp_path / "prompts", short=6, long=3)
    questions = _jsonl(tmp_path / "specbench" / "qa.jsonl", [{"turns": ["Short question number 4?"]}])
    base = ["data", "--model", str(tiny_dirs["llama"]), "--no-progress", "--prompts", str(root), "--pasted-fraction",
            "0", "--max-answer-tokens", "8", "--shard-size", "4", "--examples", "6"]
    assert main([*base, "--output", str(tmp_path / "d"), "--exclude-questions", str(questions.parent)]) == 0
    out = capsys.readouterr().out
    assert "left out 1 conversation(s) of" in out and "answer tokens by category, answer-tokens balance: c_plain" in out
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert manifest["identity"]["config"]["balance"] == "answer-tokens" and manifest["prompts"]["files"][0]["kept"] == 5
    for extra, says in ((["--categories", "qa,nope"], "no conversation of .* is in 'nope'"),
                        (["--categories", "qa,,sum"], "names separated by commas"),
                        (["--max-turns", "0"], "--max-turns must be >= 1"),
                        (["--prompts", str(tmp_path / "specbench" / "none")], "does not exist")):
        assert main([*base, "--output", str(tmp_path / "never"), *extra]) == 2
        assert re.search(says, capsys.readouterr().err)
        assert not (tmp_path / "never").exists()
    assert main(["data", "--model", str(tiny_dirs["llama"]), "--output", str(tmp_path / "never"), "--balance",
                 "none"]) == 2
    assert "--balance applies to the conversations of --prompts" in capsys.readouterr().err
