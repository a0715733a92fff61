#!/usr/bin/env bash
# Proves the Bazel build needs no network: in a network namespace that has only
# loopback, with a fresh output base (nothing fetched before), it builds every
# target (tests included) and runs //server and //metaserver with --help. The
# venv toolchain reuses PEGAFLOW_VENV (default .venv; building a venv is the one
# step that needs the package index, and it is not Bazel's).
#
# It runs on a copy of the source files (those git would commit, or the tree
# minus the venv and build outputs outside git): a fresh output base in the
# checkout itself would meet the bazel-<dir> link of the other output base and
# load packages through it.
#
# Its answer depends only on what Bazel fetches and loads, so it is skipped when
# the Bazel files, the lock and the bazel package are unchanged since it last
# passed (FORCE=1 runs it anyway). Needs root (unshare -n).
set -euo pipefail
cd "$(dirname "$0")/.."
export PEGAFLOW_VENV=${PEGAFLOW_VENV:-$PWD/.venv}
stamp=$PEGAFLOW_VENV/.pegaflow-bazel-offline.sha256

key=$(
    {
        dpkg-query -W -f='${Package} ${Version}\n' bazel-bootstrap 2>/dev/null || bazel --version
        find . \( -path ./.venv -o -path './bazel-*' -o -path ./.git \) -prune -o -type f \
            \( -name WORKSPACE -o -name .bazelrc -o -name .bazelignore -o -name 'BUILD.bazel' \
            -o -name '*.bzl' -o -path './third_party/*' -o -path './proto/*.proto' \) -print0 |
            sort -z | xargs -0 sha256sum
    } | sha256sum | cut -d' ' -f1
)
if [[ -z "${FORCE:-}" && "$(cat "$stamp" 2>/dev/null)" == "$key" ]]; then
    echo "bazel offline check: unchanged since it passed (FORCE=1 to re-run)"
    exit 0
fi

work=$(mktemp -d /tmp/pegaflow-offline.XXXXXX)
output_base=$work/output_base
source_copy=$work/src
mkdir -p "$output_base" "$source_copy"
cleanup() {
    # The Bazel server lives in the namespace; a client outside cannot reach it.
    if [[ -f $output_base/server/server.pid.txt ]]; then
        kill "$(cat "$output_base/server/server.pid.txt")" 2>/dev/null || true
    fi
    rm -rf "$work"
}
trap cleanup EXIT

if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
    git ls-files -z --cached --others --exclude-standard | tar --null -T - -cf - | tar -C "$source_copy" -xf -
else
    tar --exclude=./.venv --exclude='./bazel-*' --exclude=./build -cf - . | tar -C "$source_copy" -xf -
fi

echo "bazel offline check: copy of the sources, fresh output base, no network"
start=$SECONDS
unshare --net bash -euo pipefail -c '
    cd "$2"
    ip link set lo up
    if python3 -c "import socket; socket.create_connection((\"pypi.org\", 443), timeout=3)" 2>/dev/null; then
        echo "the network namespace reaches pypi.org: the check would prove nothing" >&2
        exit 1
    fi
    bazel="bazel --output_base=$1"
    quiet="--noshow_progress --ui_event_filters=-info --show_result=0"
    $bazel build $quiet //...
    $bazel run $quiet //server -- --help >/dev/null
    $bazel run $quiet //metaserver -- --help >/dev/null
    $bazel shutdown 2>/dev/null
' offline-check "$output_base" "$source_copy"
echo "bazel offline check: passed in $((SECONDS - start)) s"
echo "$key" >"$stamp"
