"""The router's ``/openapi.json`` (OpenAPI 3.1). Pure: no I/O.

The chat route's and the completions route's request bodies and 200 answers are the stages' own: the
router imports nothing of ``stages``, so it takes them from a stage's ``/openapi.json`` when it
registers that stage (``chat_part``, cached by ``router.runtime.Router``), less the fields the router
writes itself (the bootstrap fields: a client never sends them); until a stage has
answered (or for a stage without ``/v1/completions``), a body is documented as a plain JSON object. Every other route is described here: ``/v1/models``, ``/health``,
``/metrics`` (Prometheus text), ``/server_info`` and the admin API (bearer token). Every error
answer is an OpenAI error body (``ErrorBody``).
"""

from __future__ import annotations

from contract.bootstrap import BOOTSTRAP_FIELDS
from contract.paths import CHAT_PATH, COMPLETIONS_PATH, HEALTH_PATH, MODELS_PATH, SERVER_INFO_PATH
from router.version import VERSION

REF = "#/components/schemas/"
ERROR_REF = {"$ref": REF + "ErrorBody"}
OBJECT = {"type": "object"}
ERROR_SCHEMAS = {
    "ErrorBody": {"type": "object", "required": ["error"], "properties": {"error": {"$ref": REF + "ErrorDetail"}},
                  "description": "Every non-2xx answer."},
    "ErrorDetail": {"type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"},
        "type": {"type": "string", "description": "invalid_request_error (4xx) or server_error (5xx)."},
        "param": {"type": ["string", "null"], "description": "The request parameter at fault, as a path."},
        "code": {"type": ["string", "null"], "description": "A stable machine-readable reason."},
        "stage": {"type": "string", "description": "A stage's failure: the stage it is charged to."},
        "room": {"type": "integer", "description": "A stage's failure: the bootstrap room, when the stage named it."},
        "image_key": {"type": "string", "description": "A stage's failure: the image it is about, when named."}}},
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                               "schema": {"type": "integer", "minimum": 0}}}
INTERNAL = "A failure of the router itself (code internal_error)."
CHAT_ERRORS = {
    400: "The request is invalid: the router's own checks (invalid_json, model, image parts, too_many_images "
         "over the tightest of --max-images-per-request and the stages' limit, image_host_not_allowed, "
         "image_fetch_failed; video parts: too_many_videos, video_not_supported, invalid_video_url, "
         "invalid_video, mm_processor_kwargs invalid_value) or a stage's 400, forwarded as the stage wrote it.",
    403: "A stage refused the request (forwarded as it wrote it).",
    404: "`model` is not served here (code model_not_found).",
    409: "A stage refused the request as a conflict (forwarded as it wrote it).",
    413: "The body is over the tightest of --max-body-mb and the stages' limit, or an image or a video is too "
         "large (code request_too_large / image_too_large / video_too_large).",
    500: INTERNAL + " Or a stage's own 500, naming the stage.",
    502: "A stage failed, refused the request as not its client's fault, or could not be reached "
         "(the message names the stage).",
    503: "The router is at --max-in-flight (server_overloaded), no healthy worker or allowed pair is available "
         "(no_healthy_worker, no_allowed_pair), or a stage is overloaded; with Retry-After.",
    504: "A stage's deadline passed (the message names the stage).",
}
ADMIN_ERRORS = {401: "Missing or wrong admin token (code unauthorized, with WWW-Authenticate: Bearer).",
                403: "The admin API is disabled: the router was started without an admin token (admin_disabled)."}
WORKER_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"},
             "description": "The worker's admin id (w1, w2, ...), from GET /admin/workers."}


def _query(name: str, description: str, schema: dict | None = None) -> dict:
    return {"name": name, "in": "query", "required": False, "schema": schema or {"type": "number", "minimum": 0},
            "description": description}


def _json_body(schema: dict) -> dict:
    return {"required": True, "content": {"application/json": {"schema": schema}}}


