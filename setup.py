"""Package discovery and gRPC stub generation for setuptools (metadata is in pyproject.toml).

The repository root is the package `pegaflow`, so every sub-package found here
is installed as `pegaflow.<name>`. The gRPC stubs are generated from
proto/*.proto at build time (proto/generate.py), never committed.
"""

import pathlib
import subprocess
import sys

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
EXCLUDE = ["build", "build.*", "dist", "third_party", "third_party.*", "tools", "tools.*"]


class BuildPyWithStubs(build_py):
    """Runs proto/generate.py before copying sources, for wheels and editable installs."""

    def run(self):
        subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py")], check=True)
        super().run()


setup(
    packages=["pegaflow"] + [f"pegaflow.{p}" for p in find_packages(str(ROOT), exclude=EXCLUDE)],
    cmdclass={"build_py": BuildPyWithStubs},
)
