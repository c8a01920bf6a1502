"""A checkpoint directory checked before anything heavy is imported, so ``--model`` pointing at the
wrong place is one line naming the path and what is missing, not a traceback from transformers.

What a role reads from the directory: ``config.json`` and the weights (every role);
``preprocessor_config.json`` (every role: the encoder and a pixel-taking prefill or colocated server
preprocess images with it, the others read its image-size rule); a tokenizer (every role but the
encoder, which never sees text).
"""

from __future__ import annotations

from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")
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
    if tokenizer and not any((path / name).is_file() for name in TOKENIZER_FILES):
        return f"no tokenizer in it ({', '.join(TOKENIZER_FILES)})"
    if not (path / PROCESSOR_CONFIG).is_file():
        return f"no {PROCESSOR_CONFIG} in it (the image processor's config)"
    if not any(next(path.glob(pattern), None) for pattern in WEIGHT_PATTERNS):
        return f"no weights in it ({', '.join(WEIGHT_PATTERNS)})"
    return None


def check_model_dir(path: str | Path, *, tokenizer: bool) -> None:
    """ValueError ``--model PATH: WHAT IS MISSING`` unless ``path`` has what a role needs."""
    if (problem := model_dir_problem(path, tokenizer=tokenizer)) is not None:
        raise ValueError(f"--model {path}: {problem}")
