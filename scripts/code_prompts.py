"""Human-written code-completion prompts for `moaspec data`, from the docstrings of installed Python code.

SpecBench's humaneval turns ask the target to complete a function given its signature and
docstring. No dataset hub is reachable here, but every Python installation holds thousands
of human-written functions with docstrings (the standard library, and the packages beside
it). This writes a prompt file of their signatures and docstrings, each under one of a few
completion instructions, for `moaspec data --prompts`:

    python scripts/code_prompts.py OUT.jsonl [--roots DIR ...] [--count 1500]
    moaspec data --prompts OUT.jsonl --pasted-fraction 0 ...

Only public top-level functions with a one-line signature whose docstring reads like a
specification (a sentence, at most --max-doc characters) are taken, at most --per-module
from one module, so that no package dominates. None of it comes from HumanEval; like
`bigbench_prompts.py`, the script refuses to write anything that shares its first 60
normalised characters with a turn of the SpecBench files, if it finds them.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from bigbench_prompts import DEFAULT_SPECBENCH, refuse_specbench_overlap  # beside this script

from moaspec.errors import MoaspecError
from moaspec.fileio import atomic_write_text

# asked for in turn, so that no single phrasing is what the drafter learns to follow
INSTRUCTIONS = (
    "Complete this Python function.",
    "Implement the function below.",
    "Write the body of the following function.",
    "Finish the implementation:",
    "Fill in the code for this function so that it does what its docstring says.",
    "Here is a function signature with its documentation. Write the implementation.",
)
SKIPPED_DIRS = {"test", "tests", "testing", "idlelib", "lib2to3", "turtledemo", "ensurepip", "__pycache__",
                "site-packages", "dist-packages", "_vendor", "vendored", "_distutils"}


def signature_and_docstring(source: str, node: ast.FunctionDef) -> str:
    """The function's `def` line and docstring as written, dedented, without decorators or body."""
    head = source.splitlines()[node.lineno - 1:node.body[0].end_lineno]
    indent = len(head[0]) - len(head[0].lstrip())
    return "\n".join(line[indent:] for line in head) + "\n"


def functions(path: Path, max_doc: int) -> Iterator[str]:
    """Specification-like public top-level functions of one module, as prompt bodies."""
    try:
        source = path.read_text(encoding="utf-8")
        tree = ast.parse(source)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = ast.get_docstring(node)
        if not doc or not 40 <= len(doc) <= max_doc or "." not in doc:
            continue
        if len(node.body) < 2:  # a docstring alone (or a stub) has no implementation to learn from
            continue
        if node.body[0].lineno != node.lineno + 1 or "TODO" in doc:  # signature on one line, as HumanEval's
            continue
        text = signature_and_docstring(source, node)
        if len(text) <= max_doc + 300:
            yield text


def module_files(roots: list[Path]) -> Iterator[Path]:
    """The .py files under the roots, in a fixed order, outside test and vendored directories."""
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if not SKIPPED_DIRS.intersection(path.relative_to(root).parts[:-1]):
                yield path


def collect(roots: list[Path], per_module: int, max_doc: int, seed: int) -> list[str]:
    """Function prompts (without instructions), at most `per_module` per file, deduplicated."""
    rng = random.Random(seed)
    bodies: dict[str, None] = {}
    for path in module_files(roots):
        found = list(dict.fromkeys(functions(path, max_doc)))
        rng.shuffle(found)
        bodies.update(dict.fromkeys(found[:per_module]))
    return list(bodies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output", help="the prompt file to write (JSON lines)")
    ap.add_argument("--roots", type=Path, nargs="+", default=[Path(sysconfig.get_paths()["stdlib"])],
                    help="directories of Python code to read (default: the standard library)")
    ap.add_argument("--count", type=int, default=1500, help="at most this many prompts")
    ap.add_argument("--per-module", type=int, default=6, help="at most this many functions from one file")
    ap.add_argument("--max-doc", type=int, default=700, help="longest docstring taken, in characters")
    ap.add_argument("--seed", type=int, default=30)
    ap.add_argument("--specbench", type=Path, default=DEFAULT_SPECBENCH,
                    help="SpecBench's JSONL files, whose turns must not appear in the output")
    args = ap.parse_args()
    missing = [str(r) for r in args.roots if not r.is_dir()]
    if missing:
        sys.exit(f"code_prompts: not a directory: {', '.join(missing)}")
    if args.count < 1 or args.per_module < 1:
        sys.exit("code_prompts: --count and --per-module must be positive")
    bodies = collect(args.roots, args.per_module, args.max_doc, args.seed)
    if not bodies:
        sys.exit(f"code_prompts: no documented public functions under {', '.join(map(str, args.roots))}")
    random.Random(args.seed).shuffle(bodies)
    prompts = [f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{body}" for i, body in enumerate(bodies[:args.count])]
    try:
        checked = refuse_specbench_overlap(args.specbench, prompts)
    except MoaspecError as e:
        sys.exit(f"code_prompts: {e}")
    try:
        atomic_write_text(args.output, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    except (MoaspecError, OSError) as e:
        sys.exit(f"code_prompts: {e}")
    print(f"{args.output}: {len(prompts)} prompts from {len(bodies)} documented functions "
          f"(checked against {checked} SpecBench turns: none shared)")


if __name__ == "__main__":
    main()
