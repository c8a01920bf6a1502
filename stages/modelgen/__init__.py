"""`stage make-model`: random-weight checkpoints of each supported family, written in the standard Hugging
Face layout (config.json, model.safetensors, generation_config.json, tokenizer files with a chat template,
preprocessor_config.json, README.md; and modelgen_version, the generator's version), so tests and
benchmarks load them exactly like real checkpoints; or, with `hub_layout`, as the family's Hugging Face
repository ships it (bfloat16 shards with an index, the chat template in its own file, the repository's
config and processor fields: `hub.py`).

Importing this package is cheap (no torch); `make_model` imports torch and transformers when called.
"""

from pathlib import Path

from .llava import TEXT_MODELS, VISION_TOWERS  # LLaVA's --text and --vision choices
from .qwen import BUILDERS as _QWEN
from .sizes import PRESETS as _PRESETS
from .version import GENERATOR_VERSION, VERSION_FILE

FAMILIES: tuple[str, ...] = (*_QWEN, "llava")
SIZES: tuple[str, ...] = tuple(_PRESETS)


def make_model(
    family: str,
    size: str,
    out: str | Path,
    seed: int = 0,
    *,
    vision: str | None = None,
    text: str | None = None,
    hub_layout: bool = False,
) -> Path:
    """Write a random-weight checkpoint of `family` at `size` into directory `out` and return its path.

    The same arguments give byte-identical files (weights drawn on CPU in float32 from `seed`; the tokenizer
    is trained on a generated corpus that depends on nothing but this package). `vision` (clip|siglip,
    default clip) and `text` (llama|qwen2, default llama) choose LLaVA's towers; other families take None.
    `out` must not exist or be an empty directory (FileExistsError otherwise); files are written beside it
    and renamed into place, so `out` never holds half a checkpoint. Raises ValueError for an unknown family,
    size or tower. `hub_layout`: the same model in the hub's layout (`hub.py`; weights rounded to bfloat16).
    """
    from .build import recipe, write

    return write(recipe(family, size, vision, text), Path(out), seed, hub_layout)


__all__ = ["FAMILIES", "GENERATOR_VERSION", "VERSION_FILE", "SIZES", "TEXT_MODELS", "VISION_TOWERS", "make_model"]
