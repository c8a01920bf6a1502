"""Pure logic of the router's admin API: the ratio formula and its hysteresis, the load window over
/metrics samples, pairing rules, the bearer-token check, the room logs (router and stage), split
checks and the `stage admin` table renderer. No sockets."""

from __future__ import annotations

import argparse

import pytest

from router.admin.auth import DISABLED, refusal
from cli.admin import render, table
from router.fleet.breaker import CircuitBreaker
from router.errors import RouterError
from router.fleet.load import History, Sample, parse_sample, role_loads
from router.config import RouterConfig
from router.fleet.membership import Membership
from router.fleet.splits import check_split
from router.metrics import Metrics
from router.fleet.pairing import Pairing, PairingRules
from router.plan.policy import RoundRobin
from router.fleet.registry import Registry
from router.plan.ratio import Hysteresis, RoleLoad, clamp_split, peak_load, recommend
from router.fleet.scrape import router_counters
from router.dispatch.timeline import RoomLog, RoomRecord, stage_workers
from router.upstream.client import Upstream
from router.fleet.workers import Worker
from stages.timeline import RoomTimeline

pytestmark = pytest.mark.unit

TOKEN = "s3cret-token-0123456789"
FP = {"model": "m", "backend": "mooncake", "block_size": 16}


def worker(url: str, role: str, group: str | None = None, fingerprint: dict | None = FP,
           switchable: bool = False) -> Worker:
    """A known, healthy worker; a switchable one takes prefill and decode (``stage serve pd``)."""
    return Worker(url, role, CircuitBreaker(1, 10.0), healthy=True, known=True, models=("m",),
                  fingerprint=fingerprint, group=group, switchable=switchable, id=url.rsplit(":", 1)[-1],
                  roles=("prefill", "decode") if switchable else ())


# --- ratio -------------------------------------------------------------------------------------
def test_recommend_gives_each_role_its_share_of_need():
    # need: E 100/50 = 2, P 3000/1000 = 3, D 500/100 = 5 -> 10 workers split 2:3:5
    loads = [RoleLoad("encoder", 3, 100, 50), RoleLoad("prefill", 3, 3000, 1000), RoleLoad("decode", 4, 500, 100)]
    assert recommend(loads, 10) == {"encoder": 2, "prefill": 3, "decode": 5}


def test_recommend_keeps_one_of_each_role_and_uses_largest_remainders():
    # need P 0.1, D 9.9: D would take all 4, but P keeps one
    assert recommend([RoleLoad("prefill", 2, 1, 10), RoleLoad("decode", 2, 99, 10)], 4) == {"prefill": 1, "decode": 3}
    # quotas 1.5 : 2.5 -> remainders tie at .5: the earlier role (prefill) gets the extra worker
    assert recommend([RoleLoad("prefill", 2, 3, 1), RoleLoad("decode", 2, 5, 1)], 4) == {"prefill": 2, "decode": 2}


def test_recommend_moves_the_right_way_from_decode_heavy_to_encode_heavy():
    pool = 6
    decode_heavy = [RoleLoad("encoder", 2, 5, 100), RoleLoad("prefill", 2, 200, 2000),
                    RoleLoad("decode", 2, 900, 150)]
    encode_heavy = [RoleLoad("encoder", 2, 400, 100), RoleLoad("prefill", 2, 3000, 2000),
                    RoleLoad("decode", 2, 60, 150)]
    a, b = recommend(decode_heavy, pool), recommend(encode_heavy, pool)
    assert a == {"encoder": 1, "prefill": 1, "decode": 4}
    assert b == {"encoder": 4, "prefill": 1, "decode": 1}  # quotas 4.07 : 1.53 : 0.41, decode kept at one
    assert b["encoder"] > a["encoder"] and b["decode"] < a["decode"]


def test_recommend_without_demand_or_with_too_few_workers_is_none():
    assert recommend([RoleLoad("prefill", 1, 0, None), RoleLoad("decode", 1, 0, 10)], 2) is None
    assert recommend([RoleLoad("prefill", 1, 5, 1), RoleLoad("decode", 1, 5, 1)], 1) is None


def test_a_role_never_busy_needs_no_more_than_its_minimum():
    assert RoleLoad("decode", 3, 50, None).need == 0.0  # one-token answers: the prefill made every token
    assert recommend([RoleLoad("prefill", 1, 100, 100), RoleLoad("decode", 3, 50, None)], 4) == \
        {"prefill": 3, "decode": 1}


