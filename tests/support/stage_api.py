"""Helpers for the stage API's in-process tests (no model, no server): PNG bytes and data URLs,
a request built from fields, the APIError a call raises, and the app (``client_for``) over a
scripted fake engine (``FakeAsyncEngine``, ``scripted``) with its answers read back (``chat``,
``error_of``, ``sse_events``)."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import zlib

import pytest
import torch
from fastapi.testclient import TestClient
from PIL import Image

from stages.api.chat import ImageMode, Preparer
from stages.api.errors import APIError
from stages.api.images import ImageLimits
from stages.api.app_config import AppConfig, AppParts
from stages.api.routes import create_app
from stages.api.schemas import ChatCompletionRequest
from stages.engine.outputs import EngineStats
from stages.engine.outputs import RequestOutput
from stages.engine.multimodal import ImageInput, Prompt
from stages.engine.request import FinishReason
from stages.metrics import Metrics
from stages.generation_defaults import GenerationDefaults

MODEL = "tiny-test"


def png(width: int = 8, height: int = 6, color: tuple = (200, 10, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG signature and IHDR claiming width x height, with no pixel data at all."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    return b"\x89PNG\r\n\x1a\n" + ihdr + chunk(b"IEND", b"")


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def request(**fields) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hi"}])
    return ChatCompletionRequest.model_validate(fields)


def raises_api_error(fn, *args, **kwargs) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args, **kwargs)
    return info.value


LIMITS = ImageLimits(max_images=3, max_pixels=10_000, max_bytes=4_000)


class FakeEngine:
    """The prompt builder and engine limits ``chat.Preparer`` uses: a prompt of 4 tokens + 10 per image;
    ``built``: each prompt's messages and the images preprocessed for it. Its prefix cache holds nothing."""

    max_model_len = 64
    vocab_size = 1000
    guides = None  # compiles no grammar
    defaults = GenerationDefaults()  # the checkpoint sets no sampling default

    def __init__(self) -> None:
        self.built: list[tuple[list, list]] = []

    def build_from_sizes(self, messages: list[dict], sizes: list) -> Prompt:
        self.built.append((messages, []))
        return Prompt(token_ids=[1] * (4 + 10 * len(sizes)), image_tokens=[10] * len(sizes))

    def image_grid(self, width: int, height: int) -> None:
        return None

    def preprocess_item(self, image: Image.Image) -> ImageInput:
        self.built[-1][1].append(image)
        return ImageInput(torch.zeros(3, 2, 2), None, 10)

    def prefix_hint(self, prompt: Prompt) -> int:
        return 0

    def num_image_tokens(self, width: int, height: int) -> int:
        if max(width, height) > 200 * min(width, height):
            raise ValueError(f"absolute aspect ratio must be smaller than 200, got {max(width, height) / min(width, height)}")
        return 10

    def check_request(self, prompt: Prompt, params) -> None:
        total = len(prompt.token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(f"This model's maximum context length is {self.max_model_len} tokens; asked {total}")


def scripted(*pieces: str, reason: FinishReason = FinishReason.STOP, error: str | None = None):
    def script(request_id: str, prompt: Prompt):
        n = len(prompt.token_ids)
        for i, text in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput(request_id, text, [i], reason if last else None, n, i + 1, error if last else None)
    return script


class FakeAsyncEngine:
    def __init__(self, script=scripted("Hel", "lo", " world")) -> None:
        self.engine = FakeEngine()
        self.alive = True
        self.script = script
        self.params: list = []
        self.aborted: list[str] = []
        self.hang = False

    def stats(self) -> EngineStats:
        return EngineStats(waiting=2, running=3, blocks_used=5, blocks_total=100)

    async def generate(self, request_id: str, prompt: Prompt, params):
        self.params.append(params)
        finished = False
        try:
            for output in self.script(request_id, prompt):
                finished = output.finished
                yield output
            if self.hang:
                await asyncio.Event().wait()
        finally:
            if not finished:
                self.aborted.append(request_id)


def client_for(engine: FakeAsyncEngine, metrics: Metrics | None = None) -> TestClient:
    prepare = Preparer(engine.engine, engine.engine, LIMITS, ImageMode.PIXELS)  # FakeEngine: builder and limits
    app = create_app(AppParts(engine, prepare, metrics=metrics or Metrics()), AppConfig(MODEL))
    return TestClient(app, raise_server_exceptions=False)


def chat(client: TestClient, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    return client.post("/v1/chat/completions", json=body)


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def sse_events(response) -> list:
    lines = [line for line in response.text.split("\n\n") if line]
    assert all(line.startswith("data: ") for line in lines)
    return [line[len("data: "):] for line in lines]
