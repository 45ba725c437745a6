"""Benchmarks: `tandem bench` (bench/), `tandem random-model` (random_models/), one-off probes (probes/)."""
