#!/usr/bin/env bash
# Build deploy/Containerfile on a machine that cannot pull images (this project's machines and CI):
# Debian's mmdebstrap makes the bookworm base, podman imports it under the name the Containerfile's
# BASE_IMAGE uses, buildah builds (chroot isolation; docker format, so HEALTHCHECK is kept).
#
#   deploy/image/build.sh [--variant cpu|cuda] [--tag NAME] [--local-wheel FILE ...] [--pip-cert FILE]
#                         [--torch-index URL] [--store DIR [--runroot DIR]] [--base-tar FILE]
#
#   --variant      cpu (default) or cuda: the Containerfile's VARIANT
#   --tag          the image's name (default localhost/epd-stage:VARIANT)
#   --local-wheel  a wheel for the context's wheels/ folder (LOCAL_WHEELS=wheels), taken before the
#                  index's: pip inside a build cannot see this machine's find-links folder (repeatable)
#   --pip-cert     the CA bundle pip in the build trusts (the build secret pip-cert), where a proxy
#                  intercepts TLS; not stored in the image
#   --torch-index  TORCH_INDEX (default: the Containerfile's, per variant)
#   --store DIR    container storage under DIR (--root DIR/root --runroot DIR/run), not the machine's
#   --runroot DIR  the storage's runroot instead of DIR/run (containers/storage refuses one over 50 characters)
#   --base-tar F   the base's root filesystem tarball: made with mmdebstrap when F does not exist, reused
#                  when it does; without it a temporary one, unless the store has the base already
#
# The build context is a temporary copy of the work tree's files that git tracks or would track (so
# uncommitted changes are built), plus wheels/. Exit 3 when a tool is missing.
set -euo pipefail

repo="$(cd "$(dirname "$0")/../.." && pwd)"
variant=cpu tag="" store="" runroot="" base_tar="" wheels=() build_args=() secrets=()
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) variant="$2"; shift 2 ;;
    --tag) tag="$2"; shift 2 ;;
    --local-wheel) wheels+=("$2"); shift 2 ;;
    --pip-cert) secrets=(--secret "id=pip-cert,src=$2"); shift 2 ;;
    --torch-index) build_args+=(--build-arg "TORCH_INDEX=$2"); shift 2 ;;
    --store) store="$2"; shift 2 ;;
    --runroot) runroot="$2"; shift 2 ;;
    --base-tar) base_tar="$2"; shift 2 ;;
    *) echo "build.sh: unknown argument $1 (see the top of $0)" >&2; exit 2 ;;
  esac
done
tag="${tag:-localhost/epd-stage:$variant}"

for tool in mmdebstrap buildah podman git; do
  command -v "$tool" >/dev/null || { echo "build.sh: $tool is missing: run bash scripts/setup.sh test" >&2; exit 3; }
done
storage=()
[ -n "$store" ] && storage=(--root "$store/root" --runroot "${runroot:-$store/run}")
containerfile="$repo/deploy/Containerfile"
base="$(sed -n 's/^ARG BASE_IMAGE=//p' "$containerfile")"
packages="$(sed -n 's/.*pkgs="\([^"]*\)".*/\1/p' "$containerfile")"  # what the Containerfile installs if missing

work="$(mktemp -d "${TMPDIR:-/tmp}/epd-image.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if ! podman ${storage[@]+"${storage[@]}"} image exists "$base"; then
  tarball="${base_tar:-$work/base.tar}"
  if [ ! -f "$tarball" ]; then
    echo "build.sh: making the base $base (mmdebstrap bookworm + ${packages// /,})"
    mmdebstrap --quiet --format=tar --variant=minbase --include="${packages// /,}" bookworm "$tarball.partial.$$"
    mv "$tarball.partial.$$" "$tarball"  # whole or absent: a parallel build reads no half-written file
  fi
  podman ${storage[@]+"${storage[@]}"} import --quiet "$tarball" "$base" >/dev/null
fi

context="$work/context"
mkdir "$context"
git -C "$repo" ls-files -z --cached --others --exclude-standard \
  | (cd "$repo" && tar --null --files-from=- --ignore-failed-read -cf - 2>/dev/null) | tar -C "$context" -xf -

build_args+=(--build-arg "VARIANT=$variant")
if [ ${#wheels[@]} -gt 0 ]; then
  mkdir "$context/wheels"
  cp "${wheels[@]}" "$context/wheels/"
  build_args+=(--build-arg LOCAL_WHEELS=wheels)
fi

buildah ${storage[@]+"${storage[@]}"} bud --quiet --isolation chroot --format docker --pull=never \
  "${build_args[@]}" ${secrets[@]+"${secrets[@]}"} -f "$context/deploy/Containerfile" -t "$tag" "$context"
echo "build.sh: built $tag"
