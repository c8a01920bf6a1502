"""RouterConfig (router/config.py): the mode follows from the roles given; a bad flag is refused
with a message that names it. Pure: no sockets."""

from __future__ import annotations

import pytest

from router.config import RouterConfig

pytestmark = pytest.mark.unit

P, D = "http://127.0.0.1:8100", "http://127.0.0.1:8200"


def test_mode_follows_from_the_roles():
    assert RouterConfig(colocated=("http://h:1",)).mode == "colocated"
    assert RouterConfig(prefill=(P,), decode=(D,)).mode == "pd"
    assert RouterConfig(prefill=(P,), decode=(D,), encoder=("http://h:3",), redis_url="redis://h:6379").mode == "epd"


@pytest.mark.parametrize("kwargs, message", [
    ({}, "no workers: give --colocated URL, or --prefill URL and --decode URL"),
    ({"prefill": (P,)}, "pd mode needs both --prefill and --decode workers; --decode is missing"),
    ({"decode": (D,)}, "pd mode needs both --prefill and --decode workers; --prefill is missing"),
    ({"colocated": ("http://h:1",), "decode": (D,)}, "--colocated cannot be mixed with --prefill, --decode or --encoder"),
    ({"prefill": (P,), "decode": (D,), "encoder": ("http://h:3",)}, "epd mode (--encoder given) needs --redis-url"),
    ({"colocated": ("h:1",)}, "--colocated takes http://host:port URLs, got 'h:1'"),
    ({"colocated": ("http://h:1/v1",)}, "--colocated takes http://host:port URLs without a path"),
    ({"colocated": ("http://h",)}, "--colocated takes http://host:port URLs, got 'http://h'"),
    ({"prefill": ("http://h:99999",), "decode": (D,)}, "--prefill takes http://host:port URLs, got 'http://h:99999'"),
    ({"colocated": ("http://[::1:80",)}, "--colocated takes http://host:port URLs, got 'http://[::1:80'"),
    ({"colocated": ("http://h:1", "http://h:1")}, "--colocated names the same URL twice"),
    ({"colocated": ("http://h:1",), "policy_decode": "random"}, "--policy-decode must be one of"),
    ({"colocated": ("http://h:1",), "policy_colocated": "cache_aware"}, "--policy-colocated must be one of"),
    ({"colocated": ("http://h:1",), "max_body_mb": 0}, "--max-body-mb must be > 0, got 0"),
    ({"colocated": ("http://h:1",), "max_in_flight": 0}, "--max-in-flight must be > 0, got 0"),
    ({"colocated": ("http://h:1",), "upstream_timeout_s": -1}, "--upstream-timeout-s must be > 0, got -1"),
    ({"colocated": ("http://h:1",), "retries": -1}, "--retries must be >= 0, got -1"),
    ({"colocated": ("http://h:1",), "allowed_image_hosts": ("http://x/",)}, "--allowed-image-hosts takes host"),
    ({"colocated": ("http://h:1",), "local_encode": "sometimes"}, "--local-encode must be one of"),
    ({"colocated": ("http://h:1",), "local_encode_queue": 0}, "--local-encode-queue must be > 0, got 0"),
    ({"colocated": ("http://h:1",), "auto_ratio_roles": ("encoder", "prefill")},
     "--auto-ratio-roles must be encoder,prefill,decode or prefill,decode (encoders fixed), got 'encoder,prefill'"),
])
def test_config_errors_name_the_flag(kwargs, message):
    with pytest.raises(ValueError) as error:
        RouterConfig(**kwargs)
    assert message in str(error.value)


def test_cache_aware_is_for_encoders():
    assert RouterConfig(prefill=(P,), decode=(D,), encoder=("http://h:3",), redis_url="redis://h",
                        policy_encoder="cache_aware").policy("encoder") == "cache_aware"
