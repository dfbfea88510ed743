#!/usr/bin/env bash
# The test command: set up what is missing, lint, then run the whole suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] ruff check"
.venv/bin/ruff check .
echo "[test] pytest"
exec .venv/bin/python -m pytest "$@"
