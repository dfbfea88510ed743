#!/usr/bin/env bash
# The demo command: set up what is missing, then run the demo (extra arguments go to it).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m kv_pipe.demo "$@"
