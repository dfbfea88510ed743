#!/usr/bin/env bash
# Run here, before a GPU machine is borrowed: fills .gpu/ (git-ignored) for scripts/gpu_check.sh there. Like
# ../shared/gpu/prepare.sh (whose runner it copies), but with the Transfer Engine build this project installs on GPU
# hosts, the non-CUDA one (docs/deployment.md: over TCP the connector hands the engine host memory only, and the
# CUDA build makes a GPU context in every process that moves any); TE_BUILD=cuda takes the CUDA 13 build instead (to
# compare: section 7 of the report says whether a transfer of host memory made a context). ~46 MB either way.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
shared=../shared/gpu
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
if [ "${TE_BUILD:-non-cuda}" = cuda ]; then
    engine=(mooncake-transfer-engine-cuda13 "${TE_VERSION:-0.3.14}")
else
    engine=(mooncake-transfer-engine-non-cuda "${TE_VERSION:-0.3.13.post1}")
fi
mkdir -p .gpu/whl
rm -f .gpu/whl/mooncake_transfer_engine*.whl  # one build at a time: both install the same package
fetch() {  # fetch PACKAGE[==VERSION]: its wheel for the GPU machine's Python 3.12
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .gpu/whl "$1"
}
fetch "${engine[0]}==${engine[1]}"
for pkg in xxhash psutil pytest-timeout; do  # what the project and its tests import that such a machine lacks
    ls .gpu/whl/"${pkg//-/_}"-*.whl >/dev/null 2>&1 || fetch "$pkg"
done
cp "$shared/device.sh" .gpu/device.sh
du -sh .gpu
echo "engine: ${engine[0]} ${engine[1]}; on the GPU machine: bash .gpu/device.sh scripts/gpu_check.sh"
