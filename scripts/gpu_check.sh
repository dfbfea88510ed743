#!/usr/bin/env bash
# The checks that need a GPU, in one command, for a GPU machine with only torch, numpy and pytest besides .gpu/
# (../shared/gpu/README.md): the tests marked cuda (the pipe, the lookup buffer, block copies, the pinned arena,
# staging, the connector's data path on device caches under torch's sync debug mode, in vLLM's hook order), then
# benchmarks/bench_gpu.py's tables (device pipe vs host pipe, the engine's writes, pinned copies, a connector save ->
# load of N blocks with the device memory it reserved, a forward-like loop with saving on and off, a 1 GiB gather
# first vs warm, and whether an engine transfer of host memory made a GPU context). Each part is cut off at 5 and 4
# minutes at the most.
#   here, beforehand:        scripts/gpu_prepare.sh   (the engine build GPU hosts install, and small wheels, into .gpu/)
#   on the GPU machine:      bash .gpu/device.sh scripts/gpu_check.sh
# Results go to $OUT if set (the device tool brings that folder back), else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
"$python" -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", ok,
torch.cuda.get_device_name() if ok else ""); sys.exit(0 if ok else 1)' || { echo "gpu_check: no CUDA device"; exit 2; }
"$python" -c 'import numpy, pytest, xxhash, psutil, pytest_timeout, mooncake.engine' ||
    { echo "gpu_check: missing a package (run scripts/gpu_prepare.sh here first, then .gpu/device.sh there)"; exit 2; }
echo "[gpu_check] cuda tests"
timeout 300 "$python" -m pytest -q -p no:cacheprovider -m cuda -o addopts=-ra tests/kv_pipe tests/kv_lookup_buffer \
    tests/kv_connector/cache/test_block_copy.py tests/kv_connector/cache/test_pinned.py tests/kv_connector/cache/test_staging.py \
    tests/kv_connector/worker/test_data_path.py \
    2>&1 | tee "$out/gpu_check_tests.log" | grep -v -E '^(I|W)[0-9]{4} ' | tail -60
tests_rc=${PIPESTATUS[0]}
echo "[gpu_check] benchmark"
timeout 240 "$python" benchmarks/bench_gpu.py --out-dir "$out" 2>&1 | grep -v -E '^(I|W|E)[0-9]{4} '
bench_rc=${PIPESTATUS[0]}
echo "[gpu_check] tests exit $tests_rc, benchmark exit $bench_rc"
exit $((tests_rc != 0 || bench_rc != 0))