def test_clamp_split_moves_only_switchable_workers():
    assert clamp_split({"prefill": 1, "decode": 5}, {"prefill": 2, "decode": 1}) == {"prefill": 2, "decode": 4}
    assert clamp_split({"prefill": 6, "decode": 0}, {"prefill": 0, "decode": 1}) == {"prefill": 5, "decode": 1}
    assert clamp_split({"prefill": 3, "decode": 3}, {}) == {"prefill": 3, "decode": 3}


def test_hysteresis_waits_for_a_stable_target_worth_a_switch():
    needs = {"prefill": 3.0, "decode": 1.0}
    current, better = {"prefill": 1, "decode": 3}, {"prefill": 3, "decode": 1}
    h = Hysteresis(stable_ticks=2, min_gain=0.2)
    assert peak_load(needs, current) == 3.0 and peak_load(needs, better) == 1.0
    assert h.decide(current, better, needs) is False  # first sight
    assert h.decide(current, better, needs) is True  # second tick in a row
    assert h.decide(current, better, needs) is False  # streak starts over after applying
    assert h.decide(current, {"prefill": 2, "decode": 2}, needs) is False  # another target resets the streak
    assert h.decide(current, better, needs) is False
    assert h.decide(current, current, needs) is False  # nothing to do resets too
    assert h.decide(current, better, needs) is False


def test_hysteresis_skips_a_switch_that_gains_too_little():
    needs = {"prefill": 2.0, "decode": 1.9}  # peak 2.0/2 = 1.0 now, 1.9/2... target 3:1 -> decode 1.9 > 1.0
    h = Hysteresis(stable_ticks=1, min_gain=0.2)
    assert h.decide({"prefill": 2, "decode": 2}, {"prefill": 3, "decode": 1}, needs) is False
    assert h.decide({"prefill": 1, "decode": 3}, {"prefill": 2, "decode": 2}, needs) is True  # 2.0 -> 1.0


# --- load window -------------------------------------------------------------------------------
METRICS = """# TYPE epd_engine_step_seconds histogram
epd_engine_step_seconds_bucket{le="+Inf"} 10.0
epd_engine_step_seconds_count 10.0
epd_engine_step_seconds_sum %(busy)s
# TYPE epd_prompt_tokens_total counter
epd_prompt_tokens_total %(prompt)s
# TYPE epd_generation_tokens_total counter
epd_generation_tokens_total %(gen)s
# TYPE epd_queue_depth gauge
epd_queue_depth 2.0
# TYPE epd_running_requests gauge
epd_running_requests 1.0
# TYPE epd_kv_blocks_used gauge
epd_kv_blocks_used 7.0
"""


def metrics_text(busy: float, prompt: float, gen: float) -> str:
    return METRICS % {"busy": busy, "prompt": prompt, "gen": gen}


def test_parse_sample_reads_busy_time_and_the_roles_units():
    p = parse_sample("prefill", metrics_text(1.5, 300, 4), at=10.0)
    d = parse_sample("decode", metrics_text(1.5, 300, 4), at=10.0)
    assert (p.busy_s, p.units, p.queue_depth, p.running, p.kv_blocks_used) == (1.5, 300, 2.0, 1.0, 7.0)
    assert d.units == 4
    e = parse_sample("encoder", "# TYPE epd_encoder_seconds histogram\nepd_encoder_seconds_sum 0.5\n"
                     "epd_encoder_seconds_count 2.0\n# TYPE epd_encoder_images_encoded_total counter\n"
                     "epd_encoder_images_encoded_total 8.0\n", at=1.0)
    assert (e.busy_s, e.units, e.kv_blocks_used) == (0.5, 8.0, None)
    # a video's sampled frames count in the encoder's units as images do (the ratio's encoder demand)
    v = parse_sample("encoder", "# TYPE epd_encoder_images_encoded_total counter\nepd_encoder_images_encoded_total 8.0\n"
                     "# TYPE epd_encoder_video_frames_encoded_total counter\n"
                     "epd_encoder_video_frames_encoded_total 64.0\n", at=1.0)
    assert v.units == 72.0


