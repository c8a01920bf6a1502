#!/usr/bin/env bash
# Set up a fresh machine for this repo: system libraries Mooncake needs, a venv in .venv,
# CPU torch first (so nothing pulls a CUDA build), then the project with its extras.
#   bash scripts/setup.sh          # run-time extras (mooncake, nixl, bench)
#   bash scripts/setup.sh test     # plus the test tools
set -euo pipefail
cd "$(dirname "$0")/.."

need_libs=()
for lib in libibverbs1 librdmacm1; do
  dpkg -s "$lib" >/dev/null 2>&1 || need_libs+=("$lib")
done
if [ ${#need_libs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq "${need_libs[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
.venv/bin/pip install -q torch==2.13.0
extras="all"
[ "${1:-}" = "test" ] && extras="all,test"
.venv/bin/pip install -q -e ".[${extras}]"
