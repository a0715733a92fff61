#!/usr/bin/env bash
# What can be proved about flake.nix offline (the real inputs live on GitHub):
#   1. it parses;
#   2. `nix flake check` evaluates every output and builds the checks, with
#      nixpkgs and flake-utils replaced by the stand-ins in ci/nix-mock;
#   3. `nix develop` builds the shell with those stand-ins, enters it, and the
#      shell hook sets what make and Bazel read (PEGAFLOW_PYTHON, PEGAFLOW_VENV,
#      LD_LIBRARY_PATH).
# Not proved: that nixpkgs (nixos-23.11) has these attribute names and
# versions, or that the real shell builds. See README, "Nix".
#
# The flake is checked from a copy as a `path:` flake: a `git+file:` flake sees
# only committed files, and a `path:` flake of the repo root would copy the
# venv into the store.
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
work=$(mktemp -d /tmp/pegaflow-nix-check.XXXXXX)
trap 'rm -rf "$work"' EXIT
log=$work/nix.log
# nix is chatty on stderr (builds, "not writing lock file"): shown only on failure.
quiet() {
    if ! "$@" >>"$log" 2>&1; then
        cat "$log" >&2
        echo "nix check FAILED: $*" >&2
        exit 1
    fi
}
cp flake.nix "$work/"
if [[ -f flake.lock ]]; then cp flake.lock "$work/"; fi

nix=(nix --extra-experimental-features "nix-command flakes" --option substituters "")
mock=(
    --no-write-lock-file
    --override-input nixpkgs "path:$repo/ci/nix-mock/nixpkgs"
    --override-input flake-utils "path:$repo/ci/nix-mock/flake-utils"
)

nix-instantiate --parse flake.nix >/dev/null
echo "nix: flake.nix parses"
(cd "$work" && quiet "${nix[@]}" flake check "${mock[@]}" "path:$work")
echo "nix: flake check (stand-in inputs) passes"
# The stand-in python cannot build a venv: the hook's venv step is skipped here.
(cd "$work" && PEGAFLOW_NIX_SKIP_VENV=1 quiet "${nix[@]}" develop "${mock[@]}" "path:$work" -c bash -c '
    set -e
    test "$IN_NIX_SHELL" = impure
    [[ $PEGAFLOW_PYTHON == /nix/store/*-python311/bin/python3.11 ]]
    [[ $PEGAFLOW_VENV == "$PWD/.venv" ]]
    [[ $LD_LIBRARY_PATH == /nix/store/*-libstdcxx/lib:* ]]
')
echo "nix: nix develop (stand-in inputs) enters the shell and its hook sets PEGAFLOW_PYTHON, PEGAFLOW_VENV"

