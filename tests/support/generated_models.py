"""Generated test checkpoints, built once per machine and per version of the generator.

``model_dir("qwen2_vl")`` returns a directory holding a tiny random-weight checkpoint. Builds are
deterministic, so they are cached under ``$EPD_TEST_MODELS`` (default ``~/.cache/epd-stage/test-models``)
keyed by the options and a hash of ``stages/modelgen``'s source: editing the generator rebuilds.
``model_dir("qwen2_vl", hub=True)`` is the same model in the hub layout (``stages/modelgen/hub.py``).
A lock file keeps parallel test processes from building the same model twice.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

import stages.modelgen
from stages.modelgen import make_model

# (family, vision, text): every variant the parity tests cover
VARIANTS = {
    "qwen2_vl": ("qwen2_vl", None, None),
    "qwen2_5_vl": ("qwen2_5_vl", None, None),
    "qwen3_vl": ("qwen3_vl", None, None),
    "llava": ("llava", "clip", "llama"),
    "llava_siglip_qwen2": ("llava", "siglip", "qwen2"),
}


def _generator_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(stages.modelgen.__file__).parent.glob("*.py")):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


def model_dir(variant: str, size: str = "tiny", seed: int = 0, hub: bool = False) -> Path:
    family, vision, text = VARIANTS[variant]
    root = Path(os.environ.get("EPD_TEST_MODELS", Path.home() / ".cache" / "epd-stage" / "test-models"))
    out = root / f"{variant}-{size}-s{seed}{'-hub' if hub else ''}-{_generator_hash()}"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not out.exists():  # build beside, then rename: a half-written model is never picked up
            staging = out.with_name(out.name + ".partial")
            shutil.rmtree(staging, ignore_errors=True)
            make_model(family=family, size=size, out=staging, seed=seed, vision=vision, text=text, hub_layout=hub)
            staging.rename(out)
    return out
