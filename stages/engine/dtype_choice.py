"""``--dtype auto``: which dtype a stage runs its weights and KV pool in, and why.

``choose_dtype`` is pure: the flag, the dtype the checkpoint states (``stated_dtype`` of its config.json)
and the device type in, a ``DTypeChoice`` out. ``EngineConfig.dtype_choice`` calls it once per caller
(the engine and the encoder at load, the fingerprint, ``/server_info``) with the checkpoint read by
``read_stated_dtype``; the same checkpoint and device give the same answer in every stage, so a prefill
and a decode both on ``auto`` agree.

- an explicit ``--dtype`` (float32, bfloat16, float16) wins, source ``"--dtype"``;
- ``auto`` on a GPU: the checkpoint's dtype (transformers 5 writes ``dtype``, older ones
  ``torch_dtype``; a VLM may state it only in ``text_config``); a checkpoint that states none, or
  ``"auto"``, runs in float32;
- ``auto`` on a CPU: float32 whatever the checkpoint says (``CPU_DTYPE``; docs/devices.md has the
  measurement: in bfloat16 greedy tokens left generate()'s, and a batched run its requests' alone runs,
  and batched decode steps were slower; only prefill was faster).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DTYPES = ("float32", "bfloat16", "float16")  # names of torch dtypes; torch is imported only when a model loads
AUTO = "auto"
CPU_DTYPE = "float32"  # --dtype auto on a CPU (docs/devices.md, "--dtype auto")
UNSTATED_DTYPE = "float32"  # --dtype auto on a GPU when the checkpoint states no dtype (as HF loads it)
_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass(frozen=True)
class DTypeChoice:
    name: str  # one of DTYPES
    source: str  # "--dtype", "auto: cpu default", "auto: checkpoint dtype bfloat16", "auto: checkpoint states none"


def stated_dtype(config: dict) -> str | None:
    """The dtype a checkpoint's config.json (parsed) states: top-level ``dtype`` or ``torch_dtype``, else the
    same in ``text_config``; None when it states none (or ``"auto"``). Spelled as torch names it
    (``"torch.bfloat16"`` -> ``"bfloat16"``). Pure."""
    for level in (config, config.get("text_config") or {}):
        for key in ("dtype", "torch_dtype"):
            value = level.get(key)
            if isinstance(value, str) and value != AUTO:
                name = value.removeprefix("torch.")
                return _ALIASES.get(name, name)
    return None


def choose_dtype(flag: str, stated: str | None, device_type: str) -> DTypeChoice:
    """The dtype of ``--dtype flag`` for a checkpoint stating ``stated`` on a ``device_type`` ("cpu", "cuda").
    ValueError naming --dtype when ``auto`` meets a checkpoint dtype the engine does not run (float64,
    float8...). Pure."""
    if flag != AUTO:
        if flag not in DTYPES:
            raise ValueError(f"--dtype must be auto or one of {sorted(DTYPES)}, got {flag!r}")
        return DTypeChoice(flag, "--dtype")
    if device_type == "cpu":
        return DTypeChoice(CPU_DTYPE, "auto: cpu default")
    if stated is None:
        return DTypeChoice(UNSTATED_DTYPE, f"auto: checkpoint states none, {UNSTATED_DTYPE}")
    if stated not in DTYPES:
        raise ValueError(f"--dtype auto: the checkpoint's dtype is {stated}, which the engine does not run; "
                         f"pass --dtype with one of {sorted(DTYPES)}")
    return DTypeChoice(stated, f"auto: checkpoint dtype {stated}")


def read_stated_dtype(model_dir: str | Path) -> str | None:
    """``stated_dtype`` of ``model_dir``/config.json; None when there is no such file (a test's fake model)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    return stated_dtype(json.loads(path.read_text()))
