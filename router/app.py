"""The router's OpenAI-compatible routes (served by ``router.http``): ``POST /v1/chat/completions`` and
``POST /v1/completions`` (the legacy API, text only: routed as chat is, to the same route of each stage),
``GET /v1/models``, ``/health``, ``/metrics``, ``/server_info`` (``router.server_info``) and
``/openapi.json`` (``router.openapi``); the admin API (``/admin/*``, token required) is added from
``router.admin.routes``. A 405 carries ``Allow``.

A chat request: admission (at most ``--max-in-flight`` at once, else 503 with ``Retry-After``,
before the body is read), the body within ``--max-body-mb`` or the stages' tighter limit (413, from
Content-Length before reading and while reading), JSON, the model check, images counted against
``--max-images-per-request`` or the stages' tighter limit and resolved (epd: with their cache keys
and sizes), videos counted against ``--max-videos-per-request`` or the stages' tighter limit, fetched,
probed and planned with the stages' published video settings (``router.plan.videos``; epd: with
their cache keys), then the dispatcher. Every non-2xx answer is an OpenAI error body; a stage's own 4xx (the
request was wrong) is forwarded as the stage wrote it. The client leaving cancels the handler
(``router.http.connection``), which aborts the request in every stage. A ``RouterError`` raised under
a route is its answer; 404, 405, and a 500 for any other exception, are the server's (``router.http``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import partial

import msgspec
from prometheus_client import CONTENT_TYPE_LATEST

from contract.bootstrap import BOOTSTRAP_FIELDS
from contract.errors import Code
from contract.json_depth import TOO_DEEP, too_deep
from contract.paths import (CHAT_PATH, COMPLETIONS_PATH, HEALTH_PATH, METRICS_PATH, MODELS_PATH, OPENAPI_PATH,
                            SERVER_INFO_PATH)
from router.admin.routes import add_admin_routes
from router.errors import RouterError, bad_request, model_not_found, overloaded, stage_failed
from router.http import Request, Response, Routes, StreamResponse, json_response
from router.plan.limits import prompt_too_long
from router.http.memory import collect_after_large_bodies
from router.plan.modes import Call
from router.openapi import document
from router.runtime import Router
from router.server_info import server_info
from router.upstream.client import StageError
from router.dispatch.trace import wall
from telemetry import NO_SPAN, Span

_decode = msgspec.json.Decoder()
# the router's 5xx refusals for capacity (its limits, no worker now): outcome "rejected"; any 4xx
# the router answers is the client's ("client_error")
REJECTIONS = (Code.SERVER_OVERLOADED, "no_healthy_worker", "no_allowed_pair")
INLINE_IMAGE_CHARS = 256 << 10  # images of a request up to this size (as data: URLs) are read on the event loop
OK, CLIENT_CLOSED = 200, 499  # a request's span's status: answered; the client left first (nginx's 499)


def create_routes(router: Router) -> Routes:
    """Every route of the router over ``router`` (the admin API's too)."""
    routes = Routes()
    routes.add("POST", CHAT_PATH, collect_after_large_bodies(partial(_serve, router, CHAT_PATH)))
    routes.add("POST", COMPLETIONS_PATH, collect_after_large_bodies(partial(_serve, router, COMPLETIONS_PATH)))
    for path, handler in ((MODELS_PATH, _models), (HEALTH_PATH, _health), (METRICS_PATH, _metrics),
                          (SERVER_INFO_PATH, _server_info), (OPENAPI_PATH, _openapi)):
        routes.add("GET", path, partial(handler, router))
    add_admin_routes(routes, router)
    return routes


async def _serve(router: Router, path: str, request: Request) -> Response | StreamResponse:
    if router.in_flight >= router.config.max_in_flight:
        router.metrics.outcome("rejected").inc()
        raise overloaded(router.config.max_in_flight)
    router.in_flight += 1
    started = time.perf_counter()
    span = _request_span(router, request, path) if router.tracing.enabled else NO_SPAN
    outcome = "aborted"
    answer: tuple[int, str | None] = (CLIENT_CLOSED, None)  # the status and error code answered (spans only)
    try:
        call = await _read_call(request, router, started, path, span)
        answered = await router.dispatcher.handle(request, call)
        outcome, answer = ("success" if answered.failure is None else "upstream_error"), (OK, None)
        router.metrics.e2e.observe(time.perf_counter() - started)
        return answered.response
    except RouterError as exc:
        outcome = "client_error" if exc.status < 500 else "rejected" if exc.code in REJECTIONS else "upstream_error"
        answer = (exc.status, exc.code)
        raise
    except StageError as exc:
        failure = exc.failure
        if failure.client_fault:
            outcome, answer = "client_error", (failure.status, failure.code)
            return Response(failure.raw or b"", failure.status, "application/json")
        outcome = "rejected" if failure.busy else "upstream_error"
        error = stage_failed(failure)
        answer = (error.status, error.code)
        raise error from None
    except (asyncio.CancelledError, ConnectionResetError):
        raise  # the client left: "aborted"
    except Exception:
        outcome, answer = "internal_error", (500, None)
        raise
    finally:
        router.in_flight -= 1
        router.metrics.outcome(outcome).inc()
        if span is not NO_SPAN:
            _end_request_span(span, outcome, *answer)


def _request_span(router: Router, request: Request, path: str) -> Span:
    """The request's span (``chat``, the trace's root or the child of the client's ``traceparent``),
    begun now; ``router.dispatch.trace`` has the spans under it."""
    return router.tracing.start_span("chat", request.headers.first(b"traceparent"), time.time(),
                                     {"http.request.method": "POST", "url.path": path, "epd.mode": router.config.mode})


def _end_request_span(span: Span, outcome: str, status: int, code: str | None) -> None:
    """End the request's span: a 5xx answer is its error (a 4xx is the client's, as OpenTelemetry's
    HTTP conventions have it: only ``error.type`` says it)."""
    attributes: dict[str, object] = {"epd.outcome": outcome, "http.response.status_code": status}
    if code is not None:
        attributes["error.type"] = code
    span.end(time.time(), f"{status} {code or outcome}" if status >= 500 else None, attributes)


async def _read_call(request: Request, router: Router, started: float, path: str = CHAT_PATH,
                     span: Span = NO_SPAN) -> Call:
    """The request's body and what the router reads of it; a completions body (``path``) has no
    messages: no image is resolved and no chat-text bound applies (its stage checks its prompt).
    ``span``: the request's (its ``router.admission`` child covers this)."""
    call = await _read_call_body(request, router, started, path, span)
    if span.sampled:
        span.child("router.admission", wall(started)).end(time.time())
    return call


async def _read_call_body(request: Request, router: Router, started: float, path: str, span: Span) -> Call:
    """``_read_call``'s work: the request's ``Call`` (its ``span`` in it)."""
    limits = router.stage_limits()  # the tightest over the workers, once per request
    read = await _read_body(request, *router.body_cap(limits))
    body, raw = _without_router_fields(_parse(read), read)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("Invalid value for 'model': must be a string.", "model", Code.INVALID_VALUE)
    if model is not None and not router.serves(model):
        raise model_not_found(model, [card["id"] for card in router.models()])
    if path != CHAT_PATH:  # no images: the client's bytes are sent on (``router.plan.modes``)
        return Call(body, body.get("stream") is True, model, started, path=path, raw=raw, span=span)
    if (too_long := prompt_too_long(body, limits)) is not None:
        raise too_long
    takes_video, video = router.video_support()
    no_video = (model or _model_name(router)) if takes_video is False else None
    resolved = await router.images.resolve_media(body, limits.max_images_per_request,
                                                 limits.max_videos_per_request, no_video)
    parts = resolved.images
    if router.epd is None and parts:  # no cache: every image is a miss (epd: counted by the dispatcher, by the cache's answer)
        router.metrics.image_count("miss").inc(len(parts))
    # epd: keys and sizes; large images are decoded and hashed off the event loop
    large = sum(len(part.url) for part in parts) > INLINE_IMAGE_CHARS
    images = await asyncio.to_thread(router.image_refs, parts) if large else router.image_refs(parts)
    # videos (when the stages published their video settings): probed (PyAV) and planned off the event loop
    videos = await asyncio.to_thread(router.video_refs, resolved.videos, video, body.get("mm_processor_kwargs")) \
        if video is not None and resolved.videos else ()
    # the client's bytes are sent on (``router.plan.modes``) unless an image or a video was fetched into the body
    return Call(body, body.get("stream") is True, model, started, images, raw=None if resolved.fetched else raw,
                videos=videos, span=span)


def _model_name(router: Router) -> str:
    """The model a request that names none is served by (the first the workers list), for messages."""
    return next((card["id"] for card in router.models()), "")


def _without_router_fields(body: dict, raw: bytes) -> tuple[dict, bytes | None]:
    """``body`` without the fields the router writes itself (``contract.bootstrap``: its
    /openapi.json shows them to no client), and the bytes that are exactly it (None once one is
    dropped). In every mode: a colocated stage would otherwise read a client's."""
    if not any(name in body for name in BOOTSTRAP_FIELDS):
        return body, raw
    return {name: value for name, value in body.items() if name not in BOOTSTRAP_FIELDS}, None


async def _read_body(request: Request, max_bytes: int, refuse: Callable[[int | str, int], RouterError]) -> bytes:
    """The whole body, or ``refuse``'s 413 as soon as it is known to exceed ``max_bytes``."""
    declared = request.content_length
    if declared is not None and declared > max_bytes:
        raise refuse(declared, max_bytes)
    return await request.read(max_bytes, refuse)


def _parse(raw: bytes) -> dict:
    """The body as a JSON object, nested at most ``MAX_JSON_DEPTH`` deep (400 ``invalid_json``), as
    every stage judges it: on the bytes, before msgspec recurses (``contract.json_depth``)."""
    if too_deep(raw):
        raise bad_request(TOO_DEEP, param=None, code=Code.INVALID_JSON)
    try:
        body = _decode.decode(raw)
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}", param=None, code=Code.INVALID_JSON) from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", param=None, code=Code.INVALID_JSON)
    return body


async def _models(router: Router, request: Request) -> Response:
    return json_response({"object": "list", "data": router.models()})


async def _health(router: Router, request: Request) -> Response:
    failures = router.failures()
    if failures:
        names = "; ".join(f"{name}: {reason}" for name, reason in sorted(failures.items()))
        raise RouterError(503, f"The router is unhealthy and should be restarted: {names}", code=Code.UNHEALTHY)
    reason = router.unservable()
    if reason is not None:
        raise RouterError(503, f"The router cannot serve now: {reason}.", code="no_healthy_worker")
    return json_response({"status": "ok", "mode": router.config.mode})


async def _server_info(router: Router, request: Request) -> Response:
    return json_response(server_info(router))


async def _openapi(router: Router, request: Request) -> Response:
    return json_response(document(router.chat_schema))


async def _metrics(router: Router, request: Request) -> Response:
    return Response(router.metrics.render(), content_type=CONTENT_TYPE_LATEST)
