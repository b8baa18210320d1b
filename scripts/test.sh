#!/usr/bin/env bash
# The whole test suite: fast tests on tiny random models, then the real default model.
# Extra arguments go to pytest (e.g. -m "not real" for the fast set only).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
exec .venv/bin/python -m pytest "$@"
