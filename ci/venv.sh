#!/usr/bin/env bash
# Builds (or brings up to date) the project venv from the hashed lock, then
# installs the repo into it in editable mode. Idempotent: stamps keyed on the
# lock's sha256 and on the packaging files make a re-run on a set-up machine a
# few file reads.
#
#   PEGAFLOW_VENV   where the venv lives (default: .venv in the repo)
#   PEGAFLOW_PYTHON interpreter that creates it (default: python3.11 on PATH)
#
# Bazel's venv toolchain (tools/python/venv.bzl) reuses this venv through
# PEGAFLOW_VENV and checks the same lock stamp.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${PEGAFLOW_VENV:-$PWD/.venv}
python=${PEGAFLOW_PYTHON:-python3.11}
lock=third_party/requirements.lock
lock_stamp=$venv/.pegaflow-lock.sha256
package_stamp=$venv/.pegaflow-editable.sha256

if [[ ! -x $venv/bin/python ]]; then
    echo "venv: creating $venv with $("$python" --version 2>&1) ($(command -v "$python"))"
    "$python" -m venv "$venv"
fi

lock_sha=$(sha256sum "$lock" | cut -d' ' -f1)
if [[ "$(cat "$lock_stamp" 2>/dev/null)" != "$lock_sha" ]]; then
    echo "venv: installing $lock"
    rm -f "$lock_stamp" "$package_stamp"
    # --no-deps: the lock is the whole closure, minus what it leaves out on
    # purpose (CUDA-linked torchvision/torchaudio/torchcodec, triton).
    "$venv/bin/python" -m pip install --quiet --quiet --no-deps --require-hashes -r "$lock"
    "$venv/bin/python" ci/venv_sync.py "$lock"
    echo "$lock_sha" >"$lock_stamp"
fi

# The editable install maps `pegaflow` to this checkout (and generates the gRPC
# stubs through setup.py); redo it when the packaging files or the checkout move.
package_key="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1) $PWD"
if [[ "$(cat "$package_stamp" 2>/dev/null)" != "$package_key" ]]; then
    echo "venv: pip install -e . (pegaflow -> $PWD)"
    "$venv/bin/python" -m pip install --quiet --quiet --no-deps --no-build-isolation -e .
    echo "$package_key" >"$package_stamp"
fi
