"""One benchmark item per file, each imported by benchmarks/run.py only when that item runs."""
