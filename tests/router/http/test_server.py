"""The router's HTTP server (``router.http``) on a real loopback socket, with test routes: raw bytes
in and out for keep-alive, pipelining, ``Expect: 100-continue``, chunked bodies, the limits (400,
431, 413) and HEAD; a client leaving cancels its handler; shutdown lets a stream in flight finish;
httpx for TCP_NODELAY and connection reuse."""

from __future__ import annotations

import asyncio
import json
import socket

import httptools
import httpx
import pytest

from router.http import HttpServer, Request, Response, Routes, StreamResponse, json_response
from router.http.connection import MAX_HEAD_BYTES, PIPELINE_MAX
from process.ports import bind, free_port

pytestmark = pytest.mark.timeout(60)
MAX_BODY = 4096
WAIT_S = 5.0  # every wait on the server is bounded by this


class Probe:
    """What the test routes saw: ``started`` set when /slow begins, ``cancelled`` when it is cancelled;
    /stream waits for ``gate`` between its chunks."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.gate = asyncio.Event()


def routes(probe: Probe) -> Routes:
    table = Routes()

    async def hello(request: Request) -> Response:
        return json_response({"hello": "world"})

    async def item(request: Request) -> Response:
        await asyncio.sleep(0.05 if request.match_info["id"] == "1" else 0)  # the first would finish last
        return json_response({"id": request.match_info["id"], "q": request.query.get("q")})

    async def echo(request: Request) -> Response:
        if (request.content_length or 0) > MAX_BODY:  # as the router's chat route: refused from the header
            return json_response({"too_large": request.content_length}, status=413)
        return Response(await request.read(), content_type="application/octet-stream")

    async def slow(request: Request) -> Response:
        probe.started.set()
        try:
            await asyncio.sleep(WAIT_S * 2)
        except asyncio.CancelledError:
            probe.cancelled.set()
            raise
        return json_response({})

    async def stream(request: Request) -> StreamResponse:
        response = StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await response.write(b"data: 1\n\n")
        probe.started.set()
        await asyncio.wait_for(probe.gate.wait(), WAIT_S)
        await response.write(b"data: 2\n\n")
        await response.write_eof()
        return response

    async def nodelay(request: Request) -> Response:
        assert request.transport is not None
        sock = request.transport.get_extra_info("socket")
        return json_response(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

    async def crash(request: Request) -> Response:
        raise ValueError("a bug")

    for method, path, handler in (("GET", "/hello", hello), ("GET", "/items/{id}", item), ("POST", "/echo", echo),
                                  ("GET", "/slow", slow), ("POST", "/stream", stream), ("GET", "/nodelay", nodelay),
                                  ("GET", "/crash", crash)):
        table.add(method, path, handler)
    return table


@pytest.fixture
async def served():
    probe = Probe()
    port = free_port()
    sock = bind("127.0.0.1", port)
    server = HttpServer(routes(probe), MAX_BODY)
    await server.listen(sock)
    try:
        yield server, port, probe
    finally:
        await server.shutdown(1.0)
        sock.close()


class Answers:
    """Responses read off one raw connection, parsed by httptools."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        self.reader = reader
        self.done: list[tuple[int, dict[str, str], bytes]] = []
        self._headers: dict[str, str] = {}
        self._body = b""
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_status_code(), self._headers, self._body))
        self._headers, self._body = {}, b""

    async def read(self, count: int = 1) -> list[tuple[int, dict[str, str], bytes]]:
        async with asyncio.timeout(WAIT_S):
            while len(self.done) < count:
                data = await self.reader.read(65536)
                assert data, f"the connection closed after {len(self.done)} answers"
                self.parser.feed_data(data)
        answers, self.done = self.done[:count], self.done[count:]
        return answers


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Answers]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    return reader, writer, Answers(reader)


async def closed(reader: asyncio.StreamReader) -> bool:
    async with asyncio.timeout(WAIT_S):
        return await reader.read() == b""


def get(path: str, extra: str = "") -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: t\r\n{extra}\r\n".encode()


async def test_keep_alive_across_requests(served):
    server, port, _ = served
    reader, writer, answers = await connect(port)
    for _ in range(3):
        writer.write(get("/hello"))
        [(status, headers, body)] = await answers.read()
        assert (status, body) == (200, b'{"hello":"world"}')
        assert headers["content-type"] == "application/json; charset=utf-8" and "connection" not in headers
    writer.write(get("/hello", "Connection: close\r\n"))
    [(status, headers, _)] = await answers.read()
    assert status == 200 and headers["connection"] == "close"
    assert await closed(reader)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1)) as client:
        ports = set()
        for _ in range(3):
            response = await client.get(f"http://127.0.0.1:{port}/hello")
            ports.add(response.extensions["network_stream"].get_extra_info("client_addr")[1])
        assert len(ports) == 1


