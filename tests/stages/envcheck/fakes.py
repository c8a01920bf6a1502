"""Faked ``stage env`` facts for the verdict and render tests: a machine described in one call.

    machine(torch="cpu"|"cu12"|None, gpus=0, mooncake=(dists...), mooncake_error=None, nixl=(wheels...),
            redis=None|True|False) -> Facts
"""

from __future__ import annotations

from stages.envcheck.facts import Backend, Facts, Gpu, RedisFacts, TorchFacts, UcxFacts
from transfer.builds import mooncake_gpu_capable, nixl_gpu_capable

NON_CUDA = "mooncake-transfer-engine-non-cuda"
CUDA12 = "mooncake-transfer-engine"
REDIS_URL = "redis://:***@10.0.0.5:6379/0"


def machine(torch: str | None = "cpu", gpus: int = 0, mooncake: tuple[str, ...] = (NON_CUDA,),
            mooncake_error: str | None = None, nixl: tuple[str, ...] = ("nixl-cu12", "nixl-cu13"),
            redis: bool | None = None) -> Facts:
    if torch is None:
        torch_facts = TorchFacts(version=None, error="ModuleNotFoundError: No module named 'torch'")
    else:
        cuda = {"cpu": None, "cu12": "12.8", "cu13": "13.0"}[torch]
        torch_facts = TorchFacts(version="2.13.0", cuda=cuda, build=torch, driver="570.1" if gpus else None,
                                 gpus=tuple(Gpu(i, "NVIDIA H100 80GB HBM3", 70 << 30, 80 << 30) for i in range(gpus)))
    backends = (
        Backend("mooncake", tuple(f"{d} 0.3.13" for d in mooncake), importable=bool(mooncake) and not mooncake_error,
                import_error=mooncake_error, gpu_capable=mooncake_gpu_capable(list(mooncake))),
        Backend("nixl", tuple(f"{w} 1.5.1" for w in nixl), importable=bool(nixl),
                import_error=None if nixl else "ModuleNotFoundError: No module named 'nixl'",
                gpu_capable=torch is not None and nixl_gpu_capable(torch, list(nixl))),
    )
    refused = "ConnectionError: Error 111 connecting to 10.0.0.5:6379. Connection refused."
    redis_facts = RedisFacts() if redis is None else RedisFacts(REDIS_URL, redis, None if redis else refused)
    return Facts(python="3.11.7", platform="Linux", torch=torch_facts, transformers="5.25.0", backends=backends,
                 ucx=UcxFacts("nixl_cu13.libs", ("self/memory", "tcp/lo")), rdma=(), redis=redis_facts,
                 stage="0.1.0")
