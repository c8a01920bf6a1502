"""The generated checkpoints ``stage up``, ``stage demo``, the benchmarks and the tests run when given
no ``--model``: random-weight models of a family and size (``stages.modelgen``), made once per
machine under the cache directory, which also holds the default run-log directories.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

DEFAULT_FAMILY = "qwen2_vl"
DEFAULT_SIZE = "tiny"  # of the generated model, for stage up and stage demo alike


def cache_dir() -> Path:
    """Where generated models and default log directories live ($XDG_CACHE_HOME/epd-stage)."""
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "epd-stage"


def ensure_model(path: Path, family: str, size: str) -> Path:
    """A generated checkpoint at ``path``, made (atomically: written next to it, then renamed) if it
    is not there yet, or remade if an older generator made it (``stages.modelgen.version``). Imports
    torch only when it has to make one."""
    if (path / "config.json").exists():
        if made_by_this_generator(path):
            return path
        print(f"remaking {path}: an older version of the generator made it", flush=True)
        shutil.rmtree(path)
    from stages.modelgen import make_model

    print(f"making a random-weight {family} ({size}) checkpoint in {path}", flush=True)
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    make_model(family, size, partial)
    partial.rename(path)
    return path


def made_by_this_generator(path: Path) -> bool:
    """Whether the checkpoint at ``path`` records this version of ``stages.modelgen``."""
    from stages.modelgen import GENERATOR_VERSION, VERSION_FILE

    try:
        return (path / VERSION_FILE).read_text().strip() == str(GENERATOR_VERSION)
    except OSError:
        return False
