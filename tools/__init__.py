"""pegaflow.tools: helpers around the service (vllm_cpu: run vLLM on CPU against pegaflow).

tools/python holds Bazel helpers only and is not part of the package.
"""
