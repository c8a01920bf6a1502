"""Build the Hugging Face processor of a checkpoint without a video processor (no torchvision here).

`AutoProcessor` cannot do this for the Qwen families: their processors declare a `video_processor`, and in
transformers 5.24 `ProcessorMixin.__init__` looks up `VideoProcessorMixin` (exported only with torchvision)
even when `video_processor=None` is passed. An image-only subclass whose `__init__` does not name a video
processor sidesteps that: `ProcessorMixin` takes its sub-processor list from the `__init__` signature.

Meant for tests and reference checks (e.g. parity with `model.generate()`); serving builds prompts itself.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # transformers is imported where used
    from transformers import ProcessorMixin


@cache
def image_only(processor_cls: type[ProcessorMixin]) -> type[ProcessorMixin]:
    """`processor_cls` (Qwen2VLProcessor and friends) with the video processor left out."""

    def __init__(self: ProcessorMixin, image_processor: object = None, tokenizer: object = None,
                 chat_template: str | None = None, **kwargs: Any) -> None:
        processor_cls.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    return type(processor_cls.__name__, (processor_cls,), {"__init__": __init__, "__module__": __name__})


def hf_processor(path: str | Path, config=None, tokenizer=None, image_processor=None):
    """The family's processor for the checkpoint at `path` (pieces already loaded may be passed in)."""
    import transformers
    from transformers import AutoConfig, AutoImageProcessor, AutoTokenizer

    config = config or AutoConfig.from_pretrained(path)
    if tokenizer is None:
        from stages.chat_template import find_chat_template

        tokenizer = AutoTokenizer.from_pretrained(path)
        if not tokenizer.chat_template and (found := find_chat_template(path)) is not None:
            tokenizer.chat_template = found[1]  # a hub layout's chat_template.json (the processor's file)
    image_processor = image_processor or AutoImageProcessor.from_pretrained(path)
    if config.model_type == "llava":
        return transformers.LlavaProcessor(
            image_processor=image_processor,
            tokenizer=tokenizer,
            chat_template=tokenizer.chat_template,
            **llava_processor_kwargs(config),
        )
    names = {"qwen2_vl": "Qwen2VLProcessor", "qwen2_5_vl": "Qwen2_5_VLProcessor", "qwen3_vl": "Qwen3VLProcessor"}
    cls = image_only(getattr(transformers, names[config.model_type]))
    return cls(image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template)


def llava_processor_kwargs(config) -> dict:
    """LlavaProcessor's token-count settings, which follow from the vision tower."""
    clip = config.vision_config.model_type == "clip_vision_model"
    return {
        "patch_size": config.vision_config.patch_size,
        "vision_feature_select_strategy": config.vision_feature_select_strategy,
        "num_additional_image_tokens": 1 if clip else 0,  # CLIP's class token
    }
