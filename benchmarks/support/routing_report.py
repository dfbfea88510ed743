"""What bench_routing reports: one run of a front (``Run``), the front names, the results table, the medians over
rounds, the issue's target checks and the SLOs; and the medians of rounds run separately (``bench_routing.py
--medians-of``), read back from their results files."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from benchmarks.support.common import fmt, header

TTFT_TARGET, MOVED_TARGET = 1.05, 1.1
DECISIONS = "mooncake_proxy_route_decisions_total"


@dataclass
class Run:
    """One ``vllm bench serve`` run of one workload against one front at one rate."""

    front: str
    workload: str
    rate: float = 0.0  # requests per second
    round: int = 0
    completed: int = 0
    failed: int = 0
    duration: float = 0.0
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    followup_ttft_p50: float | None = None
    first_ttft_p50: float | None = None
    itl_p99: float | None = None
    tpot_p50: float | None = None
    goodput: float | None = None
    moved_per_req: float | None = None     # bytes
    uncached_per_req: float | None = None  # bytes
    skipped: float | None = None
    decisions: dict[str, float] = field(default_factory=dict)  # our proxy's route decisions, "choice/reason" -> count
    routed: dict[str, float] = field(default_factory=dict)
    busy: dict[str, float] = field(default_factory=dict)  # instance -> CPU seconds its processes used per second
    error: str = ""
    requests: dict[str, list[Any]] = field(default_factory=dict, repr=False)

    @property
    def moved_ratio(self) -> float | None:
        if self.moved_per_req is None or not self.uncached_per_req:
            return None
        return self.moved_per_req / self.uncached_per_req



# ----------------------------------------------------------------------------- front names
def base_front(front: str) -> str:
    """The front without its fleet's name (``1p1d ours balance`` -> ``ours balance``)."""
    return front.removeprefix("1p1d ")


def fleet_prefix(front: str) -> str:
    return front[:len(front) - len(base_front(front))]


def skips_prefills(front: str) -> bool:
    """Whether the front is one of our proxy's skip rules (the fronts a target check chooses among)."""
    return base_front(front).startswith(("ours skip", "ours estimate"))



# ----------------------------------------------------------------------------- report
def table(runs: list[Run], slos: dict[str, tuple[float, float]], slo_notes: dict[str, str] | None = None) -> str:
    out = ["| workload | front | rate req/s | round | n | failed | TTFT p50 ms | TTFT p99 ms | follow-up TTFT p50 ms "
           "| ITL p99 ms | TPOT p50 ms | goodput req/s | KV moved/req MiB | uncached KV/req MiB | moved/uncached "
           "| skipped | CPU busy |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in runs:
        mib = 1 << 20
        out.append(f"| {r.workload} | {r.front} | {r.rate:g} | {r.round} | {r.completed} | {r.failed} "
                   f"| {fmt(r.ttft_p50)} | {fmt(r.ttft_p99)} | {fmt(r.followup_ttft_p50)} | {fmt(r.itl_p99)} "
                   f"| {fmt(r.tpot_p50)} | {fmt(r.goodput, 3)} "
                   f"| {fmt(None if r.moved_per_req is None else r.moved_per_req / mib, 2)} "
                   f"| {fmt(None if r.uncached_per_req is None else r.uncached_per_req / mib, 2)} "
                   f"| {fmt(r.moved_ratio, 2)} | {fmt(r.skipped, 0)} | {busy_text(r.busy)} |")
    out.append("")
    for workload, slo in slos.items():
        note = (slo_notes or {}).get(workload)
        out.append(f"SLO ({workload}): TTFT <= {slo[0]:.0f} ms and TPOT <= {slo[1]:.1f} ms"
                   f"{f' ({note})' if note else ''}.")
    decided = decision_lines(runs)
    if decided:
        out += ["", f"Route decisions of our proxy (`{DECISIONS}`, choice/reason=requests):", "", *decided]
    errors = [f"- {run_name(r)}: {r.error}" for r in runs if r.error]
    if errors:
        out += ["", "Errors:", "", *errors]
    return "\n".join(out) + "\n"


def busy_text(busy: dict[str, float]) -> str:
    """``producer0 0.42, consumer0 0.97``: each instance's CPU use during the run, in cores."""
    return ", ".join(f"{name} {value:.2f}" for name, value in busy.items()) or "-"


def run_name(run: Run) -> str:
    return f"{run.front} / {run.workload} / {run.rate:g} req/s / round {run.round}"


def decision_lines(runs: list[Run]) -> list[str]:
    """One list item per run of our proxy that counted any route decision: how many requests each reason sent where
    (the ``skipped`` column says how many; this says why, e.g. ``local/faster_locally`` against
    ``remote/not_learned``)."""
    return [f"- {run_name(r)}: " + " ".join(f"{key}={count:.0f}" for key, count in sorted(r.decisions.items()))
            for r in runs if any(r.decisions.values())]


def medians(runs: list[Run]) -> dict[tuple[str, str, float], Run]:
    """Per (workload, front, rate): a run whose figures are the medians of that front's rounds at that rate (the run
    itself if one)."""
    groups: dict[tuple[str, str, float], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.workload, r.front, r.rate), []).append(r)
    out = {}
    for key, group in groups.items():
        if len(group) == 1:
            out[key] = group[0]
            continue

        def med(name: str, group: list[Run] = group) -> float | None:
            values = [getattr(r, name) for r in group if getattr(r, name) is not None]
            return statistics.median(values) if values else None

        out[key] = Run(key[1], key[0], key[2], completed=sum(r.completed for r in group), goodput=med("goodput"),
                       ttft_p50=med("ttft_p50"), followup_ttft_p50=med("followup_ttft_p50"),
                       moved_per_req=med("moved_per_req"), uncached_per_req=med("uncached_per_req"))
    return out


