"""What the benchmarks share, not benchmarks themselves: results files that name their commit and command (common),
child processes (procs), the raw Transfer Engine and socket baselines, the bare pipe, the vLLM stacks, pairs and fleets
they start, ``vllm bench serve`` runs, the XpYd harness, report helpers.

Not part of the product. The entry points are ``benchmarks/bench_*.py`` (benchmarks/README.md lists them)."""
