"""The route table: (method, path pattern) -> handler. A pattern is a fixed path or one with
``{name}`` segments (one path segment each, given to the handler in ``request.match_info``). Every
GET route answers HEAD too. A path no route has is a 404 ``not_found``; a path some route has, asked
with another method, a 405 ``method_not_allowed`` with ``Allow`` naming the methods it takes.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from router.errors import RouterError
from router.http.request import Request
from router.http.response import Response, StreamResponse

Handler = Callable[[Request], Awaitable[Response | StreamResponse]]
_PARAM = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


class Routes:
    """Filled before the server starts, read by every request (``resolve``)."""

    def __init__(self) -> None:
        self._fixed: dict[str, dict[str, Handler]] = {}
        self._patterns: list[tuple[re.Pattern[str], dict[str, Handler]]] = []
        self._listed: list[tuple[str, str]] = []

    def add(self, method: str, path: str, handler: Handler) -> None:
        if _PARAM.search(path) is None:
            methods = self._fixed.setdefault(path, {})
        else:
            regex = _compile(path)
            known = [m for r, m in self._patterns if r.pattern == regex.pattern]
            methods = known[0] if known else {}
            if not known:
                self._patterns.append((regex, methods))
        methods[method] = handler
        if method == "GET":
            methods.setdefault("HEAD", handler)
        self._listed.append((method, path))

    def listing(self) -> list[tuple[str, str]]:
        """Every (method, path pattern) added, in order (the HEADs that GET routes answer are not listed)."""
        return list(self._listed)

    def resolve(self, method: str, path: str) -> tuple[Handler, dict[str, str]]:
        """The handler of ``method`` on ``path`` and its path params; RouterError 404 or 405."""
        methods = self._fixed.get(path)
        params: dict[str, str] = {}
        if methods is None:
            for regex, candidate in self._patterns:
                match = regex.fullmatch(path)
                if match is not None:
                    methods, params = candidate, match.groupdict()
                    break
            else:
                raise RouterError(404, "Not Found", code="not_found")
        handler = methods.get(method)
        if handler is None:
            raise RouterError(405, "Method Not Allowed", code="method_not_allowed",
                              headers={"Allow": ",".join(sorted(methods))})
        return handler, params


def _compile(pattern: str) -> re.Pattern[str]:
    """``/a/{id}/b`` -> a regex with one named group per ``{name}``, matching one path segment."""
    parts = _PARAM.split(pattern)  # literal, name, literal, name, ..., literal
    return re.compile("".join(re.escape(part) if i % 2 == 0 else f"(?P<{part}>[^/]+)" for i, part in enumerate(parts)))
