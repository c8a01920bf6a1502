#!/usr/bin/env bash
# Prove the GPU path on a machine with an NVIDIA GPU and print one table: the README's demo, stage env,
# bf16 parity with generate() for every family, the KV pool sized by --gpu-memory-utilization, KV moved
# GPU to GPU over Mooncake and NIXL, and decode throughput against generate(). Once installed, each
# check has a time limit (they add up to about 17 minutes; pytest runs on $JOBS workers, default 4):
# where one command may run only 10 minutes (a lent machine), split the checks with --only.
#
#   bash scripts/gpu-check.sh                      # set up as the README does (scripts/setup.sh test), check cuda:0
#   bash scripts/gpu-check.sh --device cuda:1      # another GPU
#   bash scripts/gpu-check.sh --no-install --python .venv/bin/python   # reuse an installed venv
#   bash scripts/gpu-check.sh --wheels DIR         # no network: a venv over the machine's torch + DIR's wheels
#   bash scripts/gpu-check.sh --only demo,env,parity                    # some checks (names below)
#   bash scripts/gpu-check.sh --flash-attn         # also install flash-attn (it may compile for long)
#   bash scripts/gpu-check.sh --dry-run            # print what would run; needs no GPU
#   bash scripts/gpu-check.sh --cpu-smoke --only engine,transfer   # the harness itself, on the CPU venv
#
# Install: `bash scripts/setup.sh test` (torch 2.13.0 from pip's index: PyPI's is a CUDA 13 build; then
# the Mooncake and NIXL builds matching it, transfer/build_choice.py). --wheels DIR, for a machine that
# reaches no index (a lent GPU machine): a venv in .venv-gpu over the system python's own torch
# (--system-site-packages; EPD_GPU_PYTHON names that python, default python3), then every wheel in DIR
# (files split as NAME.whl.part-* are joined first) and this project, all --no-index --no-deps.
# scripts/gpu-wheels.sh fills DIR for a given Python version and says what it holds.
#
# Checks (EPD_TEST_DEVICE=<device> for every test; each has a time limit):
#   demo        `stage demo` as the README runs it (EPD; the placement line must name a GPU), then
#               `stage demo --mode pd --transfer nixl`
#   env         `stage env --json`: the GPU seen, every role ok on it, each installed transfer GPU-capable
#   parity      every family's hub-layout checkpoint with default flags (--dtype auto: bf16 on a GPU),
#               token for token against generate() in the same dtype (tests/stages/engine/test_hub_parity.py),
#               served colocated, PD and EPD (tests/e2e/test_hub_layout_stacks.py) and with the
#               checkpoint's generation config (tests/e2e/test_generation_config.py)
#   kv-pool     the pool sized from --gpu-memory-utilization on this GPU: two utilizations, the bytes
#               /server_info reports against torch's own count (scripts/gpu_kv_pool.py)
#   engine      float32 parity and placement on the GPU (single requests exact; batched: exact or a near
#               tie, tests/support/devices.py), hand-off, isolation, the Triton and flash-attn decode kernels
#   transfer    the transfer conformance suite on VRAM (NIXL; Mooncake when its CUDA build loads)
#   pd-nixl     1P1D greedy parity with generate() over NIXL, VRAM -> VRAM (tests/e2e/test_pd_parity.py)
#   pd-mooncake the same over Mooncake's CUDA build
#   video       video parity with generate() for the Qwen families on the GPU, in the engine and through
#               1E1P1D (tests/stages/engine/test_video_parity.py, tests/e2e/test_video_epd.py), and our
#               video preprocessing against transformers' own video processors (scripts/gpu_video_check.py:
#               they need torchvision, which imports beside a CUDA torch; installed here if missing)
#   bench       python -m bench.decode_throughput --quick on the GPU against HF generate() on the same GPU
# Exit status 0 when no check failed. Logs: $LOG_DIR (default /tmp/epd-gpu-check-<time>).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE="cuda:0"
PY=".venv/bin/python"
INSTALL=1
WHEELS=""
DRY_RUN=0
CPU_SMOKE=0
FLASH_ATTN=0
JOBS="${JOBS:-4}"
ONLY="demo,env,parity,kv-pool,engine,transfer,pd-nixl,pd-mooncake,video,bench"
LOG_DIR="${LOG_DIR:-/tmp/epd-gpu-check-$(date +%Y%m%d-%H%M%S)}"

usage() { sed -n '2,14p' "$0"; exit "${1:-0}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --no-install) INSTALL=0; shift ;;
    --wheels) WHEELS="$2"; PY=".venv-gpu/bin/python"; shift 2 ;;
    --only) ONLY="$2"; shift 2 ;;
    --flash-attn) FLASH_ATTN=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --cpu-smoke) CPU_SMOKE=1; INSTALL=0; DEVICE="cpu"; PY=".venv/bin/python"; JOBS=0; shift ;;
    -h|--help) usage 0 ;;
    *) echo "gpu-check: unknown argument $1" >&2; usage 2 ;;
  esac
