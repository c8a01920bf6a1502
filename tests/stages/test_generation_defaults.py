"""``--generation-config``: what a checkpoint's ``generation_config.json`` makes the default of each
sampling field (``stages.generation_defaults``), how those defaults merge with a request's own fields
(``stages.api``: only fields it leaves out, before the clamps), the prefill/decode fingerprint that
refuses a pair whose defaults differ, and the file read as the flag says (``stages.loading``)."""

from __future__ import annotations

import json

import pytest

from stages.api.chat import sampling_params as chat_params
from stages.api.completion_prompts import sampling_params as completion_params
from stages.api.completion_schema import parse_completion_request
from stages.api.schema_types import MIN_TEMPERATURE, MIN_TOP_P
from stages.api.schemas import ChatCompletionRequest
from stages.generation_defaults import (GenerationDefaults, from_generation_config, generation_info, ignored,
                                         sampled_but_greedy)
from stages.loading import generation_defaults
from transfer.fingerprint import Fingerprint, check_compatible

pytestmark = pytest.mark.unit
QWEN_VL = {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "repetition_penalty": 1.05,
           "temperature": 0.01, "top_k": 1, "top_p": 0.001}  # Qwen2-VL-7B-Instruct's file, as shipped
HI = [{"role": "user", "content": "hi"}]


def chat(defaults: GenerationDefaults, prompt_len: int = 4, max_model_len: int = 64, **fields):
    request = ChatCompletionRequest.model_validate({"messages": HI, **fields})
    return chat_params(request, prompt_len, max_model_len, vocab_size=100, defaults=defaults)


def test_the_sampling_fields_vllm_takes_and_no_others():
    config = {**QWEN_VL, "max_new_tokens": 512, "min_p": 0.1, "no_repeat_ngram_size": 3, "max_length": 100}
    defaults = from_generation_config(config)
    assert defaults.to_json() == {"temperature": 0.01, "top_p": 0.001, "top_k": 1, "repetition_penalty": 1.05,
                                  "max_tokens": 512}
    assert ignored(config) == ("min_p",) and ignored(QWEN_VL) == ()


def test_a_file_without_sampling_fields_sets_no_default():
    assert from_generation_config({"bos_token_id": 1, "eos_token_id": 2}) == GenerationDefaults()
    assert from_generation_config({"do_sample": True}).to_json() == {}


def test_do_sample_is_ignored_as_vllm_does_and_a_conflict_is_named():
    """``do_sample: false`` alone (as every generated checkpoint has it) sets no default: requests that
    leave temperature out still sample at 1.0. Beside sampling fields they apply, and are named."""
    assert from_generation_config({"do_sample": False, "bos_token_id": 0}) == GenerationDefaults()
    config = {"do_sample": False, "temperature": 0.7, "top_k": 5, "repetition_penalty": 1.2}
    assert from_generation_config(config).to_json() == {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.2}
    assert sampled_but_greedy(config) == ("temperature", "top_k")
    assert sampled_but_greedy({**config, "do_sample": True}) == sampled_but_greedy({"temperature": 0.7}) == ()


@pytest.mark.parametrize("field, value", [("temperature", 3.0), ("temperature", -1), ("top_p", 0), ("top_k", -2),
                                          ("top_k", 1.5), ("repetition_penalty", 0), ("max_new_tokens", 0),
                                          ("temperature", "hot"), ("top_k", True)])
def test_a_value_a_request_could_not_set_is_refused_naming_the_flag(field, value):
    with pytest.raises(ValueError, match=f"sets {field} to .*--generation-config none"):
        from_generation_config({"do_sample": True, field: value})


def test_defaults_fill_only_what_the_request_leaves_out():
    defaults = GenerationDefaults(temperature=0.7, top_p=0.8, top_k=5, repetition_penalty=1.5)
    left_out = chat(defaults)
    assert (left_out.temperature, left_out.top_p, left_out.top_k, left_out.repetition_penalty) == (0.7, 0.8, 5, 1.5)
    given = chat(defaults, temperature=0, top_p=1.0, top_k=-1, repetition_penalty=1.0)
    assert (given.temperature, given.top_p, given.top_k, given.repetition_penalty) == (0.0, 1.0, 0, 1.0)


def test_without_defaults_the_api_defaults_stand():
    params = chat(GenerationDefaults())
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty) == (1.0, 1.0, 0, 1.0)