def targets(runs: list[Run], thresholds: list[int]) -> tuple[list[str], dict[float, str]]:
    """The target checks at every rate swept (met / NOT met, with the figures), and the front chosen at each: the load
    may favour another rule (skipping a prefill costs the decode instance more when it is busier)."""
    by = medians([r for r in runs if not r.error and r.completed])
    lines: list[str] = []
    chosen: dict[float, str] = {}
    for rate in sorted({rate for (_, _, rate) in by}):
        found, front = targets_at(by, rate)
        lines += found
        if front is not None:
            chosen[rate] = front
    return lines or ["no completed run: nothing to check"], chosen


def targets_at(by: dict[tuple[str, str, float], Run], rate: float) -> tuple[list[str], str | None]:
    """The target checks at one rate, every line naming it, and the front chosen there: the best of the
    ``ours skip<N>`` and ``ours estimate`` fronts on the shared workload, compared with the others at the same rate."""
    at = f"{rate:g} req/s"

    def get(workload: str, front: str) -> Run | None:
        return by.get((workload, front, rate))

    candidates = [r for (workload, front, r_rate), r in by.items()
                  if workload == "shared" and r_rate == rate and skips_prefills(front)]
    if candidates:
        best = max(candidates, key=lambda r: (round(r.goodput or 0.0, 3), -(r.followup_ttft_p50 or 1e9)))
        lines = [f"{at}: chosen `{best.front}` (of the `ours skip<N>` and `ours estimate` fronts: the best goodput on "
                 "the shared workload, then the lowest follow-up TTFT)"]
    else:  # a random-only run: the first such front it ran
        front = next((f for (w, f, x) in by if w == "random" and x == rate and skips_prefills(f)), None)
        if front is None:
            return [f"{at}: no `ours skip<N>` or `ours estimate` run: nothing to check"], None
        best = Run(front, "shared", rate)
        lines = [f"{at}: checked `{front}` (no shared-workload run to choose by)"]

    def check(what: str, ok: bool | None, detail: str) -> None:
        lines.append(f"- {at}, {what}: {'met' if ok else 'NOT met' if ok is not None else 'not measured'} ({detail})")

    if candidates:
        ratio = best.moved_ratio
        check("KV moved <= 1.1x the uncached tokens' KV", None if ratio is None else ratio <= MOVED_TARGET,
              f"{fmt(ratio, 2)}x")
        for colo in ("colocated rr", "colocated ca"):
            c = get("shared", colo)
            if c is None:
                continue
            x = best.followup_ttft_p50 / c.followup_ttft_p50 if best.followup_ttft_p50 and c.followup_ttft_p50 else None
            check(f"follow-up TTFT p50 <= 1.05x {colo}", None if x is None else x <= TTFT_TARGET,
                  f"{fmt(best.followup_ttft_p50)} vs {fmt(c.followup_ttft_p50)} ms, {fmt(x, 2)}x")
        for peer in ("colocated rr", "colocated ca", fleet_prefix(best.front) + "router ca", "colocated4 rr"):
            p = get("shared", peer)
            if p is None or best.goodput is None or p.goodput is None:
                continue
            what = f"goodput >= {peer}" + (" (as many instances as the 2P2D; not an issue target)"
                                           if peer == "colocated4 rr" else "")
            check(what, best.goodput >= p.goodput, f"{best.goodput:.3f} vs {p.goodput:.3f} req/s")
    new = get("random", best.front)
    today = get("random", fleet_prefix(best.front) + "ours balance")
    if today and new and today.goodput is not None and new.goodput is not None and today.ttft_p50 and new.ttft_p50:
        check("random: goodput not lower than ours balance", new.goodput >= today.goodput,
              f"{new.goodput:.3f} vs {today.goodput:.3f} req/s")
        check("random: TTFT p50 within 10% of ours balance", new.ttft_p50 <= 1.1 * today.ttft_p50,
              f"{new.ttft_p50:.0f} vs {today.ttft_p50:.0f} ms")
    plain = get("random", fleet_prefix(best.front) + "ours prefix")
    if plain and new and plain.goodput is not None and new.goodput is not None:
        check("random: goodput not lower than ours prefix (no skipping)", new.goodput >= plain.goodput,
              f"{new.goodput:.3f} vs {plain.goodput:.3f} req/s")
    return lines, best.front


