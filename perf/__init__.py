"""Benchmarks for ffpa_cute (outside the package): `python -m perf.sweep --help`."""
