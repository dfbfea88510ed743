#!/usr/bin/env bash
# The test command: set up what is missing, lint, then run the tests. Extra arguments go to pytest.
#   scripts/test.sh           the whole suite (what CI runs): the vLLM tier, with the quick tier beside it
#   scripts/test.sh --quick   the quick tier only (no vLLM server): pipe, lookup buffer, proxy, connector units
# The two tiers run side by side: the quick tier mostly waits (peer processes, engines shutting down) while vLLM
# instances start, so together they take little longer than the vLLM tier alone. Each has its own port range
# (harness/ports.py, MKV_TEST_PORTS) so that neither hands out a port the other is about to bind.
set -euo pipefail
cd "$(dirname "$0")/.."
quick_only=0
if [ "${1:-}" = "--quick" ]; then
    quick_only=1
    shift
fi
scripts/setup.sh
echo "[test] ruff check"
.venv/bin/ruff check .
QUICK=(tests/kv_pipe tests/kv_lookup_buffer tests/proxy tests/test_proxy_server.py tests/kv_connector/test_block_copy.py
       tests/kv_connector/test_heads.py tests/kv_connector/test_params.py tests/kv_connector/test_scheduler.py
       tests/kv_connector/test_blocks.py tests/kv_connector/test_loads.py tests/kv_connector/test_source.py
       tests/kv_connector/test_config.py tests/kv_connector/test_stats.py
       tests/kv_connector/test_push.py)
if ((quick_only)); then
    echo "[test] pytest, quick tier"
    exec .venv/bin/python -m pytest "${QUICK[@]}" "$@"
fi
skip=()
for path in "${QUICK[@]}"; do
    [[ $path == tests/kv_connector/* ]] && skip+=(--ignore "$path")
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
echo "[test] pytest, quick tier in the background (its report follows the vLLM tier's)"
MKV_TEST_PORTS=20000-25999 .venv/bin/python -m pytest -p no:cacheprovider --basetemp "$work/quick" "${QUICK[@]}" "$@" \
    > "$work/quick.log" 2>&1 &
quick_pid=$!
echo "[test] pytest, vLLM tier"
set +e
MKV_TEST_PORTS=26000-31999 .venv/bin/python -m pytest --basetemp "$work/vllm" tests/kv_connector "${skip[@]}" "$@"
vllm_rc=$?
wait "$quick_pid"
quick_rc=$?
set -e
echo "[test] quick tier:"
cat "$work/quick.log"
echo "[test] vLLM tier exit $vllm_rc, quick tier exit $quick_rc"
exit $((vllm_rc != 0 || quick_rc != 0))
