"""A colocated server's /server_info (stages/colocated.py), in-process: the role, its parts, the
whole model's parameter count and the process's memory; and, from real ``stage serve colocated`` processes,
``engine``: the dtype and the KV pool, each with where it came from."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from process.ports import free_port
from stages.config import ServerConfig
from stages.engine.config import EngineConfig
from stages.engine.models import load_adapter
from tests.support.devices import DEVICE, on_gpu
from tests.support.generated_models import model_dir


def test_colocated_server_info_reports_the_whole_model_and_its_memory():
    from stages.colocated import build

    path = str(model_dir("qwen2_vl"))
    app = build(ServerConfig(role="colocated", engine=EngineConfig(model=path, kv_cache_mib=4, device=DEVICE)))
    with TestClient(app) as client:
        info = client.get("/server_info").json()
    assert (info["role"], info["parts"], info["images"]) == ("colocated", ["vision", "text"], "pixels")
    assert info["num_parameters"] == load_adapter(path, torch.float32, "sdpa").num_parameters
    assert info["rss_bytes"] > 0


def kv_bytes_per_token(path, itemsize: int) -> int:
    """Bytes of K and V of one token in every layer, from the checkpoint's config.json."""
    text = json.loads((path / "config.json").read_text())["text_config"]
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    return text["num_hidden_layers"] * 2 * text["num_key_value_heads"] * head_dim * itemsize


@pytest.fixture(scope="module")
def servers(start_server, tiny_model):
    path = tiny_model("qwen2_vl")
    return path, {"default": start_server("colocated", "--model", str(path)),
                  "explicit": start_server("colocated", "--model", str(path), "--dtype", "bfloat16",
                                           "--kv-cache-mib", "8"),
                  "pd": start_server("pd", "--model", str(path), "--kv-cache-mib", "8", "--transfer", "nixl",
                                     "--bootstrap-port", str(free_port()))}


def test_a_default_server_reports_the_auto_dtype_and_pool_and_why(servers):
    path, started = servers
    info = httpx.get(f"{started['default'].url}/server_info", timeout=10).json()
    block_bytes = kv_bytes_per_token(path, 4) * 16  # float32, 16 tokens a block
    # on a GPU conftest.launch gives test servers --kv-cache-mib 512: they share one GPU
    pool_source = "--kv-cache-mib 512" if on_gpu() else "cpu default 512 MiB"
    dtype_source = "auto: checkpoint dtype float32" if on_gpu() else "auto: cpu default"
    blocks = (512 << 20) // block_bytes
    assert info["engine"] == {"dtype": "float32", "dtype_source": dtype_source,
                              "kv_pool": {"blocks": blocks, "block_size": 16, "block_bytes": block_bytes,
                                          "bytes": blocks * block_bytes, "source": pool_source}}
    assert info["kv_blocks"]["total"] == blocks


def test_explicit_flags_win_and_are_named_as_the_source(servers):
    path, started = servers
    info = httpx.get(f"{started['explicit'].url}/server_info", timeout=10).json()
    block_bytes = kv_bytes_per_token(path, 2) * 16  # bfloat16
    blocks = (8 << 20) // block_bytes
    assert info["engine"] == {"dtype": "bfloat16", "dtype_source": "--dtype",
                              "kv_pool": {"blocks": blocks, "block_size": 16, "block_bytes": block_bytes,
                                          "bytes": blocks * block_bytes, "source": "--kv-cache-mib 8"}}
    assert info["kv_blocks"]["total"] == blocks
    answer = httpx.post(f"{started['explicit'].url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_a_switchable_worker_reports_its_engine_before_it_has_a_role(servers):
    path, started = servers
    info = httpx.get(f"{started['pd'].url}/server_info", timeout=10).json()
    block_bytes = kv_bytes_per_token(path, 4) * 16
    assert info["role"] is None and info["engine"]["kv_pool"] == {
        "blocks": (8 << 20) // block_bytes, "block_size": 16, "block_bytes": block_bytes,
        "bytes": (8 << 20) // block_bytes * block_bytes, "source": "--kv-cache-mib 8"}
    assert info["engine"]["dtype"] == info["fingerprint"]["dtype"] == "float32"
