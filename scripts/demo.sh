#!/usr/bin/env bash
# The demo command: set up what is missing, then run the whole stack (producer vLLM, consumer vLLM, proxy) and send
# a completion and a chat request through it. `--keep-running` leaves it up; `--pipe` runs the pipe-only demo.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ "${1:-}" = "--pipe" ]; then
    shift
    exec .venv/bin/python scripts/demo_pipe.py "$@"
fi
exec .venv/bin/python scripts/demo_stack.py "$@"
