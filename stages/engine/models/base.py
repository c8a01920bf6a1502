"""The model adapter interface: what the engine needs from one model family.

An adapter wraps a loaded Hugging Face model and exposes its parts (token embedding, decoder
layers, rotary embedding, final norm, LM head, vision tower) plus the family's rules (how many
placeholder tokens an image fills, how positions are numbered). The engine never branches on the
family; adding a family is one adapter file registered in ``models/__init__.py``.

Parts: a model is two halves, ``"vision"`` (the vision tower and projector: ``vision_modules``)
and ``"text"`` (the language model and LM head: ``text_modules``). An adapter holds the parts its
role loaded (``parts``); the modules of the other half are None. The rules (``image_token_id``,
``num_image_tokens``, ``size_rule``, ``prefill_positions``) read only the config, so they hold
whichever half is loaded.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, cast

import torch
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

from contract.video import VideoPlan
from stages.engine.config import PARTS, TEXT, VISION
from stages.engine.multimodal import ImageEmbedding, ImageInput


class SizeRule(ABC):
    """What an image's (width, height) implies under one image processor config, without its pixels.
    Pure and cheap; built once by ``ModelAdapter.size_rule`` (the processor is not kept)."""

    @abstractmethod
    def num_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens the image fills: ``num_image_tokens`` of it after the image processor.
        ValueError for a size the processor refuses."""

    @abstractmethod
    def grid(self, width: int, height: int) -> tuple[int, int, int] | None:
        """Its ``grid_thw`` after the processor (None for families without one)."""


class TextModel(Protocol):
    """The decoder stack of a Hugging Face language model, as the runner drives it."""

    embed_tokens: nn.Module
    rotary_emb: nn.Module
    layers: nn.ModuleList
    norm: nn.Module


class VisionLanguageModel(Protocol):
    """The inner Hugging Face model (``model``) of a vision-language family, as the adapters call it."""

    def get_image_features(self, pixel_values: torch.Tensor, **kwargs: Any) -> BaseModelOutputWithPooling: ...


