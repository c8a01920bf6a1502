"""Where a checkpoint keeps its chat template, read without torch or transformers.

Three places, in the order transformers' tokenizer prefers them: ``chat_template.jinja`` (what
transformers 5 writes), the ``chat_template`` field of ``tokenizer_config.json`` (older tokenizers),
and ``chat_template.json`` (``{"chat_template": "..."}``: what Qwen2-VL, Qwen2.5-VL and LLaVA-1.5
repositories ship for their processor). The tokenizer reads the first two itself; a template only in
``chat_template.json`` is read by the processor alone, so ``stages.prompt.load_tokenizer`` gives it
to the tokenizer from here. A field holding several named templates yields the one named ``default``.
"""

from __future__ import annotations

import json
from pathlib import Path

JINJA, TOKENIZER_CONFIG, PROCESSOR_JSON = "chat_template.jinja", "tokenizer_config.json", "chat_template.json"
PLACES = f"{JINJA}, {PROCESSOR_JSON}, or a chat_template field in {TOKENIZER_CONFIG}"


class ChatTemplateError(ValueError):
    """A file that should hold a chat template does not parse; the message names it."""


def find_chat_template(path: str | Path) -> tuple[str, str] | None:
    """(file name, template) from the first of the three places that holds one, or None.
    ChatTemplateError when a JSON file among them does not parse."""
    path = Path(path)
    if (path / JINJA).is_file():
        return JINJA, (path / JINJA).read_text()
    for name in (TOKENIZER_CONFIG, PROCESSOR_JSON):
        if (path / name).is_file():
            template = _field(path / name)
            if template is not None:
                return name, template
    return None


def _field(file: Path) -> str | None:
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise ChatTemplateError(f"{file.name} does not parse as JSON ({exc})") from None
    template = data.get("chat_template") if isinstance(data, dict) else None
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
