"""Engine configuration: frozen, validated at construction, shared by every stage that runs a model.

Importing this module is cheap (no torch), so the CLI builds its parsers from these defaults quickly."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from stages.engine.dtype_choice import AUTO, DTYPES, DTypeChoice, choose_dtype, read_stated_dtype
from stages.generation_defaults import GENERATION_CONFIGS

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "auto (cuda:0 when torch sees a GPU, else cpu), cpu, cuda (= cuda:0) or cuda:N"
_DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
VISION, TEXT = "vision", "text"  # the halves of a model (see stages/engine/models/base.py)
PARTS = (VISION, TEXT)
# --max-batched-tokens when none is given, by device type (EngineConfig.batched_tokens). A CPU: 8 decodes beside a
# 248-token chunk cost ~3-4 decode steps, a 2k prompt ~12% more than in one step; TPOT p99 of 8 streams with a
# 2k prompt every 2 s was lowest there (bench/chunked_prefill, bench/README.md). A GPU: vLLM V1's online default.
BATCHED_TOKENS = {"cpu": 256, "cuda": 2048}
KV_ALLOCATIONS = ("on_demand", "reserve")  # see stages/engine/scheduler.py
CPU_KV_CACHE_MIB = 512  # the KV pool on a CPU when --kv-cache-mib is not given (a GPU sizes it: kv_sizing.py)


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = AUTO  # AUTO or one of DTYPES; dtype_choice says what it resolves to
    block_size: int = 16
    kv_cache_mib: int | None = None  # None: CPU_KV_CACHE_MIB on a CPU, from --gpu-memory-utilization on a GPU
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory this process may use (vLLM's meaning)
    max_num_seqs: int = 64
    max_batched_tokens: int | None = None  # tokens per step; None: BATCHED_TOKENS of the device (batched_tokens)
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    threads: int = 1
    seed: int = 0
    parts: tuple[str, ...] = PARTS  # what to load: ("text",) for a stage that never encodes images
    device: str = "auto"  # see DEVICE_HELP; resolved (and checked against the machine) by torch_device
    prefix_caching: bool = True  # reuse the KV of cached prompt prefixes (scheduler.py); a decode has none to reuse
    kv_allocation: str = "on_demand"  # KV_ALLOCATIONS: blocks as tokens come (preemption), or all on admission
    # GENERATION_CONFIGS: auto, the checkpoint's sampling defaults apply to what a request leaves out; none: no defaults
    generation_config: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype != AUTO and self.dtype not in DTYPES:
            raise ValueError(f"--dtype must be {AUTO} or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if not isinstance(self.gpu_memory_utilization, (int, float)) or not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")
        check_device(self.device)
        if self.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"--kv-allocation must be one of {list(KV_ALLOCATIONS)}, got {self.kv_allocation!r}")
        if self.generation_config not in GENERATION_CONFIGS:
            raise ValueError(f"--generation-config must be one of {list(GENERATION_CONFIGS)}, "
                             f"got {self.generation_config!r}")
        for name in ("block_size", "kv_cache_mib", "max_num_seqs", "max_batched_tokens", "threads"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {getattr(self, name)}")
        if not self.parts or not set(self.parts) <= set(PARTS):
            raise ValueError(f"parts must be a non-empty subset of {PARTS}, got {self.parts}")
        if not isinstance(self.prefix_caching, bool):
            raise ValueError(f"--prefix-caching must be a bool, got {self.prefix_caching!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"--max-model-len must be > 1, got {self.max_model_len}")

    @property
    def batched_tokens(self) -> int:
        """``max_batched_tokens``, or ``BATCHED_TOKENS`` of the device it resolves to. Imports torch."""
        return self.max_batched_tokens or BATCHED_TOKENS[self.torch_device.type]

    @property
    def dtype_choice(self) -> DTypeChoice:
        """``dtype`` resolved (``stages.engine.dtype_choice``): the dtype and why. Reads the checkpoint's
        config.json and, for ``auto``, resolves the device (imports torch)."""
        if self.dtype != AUTO:
            return choose_dtype(self.dtype, None, "cpu")
        return choose_dtype(self.dtype, read_stated_dtype(self.model), self.torch_device.type)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch dtype of ``dtype_choice``: the weights' and the KV pool's. Imports torch."""
        import torch

        return getattr(torch, self.dtype_choice.name)

    @property
    def torch_device(self) -> torch.device:
        """``device`` on this machine: ``auto`` and ``cuda`` become ``cuda:0`` or ``cpu``. Imports torch.
        ValueError naming --device when the GPU asked for is not there."""
        return resolve_device(self.device)


def check_device(spec: str) -> None:
    """ValueError naming --device unless ``spec`` is a ``--device`` value (see ``DEVICE_HELP``). No torch."""
    if not isinstance(spec, str) or not _DEVICE.fullmatch(spec):
        raise ValueError(f"--device must be {DEVICE_HELP}; got {spec!r}")


def resolve_device(spec: str) -> torch.device:
    """The torch device of a ``--device`` value (see ``DEVICE_HELP``), always with an index for a GPU."""
    import torch

    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if spec == "cpu":
        return torch.device("cpu")
    index = int(spec.partition(":")[2] or 0)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ValueError(f"--device {spec}: torch sees no GPU here (a CPU build of torch, or no driver); "
                         "use --device cpu or auto")
    if index >= count:
        raise ValueError(f"--device {spec}: torch sees {count} GPU(s); use --device cuda:N with N < {count}")
    return torch.device("cuda", index)
