"""A checkpoint directory checked before anything heavy is imported, so ``--model`` pointing at the
wrong place is one line naming the path and what is missing, not a traceback from transformers.

What a role reads from the directory: ``config.json`` of a model type that has an adapter
(``SUPPORTED_MODEL_TYPES``) and the weights (every role; every file the loader opens present and,
for safetensors, whole: ``stages.weight_files``); ``preprocessor_config.json`` (every role: the
encoder and a pixel-taking prefill or colocated server preprocess images with it, the others read its
image-size rule); a tokenizer and a chat template (every role but the encoder, which never sees text;
``stages.chat_template`` says where a template may be).
"""

from __future__ import annotations

import json
from pathlib import Path

from stages.chat_template import PLACES, ChatTemplateError, find_chat_template
from stages.weight_files import weights_problem

# config.json model_type values stages.engine.models.ADAPTERS serves (a test keeps the two equal; no torch here)
SUPPORTED_MODEL_TYPES = ("llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
PROCESSOR_CONFIG = "preprocessor_config.json"


def model_dir_problem(path: str | Path, *, tokenizer: bool) -> str | None:
    """Why ``path`` cannot be loaded, in words (``"no config.json (...)"``), or None when it has what a
    role needs; ``tokenizer``: the role reads the tokenizer."""
    path = Path(path)
    if not path.exists():
        return "no such directory"
    if not path.is_dir():
        return "not a directory"
    if not (path / "config.json").is_file():
        return "no config.json in it (not a Hugging Face checkpoint directory)"
    if (problem := architecture_problem(path / "config.json")) is not None:
        return problem
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"no tokenizer in it ({', '.join(TOKENIZER_FILES)})"
    if tokenizer and (problem := chat_template_problem(path)) is not None:
        return problem
    if not (path / PROCESSOR_CONFIG).is_file():
        return f"no {PROCESSOR_CONFIG} in it (the image processor's config)"
    return weights_problem(path)


def architecture_problem(config: Path) -> str | None:
    """Why the checkpoint whose ``config.json`` is ``config`` is not one this project serves, naming
    the file, its model type and architecture and the supported types; None when it is."""
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        return f"{config.name} does not parse as JSON ({exc})"
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    architectures = data.get("architectures") if isinstance(data, dict) else None
    named = f" ({', '.join(map(str, architectures))})" if isinstance(architectures, list) and architectures else ""
    what = f"model_type {model_type!r}{named}" if model_type else f"no model_type{named}"
    return f"{config.name}: {what} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"


def chat_template_problem(path: Path) -> str | None:
    """Why no chat template can be read from checkpoint directory ``path`` (``stages.chat_template``), or None."""
    try:
        found = find_chat_template(path)
    except ChatTemplateError as exc:
        return str(exc)
    return None if found else f"no chat template in it ({PLACES})"


def check_model_dir(path: str | Path, *, tokenizer: bool) -> None:
    """ValueError ``--model PATH: WHAT IS MISSING`` unless ``path`` has what a role needs."""
    if (problem := model_dir_problem(path, tokenizer=tokenizer)) is not None:
        raise ValueError(f"--model {path}: {problem}")
