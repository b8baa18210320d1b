#!/usr/bin/env bash
# The whole test suite: fast tests on tiny random models, then the real default model.
# Extra arguments go to pytest (e.g. -m "not real" for the fast set only).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
# The chat-page test drives a real headless browser: install Debian's Chromium when we can
# (root with apt); without one that test is skipped and says why.
if ! command -v chromium >/dev/null && command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    echo "moaspec: installing chromium for the browser test (once) ..." >&2
    { apt-get install -y -q chromium >/dev/null 2>&1 || { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1; }; } \
        || echo "moaspec: could not install chromium; the browser test will be skipped" >&2
fi
exec .venv/bin/python -m pytest "$@"
