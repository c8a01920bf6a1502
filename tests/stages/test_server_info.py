"""A colocated server's /server_info (stages/colocated.py), in-process: the role, its parts, the
whole model's parameter count and the process's memory."""

from __future__ import annotations

import torch
from fastapi.testclient import TestClient

from stages.config import ServerConfig
from stages.engine.config import EngineConfig
from stages.engine.models import load_adapter
from tests.support.devices import DEVICE
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
