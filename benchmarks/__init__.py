"""The project's own measurement harness. A regular package, so that an installed distribution with a
top-level `benchmarks` cannot stand in for it."""
