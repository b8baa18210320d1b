#!/usr/bin/env bash
# The main job on the embedded default: a chat prompt answered by SmolLM2-135M-Instruct,
# accelerated by the MoA drafter shipped for it (text from accepted drafts in colour).
# Usage: scripts/demo.sh ["your prompt" [moaspec generate options...]]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
if [ $# -eq 0 ]; then
    set -- "Explain in three sentences why the sky is blue." --show-drafts
fi
exec .venv/bin/moaspec generate "$@"
