"""scripts/gpu-check.sh's kv-pool check: a colocated server on one GPU sizes its KV pool from
``--gpu-memory-utilization`` (stages/engine/kv_sizing.py), held to what the GPU itself reports.

For two utilizations it starts ``stage serve colocated --device DEVICE --gpu-memory-utilization U`` on
the generated small model, reads ``engine.kv_pool`` from ``/server_info`` and the GPU's free memory
(``torch.cuda.mem_get_info``, from this process) before the start and while the server runs. It
fails unless: the source names the utilization; the server's whole use of the GPU (the drop in free
memory: weights, pool, activations, its CUDA context) stays within ``U x total`` plus ``SLACK``; the
pool takes most of it; and the pool grows by ``(U2 - U1) x total`` between the two, within 2%.
Prints one line: the pool at each utilization and what the process used.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from process.ports import free_port  # noqa: E402
from stages.launch.models import cache_dir, ensure_model  # noqa: E402

GIB = 1 << 30
SLACK = 1 * GIB  # beyond U x total: what a caching allocator may hold ahead, and the context's rounding
UTILIZATIONS = (0.3, 0.6)


def serve(model: Path, device: str, utilization: float) -> tuple[dict, int]:
    """Start a colocated server, wait for it, return its /server_info ``engine`` and the GPU's free
    bytes while it runs; stop it."""
    import torch

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "cli", "serve", "colocated", "--model", str(model), "--device", device,
                             "--gpu-memory-utilization", str(utilization), "--port", str(port)], cwd=REPO)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=2) as answer:
                    info = json.load(answer)
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"the server at --gpu-memory-utilization {utilization} did not start")
                time.sleep(0.5)
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return info["engine"], free
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda:0")
    args = parser.parse_args()
    import torch

    model = ensure_model(cache_dir() / "qwen2_vl-small", "qwen2_vl", "small")
    free_before, total = torch.cuda.mem_get_info(torch.device(args.device))  # this process's context counted
    pools, used = {}, {}
    for utilization in UTILIZATIONS:
        engine, free = serve(model, args.device, utilization)
        pool = engine["kv_pool"]
        assert "--gpu-memory-utilization" in pool["source"], pool
        pools[utilization], used[utilization] = pool["bytes"], free_before - free
        assert used[utilization] <= utilization * total + SLACK, (
            f"at {utilization} the server used {used[utilization] / GIB:.2f} GiB of {total / GIB:.1f} GiB")
        assert pool["bytes"] >= 0.5 * used[utilization], (pool, used[utilization])
    low, high = UTILIZATIONS
    growth = pools[high] - pools[low]
    assert abs(growth - (high - low) * total) <= 0.02 * total, (growth, total)
    print(", ".join(f"{u}: pool {pools[u] / GIB:.2f} GiB, process {used[u] / GIB:.2f} GiB" for u in UTILIZATIONS)
          + f" of {total / GIB:.1f} GiB ({engine['dtype']})")


if __name__ == "__main__":
    main()
