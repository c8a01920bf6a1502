"""OpenAI-style errors of the router: ``{"error": {"message", "type", "param", "code"}}``. Pure.

The router's own refusals (body too large, overloaded, image host not allowed, no worker) and the
stage failures it reports, each message naming the stage that failed. A stage's own 4xx answer is
about the request and is forwarded unchanged, not wrapped, its typed fields included.

A stage failure's body keeps the typed fields for operators (docs/protocol.md "Typed error
fields"): ``stage`` (the stage the router blames, the one the message names), and ``room`` and
``image_key`` when the stage's answer gave them. The router's own refusals have none.
"""

from __future__ import annotations

from contract.errors import Code
from router.dispatch.verdict import Failure


class RouterError(Exception):
    """Raised anywhere under a route; the app turns it into the JSON error response."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict[str, str] | None = None, typed: dict[str, str | int] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers
        self.typed = typed or {}  # typed fields (``verdict.TYPED_FIELDS``) for the body's ``error``

    def body(self) -> dict:
        return error_body(self.status, self.message, self.code, self.param, self.typed)


def error_body(status: int, message: str, code: str, param: str | None = None,
               typed: dict[str, str | int] | None = None) -> dict:
    """Every error body has a ``code`` (``tests/stages/api/test_error_params.py`` checks each construction);
    ``typed``: fields after the OpenAI four inside ``error`` (the module docstring)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code, **(typed or {})}}


def bad_request(message: str, param: str | None, code: str) -> RouterError:
    return RouterError(400, message, code=code, param=param)


def body_too_large(size: int | str, max_bytes: int) -> RouterError:
    return RouterError(413, f"The request body is {size} bytes; this router accepts at most {max_bytes} bytes "
                       "(--max-body-mb).", code=Code.REQUEST_TOO_LARGE)


def overloaded(limit: int, retry_after_s: int = 1) -> RouterError:
    return RouterError(503, f"The router is at its limit of {limit} requests in flight (--max-in-flight); "
                       f"retry after {retry_after_s} s.", code=Code.SERVER_OVERLOADED,
                       headers={"Retry-After": str(retry_after_s)})


def no_worker(role: str, model: str | None) -> RouterError:
    which = f" serving model `{model}`" if model else ""
    return RouterError(503, f"No healthy {role} stage{which} is available now (all are down, unhealthy or "
                       "their circuits are open); retry later.", code="no_healthy_worker",
                       headers={"Retry-After": "1"})


def no_allowed_pair(rules: str) -> RouterError:
    return RouterError(503, f"No healthy prefill and decode pair is allowed by the pairing rules ({rules}); "
                       "change them with PUT /admin/pairing or add workers.", code="no_allowed_pair",
                       headers={"Retry-After": "1"})


def model_not_found(model: str, served: list[str]) -> RouterError:
    return RouterError(404, f"The model `{model}` does not exist; this router serves {served}.", param="model",
                       code=Code.MODEL_NOT_FOUND)


def stage_failed(failure: Failure) -> RouterError:
    """A stage's server-side failure, as the client sees it: the stage's status (or 502) and code;
    a 503 with ``Retry-After`` (the stage's, else 1 s); the typed fields ``stage``, and ``room`` and
    ``image_key`` when known."""
    status = failure.status if failure.status >= 500 else 502
    typed = {name: value for name, value in (("stage", failure.stage), ("room", failure.room),
                                             ("image_key", failure.image_key)) if value is not None}
    return RouterError(status, f"The {failure.stage} stage failed: {failure.message}",
                       code=failure.code or "upstream_error",
                       headers={"Retry-After": failure.retry_after or "1"} if status == 503 else None, typed=typed)
