"""The router's startup (router/runtime.py): encoders that disagree on their vision fingerprint are
refused, naming each. In-process: no sockets."""

from __future__ import annotations

import pytest

from router.config import RouterConfig
from router.runtime import Router, StartupError
from tests.support.router_epd import FP, OTHER_FP

pytestmark = pytest.mark.unit


async def test_startup_refuses_encoders_that_disagree_on_the_fingerprint():
    router = Router(RouterConfig(encoder=("http://e:1", "http://e:2"), prefill=("http://p:1",),
                                 decode=("http://d:1",), redis_url="redis://127.0.0.1:1/0"))
    for w, fp in zip(router.registry.pools["encoder"].workers, (FP, OTHER_FP)):
        w.known, w.vision_fingerprint = True, fp
    with pytest.raises(StartupError) as error:
        router._vision_fingerprint()
    assert str(error.value) == ("the encoders disagree on their vision fingerprint (their image keys would differ; "
                                f"give --encoder servers of one model, dtype and image processor): http://e:1: {FP}, "
                                f"http://e:2: {OTHER_FP}")
    router.registry.pools["encoder"].workers[1].vision_fingerprint = FP
    assert router._vision_fingerprint() == FP
    await router.close()
