"""Image parts of a chat body (router/plan/images.py): found in order with the parameter path
that names each, replaced in place; remote image URLs checked against --allowed-image-hosts.
Pure: no sockets."""

from __future__ import annotations

import pytest

from router.errors import RouterError
from router.plan.images import check_remote, image_parts

pytestmark = pytest.mark.unit


def test_image_parts_in_order_with_their_params():
    body = {"messages": [
        {"role": "system", "content": "plain"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u1"}},
                                     {"type": "image_url", "image_url": "u2"}]},
        "not a message", {"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]}
    parts = image_parts(body)
    assert [(p.url, p.param) for p in parts] == [("u1", "messages[1].content[1].image_url"),
                                                 ("u2", "messages[1].content[2].image_url")]
    parts[0].replace_url("data:x")
    parts[1].replace_url("data:y")
    assert body["messages"][1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:x"}}
    assert body["messages"][1]["content"][2] == {"type": "image_url", "image_url": "data:y"}
    assert image_parts({"messages": "nope"}) == []


@pytest.mark.parametrize("url, allowed", [
    ("http://img.example:8080/a.png", ("img.example:8080",)),
    ("https://IMG.example/a.png", ("img.example",)),
    ("https://img.example/a.png", ("img.example:443",)),
    ("http://[::1]:9000/a.png", ("[::1]:9000",)),
    ("http://127.0.0.1:9000/a.png", ("other", "127.0.0.1")),
])
def test_allowed_hosts(url, allowed):
    check_remote(url, allowed, "p")


@pytest.mark.parametrize("url, allowed, code", [
    ("http://img.example:8081/a.png", ("img.example:8080",), "image_host_not_allowed"),
    ("http://evil.example/a.png", ("img.example",), "image_host_not_allowed"),
    ("http://img.example.evil/a.png", ("img.example",), "image_host_not_allowed"),
    ("http://localhost:9000/a.png", ("127.0.0.1:9000",), "image_host_not_allowed"),
    ("http://a.png", (), "image_host_not_allowed"),
    ("ftp://img.example/a.png", ("img.example",), "invalid_image_url"),
    ("http://img.example:99999/a.png", ("img.example",), "invalid_image_url"),
])
def test_refused_hosts(url, allowed, code):
    with pytest.raises(RouterError) as error:
        check_remote(url, allowed, "messages[0].content[0].image_url")
    assert (error.value.status, error.value.code, error.value.param) == (400, code,
                                                                         "messages[0].content[0].image_url")