class ModelAdapter(ABC):
    family: ClassVar[str]
    model_types: ClassVar[tuple[str, ...]]  # config.model_type values this adapter serves
    vision_modules: ClassVar[tuple[str, ...]]  # dotted paths of the vision half in the HF model
    text_modules: ClassVar[tuple[str, ...]] = ("model.language_model", "lm_head")

    def __init__(self, model: PreTrainedModel, parts: tuple[str, ...] = PARTS) -> None:
        self.model = model
        self.parts = parts
        self.config: PretrainedConfig = model.config
        self.text_config: PretrainedConfig = model.config.get_text_config()

    @classmethod
    def modules_of(cls, parts: tuple[str, ...]) -> tuple[str, ...]:
        """The dotted module paths that make up ``parts``."""
        return tuple(path for part in parts for path in {VISION: cls.vision_modules, TEXT: cls.text_modules}[part])

    @property
    def device(self) -> torch.device:
        """Where the loaded weights are (``load_adapter``'s ``device``)."""
        return next(self.model.parameters()).device

    @property
    def num_parameters(self) -> int:
        """Parameters this adapter holds (the loaded parts only; a tied weight counts once)."""
        return sum(p.numel() for p in self.model.parameters())

    def vision_identity(self) -> dict:
        """Everything in the config that can shape an image embedding: the whole config except the
        language model's (for ``cache.keys.vision_fingerprint``)."""
        return {k: v for k, v in self.config.to_dict().items() if k != "text_config"}

    def vision_state(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters and buffers by name of everything but the language model (the vision tower,
        its projector and whatever else the model holds), for ``cache.keys.weights_digest``: the same
        list whether the model was loaded whole (a switchable worker) or vision only (an encoder)."""
        text = self.modules_of((TEXT,))
        return [(name, tensor) for name, tensor in self.model.state_dict().items()
                if not any(name == path or name.startswith(path + ".") for path in text)]

    def submodule(self, path: str) -> nn.Module:
        """The loaded module at the dotted ``path`` of the Hugging Face model."""
        return self.model.get_submodule(path)

    def image_features(self, pixel_values: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, BaseModelOutputWithPooling]:
        """The inner model's ``get_image_features``: the projected embeddings (its ``pooler_output``;
        RuntimeError if it returned none) and the whole output."""
        out = cast(VisionLanguageModel, self.submodule("model")).get_image_features(pixel_values, **kwargs)
        if out.pooler_output is None:
            raise RuntimeError(f"this {self.family} model's get_image_features returned no pooler_output")
        return out.pooler_output, out

    def _require(self, part: str) -> None:
        if part not in self.parts:
            raise RuntimeError(f"this {self.family} adapter was loaded without its {part} half (parts={self.parts})")

    # --- parts -----------------------------------------------------------------------------
    @property
    def text_model(self) -> TextModel:
        """The decoder stack (``model.language_model``): has ``embed_tokens``, ``layers``, ``norm``
        and ``rotary_emb``."""
        return cast(TextModel, self.submodule("model.language_model"))

    @property
    def lm_head(self) -> nn.Linear:
        """The output projection (a plain linear layer in every family served)."""
        head = self.submodule("lm_head")
        if not isinstance(head, nn.Linear):
            raise TypeError(f"this {self.family} model's lm_head is a {type(head).__name__}, not a Linear layer")
        return head

    @property
    @abstractmethod
    def image_token_id(self) -> int: ...

    @property
    def video_token_id(self) -> int | None:
        """The placeholder token of a video's frames; None: this family takes no video."""
        return None

    @property
    def video_rule(self) -> str | None:
        """The ``contract.video`` sampling rule of this family's video processor (None: no video)."""
        return None

    @property
    def timestamped_video(self) -> bool:
        """Whether the prompt writes a video frame by frame with ``<t seconds>`` before each temporal
        patch (Qwen3-VL) rather than as one run of placeholders."""
        return False

    @functools.cached_property
    def media_token_ids(self) -> frozenset[int]:
        """The placeholder tokens an image or a video fills: what the engine splices embeddings into."""
        video = self.video_token_id
        return frozenset([self.image_token_id] if video is None else [self.image_token_id, video])

    # --- rules -----------------------------------------------------------------------------
    @abstractmethod
    def num_image_tokens(self, image: ImageInput) -> int:
        """Placeholder tokens one preprocessed image fills in the prompt (from its pixel tensor's shape)."""

    @abstractmethod
    def size_rule(self, image_processor: Any) -> SizeRule:
        """The rule giving an image's token count and grid from its size under ``image_processor``'s
        config (the processor is read here, never called, and not kept by the rule)."""

    @abstractmethod
    def encode(self, images: list[ImageInput]) -> list[ImageEmbedding]:
        """Run the vision tower and projector; one embedding per image, in order."""

    def prefill_positions(self, token_ids: list[int], grids: list,
                          videos: list[VideoPlan | None]) -> tuple[torch.Tensor, int]:
        """Positions [rows, len] of a fresh prompt, on the CPU (host-side index arithmetic), and the rope
        delta (decode position = tokens so far + delta). ``grids`` and ``videos``: per item in prompt order,
        its grid and its video plan (None: an image). Default: plain 1-D positions 0..len-1, delta 0."""
        return torch.arange(len(token_ids), device="cpu").unsqueeze(0), 0

    @property
    def position_rows(self) -> int:
        return 1

    @property
    def deepstack_layers(self) -> int:
        """Deepstack feature rows an image embedding carries per token (``ImageEmbedding.deepstack``); 0: none."""
        return 0

    def layer_hook(self, layer: int, hidden: torch.Tensor, image_rows: torch.Tensor, embeddings: list[ImageEmbedding]) -> torch.Tensor:
        """Called after each decoder layer with the packed rows holding image tokens (Qwen3-VL deepstack)."""
        return hidden
