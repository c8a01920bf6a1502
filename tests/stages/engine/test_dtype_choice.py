"""``--dtype auto``: what the checkpoint states, what each device gets, and the flag in every error."""

from __future__ import annotations

import json

import pytest

from stages.engine.config import EngineConfig
from stages.engine.dtype_choice import DTypeChoice, choose_dtype, read_stated_dtype, stated_dtype

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("config, expected", [
    ({"dtype": "bfloat16"}, "bfloat16"),  # transformers 5
    ({"torch_dtype": "float16"}, "float16"),  # transformers 4
    ({"torch_dtype": "torch.bfloat16"}, "bfloat16"),  # old repr spelling
    ({"dtype": "bfloat16", "torch_dtype": "float16"}, "bfloat16"),  # the new name first
    ({"text_config": {"torch_dtype": "bfloat16"}}, "bfloat16"),  # a VLM stating it in its text half only
    ({"dtype": "float32", "text_config": {"dtype": "bfloat16"}}, "float32"),  # top level wins
    ({"dtype": "auto", "text_config": {"dtype": "float16"}}, "float16"),  # "auto" states nothing
    ({"torch_dtype": "half"}, "float16"),
    ({"dtype": "float64"}, "float64"),  # reported as stated; choose_dtype refuses it
    ({}, None),
    ({"dtype": None, "text_config": None}, None),
])
def test_stated_dtype_reads_every_place_a_checkpoint_puts_it(config, expected):
    assert stated_dtype(config) == expected


@pytest.mark.parametrize("flag, stated, device, expected", [
    ("bfloat16", "float32", "cuda", DTypeChoice("bfloat16", "--dtype")),
    ("float16", None, "cpu", DTypeChoice("float16", "--dtype")),
    ("auto", "bfloat16", "cuda", DTypeChoice("bfloat16", "auto: checkpoint dtype bfloat16")),
    ("auto", "float32", "cuda", DTypeChoice("float32", "auto: checkpoint dtype float32")),
    ("auto", None, "cuda", DTypeChoice("float32", "auto: checkpoint states none, float32")),
    ("auto", "bfloat16", "cpu", DTypeChoice("float32", "auto: cpu default")),
    ("auto", "float64", "cpu", DTypeChoice("float32", "auto: cpu default")),  # the CPU never reads it
])
def test_choose_dtype(flag, stated, device, expected):
    assert choose_dtype(flag, stated, device) == expected


def test_a_checkpoint_dtype_the_engine_does_not_run_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--dtype auto: the checkpoint's dtype is float64, which the engine does "
                                         r"not run; pass --dtype with one of \['bfloat16', 'float16', 'float32'\]$"):
        choose_dtype("auto", "float64", "cuda")


def test_an_unknown_dtype_flag_is_refused_by_the_config():
    with pytest.raises(ValueError, match=r"^--dtype must be auto or one of \['bfloat16', 'float16', 'float32'\], "
                                         r"got 'float64'$"):
        EngineConfig(model="/m", dtype="float64")


def test_the_config_reads_the_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    assert read_stated_dtype(tmp_path) == "bfloat16"
    assert read_stated_dtype(tmp_path / "missing") is None
    assert EngineConfig(model=str(tmp_path)).dtype == "auto"  # the default
    assert EngineConfig(model=str(tmp_path), device="cpu").dtype_choice == DTypeChoice("float32", "auto: cpu default")
    assert EngineConfig(model=str(tmp_path), dtype="float16", device="cpu").dtype_choice.name == "float16"