async def test_an_idle_kept_alive_connection_is_closed_after_the_keep_alive_time(served, monkeypatch):
    _, port, _ = served
    monkeypatch.setattr("router.http.connection.KEEPALIVE_S", 0.3)
    reader, writer, answers = await connect(port)
    writer.write(get("/hello"))
    [(status, _, _)] = await answers.read()
    assert status == 200
    started = asyncio.get_running_loop().time()
    assert await closed(reader)
    assert asyncio.get_running_loop().time() - started >= 0.25


async def test_http10_closes_after_the_answer(served):
    _, port, _ = served
    reader, writer, answers = await connect(port)
    writer.write(b"GET /hello HTTP/1.0\r\n\r\n")
    [(status, _, body)] = await answers.read()
    assert (status, body) == (200, b'{"hello":"world"}')
    assert await closed(reader)


async def test_pipelined_requests_are_answered_in_order(served):
    _, port, _ = served
    _, writer, answers = await connect(port)
    writer.write(get("/items/1?q=a%20b") + get("/items/2") + get("/hello"))
    got = await answers.read(3)
    assert [json.loads(body) for _, _, body in got] == [{"id": "1", "q": "a b"}, {"id": "2", "q": None},
                                                        {"hello": "world"}]


async def test_many_pipelined_requests_pause_reading_and_are_all_answered(served):
    _, port, _ = served
    _, writer, answers = await connect(port)
    count = PIPELINE_MAX * 3
    writer.write(b"".join(get(f"/items/{i}") for i in range(2, 2 + count)))
    got = await answers.read(count)
    assert [json.loads(body)["id"] for _, _, body in got] == [str(i) for i in range(2, 2 + count)]


async def test_a_pipelined_body_over_the_pipeline_bound_is_read_once_its_turn_comes(served, monkeypatch):
    _, port, _ = served
    monkeypatch.setattr("router.http.connection.PIPELINE_HIGH_BYTES", 1024)
    _, writer, answers = await connect(port)
    body = b"z" * 3000
    post = b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body)
    writer.write(get("/items/1") + post + body[:2000])  # /items/1 takes 50 ms: the POST waits, over the bound
    await asyncio.sleep(0.02)
    writer.write(body[2000:] + get("/hello"))  # read only once the POST is answered (reading resumed)
    got = await answers.read(3)
    assert [(status, body_) for status, _, body_ in got] == [
        (200, b'{"id":"1","q":null}'), (200, body), (200, b'{"hello":"world"}')]


async def test_expect_100_continue(served):
    _, port, _ = served
    reader, writer, answers = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\nExpect: 100-continue\r\n\r\n")
    async with asyncio.timeout(WAIT_S):
        assert await reader.readexactly(25) == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    [(status, _, body)] = await answers.read()
    assert (status, body) == (200, b"hello")


async def test_expect_100_continue_over_the_cap_is_refused_at_once_and_closed(served):
    _, port, _ = served
    reader, writer, answers = await connect(port)
    writer.write(f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {MAX_BODY + 1}\r\n"
                 "Expect: 100-continue\r\n\r\n".encode())
    [(status, headers, body)] = await answers.read()
    assert status == 413 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert f"The request body is {MAX_BODY + 1} bytes" in json.loads(body)["error"]["message"]
    assert await closed(reader)


async def test_a_chunked_body(served):
    _, port, _ = served
    _, writer, answers = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
    await asyncio.sleep(0.05)
    writer.write(b"6\r\n world\r\n0\r\n\r\n")
    [(status, _, body)] = await answers.read()
    assert (status, body) == (200, b"hello world")


async def test_a_malformed_request_line_is_400_then_closed(served):
    _, port, _ = served
    reader, writer, answers = await connect(port)
    writer.write(get("/hello") + b"NOT HTTP AT ALL\r\n\r\n")
    [(first, _, _), (status, headers, body)] = await answers.read(2)
    assert first == 200 and status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "invalid_request"
    assert await closed(reader)


async def test_an_upgrade_is_answered_over_http11_then_closed(served):
    _, port, _ = served
    reader, writer, answers = await connect(port)
    writer.write(get("/hello", "Connection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n"))
    [(status, headers, body)] = await answers.read()
    assert (status, body) == (200, b'{"hello":"world"}') and headers["connection"] == "close"
    assert await closed(reader)


