#!/usr/bin/env bash
# Prove the GPU path on a machine with an NVIDIA GPU, from a fresh clone, in about ten minutes
# (most of it downloading the CUDA build of torch), and print one summary table.
#
#   bash scripts/gpu-check.sh                      # install into .venv-gpu, run every check on cuda:0
#   bash scripts/gpu-check.sh --device cuda:1      # another GPU
#   bash scripts/gpu-check.sh --no-install --python .venv-gpu/bin/python   # reuse an installed venv
#   bash scripts/gpu-check.sh --only engine,pd-nixl                        # some checks (names below)
#   bash scripts/gpu-check.sh --flash-attn         # also install flash-attn (it may compile for long)
#   bash scripts/gpu-check.sh --dry-run            # print what would run; needs no GPU
#   bash scripts/gpu-check.sh --cpu-smoke --only engine,transfer   # the harness itself, on the CPU venv
#
# Install: a venv (.venv-gpu), torch from PyPI (its Linux wheel is a CUDA build; the check stops if
# torch sees no GPU), the project with the nixl, test and bench extras (nixl brings its CUDA 12 and 13
# wheels), and Mooncake's CUDA build matching torch's CUDA (mooncake-transfer-engine for 12,
# mooncake-transfer-engine-cuda13 for 13) in place of the non-CUDA one; Mooncake checks are skipped,
# with the reason, where that build does not load.
#
# Checks (EPD_TEST_DEVICE=<device> for every test; each has a time limit):
#   engine      greedy parity with generate() on the GPU (single requests exact; batched: exact or a
#               near tie, tests/support/devices.py), no tensor off the device (meta default device), prefill ->
#               decode hand-off, one request's failure its own, the Triton and flash-attn decode kernels
#   colocated   `stage serve colocated --device <device>` end to end (tests/stages/test_colocated_server.py)
#   transfer    the transfer conformance suite on VRAM (NIXL; Mooncake when its CUDA build loads)
#   pd-nixl     1P1D greedy parity with generate() over NIXL, VRAM -> VRAM (tests/e2e/test_pd_parity.py)
#   pd-mooncake the same over Mooncake's CUDA build
#   bench       python -m bench.decode_throughput --quick on the GPU against HF generate() on the same GPU
# Exit status 0 when no check failed. Logs: $LOG_DIR (default /tmp/epd-gpu-check-<time>).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE="cuda:0"
PY=".venv-gpu/bin/python"
INSTALL=1
DRY_RUN=0
CPU_SMOKE=0
FLASH_ATTN=0
ONLY="engine,colocated,transfer,pd-nixl,pd-mooncake,bench"
LOG_DIR="${LOG_DIR:-/tmp/epd-gpu-check-$(date +%Y%m%d-%H%M%S)}"
TORCH_SPEC="torch==2.13.0"

usage() { sed -n '2,13p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --only) ONLY="$2"; shift 2 ;;
    --flash-attn) FLASH_ATTN=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --cpu-smoke) CPU_SMOKE=1; INSTALL=0; DEVICE="cpu"; PY=".venv/bin/python"; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; usage 2 ;;
  esac
done
mkdir -p "$LOG_DIR"
export EPD_TEST_DEVICE="$DEVICE"

NAMES=(); STATUS=(); DETAIL=(); SECS=()
record() { NAMES+=("$1"); STATUS+=("$2"); DETAIL+=("$3"); SECS+=("${4:--}"); }
wanted() { [[ ",$ONLY," == *",$1,"* ]]; }
say() { echo "gpu-check: $*"; }

# Run a command (or print it, with --dry-run); its output goes to $LOG_DIR/<name>.log.
step() {
  local name="$1"; shift
  if [ "$DRY_RUN" = 1 ]; then echo "  [$name] $*"; return 0; fi
  say "$name: $*"
  "$@" >>"$LOG_DIR/$name.log" 2>&1
}

# One pytest check: NAME LIMIT_S ARGS...; the table gets pytest's own counts.
check() {
  local name="$1" limit="$2"; shift 2
  if ! wanted "$name"; then return; fi
  if [ "$DRY_RUN" = 1 ]; then echo "  [$name] EPD_TEST_DEVICE=$DEVICE timeout $limit $PY -m pytest -q -p no:cacheprovider $*"; return; fi
  local start=$SECONDS rc counts
  say "$name: pytest $* (at most ${limit}s)"
  timeout "$limit" "$PY" -m pytest -q -p no:cacheprovider "$@" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  counts=$(tail -n 5 "$LOG_DIR/$name.log" | grep -Eo '[0-9]+ (passed|failed|skipped|errors?|deselected)' | paste -sd, - | sed 's/,/, /g')
  case $rc in
    0) record "$name" "passed" "${counts:-no summary}" $((SECONDS - start)) ;;
    5) record "$name" "skipped" "no test selected" $((SECONDS - start)) ;;
    124) record "$name" "FAILED" "timed out after ${limit}s; ${counts:-see $LOG_DIR/$name.log}" $((SECONDS - start)) ;;
    *) record "$name" "FAILED" "${counts:-exit $rc}; see $LOG_DIR/$name.log" $((SECONDS - start)) ;;
  esac
}

