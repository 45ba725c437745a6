"""Benchmarks: `tandem bench` (load generator, systems side by side) and `tandem random-model`."""