async def test_headers_over_the_cap_are_431_then_closed(served):
    _, port, _ = served
    reader, writer, answers = await connect(port)
    writer.write(b"GET /hello HTTP/1.1\r\nHost: t\r\n")
    for _ in range(MAX_HEAD_BYTES // 8192 + 1):
        writer.write(b"X-Filler: " + b"a" * 8192 + b"\r\n")
    [(status, headers, body)] = await answers.read()
    assert status == 431 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_header_fields_too_large"
    assert await closed(reader)


async def test_a_body_over_the_cap_is_413_and_the_connection_stays_usable(served):
    _, port, _ = served
    _, writer, answers = await connect(port)
    writer.write(f"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: {MAX_BODY * 4}\r\n\r\n".encode())
    [(status, _, body)] = await answers.read()  # from Content-Length, before any of the body was sent
    assert status == 413 and json.loads(body) == {"too_large": MAX_BODY * 4}
    writer.write(b"x" * (MAX_BODY * 4))  # read and dropped
    writer.write(get("/hello"))
    [(status, _, _)] = await answers.read()
    assert status == 200


async def test_a_chunked_body_over_the_cap_is_413_while_reading(served):
    _, port, _ = served
    _, writer, answers = await connect(port)
    writer.write(b"POST /echo HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
    piece = b"y" * 1024
    writer.write(b"".join(b"%x\r\n%b\r\n" % (len(piece), piece) for _ in range(MAX_BODY // 1024 + 1)))
    [(status, _, body)] = await answers.read()
    assert status == 413
    assert json.loads(body)["error"]["message"].startswith(f"The request body is more than {MAX_BODY} bytes")
    writer.write(b"0\r\n\r\n" + get("/hello"))
    [(status, _, _)] = await answers.read()
    assert status == 200


async def test_head_on_a_get_route_has_no_body(served):
    _, port, _ = served
    reader, writer, _ = await connect(port)
    writer.write(b"HEAD /hello HTTP/1.1\r\nHost: t\r\n\r\n" + get("/hello", "Connection: close\r\n"))
    async with asyncio.timeout(WAIT_S):
        data = await reader.read()
    first, _, second = data.partition(b"HTTP/1.1 200 OK\r\n")[2].partition(b"HTTP/1.1 200 OK\r\n")
    assert first.endswith(b"\r\n\r\n") and b"Content-Length: 17\r\n" in first
    assert second.endswith(b'\r\n\r\n{"hello":"world"}')


async def test_not_found_method_not_allowed_and_a_crash(served):
    _, port, _ = served
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S) as client:
        missing = await client.get("/nowhere")
        assert missing.status_code == 404 and missing.json() == {"error": {
            "message": "Not Found", "type": "invalid_request_error", "param": None, "code": "not_found"}}
        wrong = await client.delete("/items/3")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "GET,HEAD"
        assert wrong.json()["error"]["code"] == "method_not_allowed"
        crashed = await client.get("/crash")
        assert crashed.status_code == 500 and crashed.json()["error"] == {
            "message": "Internal router error: ValueError", "type": "server_error", "param": None,
            "code": "internal_error"}
        assert (await client.get("/hello")).status_code == 200


async def test_tcp_nodelay_on_accepted_connections(served):
    _, port, _ = served
    async with httpx.AsyncClient(timeout=WAIT_S) as client:
        assert (await client.get(f"http://127.0.0.1:{port}/nodelay")).json() == 1


async def test_the_client_leaving_cancels_its_handler(served):
    server, port, probe = served
    _, writer, _ = await connect(port)
    writer.write(get("/slow"))
    await asyncio.wait_for(probe.started.wait(), WAIT_S)
    writer.close()
    await asyncio.wait_for(probe.cancelled.wait(), WAIT_S)
    async with asyncio.timeout(WAIT_S):
        while server.connections:
            await asyncio.sleep(0.01)


async def test_shutdown_lets_a_stream_in_flight_finish(served):
    server, port, probe = served
    idle_reader, idle_writer, idle_answers = await connect(port)
    idle_writer.write(get("/hello"))
    await idle_answers.read()
    reader, writer, answers = await connect(port)
    writer.write(b"POST /stream HTTP/1.1\r\nHost: t\r\nContent-Length: 0\r\n\r\n")
    await asyncio.wait_for(probe.started.wait(), WAIT_S)
    stopping = asyncio.ensure_future(server.shutdown(WAIT_S))
    assert await closed(idle_reader)  # an idle kept-alive connection is closed at once
    with pytest.raises(OSError):
        await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), WAIT_S)  # no longer listening
    probe.gate.set()
    [(status, headers, body)] = await answers.read()
    assert status == 200 and headers["transfer-encoding"] == "chunked" and body == b"data: 1\n\ndata: 2\n\n"
    await asyncio.wait_for(stopping, WAIT_S)
    assert await closed(reader)


@pytest.mark.unit
def test_the_route_table_lists_its_routes():
    table = routes(Probe())
    assert table.listing()[:3] == [("GET", "/hello"), ("GET", "/items/{id}"), ("POST", "/echo")]
