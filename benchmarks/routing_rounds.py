"""Medians over rounds of ``bench_routing`` run separately (one results JSON per round, e.g. a sweep run once per
session): every front's median per workload and rate, and the issue's target checks on those medians, as
``bench_routing --repeat N`` prints them for rounds of one run. The rounds must share their SLOs (``--slo-from`` the
first round) and the machine; this script refuses files whose CPU or SLOs differ.

    .venv/bin/python benchmarks/routing_rounds.py benchmarks/results/bench_routing_sweep_avx512_round{1,2,3}.json \
        --name bench_routing_sweep_avx512_medians
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import fields
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_routing import Run, busy_text, medians, targets
from benchmarks.support.common import RESULTS, fmt, header, write


def load(paths: list[Path]) -> tuple[list[Run], dict[str, list[float]], list[str]]:
    """Every run of every file, numbered by file (round), with the SLOs they share and each file's commit."""
    runs: list[Run] = []
    slos: dict[str, list[float]] | None = None
    cpu = None
    commits = []
    names = {f.name for f in fields(Run)}
    for round_, path in enumerate(paths):
        data = json.loads(path.read_text())
        if slos is not None and data["slos"] != slos:
            raise SystemExit(f"{path}: SLOs {data['slos']} differ from the first file's {slos} (use --slo-from)")
        if cpu is not None and data["cpu"] != cpu:
            raise SystemExit(f"{path}: another machine ({data['cpu']['model']}) than the first file's")
        slos, cpu = data["slos"], data["cpu"]
        commits.append(f"{path.name}: commit {data['commit']}")
        for raw in data["runs"]:
            run = Run(**{k: v for k, v in raw.items() if k in names})
            run.round = round_
            runs.append(run)
    return runs, slos or {}, commits


def table(by: dict[tuple[str, str, float], Run], groups: dict[tuple[str, str, float], list[Run]]) -> str:
    out = ["| workload | front | rate req/s | rounds | goodput req/s (each round) | TTFT p50 ms | follow-up TTFT p50 ms "
           "| ITL p99 ms | moved/uncached | CPU busy (median) |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---|"]
    for key in sorted(by, key=lambda k: (k[0], k[2], k[1])):
        m, group = by[key], groups[key]
        each = " / ".join(fmt(r.goodput, 3) for r in group)
        itl = statistics.median([r.itl_p99 for r in group if r.itl_p99 is not None] or [float("nan")])
        names = sorted({name for r in group for name in r.busy})  # rounds before the CPU column have none
        busy = {name: statistics.median([r.busy[name] for r in group if name in r.busy]) for name in names}
        out.append(f"| {key[0]} | {key[1]} | {key[2]:g} | {len(group)} | **{fmt(m.goodput, 3)}** ({each}) "
                   f"| {fmt(m.ttft_p50, 0)} | {fmt(m.followup_ttft_p50, 0)} | {fmt(itl, 0)} | {fmt(m.moved_ratio, 2)} "
                   f"| {busy_text(busy)} |")
    return "\n".join(out) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", type=Path, nargs="+", help="results JSONs of bench_routing, one per round")
    parser.add_argument("--name", help="also write the table as benchmarks/results/NAME.{md,json}")
    args = parser.parse_args()
    runs, slos, commits = load(args.files)
    done = [r for r in runs if not r.error and r.completed]
    groups: dict[tuple[str, str, float], list[Run]] = {}
    for r in done:
        groups.setdefault((r.workload, r.front, r.rate), []).append(r)
    by = medians(done)
    checks, chosen = targets(done, [])
    slo_lines = [f"SLO ({w}): TTFT <= {t:.0f} ms and TPOT <= {p:.1f} ms." for w, (t, p) in slos.items()]
    md = (header("bench_routing: medians over rounds run separately") + "\nRounds: " + "; ".join(commits) + ".\n\n"
          + table(by, groups) + "\n" + "\n".join(slo_lines) + "\n\n" + "\n".join(
              ["(each front's median over the rounds)", *checks]) + "\n")
    print(md)
    if args.name:
        write(args.name, {"rounds": [str(p) for p in args.files], "slos": slos, "checks": checks,
                          "chosen": {f"{rate:g}": front for rate, front in chosen.items()}}, md, RESULTS)


if __name__ == "__main__":
    main()
