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
# The quick tier is two runs side by side: the pipe and buffer tests (real processes and engines; they mostly wait, so
# they run on several workers) and the unit tests (connector logic, proxy; one process: each worker would import vLLM).
PIPES=(tests/kv_pipe tests/kv_lookup_buffer tests/kv_connector/test_data_path.py)
UNITS=(tests/kv_proxy tests/test_proxy_server.py tests/kv_connector/test_block_copy.py tests/kv_connector/test_heads.py
       tests/kv_connector/test_params.py tests/kv_connector/test_scheduler.py tests/kv_connector/test_blocks.py
       tests/kv_connector/test_loads.py tests/kv_connector/test_source.py tests/kv_connector/test_config.py
       tests/kv_connector/test_stats.py tests/kv_connector/test_push.py tests/kv_connector/test_kv_layout.py
       tests/kv_connector/test_staging.py tests/kv_connector/test_digest.py tests/kv_connector/test_lookups.py
       tests/kv_connector/test_pinned.py)
WORKERS=${MKV_TEST_WORKERS:-4}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# quick_tier FIRST_PORT: both runs, each in its own port range (tests/servers.py: MKV_TEST_PORTS); their reports
# follow each other; fails if either did
quick_tier() {
    local first=$1
    shift
    MKV_TEST_PORTS=$first-$((first + 2999)) .venv/bin/python -m pytest -p no:cacheprovider --basetemp "$work/units" \
        "${UNITS[@]}" "$@" > "$work/units.log" 2>&1 &
    local units_pid=$!
    MKV_TEST_PORTS=$((first + 3000))-$((first + 5999)) .venv/bin/python -m pytest -p no:cacheprovider \
        --basetemp "$work/pipes" -n "$WORKERS" "${PIPES[@]}" "$@" > "$work/pipes.log" 2>&1
    local pipes_rc=$?
    wait "$units_pid"
    local units_rc=$?
    echo "[test] quick tier, pipe and buffer tests ($WORKERS workers):"
    cat "$work/pipes.log"
    echo "[test] quick tier, unit tests:"
    cat "$work/units.log"
    return $((pipes_rc != 0 || units_rc != 0))
}
if ((quick_only)); then
    echo "[test] pytest, quick tier"
    set +e
    quick_tier 20000 "$@"
    quick_rc=$?
    echo "[test] quick tier exit $quick_rc"
    exit "$quick_rc"
fi
skip=()
for path in "${UNITS[@]}" "${PIPES[@]}"; do
    [[ $path == tests/kv_connector/* ]] && skip+=(--ignore "$path")
done
echo "[test] pytest, quick tier in the background (its report follows the vLLM tier's)"
(set +e; quick_tier 20000 "$@" > "$work/quick.log" 2>&1) &
quick_pid=$!
echo "[test] pytest, vLLM tier"
set +e
MKV_TEST_PORTS=26000-31999 .venv/bin/python -m pytest --basetemp "$work/vllm" tests/kv_connector "${skip[@]}" "$@"
vllm_rc=$?
wait "$quick_pid"
quick_rc=$?
set -e
cat "$work/quick.log"
echo "[test] vLLM tier exit $vllm_rc, quick tier exit $quick_rc"
exit $((vllm_rc != 0 || quick_rc != 0))
