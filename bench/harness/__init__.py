"""Reusable pieces of the benchmark harness: seeded traces, the locust load generator, real vLLM
and pegaflow-server processes, cache analysis, result files and plots."""