# (method, path, summary, request body schema or None, parameters, {extra status: description})
ADMIN_ROUTES: tuple[tuple[str, str, str, dict | None, list[dict], dict[int, str]], ...] = (
    ("get", "/admin/workers", "Every worker, with its stage's queue and KV blocks", None, [], {}),
    ("post", "/admin/workers", "Add a worker (its /health, /v1/models and /server_info are checked)",
     {"type": "object", "required": ["url", "role"], "properties": {
         "url": {"type": "string", "description": "http://host:port"}, "role": {"type": "string"},
         "group": {"type": "string", "minLength": 1}}},
     [], {400: "A bad body, role or URL.", 409: "Already a worker, unhealthy, or it cannot be paired.",
          502: "The worker could not be reached (worker_unreachable)."}),
    ("post", "/admin/workers/{id}/drain", "No new work for the worker; answers once idle (200) or after wait_s (202)",
     None, [WORKER_ID, _query("wait_s", "How long to wait for the worker to be idle (default --drain-timeout-s).")],
     {202: "Still busy after wait_s.", 400: "A bad wait_s.", 404: "No such worker (worker_not_found)."}),
    ("post", "/admin/workers/{id}/resume", "The worker takes new work again", None, [WORKER_ID],
     {404: "No such worker (worker_not_found).", 409: "It is switching roles (worker_busy)."}),
    ("delete", "/admin/workers/{id}", "Remove a worker (refused while it has requests in flight)", None,
     [WORKER_ID, _query("force", "true: remove it even with requests in flight.", {"type": "string"})],
     {404: "No such worker (worker_not_found).", 409: "It has requests in flight or is switching (worker_busy)."}),
    ("get", "/admin/pairing", "The pairing rules and the pairs they allow", None, [], {}),
    ("put", "/admin/pairing", "Replace the pairing rules", OBJECT, [], {400: "Bad rules (invalid_pairing)."}),
    ("post", "/admin/workers/{id}/role", "Switch one switchable worker to a role (drained first, nothing lost)",
     {"type": "object", "required": ["role"], "properties": {"role": {"type": "string",
                                                                      "enum": ["encoder", "prefill", "decode"]}}},
     [WORKER_ID], {400: "A role the router has no pool for or the worker cannot take (invalid_role).",
                   404: "No such worker (worker_not_found).",
                   409: "A fixed worker, one drained or switching, the only worker of its role, or a split "
                        "being applied.",
                   502: "The worker did not take its new role (switch_failed).",
                   504: "The worker stayed busy past --drain-timeout-s (drain_timeout)."}),
    ("get", "/admin/ratio", "Load, capacity and the recommended E:P:D split", None,
     [_query("window_s", "The window to measure over (at most --ratio-window-s).")], {400: "A bad window_s."}),
    ("post", "/admin/ratio", "Switch switchable workers to a prefill:decode split, or E:P:D in epd mode",
     {"type": "object", "required": ["prefill", "decode"], "properties": {
         "encoder": {"type": "integer", "minimum": 1}, "prefill": {"type": "integer", "minimum": 1},
         "decode": {"type": "integer", "minimum": 1}}},
     [], {400: "Not a split of this pool, or colocated mode (invalid_split).",
          409: "The split cannot be reached now, or another is being applied.",
          502: "A worker did not take its new role (switch_failed).",
          504: "A worker stayed busy past --drain-timeout-s (drain_timeout)."}),
    ("get", "/admin/rooms", "The slowest recent rooms", None,
     [_query("slowest", "How many rooms (default 10).")], {400: "A bad slowest."}),
    ("get", "/admin/rooms/{room}", "One room across the stages", None,
     [{"name": "room", "in": "path", "required": True, "schema": {"type": "string"}}],
     {404: "The room is not among the last --room-history rooms (room_not_found)."}),
)


def chat_part(stage_document: dict) -> dict:
    """From a stage's ``/openapi.json``: its chat request body schema, its 200 answer's content, the
    same of its completions route (``completions``; None if it has none) and the component schemas
    they refer to (transitively), the request bodies without the bootstrap fields. KeyError or
    TypeError if it has no chat route."""
    request, answer = _route_part(stage_document, CHAT_PATH)
    completions = (_route_part(stage_document, COMPLETIONS_PATH) if COMPLETIONS_PATH in stage_document["paths"]
                   else None)
    available = stage_document.get("components", {}).get("schemas", {})
    schemas: dict[str, dict] = {}
    pending = _refs(request) + _refs(answer) + _refs(list(completions or ()))
    while pending:
        name = pending.pop()
        if name not in schemas:
            schemas[name] = available[name]
            pending += _refs(schemas[name])
    _without_router_fields(schemas, request)
    if completions is not None:
        _without_router_fields(schemas, completions[0])
    return {"request": request, "answer": answer, "schemas": schemas,
            "completions": None if completions is None else {"request": completions[0], "answer": completions[1]}}


def _without_router_fields(schemas: dict[str, dict], request: dict) -> None:
    """The request body a client may send: the stage's without the fields the router writes itself
    (``contract.bootstrap.BOOTSTRAP_FIELDS``; a client's own are dropped, as any unknown field).
    ``request``: a reference to one of ``schemas``, replaced by a copy."""
    ref = request.get("$ref")
    if isinstance(ref, str) and ref.removeprefix(REF) in schemas:
        name = ref.removeprefix(REF)
        schema = schemas[name]
        schemas[name] = {**schema, "properties": {key: value for key, value in schema.get("properties", {}).items()
                                                  if key not in BOOTSTRAP_FIELDS}}
        if "required" in schema:
            schemas[name]["required"] = [key for key in schema["required"] if key not in BOOTSTRAP_FIELDS]