done
mkdir -p "$LOG_DIR"
export EPD_TEST_DEVICE="$DEVICE"
export PYTHONUNBUFFERED=1

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
  local args=(-q -p no:cacheprovider -n "$JOBS" "$@")
  if [ "$DRY_RUN" = 1 ]; then echo "  [$name] EPD_TEST_DEVICE=$DEVICE timeout $limit $PY -m pytest ${args[*]}"; return; fi
  local start=$SECONDS rc counts
  say "$name: pytest $* (at most ${limit}s)"
  timeout "$limit" "$PY" -m pytest "${args[@]}" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  counts=$(tail -n 5 "$LOG_DIR/$name.log" | grep -Eo '[0-9]+ (passed|failed|skipped|errors?|deselected)' | paste -sd, - | sed 's/,/, /g')
  case $rc in
    0) record "$name" "passed" "${counts:-no summary}" $((SECONDS - start)) ;;
    5) record "$name" "skipped" "no test selected" $((SECONDS - start)) ;;
    124) record "$name" "FAILED" "timed out after ${limit}s; ${counts:-see $LOG_DIR/$name.log}" $((SECONDS - start)) ;;
    *) record "$name" "FAILED" "${counts:-exit $rc}; see $LOG_DIR/$name.log" $((SECONDS - start)) ;;
  esac
}

# One command check: NAME LIMIT_S CMD...; its last output line is the table's detail.
run_check() {
  local name="$1" limit="$2"; shift 2
  if [ "$DRY_RUN" = 1 ]; then echo "  [$name] timeout $limit $*"; return; fi
  local start=$SECONDS rc
  say "$name: $* (at most ${limit}s)"
  timeout "$limit" "$@" >"$LOG_DIR/$name.log" 2>&1
  rc=$?
  local last; last=$(grep -v '^\s*$' "$LOG_DIR/$name.log" | tail -n 1 | cut -c1-150)
  case $rc in
    0) record "$name" "passed" "$last" $((SECONDS - start)) ;;
    3) record "$name" "skipped" "$last" $((SECONDS - start)) ;;  # the check cannot run here (it says why)
    124) record "$name" "FAILED" "timed out after ${limit}s; see $LOG_DIR/$name.log" $((SECONDS - start)) ;;
    *) record "$name" "FAILED" "exit $rc: $last" $((SECONDS - start)) ;;
  esac
}

# --- install -------------------------------------------------------------------------------
install() {
  local start=$SECONDS
  if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$DRY_RUN" = 0 ]; then
    say "no nvidia-smi on this machine: this check needs an NVIDIA GPU (try --dry-run or --cpu-smoke)"; exit 2
  fi
  if [ -n "$WHEELS" ]; then
    install_offline || return 1
  else
    step install bash scripts/setup.sh test || { record install FAILED "scripts/setup.sh test; see $LOG_DIR/install.log"; return 1; }
  fi
  if [ "$DRY_RUN" = 0 ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda and torch.cuda.is_available() else 1)"; then
    record install FAILED "torch is not a CUDA build or sees no GPU: $("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)')"
    return 1
  fi
  if [ "$FLASH_ATTN" = 1 ]; then
    step install timeout 900 "$PY" -m pip install -q flash-attn --no-build-isolation \
      || say "flash-attn did not install: its decode path is skipped (the Triton kernel covers every case)"
  fi
  record install "done" "$("$PY" -c 'import torch; print(f"torch {torch.__version__} CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")' 2>/dev/null || echo dry-run)" $((SECONDS - start))
}

