"""The rig over IPv6: 1E1P1D over NIXL with every address the stages are given an IPv6 one
(``[addr]:port`` in every URL, ``--allowed-bootstrap``, the Redis URL): greedy parity with
``generate()`` through the router, one image, stream and not; no wildcard listener on any host.

NIXL, not Mooncake: Mooncake's handshake dials IPv4 only, and a prefill or decode refuses an
IPv6-only ``--transfer-host`` with Mooncake at start, saying so (checked here too)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.support.generated_models import model_dir
from tests.multihost.rig import HOSTS
from tests.multihost.stack import CASES, VARIANT, Reference, Stack, ask, case_images, start_stack

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def stack(make_rig) -> Iterator[Stack]:
    yield start_stack(make_rig(6), "nixl", encoders=("e1",), prefills=("p1",), decodes=("d1",))


@pytest.fixture(scope="module")
def reference() -> Reference:
    return Reference()


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_router_answer_equals_generate_over_ipv6(stack, reference, stream):
    assert stack.router.url.startswith("http://[fd00:e9d::")
    text = CASES["one_image"][0]
    images = case_images("one_image", 30 + stream)
    answer, usage = stack.rig.client(ask, stack.router.base_url, text, images, stream)
    expected, prompt_tokens, completion_tokens = reference.expected(text, images)
    assert answer == expected
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, completion_tokens)
    deadline = time.monotonic() + 10
    while any(used := stack.blocks_used()):
        assert time.monotonic() < deadline, f"KV blocks still in use on (p1, d1): {used}"
        time.sleep(0.1)


def test_no_wildcard_listener_on_any_host_over_ipv6(stack):
    stack.rig.client(ask, stack.router.base_url, "hi", case_images("one_image", 39), False)
    for host in HOSTS:
        found = stack.rig.listeners(host)
        assert not [item for item in found if item[0] in ("0.0.0.0", "::")], (host, found)
        # on the host's own addresses; IPv4 is allowed because NIXL's UCX listener binds the
        # interface's IPv4 address even when --transfer-host is IPv6 (reported on issue 16)
        assert {a for a, _ in found} <= {stack.rig.addr(host, 4), stack.rig.addr(host, 6)}, (host, found)
    for server in (stack.router, *stack.stages):  # each HTTP port on the IPv6 address it was given
        assert (stack.rig.addr(server.host, 6), server.port) in stack.rig.listeners(server.host)


def test_mooncake_refuses_an_ipv6_only_transfer_host_at_start(stack):
    with pytest.raises(RuntimeError) as failed:
        stack.rig.start("p2", "prefill", "--model", str(model_dir(VARIANT)), "--kv-cache-mib", "16",
                        "--transfer", "mooncake", timeout_s=60)
    assert "Mooncake's handshake dials IPv4 only" in str(failed.value)

