"""The HTTP paths the router calls on a stage, and serves to its clients under the same names. Pure."""

from __future__ import annotations

from typing import Final

CHAT_PATH: Final = "/v1/chat/completions"  # every generating stage, and the router
COMPLETIONS_PATH: Final = "/v1/completions"  # OpenAI's legacy completions: text prompts, routed as chat is
ENCODE_PATH: Final = "/v1/encode"  # the encoder: a room's images into the embedding cache (``contract.encode``)
ABORT_PATH: Final = "/v1/abort"  # the encoder: give up a room's images (``contract.encode.AbortRequest``)
MODELS_PATH: Final = "/v1/models"
HEALTH_PATH: Final = "/health"  # 200 while serving; 503 ``{"status": "draining"}`` while shutting down
SERVER_INFO_PATH: Final = "/server_info"  # what the server is: role, model, limits (read when registering it)
METRICS_PATH: Final = "/metrics"
OPENAPI_PATH: Final = "/openapi.json"  # a stage's: the router copies its chat and completions schemas
