"""From a ``CompletionRequest`` to what the engine runs: one ``Prompt`` per prompt (text tokenized
without any chat template, or the token ids as given) and one ``SamplingParams`` for them all.

Refused with a 400 naming the parameter: an empty prompt, a token id outside the model's vocabulary,
a prompt that holds image placeholder tokens (no image fills them), a prompt plus ``max_tokens`` over
the context, a ``logit_bias`` key that is not a token id. ``echo`` with ``logprobs`` asks the engine
for the prompt's logprobs too (``SamplingParams.prompt_logprobs``, same k).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from stages.api.chat import EngineLimits
from stages.api.completion_schema import CompletionRequest
from stages.api.errors import bad_request
from stages.api.schemas import MIN_TEMPERATURE, MIN_TOP_P
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class Prepared:
    prompts: list[Prompt]
    texts: list[str]  # each prompt's text (what echo prepends)
    params: SamplingParams


def prepare_completion(request: CompletionRequest, tokenizer: Any, engine: EngineLimits) -> Prepared:
    """Everything CPU-bound before the request is queued (tokenization); run it off the event loop."""
    prompts, texts = [], []
    for i, given in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
        if isinstance(given, str):
            ids, text = tokenizer(given, add_special_tokens=True)["input_ids"], given
        else:
            ids, text = list(given), None
        if not ids:
            raise bad_request("The prompt makes no tokens.", param, "invalid_value")
        if (bad := next((t for t in ids if not 0 <= t < engine.vocab_size), None)) is not None:
            raise bad_request(f"Token id {bad} is outside the model's vocabulary (0 to {engine.vocab_size - 1}).",
                              param, "invalid_value")
        prompts.append(Prompt(token_ids=ids))
        texts.append(text if text is not None else tokenizer.decode(ids))
    params = sampling_params(request, engine.vocab_size)
    for i, prompt in enumerate(prompts):
        try:
            engine.check_request(prompt, params)
        except ValueError as exc:
            too_long = len(prompt.token_ids) + params.max_tokens > engine.max_model_len
            raise bad_request(str(exc).replace("in the messages", "in the prompt"),
                              "max_tokens" if too_long and len(prompt.token_ids) < engine.max_model_len else
                              "prompt" if len(prompts) == 1 else f"prompt[{i}]",
                              "context_length_exceeded" if too_long else "invalid_value") from None
    return Prepared(prompts, texts, params)


def sampling_params(request: CompletionRequest, vocab_size: int) -> SamplingParams:
    """The request's sampling, with the clamps its schema documents (as chat's)."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_k = request.top_k or 0
    echo_logprobs = request.logprobs if request.echo else None
    try:
        return SamplingParams(
            max_tokens=request.max_tokens or 16,
            temperature=max(temperature, MIN_TEMPERATURE) if temperature > 0 else 0.0,
            top_p=1.0 if request.top_p is None else max(request.top_p, MIN_TOP_P),
            top_k=top_k if 0 < top_k < vocab_size else 0,
            seed=request.seed,
            stop=request.stop_strings,
            ignore_eos=bool(request.ignore_eos),
            n=request.choices_per_prompt,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            logprobs=request.logprobs,
            prompt_logprobs=echo_logprobs,
        )
    except ValueError as exc:
        raise bad_request(str(exc), None, "invalid_value") from None


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """``{"123": 5.0}`` -> ``((123, 5.0),)``; 400 naming ``logit_bias`` for a key that is no token id."""
    pairs = []
    for key, value in (bias or {}).items():
        token = int(key) if key.isascii() and key.isdigit() else -1
        if not 0 <= token < vocab_size:
            raise bad_request(f"Invalid value for 'logit_bias': {key[:32]!r} is not a token id of this model "
                              f"(0 to {vocab_size - 1}).", "logit_bias", "invalid_value")
        pairs.append((token, value))
    return tuple(pairs)