def test_defaults_go_through_the_clamps_a_request_does():
    params = chat(from_generation_config({**QWEN_VL, "temperature": 1e-6, "top_p": 1e-9}))
    assert (params.temperature, params.top_p, params.top_k) == (MIN_TEMPERATURE, MIN_TOP_P, 1)
    assert chat(GenerationDefaults(top_k=1000)).top_k == 0  # at or above the vocabulary: off, as a request's


def test_max_new_tokens_is_the_default_max_tokens_within_the_context():
    defaults = GenerationDefaults(max_tokens=10)
    assert chat(defaults).max_tokens == 10
    assert chat(defaults, prompt_len=60).max_tokens == 4  # what is left of the context, if fewer
    assert chat(defaults, max_tokens=20).max_tokens == chat(defaults, max_completion_tokens=20).max_tokens == 20
    assert chat(GenerationDefaults()).max_tokens == 60  # the context's rest, as before
    body = parse_completion_request(b'{"prompt": "x"}')
    assert completion_params(body, 100, left=50, defaults=defaults).max_tokens == 10
    assert completion_params(body, 100, left=3, defaults=defaults).max_tokens == 3
    assert completion_params(body, 100, left=50).max_tokens == 16  # OpenAI's default without one
    given = parse_completion_request(b'{"prompt": "x", "max_tokens": 30}')
    assert completion_params(given, 100, left=50, defaults=defaults).max_tokens == 30


def test_completions_take_the_sampling_defaults_too():
    params = completion_params(parse_completion_request(b'{"prompt": "x", "top_k": 3}'), 100,
                               defaults=GenerationDefaults(temperature=0.5, top_k=1, repetition_penalty=1.3))
    assert (params.temperature, params.top_k, params.repetition_penalty) == (0.5, 3, 1.3)


def test_server_info_and_fingerprint_forms():
    defaults = GenerationDefaults(top_k=1, temperature=0.7)
    assert generation_info("auto", defaults) == {"generation_config": "auto",
                                                 "generation_defaults": {"temperature": 0.7, "top_k": 1}}
    assert defaults.key() == '{"temperature":0.7,"top_k":1}' and GenerationDefaults().key() == "{}"


def test_a_pair_whose_sampling_defaults_differ_is_refused_naming_the_flag():
    kv = dict(model="qwen2_vl-0", backend="mooncake", dtype="float32", block_size=16, num_layers=2,
              num_kv_heads=2, head_dim=8, block_bytes=1024)
    auto = Fingerprint(**kv, generation_defaults=GenerationDefaults(temperature=0.7).key())
    none = Fingerprint(**kv, generation_defaults=GenerationDefaults().key())
    assert check_compatible(auto, auto) is None and check_compatible(none, Fingerprint(**kv)) is None
    reason = check_compatible(auto, none)
    assert reason == ('sampling defaults differ: prefill {"temperature":0.7}, decode {}; start both with the same '
                      "--generation-config (and the same generation_config.json in the checkpoint)")


def test_the_file_is_read_as_the_flag_says(tmp_path):
    assert generation_defaults(tmp_path, "auto") == GenerationDefaults()  # no file: no defaults
    (tmp_path / "generation_config.json").write_text(json.dumps(QWEN_VL))
    assert generation_defaults(tmp_path, "auto") == from_generation_config(QWEN_VL)
    assert generation_defaults(tmp_path, "none") == GenerationDefaults()
    (tmp_path / "generation_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="not a JSON object; fix the file or start with --generation-config none"):
        generation_defaults(tmp_path, "auto")
    (tmp_path / "generation_config.json").write_text("{")
    with pytest.raises(ValueError, match="--generation-config none"):
        generation_defaults(tmp_path, "auto")


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode", "pd"])
def test_the_flag_defaults_to_auto_and_reaches_the_engine_config(role):
    from cli import build_parser
    from cli.serve import server_config

    def engine(*flags: str):
        return server_config(build_parser().parse_args(["serve", role, "--model", "/m", *flags]), role).engine

    assert engine().generation_config == "auto"
    assert engine("--generation-config", "none").generation_config == "none"
    with pytest.raises(SystemExit):  # argparse: not one of the choices
        engine("--generation-config", "vllm")


def test_the_engine_config_refuses_another_value_naming_the_flag():
    from stages.engine.config import EngineConfig

    with pytest.raises(ValueError, match="--generation-config must be one of"):
        EngineConfig(model="/m", generation_config="path/to/dir")
