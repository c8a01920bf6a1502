#!/usr/bin/env bash
# Set up a fresh machine for this repo: system libraries Mooncake needs, a venv in .venv,
# torch==2.13.0 first, then the project with its extras (which installs no other torch).
#   bash scripts/setup.sh          # run-time extras (mooncake, nixl, bench)
#   bash scripts/setup.sh test     # plus the test tools
# torch comes from pip's configured index (`pip config list`): on a plain Linux x86_64 machine that is
# PyPI, whose torch wheel is the CUDA build (with its nvidia-* wheels, several GB). For the CPU build:
#   EPD_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
set -euo pipefail
cd "$(dirname "$0")/.."

need_libs=()
libs=(libibverbs1 librdmacm1 libnuma1 libcurl4)  # what Mooncake's library loads
# the test suite: the multi-host rig (tests/multihost/) filters a host's ports with nft; tests/deploy/
# builds the image (mmdebstrap, buildah, podman), checks Prometheus rules and scrapes a stack (prometheus:
# promtool), and serves DNS records to the router's discovery (dnsmasq)
[ "${1:-}" = "test" ] && libs+=(nftables mmdebstrap buildah podman prometheus dnsmasq)
# kubectl renders the manifests (`kubectl kustomize`, 1.21 or newer: deploy/k8s uses kustomize components).
# Where none is installed this takes Debian's kubernetes-client, whose 1.20 is too old for them: install a
# newer kubectl from Kubernetes' own packages there (the test then fails with kustomize's complaint)
[ "${1:-}" = "test" ] && ! command -v kubectl >/dev/null && libs+=(kubernetes-client)
for lib in "${libs[@]}"; do
  dpkg -s "$lib" >/dev/null 2>&1 || need_libs+=("$lib")
done
if [ ${#need_libs[@]} -gt 0 ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_libs[@]}"
fi

[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q --upgrade pip
torch_index=()  # EPD_TORCH_INDEX: opt-in (see the top); CI takes torch from the machine's pip configuration
if [ -n "${EPD_TORCH_INDEX:-}" ]; then torch_index=(--index-url "$EPD_TORCH_INDEX"); fi
.venv/bin/pip install -q ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0
extras="all"
[ "${1:-}" = "test" ] && extras="all,test"
.venv/bin/pip install -q -e ".[${extras}]"
