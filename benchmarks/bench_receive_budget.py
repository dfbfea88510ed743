"""The receive budget under the attack of issue #37: a peer links, announces a large tensor, sends CHUNK frames for
all of it but its last chunk and vanishes, again and again. Each failed receive's result is held ``timeout`` + 5 s
(writes the sender started may still land in it); they must count in ``receive_budget`` while held. Prints the
victim's RSS (this process: it owns the pipe) before, at its highest, and once the held results are let go, with
what became of each receive, and checks that a real peer is served afterwards.

    .venv/bin/python benchmarks/bench_receive_budget.py                    # the issue's scale: 5 x 256 MiB, 300 MiB
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.support.common import header, write
from harness.pipes import make_config, open_pipe
from kv_pipe import PeerDisconnected, ProtocolError
from tests.kv_pipe.side_channel import (
    announce_and_vanish,
    assert_still_serves,
    large_tensors,
    raw_connect,
    raw_welcome,
    resident_bytes,
)

MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=256, help="each announced tensor (default 256)")
    parser.add_argument("--budget-mib", type=int, default=300, help="receive_budget (default 300)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--timeout", type=float, default=5.0, help="the pipe's timeout: results are held this + 5 s")
    parser.add_argument("--name", default="bench_receive_budget")
    args = parser.parse_args()
    size, chunk = args.size_mib * MiB, 4 * MiB
    cfg = make_config(receive_budget=args.budget_mib * MiB, result_pool_size=0, timeout=args.timeout)
    rows = []
    with open_pipe(cfg, 1) as pipe:
        with raw_connect(pipe) as sock:
            raw_welcome(sock, pipe)  # the link and its ring exist before the memory is measured
        gc.collect()
        base = highest = resident_bytes()
        began = time.monotonic()
        for i in range(args.rounds):
            with raw_connect(pipe) as sock:
                announce_and_vanish(sock, pipe, size, chunk)
                try:
                    pipe.recv_tensor(timeout=30)
                    outcome = "received (a bug: the sender never finished it)"
                except (PeerDisconnected, ProtocolError) as e:
                    outcome = "refused (receive_budget)" if "receive_budget" in str(e) else "failed, result held"
            rss = resident_bytes()
            highest = max(highest, rss)
            rows.append((i + 1, time.monotonic() - began, outcome, (rss - base) / MiB))
        attack = time.monotonic() - began
        time.sleep(args.timeout + 5.5)  # the held results are let go
        assert_still_serves(cfg, pipe)  # (a held result is let go lazily: at the next receive's reservation)
        gc.collect()
        after, alive = resident_bytes(), large_tensors(size)
    table = ["| round | at s | outcome | RSS above the start MiB |", "|---:|---:|---|---:|"]
    table += [f"| {n} | {at:.1f} | {outcome} | {grown:.0f} |" for n, at, outcome, grown in rows]
    grown = (highest - base) / MiB
    limit = args.budget_mib + chunk / MiB
    summary = (f"{args.rounds} x {args.size_mib} MiB announced in {attack:.1f} s against receive_budget "
               f"{args.budget_mib} MiB: RSS {base / MiB:.0f} MiB at the start, {highest / MiB:.0f} MiB at most "
               f"(+{grown:.0f}; the bound: budget + one chunk = {limit:.0f} MiB: {'met' if grown <= limit else 'NOT met'}),"
               f" {after / MiB:.0f} MiB once the held results were let go and a real peer was served ({alive} "
               f"tensor(s) of {args.size_mib} MiB still alive).")
    md = (header("bench_receive_budget: the receive budget under failed receives") + "\n" + "\n".join(table) + "\n\n"
          + summary + "\n")
    print(md)
    write(args.name, {"rounds": [{"round": n, "at": at, "outcome": o, "grown_mib": g} for n, at, o, g in rows],
                      "base_mib": base / MiB, "highest_mib": highest / MiB, "after_mib": after / MiB,
                      "budget_mib": args.budget_mib, "alive_after": alive, "size_mib": args.size_mib, "within": grown <= limit,
                      "summary": summary}, md)


if __name__ == "__main__":
    main()