install_offline() {
  local base="${EPD_GPU_PYTHON:-python3}"
  [ -x "$PY" ] || step install "$base" -m venv --system-site-packages .venv-gpu
  for deb in "$WHEELS"/*.deb; do  # Mooncake's system libraries (libibverbs1, librdmacm1, libnuma1) where apt reaches nothing
    [ -e "$deb" ] && step install dpkg -x "$deb" /
  done
  [ -e "$(ls "$WHEELS"/*.deb 2>/dev/null | head -n 1)" ] && step install ldconfig
  if [ "$DRY_RUN" = 0 ]; then  # join split wheels (the carry limit per file), then install everything as is
    for first in "$WHEELS"/*.whl.part-aa; do
      [ -e "$first" ] || continue
      cat "${first%.part-aa}".part-* > "${first%.part-aa}" && rm -f "${first%.part-aa}".part-*
    done
  fi
  step install "$PY" -m pip install -q --no-index --no-deps --no-cache-dir "$WHEELS"/*.whl \
    || { record install FAILED "wheels from $WHEELS; see $LOG_DIR/install.log"; return 1; }
  step install "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
    || { record install FAILED "the project; see $LOG_DIR/install.log"; return 1; }
}

# --- the README's demo and stage env ---------------------------------------------------------
demo() {
  wanted demo || return
  local where="cuda" flags=()  # the README's command places the stages itself (stages/launch/placement.py)
  [ "$CPU_SMOKE" = 1 ] && where="cpu" && flags=(--device cpu)
  run_check demo 150 "$PY" -m cli demo --max-tokens 8 ${flags[@]+"${flags[@]}"}
  [ "$DRY_RUN" = 1 ] || grep -q ": encoder $where.*prefill $where.*decode $where" "$LOG_DIR/demo.log" \
    || record demo-placed "FAILED" "the demo's placement line names no $where device: see $LOG_DIR/demo.log"
  run_check demo-pd-nixl 120 "$PY" -m cli demo --mode pd --transfer nixl --max-tokens 8 ${flags[@]+"${flags[@]}"}
}

env_check() {
  wanted env || return
  run_check env 60 "$PY" - "$DEVICE" "$CPU_SMOKE" <<'PYEOF'
import json, subprocess, sys
device, smoke = sys.argv[1], sys.argv[2] == "1"
report = json.loads(subprocess.run([sys.executable, "-m", "cli", "env", "--json", "--device", device],
                                   capture_output=True, text=True, check=True, timeout=50).stdout)
subprocess.run([sys.executable, "-m", "cli", "env", "--device", device], check=True, timeout=50)
problems = [f"{role}: {'; '.join(v['problems'])}" for role, v in report["verdicts"].items() if not v["ok"]]
gpus = report["torch"]["gpus"]
if not smoke:
    problems += [] if gpus else ["torch sees no GPU"]
    problems += [f"{b['name']} cannot register GPU memory ({', '.join(b['dists'])})"
                 for b in report["backends"] if b["dists"] and not b["gpu_capable"]]
assert not problems, problems
print(f"{len(gpus)} GPU(s); " + ", ".join(f"{role} ok" for role in report["verdicts"]) + "; "
      + ", ".join(f"{b['name']} {'GPU' if b['gpu_capable'] else 'host'}" for b in report["backends"]))
PYEOF
}

# --- bench ---------------------------------------------------------------------------------
bench() {
  wanted bench || return
  local out="$LOG_DIR/decode_throughput.json" start=$SECONDS
  local cmd=("$PY" -m bench.decode_throughput --device "$DEVICE" --quick --server-cores "" --client-cores ""
             --out "$out" --summary-dir "$LOG_DIR/summaries" --startup-timeout 300)
  if [ "$DRY_RUN" = 1 ]; then echo "  [bench] timeout 150 ${cmd[*]}"; return; fi
  say "bench: ${cmd[*]}"
  if timeout 150 "${cmd[@]}" >"$LOG_DIR/bench.log" 2>&1; then
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
  printf '%-13s %-8s %6s  %s\n' "check" "result" "secs" "detail"
  printf '%-13s %-8s %6s  %s\n' "-----" "------" "----" "------"
  local failed=0 i
  for i in "${!NAMES[@]}"; do
    printf '%-13s %-8s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${SECS[$i]}" "${DETAIL[$i]}"
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
MOONCAKE_GPU=1  # Mooncake checks need its CUDA build (transfer/builds.py); NIXL's wheels always have CUDA
if [ "$DRY_RUN" = 0 ] && [ "$CPU_SMOKE" = 0 ] && ! "$PY" -c "import sys, mooncake.engine
from transfer.builds import installed_mooncake, mooncake_gpu_capable
sys.exit(0 if mooncake_gpu_capable(installed_mooncake()) else 1)" >"$LOG_DIR/mooncake.log" 2>&1; then
  MOONCAKE_GPU=0
fi

demo
env_check
check parity 120 tests/stages/engine/test_hub_parity.py tests/e2e/test_hub_layout_stacks.py tests/e2e/test_generation_config.py
if wanted kv-pool; then run_check kv-pool 60 "$PY" scripts/gpu_kv_pool.py --device "$DEVICE"; fi
check engine 120 tests/stages/engine/test_parity.py tests/stages/engine/test_device_placement.py tests/stages/engine/test_handoff.py \
  tests/stages/engine/test_isolation.py tests/stages/engine/test_device_paged_decode.py tests/stages/test_device_config.py
check transfer 60 tests/transfer/test_conformance.py
check pd-nixl 90 tests/e2e/test_pd_parity.py -k nixl
if [ "$MOONCAKE_GPU" = 1 ]; then
  check pd-mooncake 90 tests/e2e/test_pd_parity.py -k mooncake
elif wanted pd-mooncake; then
  record pd-mooncake "FAILED" "Mooncake's CUDA build is not installed or does not load ($(tail -n 1 "$LOG_DIR/mooncake.log" | cut -c1-100))"
fi
check video 120 tests/stages/engine/test_video_parity.py tests/e2e/test_video_epd.py
if wanted video; then
  [ "$DRY_RUN" = 1 ] || "$PY" -c 'import torchvision' >/dev/null 2>&1 || timeout 300 "$PY" -m pip install -q torchvision \
    >"$LOG_DIR/torchvision.log" 2>&1
  run_check video-processors 120 "$PY" scripts/gpu_video_check.py
fi
bench

[ "$DRY_RUN" = 1 ] && exit 0
print_table
exit $?
