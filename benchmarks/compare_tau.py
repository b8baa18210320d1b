"""Two drafters' chain acceptance compared prompt by prompt, with the sign test that BENCHMARKS.md reports.

Reads what ``chain_tau.py --output`` writes for a baseline and a candidate measured on the
same prompts, and prints, per category and overall, both τ (per verification, pooled over
the prompts' cycles, as ``chain_tau.py`` computes it), on how many prompts the candidate's τ
is higher, lower or equal, and the two-sided sign test's p (ties dropped). Several pairs,
``BASE NEW BASE NEW ...`` (say the first ten and the next ten questions of each file), are
pooled into one test:

    .venv/bin/python benchmarks/compare_tau.py bench-out/shipped.json bench-out/candidate.json \
        [BASE2 NEW2 ...] [--output FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from math import comb
from pathlib import Path
from typing import Any

from moaspec.fileio import atomic_write_text

Row = dict[str, Any]


def sign_test(higher: int, lower: int) -> float:
    """Two-sided sign test p-value (ties dropped)."""
    n = higher + lower
    if n == 0:
        return 1.0
    tail = sum(comb(n, k) for k in range(min(higher, lower) + 1)) / 2**n
    return min(1.0, 2 * tail)


def load_rows(path: str | Path) -> dict[tuple[str, str], Row]:
    """The per-prompt rows of one ``chain_tau.py`` output, by (category, question id)."""
    try:
        rows = json.loads(Path(path).read_text())["rows"]
        keyed = {(str(r["category"]), str(r["question"])): r for r in rows}
        if not keyed or not all(isinstance(r["tau"], (int, float)) and r["accepted"] for r in rows):
            raise ValueError("no prompt with a τ and its accepted lengths")
    except FileNotFoundError:
        raise SystemExit(f"compare_tau: no file {path}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:  # JSONDecodeError is a ValueError
        raise SystemExit(f"compare_tau: {path} is not the output of chain_tau.py --output ({e})") from None
    return keyed


def pooled_tau(rows: list[Row]) -> float:
    """Accepted tokens per verification over all the rows' cycles (chain_tau.py's τ of a group)."""
    accepted = [a for r in rows for a in r["accepted"]]
    return sum(accepted) / len(accepted)


def compare(pairs: list[tuple[dict[tuple[str, str], Row], dict[tuple[str, str], Row]]]) -> dict[str, dict[str, Any]]:
    """Per category and ``overall``: both τ, the candidate's prompts higher / lower / equal, and the sign test's p.

    Each pair must hold the same prompts; the pairs' prompts are pooled (a prompt measured in
    two pairs counts twice)."""
    groups: dict[str, list[tuple[Row, Row]]] = defaultdict(list)
    for i, (base, new) in enumerate(pairs):
        if base.keys() != new.keys():
            first, second = sorted(base.keys() - new.keys()), sorted(new.keys() - base.keys())
            category, question = (first or second)[0]
            raise ValueError(f"pair {i + 1} was measured on different prompts: {len(first)} only in the first file, "
                             f"{len(second)} only in the second (e.g. {category} question {question})")
        for key in base:
            groups[key[0]].append((base[key], new[key]))
    groups = dict(sorted(groups.items()))
    groups["overall"] = [p for g in groups.values() for p in g]
    result = {}
    for name, matched in groups.items():
        higher = sum(n["tau"] > b["tau"] for b, n in matched)
        lower = sum(n["tau"] < b["tau"] for b, n in matched)
        result[name] = {"prompts": len(matched), "base_tau": round(pooled_tau([b for b, _ in matched]), 3),
                        "new_tau": round(pooled_tau([n for _, n in matched]), 3), "higher": higher, "lower": lower,
                        "equal": len(matched) - higher - lower, "sign_test_p": round(sign_test(higher, lower), 4)}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="BASE NEW [BASE NEW ...]: chain_tau.py outputs, in pairs")
    ap.add_argument("--output", default=None, help="write the comparison as JSON here")
    args = ap.parse_args()
    if len(args.files) % 2:
        sys.exit("compare_tau: give the files in pairs, BASE NEW [BASE NEW ...]")
    loaded = [load_rows(f) for f in args.files]
    try:
        result = compare(list(zip(loaded[::2], loaded[1::2])))
    except ValueError as e:
        sys.exit(f"compare_tau: {e}")
    print(f"{'category':<11}{'prompts':>8}{'base τ':>8}{'new τ':>8}{'higher':>8}{'lower':>7}{'equal':>7}{'p':>8}")
    for name, r in result.items():
        print(f"{name:<11}{r['prompts']:>8}{r['base_tau']:>8.3f}{r['new_tau']:>8.3f}{r['higher']:>8}{r['lower']:>7}"
              f"{r['equal']:>7}{r['sign_test_p']:>8.3f}")
    if args.output:
        atomic_write_text(args.output, json.dumps({"files": args.files, "comparison": result}, indent=1))


if __name__ == "__main__":
    main()