def _route_part(stage_document: dict, path: str) -> tuple[dict, dict]:
    """A stage route's request body schema and its 200 answer's content."""
    operation = stage_document["paths"][path]["post"]
    return operation["requestBody"]["content"]["application/json"]["schema"], operation["responses"]["200"]["content"]


def _refs(node: object) -> list[str]:
    """Names of the component schemas ``node`` refers to."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        found = [ref.removeprefix(REF)] if isinstance(ref, str) and ref.startswith(REF) else []
        return found + [name for value in node.values() for name in _refs(value)]
    if isinstance(node, list):
        return [name for value in node for name in _refs(value)]
    return []


def document(chat: dict | None) -> dict:
    """The router's OpenAPI document; ``chat``: a stage's ``chat_part``, or None before any answered."""
    unknown: dict = {"request": OBJECT, "answer": {"application/json": {"schema": OBJECT},
                                             "text/event-stream": {"schema": {"type": "string"}}}}
    chat = chat or {**unknown, "schemas": {}}
    completions: dict = chat.get("completions") or unknown
    paths = {
        CHAT_PATH: {"post": _operation("Create a chat completion (OpenAI-compatible), routed to the stages",
                                  {200: {"description": "The completion; with `stream: true`, a server-sent event "
                                         "stream.", "content": chat["answer"]}},
                                  CHAT_ERRORS, body=_json_body(chat["request"]))},
        COMPLETIONS_PATH: {"post": _operation(
            "Create a completion (OpenAI's legacy completions API, text only), routed to the stages as chat is",
            {200: {"description": "The completion; with `stream: true`, a server-sent event stream of "
                   "text_completion chunks.", "content": completions["answer"]}},
            CHAT_ERRORS, body=_json_body(completions["request"]))},
        MODELS_PATH: {"get": _operation("The models the answering stages serve", _ok({
            "type": "object", "required": ["object", "data"], "properties": {
                "object": {"const": "list"}, "data": {"type": "array", "items": OBJECT}}}))},
        HEALTH_PATH: {"get": _operation("200 while the router can route", _ok({
            "type": "object", "required": ["status", "mode"], "properties": {
                "status": {"const": "ok"}, "mode": {"type": "string"}}}), {
            503: "A loop of the router died (unhealthy), or no request can be served now (no_healthy_worker)."})},
        "/metrics": {"get": _operation("Prometheus metrics (epd_router_* names)", {200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}}}})},
        SERVER_INFO_PATH: {"get": _operation("What this router is: mode, version, workers per role, limits", _ok({
            "type": "object", "required": ["role", "mode", "version", "workers", "limits"]}))},
    }
    for method, path, summary, body, parameters, errors in ADMIN_ROUTES:
        operation = _operation(summary, _ok(OBJECT), {**ADMIN_ERRORS, **errors},
                               body=_json_body(body) if body is not None else None, parameters=parameters)
        if 413 not in errors and body is not None:
            operation["responses"]["413"] = _error("The body is over --max-body-mb.")
        operation["security"] = [{"adminToken": []}]
        operation["responses"]["401"]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
        paths.setdefault(path, {})[method] = operation
    return {"openapi": "3.1.0",
            "info": {"title": "epd-stage router", "version": VERSION},
            "paths": paths,
            "components": {"schemas": {**ERROR_SCHEMAS, **chat["schemas"]},
                           "securitySchemes": {"adminToken": {
                               "type": "http", "scheme": "bearer",
                               "description": "The router's --admin-token (or EPD_ADMIN_TOKEN)."}}}}


def _ok(schema: dict) -> dict:
    return {200: {"description": "OK.", "content": {"application/json": {"schema": schema}}}}


def _error(description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": ERROR_REF}}}


def _operation(summary: str, answers: dict, errors: dict[int, str] | None = None, *, body: dict | None = None,
               parameters: list[dict] | None = None) -> dict:
    """One operation: its answers, its other statuses (and a 500, always), each error an OpenAI error body."""
    responses = {str(status): answer for status, answer in answers.items()}
    for status, description in sorted({500: INTERNAL, **(errors or {})}.items()):
        responses[str(status)] = _error(description) if status >= 400 else \
            {"description": description, "content": {"application/json": {"schema": OBJECT}}}
        if status == 503:
            responses[str(status)]["headers"] = RETRY_AFTER
    operation: dict = {"summary": summary, "responses": dict(sorted(responses.items()))}
    if body is not None:
        operation["requestBody"] = body
    if parameters:
        operation["parameters"] = parameters
    return operation
