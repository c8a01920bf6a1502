"""Hugging Face ``generate()`` on the same checkpoint and the same prompt: the reference for parity."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText

from stages.engine.config import EngineConfig
from stages.engine.multimodal import Prompt
from tests.support.devices import DEVICE


def random_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def load_reference(model_dir) -> torch.nn.Module:
    """The whole HF model on the tests' device (``tests.support.devices.DEVICE``), in the dtype a stage server
    runs it in there by default (``--dtype auto``: float32 on a CPU, the checkpoint's on a GPU; the generated
    checkpoints state float32)."""
    dtype = EngineConfig(model=str(model_dir), device=DEVICE).torch_dtype
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=dtype).to(DEVICE).eval()


def hf_inputs(prompt: Prompt, image_token_id: int, device: str = DEVICE) -> dict:
    """``generate()``/forward keyword arguments for ``prompt`` (our token ids and preprocessed pixels)."""
    ids = torch.tensor([prompt.token_ids], device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if prompt.images and prompt.images[0].grid_thw is not None:
        inputs["pixel_values"] = torch.cat([im.pixel_values for im in prompt.images]).to(device)
        inputs["image_grid_thw"] = torch.tensor([im.grid_thw for im in prompt.images], device=device)
        inputs["mm_token_type_ids"] = (ids == image_token_id).int()
    elif prompt.images:
        inputs["pixel_values"] = torch.stack([im.pixel_values for im in prompt.images]).to(device)
    return inputs


def hf_greedy(model, prompt: Prompt, image_token_id: int, max_new_tokens: int) -> list[int]:
    """Greedy continuation of ``prompt`` by ``model.generate``, up to ``max_new_tokens`` or the
    end-of-sequence token, which is included."""
    inputs = hf_inputs(prompt, image_token_id)
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
