"""`stage admin` against a server whose 2xx answer is not a JSON object (found by mypy: the table
renderer indexed whatever came back and crashed with a TypeError on a string)."""

from __future__ import annotations

import argparse
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli.admin import add_admin_args, run


class _TextAnswer(BaseHTTPRequestHandler):
    """Answers every GET with 200 and a body that is not JSON (as a proxy's page would be)."""

    def do_GET(self) -> None:
        body = b"<html>not the router</html>"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def text_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _TextAnswer)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_admin_args(parser)
    return parser.parse_args(list(argv))


def test_a_success_that_is_not_a_json_object_is_an_error_line(text_server: str, capsys: pytest.CaptureFixture[str]):
    assert run(_args("workers", "--router", text_server)) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err == ("stage admin: HTTP 200: the answer is not a JSON object: "
                   "'<html>not the router</html>'\n")


def test_with_json_the_answer_is_printed_as_it_came(text_server: str, capsys: pytest.CaptureFixture[str]):
    assert run(_args("workers", "--router", text_server, "--json")) == 0
    out, err = capsys.readouterr()
    assert out == '"<html>not the router</html>"\n'
    assert err == ""
