"""A checkpoint's sampling defaults (``--generation-config auto|none``, vLLM's flag): the fields of its
``generation_config.json`` that a request which leaves them out is sampled with. Pure: no I/O
(``stages.loading`` reads the file).

    from_generation_config({"do_sample": True, "temperature": 0.7, "top_k": 1, ...}) -> GenerationDefaults
    GenerationDefaults(temperature=0.7, top_k=1).to_json() -> {"temperature": 0.7, "top_k": 1}

What is taken (vLLM's ``ModelConfig.get_diff_sampling_param``): ``temperature``, ``top_p``, ``top_k``,
``repetition_penalty`` and ``max_new_tokens`` (a request's ``max_tokens``), each only when the file sets
it; a field the file leaves out keeps the API's own default (temperature 1.0, no top-p or top-k, no
penalty), not transformers' ``generate()`` defaults. ``min_p`` is vLLM's too, but this engine has no
min-p: it is not taken, and ``ignored`` names it so the server can say so at start.

``do_sample``: ignored, as vLLM does; ``generate()`` is greedy when it is false (or unset). Decision:
vLLM's, for three reasons. Files saying ``"do_sample": false`` and no sampling field are common (every
checkpoint ``stage make-model`` writes is one): taking it would make greedy the default of every request
that leaves temperature out, silently replacing the OpenAI default of sampling at 1.0, which is not
what the flag is for. transformers itself refuses to save ``do_sample: false`` beside a temperature,
top_p or top_k (``GenerationConfig.validate``), so in a well-formed file that sets them ``do_sample`` is
true and ``generate()`` agrees with this server. And where a file does hold both,
``sampled_but_greedy`` says so and the server logs a warning (send ``temperature: 0`` for greedy).

``none`` is the behaviour before the flag: no defaults. A value a request could not set itself
(outside the API's ranges, or of the wrong type) is refused at start, naming the flag.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

GENERATION_CONFIGS = ("auto", "none")  # --generation-config
FILE = "generation_config.json"
_SAMPLED = ("temperature", "top_p", "top_k")  # used by generate() only when do_sample is true
_TAKEN = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # file's name -> API's
_IGNORED = ("min_p",)  # vLLM takes them; this engine cannot


@dataclass(frozen=True)
class GenerationDefaults:
    """The defaults a request's unset (None) sampling fields take; None: the API's own default.
    Ranges are the API's: temperature in [0, 2], top_p in (0, 1], top_k >= -1 (0 and -1: off),
    repetition_penalty in (0, 2], max_tokens >= 1."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        checks = {"temperature": lambda v: _number(v) and 0.0 <= v <= 2.0,
                  "top_p": lambda v: _number(v) and 0.0 < v <= 1.0,
                  "top_k": lambda v: _integer(v) and v >= -1,
                  "repetition_penalty": lambda v: _number(v) and 0.0 < v <= 2.0,
                  "max_tokens": lambda v: _integer(v) and v >= 1}
        for name, ok in checks.items():
            value = getattr(self, name)
            if value is not None and not ok(value):
                source = "max_new_tokens" if name == "max_tokens" else name
                raise ValueError(f"{FILE} sets {source} to {value!r}, which a request could not set "
                                 "(see the API's ranges); fix the file or start with --generation-config none")

    def to_json(self) -> dict[str, Any]:
        """The fields set, by the API's names (``/server_info`` ``generation_defaults``)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def key(self) -> str:
        """Canonical JSON of ``to_json()``: what a prefill and a decode compare (``transfer.fingerprint``)."""
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


def generation_info(mode: str, defaults: GenerationDefaults) -> dict[str, Any]:
    """``/server_info``'s ``generation_config`` (the flag) and ``generation_defaults`` (what applies)."""
    return {"generation_config": mode, "generation_defaults": defaults.to_json()}


def from_generation_config(config: Mapping[str, Any]) -> GenerationDefaults:
    """The defaults a parsed ``generation_config.json`` sets (see the module docstring); ValueError naming
    ``--generation-config`` for a value a request could not set."""
    return GenerationDefaults(**{api: config[name] for name, api in _TAKEN.items() if config.get(name) is not None})


def ignored(config: Mapping[str, Any]) -> tuple[str, ...]:
    """Fields vLLM would take from ``config`` that this server cannot apply (a warning at start)."""
    return tuple(name for name in _IGNORED if config.get(name) is not None)


def sampled_but_greedy(config: Mapping[str, Any]) -> tuple[str, ...]:
    """The sampling fields ``config`` sets beside ``"do_sample": false`` (applied here, as vLLM does,
    where ``generate()`` would decode greedily): a warning at start."""
    return tuple(name for name in _SAMPLED if config.get("do_sample") is False and config.get(name) is not None)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
