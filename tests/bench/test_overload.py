"""The pure parts of bench/overload/ and bench/soak/: each answer's check, the outcome summary, RSS
growth, the overload verdict, a series' growth after the warm-up, the ramp's capacity and the soak
verdict (the benchmarks themselves run in tests/bench/test_soak.py and by hand, bench/README.md)."""

from __future__ import annotations

import pytest

from bench.overload.analysis import check_outcome, refuser, rss_growth, summarize_outcomes, verdict
from bench.overload.client import body_ok
from bench.soak.analysis import Bounds, capacity, growth, growth_table, slope
from bench.soak.analysis import verdict as soak_verdict

pytestmark = pytest.mark.unit

OK = {"index": 0, "status": 200, "body_ok": True, "latency_s": 0.5}
BUSY = {"index": 1, "status": 503, "retry_after": "1", "code": "server_overloaded", "latency_s": 0.1,
        "message": "The decode stage failed: The server is at its limit of 12 requests in flight "
                   "(--max-num-seqs + --max-waiting)"}


@pytest.mark.parametrize("record, why", [
    (OK, None),
    (BUSY, None),
    ({"status": 429, "retry_after": "2"}, None),
    ({"status": 200, "body_ok": False}, "200 with an incomplete or wrong body"),
    ({"status": 503, "retry_after": None}, "503 without a valid Retry-After (None)"),
    ({"status": 429, "retry_after": "soon"}, "429 without a valid Retry-After ('soon')"),
    ({"status": 502, "code": "upstream_error"}, "status 502 (code upstream_error)"),
    ({"status": "timeout"}, "status timeout (code None)"),
])
def test_check_outcome_allows_only_whole_200s_and_refusals_with_retry_after(record, why):
    assert check_outcome(record) == why


def test_body_ok_needs_done_and_the_token_count():
    stream = 'data: {"choices":[]}\n\ndata: {"choices":[],"usage":{"completion_tokens":4}}\n\ndata: [DONE]\n\n'
    assert body_ok(stream, "text/event-stream", 4)
    assert not body_ok(stream, "text/event-stream", 5)
    assert not body_ok(stream.replace("data: [DONE]\n\n", ""), "text/event-stream", 4)
    assert body_ok('{"usage": {"completion_tokens": 4}}', "application/json", 4)
    assert not body_ok('{"usage": {"completion_tokens": 4}', "application/json", 4)


def test_summarize_outcomes_counts_statuses_codes_and_bad_answers():
    bad = {"index": 2, "status": 502, "code": "upstream_error", "latency_s": 1.0}
    out = summarize_outcomes([OK, BUSY, BUSY, bad])
    assert out["requests"] == 4 and out["by_status"] == {"200": 1, "502": 1, "503": 2}
    assert out["refusal_codes"] == {"server_overloaded": 2} and out["refused_by"] == {"decode": 2}
    assert out["bad_count"] == 1
    assert out["bad"] == [{"index": 2, "status": 502, "reason": "status 502 (code upstream_error)"}]
    assert out["latency_s"]["503"] == {"n": 2, "median": 0.1, "p90": 0.1, "min": 0.1, "max": 0.1}


def _sample(t, **rss):
    return {"t": t, **{name: None if v is None else {"rss_mib": v, "fds": 10, "threads": 3} for name, v in rss.items()}}


def test_rss_growth_is_peak_and_last_over_the_first_sample():
    samples = [_sample(0, router=50.0, decode=900.0), _sample(1, router=80.0, decode=950.0),
               _sample(2, router=60.0, decode=None)]
    out = rss_growth(samples, ["router", "decode"])
    assert out["router"] == {"baseline_mib": 50.0, "peak_mib": 80.0, "last_mib": 60.0,
                             "peak_growth_mib": 30.0, "last_growth_mib": 10.0}
    assert out["decode"]["peak_growth_mib"] == 50.0 and out["decode"]["last_mib"] is None


