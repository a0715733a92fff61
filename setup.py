"""Package discovery and gRPC stub generation for setuptools (metadata is in pyproject.toml).

The repository root is the package `pegaflow`, so every sub-package found here
is installed as `pegaflow.<name>` (`tools` included: tools/vllm_cpu is part of
the package, tools/python holds Bazel files only and has no __init__.py). The
gRPC stubs are generated from proto/*.proto at build time (proto/generate.py),
never committed.
"""

import pathlib
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
# Not part of the installed package: build outputs (Bazel's bazel-<dir> link
# mirrors the source tree, __init__.py included), the lock tooling, CI scripts,
# and the tests (a regular install ships no tests; editable installs see them anyway).
EXCLUDE = [
    "bazel-*",
    "build",
    "build.*",
    "dist",
    "third_party",
    "third_party.*",
    "ci",
    "ci.*",
    "tests",
    "*.tests",
    "*.tests.*",
]


class BuildPyWithStubs(build_py):
    """Runs proto/generate.py before copying sources, for wheels and editable installs."""

    def run(self):
        subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py")], check=True)
        super().run()

    def find_package_modules(self, package, package_dir):
        # This file sits in the package's folder (the root); it is not a module of it.
        modules = super().find_package_modules(package, package_dir)
        return [m for m in modules if not (package == "pegaflow" and m[1] == "setup")]


setup(
    packages=["pegaflow"] + [f"pegaflow.{p}" for p in find_packages(str(ROOT), exclude=EXCLUDE)],
    cmdclass={"build_py": BuildPyWithStubs},
)
