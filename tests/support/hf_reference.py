"""Hugging Face ``generate()`` on the same checkpoint and the same prompt: the reference for parity."""

from __future__ import annotations

import inspect

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


def hf_inputs(prompt: Prompt, image_token_id: int, device: str = DEVICE, video_token_id: int | None = None) -> dict:
    """``generate()``/forward keyword arguments for ``prompt`` (our token ids and preprocessed pixels): a
    Qwen prompt's videos (``prompt.videos``) as ``pixel_values_videos`` with their grids, token type 2 and
    (for Qwen2.5-VL, which ``hf_greedy`` keeps) each one's seconds per temporal patch."""
    ids = torch.tensor([prompt.token_ids], device=device)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    plans = prompt.video_plans
    images = [im for im, plan in zip(prompt.images, plans) if plan is None]
    videos = [im for im, plan in zip(prompt.images, plans) if plan is not None]
    if prompt.images and prompt.images[0].grid_thw is not None:
        types = (ids == image_token_id).int()
        if images:
            inputs["pixel_values"] = torch.cat([im.pixel_values for im in images]).to(device)
            inputs["image_grid_thw"] = torch.tensor([im.grid_thw for im in images], device=device)
        if videos:
            assert video_token_id is not None, "a prompt with videos needs the video token"
            types = types + 2 * (ids == video_token_id).int()
            inputs["pixel_values_videos"] = torch.cat([im.pixel_values for im in videos]).to(device)
            inputs["video_grid_thw"] = torch.tensor([im.grid_thw for im in videos], device=device)
            inputs["second_per_grid_ts"] = torch.tensor([plan.seconds_per_grid for plan in plans if plan is not None],
                                                        device=device)
        inputs["mm_token_type_ids"] = types
    elif prompt.images:
        inputs["pixel_values"] = torch.stack([im.pixel_values for im in prompt.images]).to(device)
    return inputs


def hf_greedy(model, prompt: Prompt, image_token_id: int, max_new_tokens: int,
              video_token_id: int | None = None) -> list[int]:
    """Greedy continuation of ``prompt`` by ``model.generate``, up to ``max_new_tokens`` or the
    end-of-sequence token, which is included."""
    inputs = hf_inputs(prompt, image_token_id, video_token_id=video_token_id)
    if "second_per_grid_ts" in inputs and "second_per_grid_ts" not in inspect.signature(model.forward).parameters:
        del inputs["second_per_grid_ts"]  # absolute time is Qwen2.5-VL's alone
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()
