"""A request's ``SamplingParams`` from the fields chat and legacy completions share, with the clamps
their schemas document. Each route adds what only it knows: how many tokens at most, which logprobs,
a grammar. A field the request leaves out (None) takes the checkpoint's default
(``with_defaults``: ``stages.generation_defaults``, ``--generation-config``) before the clamps, else
the API's own.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

from pydantic import BaseModel

from contract.errors import Code
from stages.api.errors import bad_request
from stages.api.schema_types import MIN_REPETITION_PENALTY, MIN_TEMPERATURE, MIN_TOP_P
from stages.engine.guide import Guide
from stages.engine.sampling_params import SamplingParams
from stages.generation_defaults import GenerationDefaults

NO_DEFAULTS = GenerationDefaults()  # --generation-config none, or a checkpoint that sets none
SAMPLED_DEFAULTS = ("temperature", "top_p", "top_k", "repetition_penalty")  # what with_defaults fills in
_R = TypeVar("_R", bound=BaseModel)


class SamplingFields(Protocol):
    """The sampling fields of ``ChatCompletionRequest`` and ``CompletionRequest``."""

    temperature: float | None
    top_p: float | None
    top_k: int | None
    seed: int | None
    ignore_eos: bool | None
    n: int | None
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    logit_bias: dict[str, float] | None

    @property
    def stop_strings(self) -> tuple[str, ...]: ...


def with_defaults(request: _R, defaults: GenerationDefaults) -> _R:
    """``request`` with each of ``temperature``, ``top_p``, ``top_k`` and ``repetition_penalty`` it
    leaves out (None) set to ``defaults``' (the checkpoint's; validated at start), a copy if any is;
    ``sampling_params`` then clamps them as a request's own. ``max_tokens`` is each route's to default."""
    unset = {name: value for name, value in defaults.to_json().items()
             if name in SAMPLED_DEFAULTS and getattr(request, name) is None}
    return request.model_copy(update=unset) if unset else request


def sampling_params(request: SamplingFields, vocab_size: int, *, max_tokens: int, logprobs: int | None,
                    prompt_logprobs: int | None = None, guide: Guide | None = None) -> SamplingParams:
    """A field the request leaves out takes the API's default (``with_defaults`` first, for the
    checkpoint's): temperature 1.0, top_p 1.0, no top-k, repetition_penalty 1.0. A sampled temperature
    below ``MIN_TEMPERATURE``, a top_p below ``MIN_TOP_P`` and a repetition_penalty below
    ``MIN_REPETITION_PENALTY`` are raised to them (smaller ones overflow the logits); a top_k of -1, or
    at or above the vocabulary size, disables top-k (0). 400 naming ``logit_bias`` for a key that is no
    token id of this model; 400 for what ``SamplingParams`` refuses."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = request.top_k or 0
    repetition_penalty = 1.0 if request.repetition_penalty is None else request.repetition_penalty
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0,
            top_p=max(top_p, MIN_TOP_P),
            top_k=top_k if 0 < top_k < vocab_size else 0,
            seed=request.seed,
            stop=request.stop_strings,
            ignore_eos=bool(request.ignore_eos),
            n=request.n or 1,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=max(repetition_penalty, MIN_REPETITION_PENALTY),
            logit_bias=logit_bias(request.logit_bias, vocab_size),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            guide=guide,
        )
    except ValueError as exc:
        raise bad_request(str(exc), None, Code.INVALID_VALUE) from None


def logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"123": 5.0}`` -> ``((123, 5.0),)``; 400 naming ``logit_bias`` for a key that is no token id."""
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"Invalid key in 'logit_bias': {key[:32]}. This model's token ids are 0 to "
                              f"{vocab_size - 1}.", "logit_bias", Code.INVALID_VALUE)
        pairs.append((token, value))
    return tuple(pairs)
