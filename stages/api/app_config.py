"""What ``routes.create_app`` builds a stage's HTTP layer from: ``AppConfig``, the values (the model's
name, the server's limits and role), and ``AppParts``, the live objects (the engine, the request
pipeline, the process's metrics and supervisor). ``app_config`` composes the values of a
stage server from its ``ServerConfig`` and its prompt builder.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stages.api.chat_response import TokenText
from stages.api.errors import Stage
from stages.api.lifetime import Generate
from stages.api.sampling import NO_DEFAULTS
from stages.api.schemas import ChatCompletionRequest
from stages.api.token_text import TokenText as TokenizerText
from stages.api.token_text import token_id_text
from stages.config import ServerConfig
from stages.engine.async_engine import AsyncEngine
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.generation_defaults import GenerationDefaults
from stages.metrics import Metrics
from stages.supervisor import Supervisor

if TYPE_CHECKING:
    from stages.prompt import PromptBuilder

Prepare = Callable[[ChatCompletionRequest], tuple[Prompt, SamplingParams]]  # stages.api.chat.Preparer and its kin


@dataclass(frozen=True)
class AppConfig:
    """``model_name``: what ``/v1/models`` lists and requests must name. ``stage``: the server's role,
    the ``stage`` field of every error it answers (``stages.api.errors.stamped``). Admission: at most
    ``max_in_flight`` requests held at once; bodies over ``max_body_bytes`` get 413; with
    ``chars_per_token`` (the prompt builder's), messages whose text cannot fit the context get 400
    before they are built (``stages.api.parse``). A stream silent for ``stream_keepalive_s`` sends a
    keep-alive comment. ``generation_defaults``: the checkpoint's sampling defaults (the prompt
    builder's, ``stages.generation_defaults``), for the fields a ``/v1/completions`` request leaves out
    (chat's ``Preparer`` reads the same from the builder)."""

    model_name: str
    stage: Stage = None
    owned_by: str = "epd-stage"
    max_body_bytes: int = 64 << 20
    max_in_flight: int = 512
    chars_per_token: int | None = None
    stream_keepalive_s: float = 2.0
    generation_defaults: GenerationDefaults = NO_DEFAULTS


@dataclass(frozen=True)
class AppParts:
    """``prepare`` turns a request body into the prompt and sampling parameters (on a worker thread;
    ``stages.api.chat``). ``generate`` (``stages.api.lifetime.Generate``; default: the engine runs the
    request whole) makes every check that needs no progress of the engine and returns the request's
    outputs; prefill and decode servers pass their room coordinator's. ``lifespan``: starts and stops
    the engine (else the caller does). ``tokenizer``: the model's (the prompt builder's); it reads
    ``/v1/completions``' text prompts and names the tokens in ``logprobs`` (``token_id:N`` without one)."""

    engine: AsyncEngine
    prepare: Prepare
    generate: Generate | None = None
    metrics: Metrics = field(default_factory=Metrics)
    supervisor: Supervisor = field(default_factory=Supervisor)
    lifespan: Any = None
    tokenizer: Any = None

    def token_text(self) -> TokenText:
        """How a token id reads in an answer's ``logprobs``: ``token_id:N`` without a tokenizer."""
        return token_id_text if self.tokenizer is None else TokenizerText(self.tokenizer)


def app_config(config: ServerConfig, prompts: PromptBuilder, stage: Stage) -> AppConfig:
    """The HTTP layer's values for a stage server of role ``stage`` that builds its prompts with ``prompts``."""
    return AppConfig(config.model_name, stage=stage, max_body_bytes=config.max_body_bytes,
                     max_in_flight=config.max_in_flight, chars_per_token=prompts.chars_per_token,
                     stream_keepalive_s=config.stream_keepalive_s, generation_defaults=prompts.defaults)
