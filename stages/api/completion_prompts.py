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

from contract.errors import Code
from stages.api.chat import EngineLimits
from stages.api.completion_schema import CompletionRequest
from stages.api.errors import bad_request
from stages.api.sampling import NO_DEFAULTS, with_defaults
from stages.api.sampling import sampling_params as shared_sampling_params
from stages.engine.multimodal import Prompt
from stages.engine.sampling_params import SamplingParams
from stages.generation_defaults import GenerationDefaults


@dataclass(frozen=True)
class Prepared:
    prompts: list[Prompt]
    texts: list[str]  # each prompt's text (what echo prepends)
    params: SamplingParams


def prepare_completion(request: CompletionRequest, tokenizer: Any, engine: EngineLimits,
                       defaults: GenerationDefaults = NO_DEFAULTS) -> Prepared:
    """Everything CPU-bound before the request is queued (tokenization); run it off the event loop.
    ``defaults``: the checkpoint's sampling defaults (``stages.generation_defaults``)."""
    prompts, texts = [], []
    for i, given in enumerate(request.prompts):
        param = "prompt" if len(request.prompts) == 1 else f"prompt[{i}]"
        if isinstance(given, str):
            ids, text = tokenizer(given, add_special_tokens=True)["input_ids"], given
        else:
            ids, text = list(given), None
        if not ids:
            raise bad_request("The prompt makes no tokens.", param, Code.INVALID_VALUE)
        if (bad := next((t for t in ids if not 0 <= t < engine.vocab_size), None)) is not None:
            raise bad_request(f"Token id {bad} is outside the model's vocabulary (0 to {engine.vocab_size - 1}).",
                              param, Code.INVALID_VALUE)
        prompts.append(Prompt(token_ids=ids))
        texts.append(text if text is not None else tokenizer.decode(ids))
    longest = max(len(prompt.token_ids) for prompt in prompts)
    params = sampling_params(request, engine.vocab_size, max(1, engine.max_model_len - longest), defaults)
    for i, prompt in enumerate(prompts):
        try:
            engine.check_request(prompt, params)
        except ValueError as exc:
            too_long = len(prompt.token_ids) + params.max_tokens > engine.max_model_len
            raise bad_request(str(exc).replace("in the messages", "in the prompt"),
                              "max_tokens" if too_long and len(prompt.token_ids) < engine.max_model_len else
                              "prompt" if len(prompts) == 1 else f"prompt[{i}]",
                              Code.CONTEXT_LENGTH_EXCEEDED if too_long else Code.INVALID_VALUE) from None
    return Prepared(prompts, texts, params)


def sampling_params(request: CompletionRequest, vocab_size: int, left: int | None = None,
                    defaults: GenerationDefaults = NO_DEFAULTS) -> SamplingParams:
    """The request's sampling (``stages.api.sampling``, with the checkpoint's ``defaults`` for the
    fields it leaves out): ``max_tokens`` 16 unless given (as OpenAI), or the checkpoint's
    ``max_new_tokens`` if it sets one, then at most ``left`` (what the longest prompt leaves of the
    context: a default never makes a request too long); ``echo`` with ``logprobs`` asks for the
    prompt's logprobs too."""
    asked = request.max_tokens if "max_tokens" in request.model_fields_set else None  # the schema fills in 16
    default = 16 if defaults.max_tokens is None else min(defaults.max_tokens, left or defaults.max_tokens)
    max_tokens = asked or default
    return shared_sampling_params(with_defaults(request, defaults), vocab_size, max_tokens=max_tokens,
                                  logprobs=request.logprobs, prompt_logprobs=request.logprobs if request.echo else None)
