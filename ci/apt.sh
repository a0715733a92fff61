#!/usr/bin/env bash
# Installs the packages of ci/apt-packages.txt that dpkg does not already list
# as installed; on a set-up machine it only asks dpkg (milliseconds).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${IN_NIX_SHELL:-}" ]]; then
    exit 0  # the nix dev shell (flake.nix) provides the tools
fi
if ! command -v dpkg-query >/dev/null; then
    echo "ci/apt.sh: not a Debian system; install by hand: $(grep -v '^#' ci/apt-packages.txt | xargs)" >&2
    exit 1
fi

mapfile -t wanted < <(grep -v '^[[:space:]]*#' ci/apt-packages.txt | awk 'NF { print $1 }')
mapfile -t installed < <(dpkg-query -W -f='${Package} ${db:Status-Status}\n' "${wanted[@]}" 2>/dev/null |
    awk '$2 == "installed" { print $1 }')
missing=()
for pkg in "${wanted[@]}"; do
    [[ " ${installed[*]} " == *" ${pkg} "* ]] || missing+=("$pkg")
done
if ((${#missing[@]} == 0)); then
    exit 0
fi

echo "apt: installing ${missing[*]}"
sudo=()
if ((EUID != 0)); then sudo=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq
"${sudo[@]}" apt-get install -y -qq "${missing[@]}"