def test_overload_verdict_names_every_reason():
    outcomes = summarize_outcomes([OK, BUSY])
    fine = {"router": {"peak_growth_mib": 10.0}}
    assert verdict(outcomes, fine, 64, 2, True, {"router": True}) == {"ok": True, "reasons": []}
    out = verdict(summarize_outcomes([BUSY, {"status": "timeout", "latency_s": 60}]),
                  {"router": {"peak_growth_mib": 100.0}, "decode": {"peak_growth_mib": None}}, 64, 3, False,
                  {"router": False, "request": True})
    assert out == {"ok": False, "reasons": [
        "2 of 3 requests answered within the run's deadline", "1 answers not 200, 429 or 503 with Retry-After",
        "no request succeeded", "router: RSS grew 100.0 MiB > 64 MiB", "decode: RSS not measured (process gone?)",
        "router: not healthy after the burst"]}


FLAT = [(t * 30.0, 1000.0 + (t % 2)) for t in range(40)]  # 20 minutes, one sample every 30 s


def test_a_flat_series_passes_and_a_leak_fails():
    flat = growth(FLAT, 120, Bounds(), "rss_mib")
    assert flat["ok"] and flat["growth"] == 0 and flat["bound"] == 50.0 and flat["n"] == 36
    leak = growth([(t, v + t / 10) for t, v in FLAT], 120, Bounds(), "rss_mib")  # 6 MiB a minute
    assert not leak["ok"] and leak["growth"] == 72.0 and leak["slope_per_min"] == pytest.approx(6.0, abs=0.1)


def test_growth_during_the_warm_up_is_not_judged_and_one_spike_does_not_decide():
    series = [(t, 40.0 if t < 120 else 60.0) for t, _ in FLAT]
    series[-1] = (series[-1][0], 200.0)
    out = growth(series, 120, Bounds(), "fds")
    assert out["ok"] and out["growth"] == 0.0 and out["bound"] == 32.0


def test_growth_needs_enough_samples_after_the_warm_up():
    assert growth(FLAT[:6], 90, Bounds(), "threads") == {
        "n": 3, "ok": False, "reason": "3 samples after the warm-up, need 4"}


def test_slope_is_least_squares_per_second():
    assert slope([(0, 1), (1, 3), (2, 5)]) == pytest.approx(2.0)
    assert slope([(5, 1), (5, 9)]) == 0.0


def test_capacity_is_the_best_step():
    assert capacity([{"ok_per_s": 10.0}, {"ok_per_s": 14.5}, {"ok_per_s": 12.0}]) == 14.5
    assert capacity([]) == 0.0


def test_soak_verdict_fails_on_growth_bad_answers_or_no_capacity():
    samples = [{"t": t, "router": {"rss_mib": v, "fds": 10 + 2 * int(t // 30), "threads": 4}} for t, v in FLAT]
    table = growth_table(samples, ["router"], 120, Bounds())
    assert [m for m, g in table["router"].items() if not g["ok"]] == ["fds"]
    out = soak_verdict([OK, {"status": 500, "latency_s": 1}], table, 0.0)
    assert not out["ok"] and out["reasons"] == [
        "the ramp measured no capacity", "1 answers not 200, 429 or 503 with Retry-After",
        f"router fds: grew {table['router']['fds']['growth']} > 32.0"]
    flat = growth_table([{**s, "router": {**s["router"], "fds": 10}} for s in samples], ["router"], 120, Bounds())
    assert soak_verdict([OK, BUSY], flat, 5.0)["ok"]


@pytest.mark.parametrize("message, who", [
    ("The router is at its limit of 256 requests in flight (--max-in-flight); retry after 1 s.", "router"),
    ("The prefill stage failed: The server is at its limit of 12 requests in flight", "prefill"),
    (BUSY["message"], "decode"),
    ("busy", "other"),
    (None, "other"),
])
def test_refuser_reads_who_refused_from_the_message(message, who):
    assert refuser(message) == who
