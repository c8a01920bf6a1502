"""One real colocated server per test module (the tiny generated Qwen2-VL model, served as ``MODEL``)
and the official openai client on it, for the modules that check answers against Hugging Face.

Import the fixtures a test module uses by name (pytest finds fixtures in a module's namespace):

    from tests.support.colocated_openai import MODEL, TOLERANCE, client, model_dir, server  # noqa: F401

``model_dir``  (module scope) the model's checkpoint directory.
``server``     (module scope) ``stage serve colocated`` on it: one thread, 16 MiB of KV, 512 tokens.
``client``     (module scope) an ``openai.OpenAI`` on ``server``, no retries, 60 s timeout.
"""

from __future__ import annotations

from pathlib import Path

import openai
import pytest

MODEL = "tiny-vl"
TOLERANCE = 1e-4  # logprobs against Hugging Face's log_softmax


@pytest.fixture(scope="module")
def model_dir(tiny_model) -> Path:
    return tiny_model("qwen2_vl")


@pytest.fixture(scope="module")
def server(start_server, model_dir):
    return start_server("colocated", "--model", str(model_dir), "--served-model-name", MODEL,
                        "--max-model-len", "512", "--kv-cache-mib", "16", "--threads", "1")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
