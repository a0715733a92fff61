"""pegaflow benchmarks: a locust-driven harness (`bench.harness`) and the experiments built on it
(`bench.experiments`). See bench/README.md for how to run each one and the committed results."""