def test_history_sums_increases_per_role_over_the_window():
    h = History(window_s=10.0)
    for t, busy, prompt in [(0, 0, 0), (5, 1, 1000), (10, 2, 2000), (15, 4, 5000)]:
        h.add("w1", parse_sample("prefill", metrics_text(busy, prompt, 0), at=t))
        h.add_router(t, {"images": t})
    loads, report = role_loads(h, now=15.0, window_s=10.0, workers={"prefill": 2}, roles=["prefill"])
    assert loads == [RoleLoad("prefill", 2, 4000 / 10, 4000 / 3)]  # intervals ending after t=5: 5->10, 10->15
    assert report["prefill"]["utilization"] == pytest.approx(3 / (10 * 2))
    assert h.router_increase(15.0, 10.0, "images") == 10


def test_history_drops_intervals_across_a_role_switch_and_survives_a_restart():
    h = History(window_s=100.0)
    h.add_router(0, {})
    samples = [Sample(0, "decode", 0, 0, 0, 0, 0), Sample(1, "decode", 1, 100, 0, 0, 0),
               Sample(2, "prefill", 1.5, 900, 0, 0, 0),  # switched: this interval counts for nobody
               Sample(3, "prefill", 2.5, 1900, 0, 0, 0),
               Sample(4, "prefill", 0.5, 300, 0, 0, 0)]  # restarted: counters went down, count from zero
    for s in samples:
        h.add("w1", s)
    totals = h.role_totals(now=4.0, window_s=100.0)
    assert (totals["decode"].units, totals["decode"].busy_s) == (100, 1)
    assert (totals["prefill"].units, totals["prefill"].busy_s) == (1000 + 300, 1.0 + 0.5)


def test_the_router_counters_count_every_image_hit_or_miss():
    """The ratio's encode demand is every image received, whatever the cache said of it."""
    metrics = Metrics()
    assert router_counters(metrics)["images"] == 0.0
    metrics.images.labels(cache="hit").inc(2)
    metrics.images.labels(cache="miss").inc(3)
    metrics.ttft.observe(0.5)
    counters = router_counters(metrics)
    assert (counters["images"], counters["ttft_sum"], counters["ttft_count"], counters["tpot_count"]) == (5, 0.5, 1, 0)


def test_history_keeps_one_sample_before_the_window_as_its_baseline():
    h = History(window_s=2.0)
    for t in range(10):
        h.add("w1", Sample(float(t), "decode", float(t), 10.0 * t, 0, 0, 0))
    assert h.role_totals(now=9.0, window_s=2.0)["decode"].units == 20.0
    assert len(h._workers["w1"]) == 3  # t = 7 (baseline), 8, 9


# --- pairing -----------------------------------------------------------------------------------
def test_pairing_rules_by_group_with_links_and_by_transfer():
    pa, pb = worker("http://p:1", "prefill", "a"), worker("http://p:2", "prefill", "b")
    pnone = worker("http://p:3", "prefill")
    da, db = worker("http://d:1", "decode", "a"), worker("http://d:2", "decode", "b")
    rules = PairingRules.from_json({"by": "group", "links": {"a": ["a", "b"]}})
    assert [rules.allows(p, d) for p in (pa, pb, pnone) for d in (da, db)] == [True, True, False, True, False, False]
    assert PairingRules.from_json({"by": "group"}).allows(pnone, worker("http://d:3", "decode"))  # both "default"
    nixl = worker("http://d:4", "decode", fingerprint={**FP, "backend": "nixl"})
    by_transfer = PairingRules.from_json({"by": "transfer"})
    assert by_transfer.allows(pa, db) and not by_transfer.allows(pa, nixl)
    assert PairingRules().allows(pa, db) and PairingRules().to_json() == {"by": "any", "links": {}}


SHAPE = 'pairing rules are {"by": "any" | "group" | "transfer", "links"?: {label: [labels]}}'


@pytest.mark.parametrize("body, message", [
    ({"by": "rack"}, "pairing 'by' must be one of ['any', 'group', 'transfer'], got 'rack'"),
    ({"by": "any", "links": {"a": ["b"]}}, "pairing 'links' need 'by': 'group' or 'transfer'"),
    ({"by": "group", "links": {"a": "b"}}, "pairing 'links' maps a label to a list of labels, got {'a': 'b'}"),
    ({"by": "group", "links": {"a": [""]}}, "pairing 'links' maps a label to a list of labels, got 'a': ('',)"),
    ({"by": "group", "extra": 1}, SHAPE),
    ([1], SHAPE),
])
def test_bad_pairing_rules_say_what_is_wrong(body, message):
    with pytest.raises(ValueError) as error:
        PairingRules.from_json(body)
    assert str(error.value) == message


