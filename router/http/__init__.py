"""The router's HTTP/1.1 server: an asyncio ``Protocol`` per connection with httptools' C parser
(llhttp) reading every request, small request and response types, and a route table. docs/router.md
"The server" says why not aiohttp's server, and what this one does and does not do.

    request.py     Request: method, path, query, headers, path params, the body as it arrives (capped)
    response.py    Response (whole), StreamResponse (chunked), json_response, error_response
    routes.py      Routes: (method, path pattern) -> handler; 404, 405 with Allow
    connection.py  Connection: one client's connection: parsing, keep-alive, pipelining, limits, cancellation
    server.py      HttpServer: listening on a bound socket, the connections, graceful shutdown
"""

from router.http.request import Request
from router.http.response import Response, StreamResponse, error_response, json_response
from router.http.routes import Handler, Routes
from router.http.server import HttpServer

__all__ = ["Handler", "HttpServer", "Request", "Response", "Routes", "StreamResponse", "error_response",
           "json_response"]
