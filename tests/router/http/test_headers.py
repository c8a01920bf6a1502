"""``router.http.request.Headers``: ``get`` (every header decoded once, any case, repeats joined) and
``first`` (one header found in the raw bytes, the others left undecoded)."""

from __future__ import annotations

import pytest

from router.http.request import Headers

pytestmark = pytest.mark.unit

RAW = [(b"Host", b"r:8080"), (b"TraceParent", b"00-ab-cd-01"), (b"X-Dup", b"a"), (b"x-dup", b"b")]


def test_first_finds_a_header_in_any_case_without_decoding_the_others():
    headers = Headers(RAW)
    assert headers.first(b"traceparent") == "00-ab-cd-01"
    assert headers.first(b"x-dup") == "a"  # the first of repeated ones
    assert headers.first(b"absent") is None and Headers().first(b"host") is None
    assert headers._by_name is None  # nothing else decoded


def test_get_decodes_every_header_once_and_joins_repeats():
    headers = Headers(RAW)
    assert headers.get("X-DUP") == "a, b" and headers.get("traceparent") == "00-ab-cd-01"
    assert headers.get("absent", "-") == "-"
