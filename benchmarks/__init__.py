"""The benchmarks (not part of the product): entry points ``bench_*.py`` here, what they share in ``support/``."""