def slos_of(runs: list[Run], workloads: list[str], rate: float, x: float) -> dict[str, tuple[float, float]]:
    """Per workload: ``x`` times ``colocated rr``'s TTFT p50 and TPOT p50 at ``rate`` (medians over its rounds). One
    SLO for every rate, from the lowest: at a higher rate goodput then shows what the load costs each front."""
    out = {}
    for workload in workloads:
        base = [r for r in runs if r.front == "colocated rr" and r.workload == workload and r.rate == rate
                and r.ttft_p50 and r.tpot_p50]
        if base:
            out[workload] = (x * statistics.median(r.ttft_p50 for r in base),
                             x * statistics.median(r.tpot_p50 for r in base))
    return out



# ----------------------------------------------------------------------------- rounds run separately
def load_rounds(paths: list[Path]) -> tuple[list[Run], dict[str, list[float]], list[str]]:
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


def rounds_table(by: dict[tuple[str, str, float], Run], groups: dict[tuple[str, str, float], list[Run]]) -> str:
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


def medians_of(paths: list[Path]) -> tuple[str, dict[str, Any]]:
    """The medians over rounds run separately (one results JSON of bench_routing per round, sharing their SLOs and
    their machine): the markdown report and the figures for its results JSON."""
    runs, slos, commits = load_rounds(paths)
    done = [r for r in runs if not r.error and r.completed]
    groups: dict[tuple[str, str, float], list[Run]] = {}
    for r in done:
        groups.setdefault((r.workload, r.front, r.rate), []).append(r)
    by = medians(done)
    checks, chosen = targets(done, [])
    slo_lines = [f"SLO ({w}): TTFT <= {t:.0f} ms and TPOT <= {p:.1f} ms." for w, (t, p) in slos.items()]
    md = (header("bench_routing: medians over rounds run separately") + "\nRounds: " + "; ".join(commits) + ".\n\n"
          + rounds_table(by, groups) + "\n" + "\n".join(slo_lines) + "\n\n" + "\n".join(
              ["(each front's median over the rounds)", *checks]) + "\n")
    data = {"rounds": [str(p) for p in paths], "slos": slos, "checks": checks,
            "chosen": {f"{rate:g}": front for rate, front in chosen.items()}}
    return md, data
