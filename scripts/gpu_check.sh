#!/usr/bin/env bash
# The checks that need a GPU, in one command, for a GPU machine without vLLM or Quart (../shared/gpu/README.md):
# the tests marked cuda (the pipe, the lookup buffer, block copies, staging, the connector's data path on device
# caches under torch's sync debug mode), then benchmarks/bench_gpu.py's tables (device pipe vs host pipe, the
# engine's device->device write vs pinned->pinned, pinned copies, a connector save -> load of N blocks, a
# forward-like loop with saving on and off). Each part is cut off at 5 and 4 minutes at the most.
#   here, beforehand:        ../shared/gpu/prepare.sh   (the CUDA build of the Transfer Engine, into .gpu/)
#   on the GPU machine:      bash .gpu/device.sh scripts/gpu_check.sh
# Results go to $OUT if set (the device tool brings that folder back), else benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
mkdir -p "$out"
"$python" -c 'import torch, sys; ok = torch.cuda.is_available(); print("torch", torch.__version__, "cuda", ok,
torch.cuda.get_device_name() if ok else ""); sys.exit(0 if ok else 1)' || { echo "gpu_check: no CUDA device"; exit 2; }
echo "[gpu_check] cuda tests"
timeout 300 "$python" -m pytest -q -p no:cacheprovider -m cuda -o addopts=-ra tests/kv_pipe tests/kv_lookup_buffer \
    tests/kv_connector/test_block_copy.py tests/kv_connector/test_staging.py tests/kv_connector/test_data_path.py \
    2>&1 | tee "$out/gpu_check_tests.log" | grep -v -E '^(I|W)[0-9]{4} ' | tail -60
tests_rc=${PIPESTATUS[0]}
echo "[gpu_check] benchmark"
timeout 240 "$python" benchmarks/bench_gpu.py --out-dir "$out" 2>&1 | grep -v -E '^(I|W|E)[0-9]{4} '
bench_rc=${PIPESTATUS[0]}
echo "[gpu_check] tests exit $tests_rc, benchmark exit $bench_rc"
exit $((tests_rc != 0 || bench_rc != 0))