# --- install -------------------------------------------------------------------------------
MOONCAKE_OK=0
MOONCAKE_WHY="not checked"
install() {
  local start=$SECONDS
  if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$DRY_RUN" = 0 ]; then
    say "no nvidia-smi on this machine: this check needs an NVIDIA GPU (try --dry-run or --cpu-smoke)"; exit 2
  fi
  local need=()
  for lib in libibverbs1 librdmacm1; do dpkg -s "$lib" >/dev/null 2>&1 || need+=("$lib"); done
  if [ ${#need[@]} -gt 0 ]; then  # Mooncake's import needs them
    local sudo=""; [ "$(id -u)" -ne 0 ] && sudo="sudo"
    step install $sudo apt-get update -qq
    step install $sudo apt-get install -y -qq "${need[@]}"
  fi
  [ -x "$PY" ] || step install python3 -m venv "$(dirname "$(dirname "$PY")")"
  step install "$PY" -m pip install -q --upgrade pip || { record install FAILED "pip upgrade; see $LOG_DIR/install.log"; return 1; }
  step install "$PY" -m pip install -q "$TORCH_SPEC" || { record install FAILED "torch; see $LOG_DIR/install.log"; return 1; }
  if [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)"; then
    record install FAILED "torch is not a CUDA build or sees no GPU: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
    return 1
  fi
  step install "$PY" -m pip install -q -e ".[nixl,test,bench]" || { record install FAILED "project; see $LOG_DIR/install.log"; return 1; }
  local cuda_major=12
  [ "$DRY_RUN" = 0 ] && cuda_major=$("$PY" -c "import torch; print(torch.version.cuda.split('.')[0])")
  local mooncake="mooncake-transfer-engine"; [ "$cuda_major" = 13 ] && mooncake="mooncake-transfer-engine-cuda13"
  step install "$PY" -m pip uninstall -y -q mooncake-transfer-engine-non-cuda
  if ! step install "$PY" -m pip install -q "$mooncake"; then
    MOONCAKE_WHY="$mooncake did not install (see $LOG_DIR/install.log)"
  fi
  if [ "$FLASH_ATTN" = 1 ]; then
    step install timeout 900 "$PY" -m pip install -q flash-attn --no-build-isolation \
      || say "flash-attn did not install: its decode path is skipped (the Triton kernel covers every case)"
  fi
  record install "done" "$("$PY" -c 'import torch; print(f"torch {torch.__version__} CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")' 2>/dev/null || echo dry-run)" $((SECONDS - start))
}

mooncake_loads() {
  [ "$DRY_RUN" = 1 ] && { MOONCAKE_OK=1; return; }
  local out
  if out=$("$PY" -c "import mooncake.engine; from transfer.mooncake import cuda_build, installed_builds
assert cuda_build(), f'not a CUDA build: {installed_builds()}'" 2>&1); then
    MOONCAKE_OK=1
  else
    [ "$MOONCAKE_WHY" = "not checked" ] && MOONCAKE_WHY="its CUDA build does not load: $(echo "$out" | tail -n 1 | cut -c1-120)"
  fi
}

# --- bench ---------------------------------------------------------------------------------
bench() {
  wanted bench || return
  local out="$LOG_DIR/decode_throughput.json" start=$SECONDS
  local cmd=("$PY" -m bench.decode_throughput --device "$DEVICE" --quick --server-cores "" --client-cores ""
             --out "$out" --summary-dir "$LOG_DIR/summaries" --startup-timeout 300)
  if [ "$DRY_RUN" = 1 ]; then echo "  [bench] timeout 420 ${cmd[*]}"; return; fi
  say "bench: ${cmd[*]}"
  if timeout 420 "${cmd[@]}" >"$LOG_DIR/bench.log" 2>&1; then
    record bench "passed" "$("$PY" - "$out" <<'PYEOF'
import json, sys
report = json.load(open(sys.argv[1]))
levels = ", ".join(f"C={o['concurrency']} {o['tokens_per_s']:.0f} tok/s ({o['ratio_vs_hf']:.1f}x)" for o in report["ours"])
print(f"HF generate() {report['hf']['tokens_per_s']:.0f} tok/s; stage serve colocated {levels}")
PYEOF
)" $((SECONDS - start))
  else
    record bench "FAILED" "exit $?; see $LOG_DIR/bench.log" $((SECONDS - start))
  fi
}

print_table() {
  echo
  echo "GPU check on $DEVICE ($(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  printf '%-12s %-8s %6s  %s\n' "check" "result" "secs" "detail"
  printf '%-12s %-8s %6s  %s\n' "-----" "------" "----" "------"
  local failed=0 i
  for i in "${!NAMES[@]}"; do
    printf '%-12s %-8s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${DETAIL[$i]}"
    [ "${STATUS[$i]}" = "FAILED" ] && failed=1
  done
  echo "logs: $LOG_DIR"
  return $failed
}

# --- run -----------------------------------------------------------------------------------
[ "$DRY_RUN" = 1 ] && say "dry run: device $DEVICE, python $PY, checks $ONLY; would run:"
if [ "$INSTALL" = 1 ] && ! install; then print_table; exit 1; fi
if [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import stages" 2>/dev/null; then
  say "$PY cannot import the project (install it, or drop --no-install)"; exit 2
fi
mooncake_loads

check engine 420 tests/stages/engine/test_parity.py tests/stages/engine/test_device_placement.py tests/stages/engine/test_handoff.py \
  tests/stages/engine/test_isolation.py tests/stages/engine/test_device_paged_decode.py tests/stages/test_device_config.py
check colocated 300 tests/stages/test_colocated_server.py
check transfer 300 tests/transfer/test_conformance.py
check pd-nixl 420 tests/e2e/test_pd_parity.py -k nixl
if [ "$MOONCAKE_OK" = 1 ]; then
  check pd-mooncake 420 tests/e2e/test_pd_parity.py -k mooncake
elif wanted pd-mooncake; then
  record pd-mooncake "skipped" "$MOONCAKE_WHY"
fi
bench

[ "$DRY_RUN" = 1 ] && exit 0
print_table
exit $?
