"""The benchmark scripts (benchmarks/README.md); their shared helpers are in benchmarks/common.py."""
