"""``vllm bench serve`` as bench_serve and bench_routing run it: one run as a child process against a front, its
result file read back, and goodput computed from the per-request figures against a stated SLO."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.processes import spawn, stop

CLIENT_TIMEOUT = 1800.0  # one vllm bench serve run


@dataclass
class ServeResult:
    """What one run reported: its JSON (``data``, empty if it failed), the per-request figures, and an error."""

    data: dict[str, Any] = field(default_factory=dict)
    requests: dict[str, list[Any]] = field(default_factory=dict)  # ttft, latency (s), output_len, input_len
    error: str = ""


def run_bench_serve(base_url: str, model: Path, dataset: list[str], prompts: int, rate: float | None, seed: int,
                    result_file: Path, extra: list[str] | None = None) -> ServeResult:
    """``vllm bench serve`` against ``base_url`` (streamed /v1/completions, ``--ignore-eos``) with the ``dataset``
    options, ``prompts`` requests at ``rate`` req/s (None: all at once), p50 and p99 of TTFT, TPOT, ITL and latency;
    its output goes to ``result_file`` with a .log suffix."""
    cmd = [str(Path(sys.executable).parent / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", base_url,
           "--endpoint", "/v1/completions", "--model", str(model), "--tokenizer", str(model), *dataset, "--ignore-eos",
           "--num-prompts", str(prompts), "--request-rate", "inf" if rate is None else str(rate), "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--save-result",
           "--save-detailed", "--result-dir", str(result_file.parent), "--result-filename", result_file.name,
           "--disable-tqdm", *(extra or [])]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    log = result_file.with_suffix(".log")
    proc = spawn(cmd, log, env)
    try:
        code = proc.wait(timeout=CLIENT_TIMEOUT)
    except BaseException:
        stop(proc)
        raise
    if code != 0 or not result_file.is_file():
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
        print(f"  {result_file.stem}: vllm bench serve exited with {code}; log tail:\n{tail}", flush=True)
        return ServeResult(error=f"vllm bench serve exited with {code}")
    data = json.loads(result_file.read_text())
    requests = {"ttft": data["ttfts"], "latency": data["latencies"], "output_len": data["output_lens"],
                "input_len": data["input_lens"]}
    errors = sorted({e for e in data.get("errors", []) if e})
    error = f"{len(errors)} distinct request errors, first: {errors[0][:200]}" if errors else ""
    return ServeResult(data, requests, error)


def goodput(requests: dict[str, list[Any]], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> float | None:
    """Requests per second that met both SLOs, as vLLM defines it (TPOT of a one-token answer counts as 0)."""
    if not duration or not requests:
        return None
    good = 0
    for ttft, latency, out in zip(requests["ttft"], requests["latency"], requests["output_len"], strict=True):
        if not out:
            continue  # failed
        tpot = (latency - ttft) / (out - 1) if out > 1 else 0.0
        good += ttft * 1e3 <= slo_ttft_ms and tpot * 1e3 <= slo_tpot_ms
    return good / duration