def test_pairing_state_says_why_a_pair_is_never_built():
    pairing = Pairing(PairingRules.from_json({"by": "group"}))
    pa, da = worker("http://p:1", "prefill", "a"), worker("http://d:1", "decode", "a")
    db = worker("http://d:2", "decode", "b")
    odd = worker("http://d:3", "decode", "a", fingerprint={**FP, "block_size": 32})
    assert pairing.pairable(pa, da) and pairing.why_not(pa, da) is None
    assert pairing.why_not(pa, db) == "pairing rules (by group (each label feeds its own))"
    assert pairing.why_not(pa, odd) == "fingerprints differ: block_size: 16 != 32"
    pairing.refused.add((pa.url, da.url))
    assert not pairing.pairable(pa, da)
    assert pairing.why_not(pa, da).startswith("the decode did not register the prefill's bootstrap address")


# --- auth --------------------------------------------------------------------------------------
def test_admin_auth():
    disabled = refusal(None, f"Bearer {TOKEN}")
    assert (disabled.status, disabled.message, disabled.code) == (403, DISABLED, "admin_disabled")
    assert DISABLED == ("admin API disabled: start the router with --admin-token or the EPD_ADMIN_TOKEN environment "
                        "variable (stage up takes the same flag and variable)")
    for header, message in [(None, "missing admin token: send Authorization: Bearer <token>"),
                            ("Basic abc", "missing admin token: send Authorization: Bearer <token>"),
                            ("Bearer wrong", "wrong admin token"), (f"bearer {TOKEN}", "missing admin token: "
                                                                    "send Authorization: Bearer <token>"),
                            (f"Bearer {TOKEN}x", "wrong admin token")]:
        error = refusal(TOKEN, header)
        assert (error.status, error.message, error.headers) == (401, message, {"WWW-Authenticate": "Bearer"})
    assert refusal(TOKEN, f"Bearer {TOKEN}") is None


# --- room logs ---------------------------------------------------------------------------------
def test_room_log_keeps_the_last_rooms_and_lists_the_slowest():
    log = RoomLog(capacity=3)
    for room, seconds in [(1, 0.5), (2, 3.0), (3, 1.0), (4, 2.0)]:
        log.open(RoomRecord(room, received=100.0, dispatched=100.0, stream=True)).done = 100.0 + seconds
    log.open(RoomRecord(5, received=100.0, dispatched=100.0, stream=False))  # still running: not listed
    assert log.get(1) is None and log.get(2) is None and len(log) == 3
    assert [r.room for r in log.slowest(10)] == [4, 3]
    record = log.get(4)
    assert [e["event"] for e in record.events()] == ["received", "dispatched", "done"]


def test_stage_timeline_is_bounded_and_ordered():
    timeline = RoomTimeline(capacity=2)
    timeline.mark(1, "queued")
    timeline.mark(2, "queued")
    timeline.mark(1, "prefilled", prompt_tokens=9)
    timeline.mark(3, "queued")
    assert timeline.events(1) is None
    assert [e["event"] for e in timeline.events(2)] == ["queued"]
    timeline.mark(2, "kv_written", bytes=8192, seconds=0.01)
    events = timeline.events(2)
    assert events[1]["bytes"] == 8192 and events[0]["t"] <= events[1]["t"]


# --- split checks and tables -------------------------------------------------------------------
def test_check_split():
    ps = [worker("http://p:1", "prefill"), worker("http://p:2", "prefill", switchable=True)]
    ds = [worker("http://d:1", "decode"), worker("http://d:2", "decode", switchable=True)]
    pools = {"prefill": ps, "decode": ds}
    assert check_split({"prefill": 1, "decode": 3}, pools) == {"prefill": 1, "decode": 3}
    check_split({"prefill": 3, "decode": 1}, pools)
    for prefill, decode, status, message in [
        (0, 4, 400, 'a split is {"prefill": n, "decode": m}, each an integer >= 1'),
        (True, 3, 400, 'a split is {"prefill": n, "decode": m}, each an integer >= 1'),
        (2, 3, 400, "the pool has 4 prefill and decode workers; prefill + decode must be 4, got 2 + 3"),
    ]:
        with pytest.raises(RouterError) as error:
            check_split({"prefill": prefill, "decode": decode}, pools)
        assert (error.value.status, error.value.message) == (status, message)
    with pytest.raises(RouterError) as error:
        check_split({"prefill": 1, "decode": 3}, {"prefill": [worker("http://p:1", "prefill")] * 2, "decode": ds})
    assert error.value.status == 409 and error.value.message == (
        "only switchable workers (stage serve pd) change roles: 2 prefill and 1 decode workers are fixed, so "
        "prefill must be >= 2 and decode >= 1")


