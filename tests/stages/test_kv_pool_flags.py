"""``--dtype``, ``--kv-cache-mib`` and ``--gpu-memory-utilization`` from the command line to ``EngineConfig``:
defaults, validation naming the flag, and which roles take them."""

from __future__ import annotations

import pytest

from cli import build_parser
from cli.serve import server_config

pytestmark = pytest.mark.unit


def engine(role: str, *flags: str):
    extra = ["--redis-url", "redis://127.0.0.1:1/0"] if role == "encoder" else []
    return server_config(build_parser().parse_args(["serve", role, "--model", "/m", *extra, *flags]), role).engine


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode", "pd"])
def test_kv_roles_default_to_auto_dtype_and_an_automatic_pool(role):
    config = engine(role)
    assert (config.dtype, config.kv_cache_mib, config.gpu_memory_utilization) == ("auto", None, 0.9)
    config = engine(role, "--dtype", "bfloat16", "--kv-cache-mib", "64", "--gpu-memory-utilization", "0.45")
    assert (config.dtype, config.kv_cache_mib, config.gpu_memory_utilization) == ("bfloat16", 64, 0.45)


def test_the_encoder_takes_dtype_but_has_no_pool_flags():
    assert engine("encoder", "--dtype", "float16").dtype == "float16"
    assert engine("encoder").dtype == "auto"
    with pytest.raises(SystemExit):
        engine("encoder", "--gpu-memory-utilization", "0.5")


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_a_utilization_outside_zero_to_one_is_refused_naming_the_flag(value):
    with pytest.raises(ValueError, match=rf"^--gpu-memory-utilization must be in \(0, 1\], got {float(value)}$"):
        engine("colocated", "--gpu-memory-utilization", value)


def test_a_zero_pool_is_refused_naming_the_flag():
    with pytest.raises(ValueError, match=r"^--kv-cache-mib must be > 0, got 0$"):
        engine("decode", "--kv-cache-mib", "0")