def test_tables_are_aligned_and_show_missing_values_as_dashes():
    assert table([{"a": "w1", "b": None}, {"a": "w12", "b": 0.12345}], [("ID", lambda r: r["a"]),
                                                                         ("LOAD", lambda r: r["b"])]) == \
        "ID   LOAD\nw1   -\nw12  0.123"
    args = argparse.Namespace(admin_command="drain")
    answer = {"worker": {"id": "w3", "role": "decode", "url": "http://d:1", "outstanding": 2}, "idle": False}
    assert render(args, answer) == "w3 (decode http://d:1): draining, 2 request(s) in flight"


def test_the_slowest_rooms_table_names_each_stages_workers():
    rooms = [{"room": 7, "seconds": 1.5, "outcome": "success", "workers": {
                 "encoder": {"id": "w1"}, "encoder2": {"id": "w2"}, "prefill": {"id": "w3"}, "decode": {"id": "w4"}}},
             {"room": 8, "seconds": 0.25, "outcome": "success", "workers": {"prefill": {"id": "w3"},
                                                                            "decode": {"id": "w4"}}}]
    args = argparse.Namespace(admin_command="room")
    assert render(args, {"kept": 2, "capacity": 8, "rooms": rooms}) == (
        "ROOM  SECONDS  OUTCOME  ENCODER  PREFILL  DECODE\n"
        "7     1.5      success  w1,w2    w3       w4\n"
        "8     0.25     success  -        w3       w4")


def test_stage_workers_keys_a_repeated_stage_by_number():
    ws = [worker("http://e:1", "encoder"), worker("http://e:2", "encoder"), worker("http://p:1", "prefill")]
    assert stage_workers([("decode", ws[2]), ("encoder", ws[0]), ("encoder", ws[1]), ("prefill", ws[2])]) == {
        "decode": {"id": "1", "url": "http://p:1"}, "encoder": {"id": "1", "url": "http://e:1"},
        "encoder2": {"id": "2", "url": "http://e:2"}, "prefill": {"id": "1", "url": "http://p:1"}}


# --- membership, without sockets ---------------------------------------------------------------
def membership_of(prefills: list[Worker], decodes: list[Worker]) -> Membership:
    registry = Registry("pd", {"prefill": RoundRobin(), "decode": RoundRobin()}, Metrics(),
                        lambda: CircuitBreaker(1, 10.0))
    for w in [*prefills, *decodes]:
        registry.add(w)
    config = RouterConfig(prefill=("http://p:1",), decode=("http://d:1",))
    return Membership(config, registry, Upstream(config), Pairing(), _no_schema)


async def _no_schema(workers: list[Worker]) -> None:
    pass


def test_a_new_worker_must_fit_its_peers():
    membership = membership_of([worker("http://p:1", "prefill")], [worker("http://d:1", "decode")])
    membership._check_fits(worker("http://d:2", "decode"))
    with pytest.raises(RouterError) as error:
        membership._check_fits(worker("http://d:3", "decode", fingerprint={**FP, "block_size": 32}))
    assert (error.value.status, error.value.code, error.value.message) == (
        409, "worker_misfit", "http://d:3 can never be paired: its fingerprint matches no prefill (against w1 "
        "http://p:1: block_size: 32 != 16)")


async def test_a_split_moves_only_switchable_workers_not_drained():
    x = worker("http://x:1", "prefill", switchable=True)
    membership = membership_of([worker("http://p:1", "prefill"), x], [worker("http://d:1", "decode")])
    x.draining = True
    with pytest.raises(RouterError) as error:
        await membership.apply_split({"prefill": 1, "decode": 2})
    assert (error.value.status, error.value.message) == (
        409, "1 prefill worker(s) must switch, but only 0 are switchable and not drained (resume drained ones first)")
