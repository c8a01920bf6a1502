"""The pure parts of bench/epd_cache/: the subscriber's RESP parsing, the wake figures of a miss,
the distinct images of a round, the summary's ratios (the ones bench/README.md quotes), the goals and
the summary's figures (the benchmark itself is run by hand, bench/README.md)."""

from __future__ import annotations

import pytest

from bench.epd_cache.analysis import goals, same_texts, summarize, wake
from bench.epd_cache.landing import parse_pushes
from bench.epd_cache.report import figures
from bench.epd_cache.workload import ImageSource, plan_round

pytestmark = pytest.mark.unit

CONFIRM = b"*3\r\n$9\r\nsubscribe\r\n$10\r\nepd:events\r\n:1\r\n"
READY = b'{"kind":"ready","key":"ab","reason":""}'
MESSAGE = b"*3\r\n$7\r\nmessage\r\n$10\r\nepd:events\r\n$%d\r\n%s\r\n" % (len(READY), READY)


def test_parse_pushes_reads_whole_arrays_and_leaves_the_tail():
    buffer = CONFIRM + MESSAGE + MESSAGE[:-5]
    pushes, used = parse_pushes(buffer)
    assert pushes == [[b"subscribe", b"epd:events", b"1"], [b"message", b"epd:events", READY]]
    assert used == len(CONFIRM) + len(MESSAGE)
    assert parse_pushes(buffer[used:] + MESSAGE[-5:]) == ([[b"message", b"epd:events", READY]], len(MESSAGE))


@pytest.mark.parametrize("cut", [1, 4, 12, 20, len(MESSAGE) - 1])
def test_parse_pushes_waits_for_an_incomplete_array(cut):
    assert parse_pushes(MESSAGE[:cut]) == ([], 0)


def test_parse_pushes_refuses_what_is_not_an_array():
    with pytest.raises(ValueError, match="not a RESP array at byte 0"):
        parse_pushes(b"+OK\r\n")
    with pytest.raises(ValueError, match=r"unexpected RESP type b'\+'"):
        parse_pushes(b"*1\r\n+OK\r\n")


def _miss(landed, created, misses=2.0, **events):
    return {"case": "miss", "landed_at": landed, "created_at": created, "prefill_cache_misses": misses}, events


def test_wake_of_a_miss_that_waited():
    reply, events = _miss(100.0, 99.998, queued=99.5, paired=100.01, embeddings_ready=100.0015)
    assert wake(reply, events) == {"waited": True, "wake_ms": 1.5, "wake_upper_ms": 3.5,
                                    "queued_before_landing_ms": 500.0}  # pairing late holds nothing up


def test_wake_of_a_miss_queued_after_the_landing_or_without_a_cache_miss_did_not_wait():
    reply, events = _miss(100.0, 99.998, queued=100.005, paired=100.01, embeddings_ready=100.011)
    assert wake(reply, events)["waited"] is False
    reply, events = _miss(100.0, 99.998, misses=0.0, queued=99.5, paired=99.6, embeddings_ready=100.0015)
    assert wake(reply, events)["waited"] is False


def test_wake_falls_back_to_created_at_and_skips_hits():
    reply, events = _miss(None, 99.998, queued=99.5, paired=99.6, embeddings_ready=100.0015)
    assert wake(reply, events) == {"waited": True, "wake_upper_ms": 3.5, "queued_before_landing_ms": 498.0}
    assert wake({**reply, "case": "hit"}, events) == {"waited": False}


def test_a_round_never_repeats_an_image():
    source = ImageSource(size=32, salt=7)
    pairs = plan_round(source, [1, 4, 8], requests=3, round_index=1) + plan_round(source, [1, 4, 8], 3, 2)
    images = [p for pair in pairs for p in pair.pngs]
    assert [pair.n for pair in pairs[:6]] == [1, 4, 8, 1, 4, 8]
    assert [pair.index for pair in pairs[:6]] == [-1, -1, -1, 0, 0, 0]
    assert len(images) == 2 * 4 * 13 == len(set(images))


def _sample(n, case, ttft_ms, cpu, index=0, warmup=False, encoded=None, wake_ms=None, text="abc"):
    out = {"n": n, "case": case, "round": 1, "index": index, "warmup": warmup, "ttft_s": ttft_ms / 1e3,
           "cpu_ms": cpu, "prompt_tokens": 27 + 64 * n, "text": text, "room": 7,
           "encoded": n if encoded is None and case == "miss" else (encoded or 0),
           "prefill_events": {"queued": 1.0, "embeddings_ready": 1.002}, "prefill_cache_misses": 1.0,
           "waited": wake_ms is not None}
    if wake_ms is not None:
        out |= {"wake_ms": wake_ms, "wake_upper_ms": wake_ms + 1.0}
    return out


def _runs():
    epd_cpu = lambda e, p, d: {"encoder": e, "prefill": p, "decode": d, "router": 50, "redis": 1}  # noqa: E731
    epd = [_sample(1, "miss", 500.0, epd_cpu(0, 0, 0), index=-1, warmup=True),
           _sample(1, "hit", 100.0, epd_cpu(0, 0, 0), index=-1, warmup=True),
           _sample(1, "miss", 200.0, epd_cpu(100, 60, 40), wake_ms=1.2),
           _sample(1, "hit", 80.0, epd_cpu(0, 60, 40)),
           _sample(1, "miss", 300.0, epd_cpu(120, 60, 40), index=1, wake_ms=2.4),
           _sample(1, "hit", 150.0, epd_cpu(0, 60, 40), index=1, encoded=1)]
    coloc = [_sample(s["n"], s["case"], 250.0, {"colocated": 150, "router": 50}, index=s["index"],
                     warmup=s["warmup"], text="abc" if i != 3 else "abd") for i, s in enumerate(epd)]
    burst = {"unique_images": 12, "encoded": 12.0}
    return {"colocated": [{"samples": coloc, "burst": None}], "epd": [{"samples": epd, "burst": burst}]}


def test_summarize_gives_hit_over_miss_paired_cpu_and_vs_colocated():
    s = summarize(_runs(), [1])
    assert s["ttft_ms"]["epd"]["1"]["miss"] == {"n": 2, "median": 250.0, "p90": 300.0, "min": 200.0, "max": 300.0}
    assert s["ratio_hit_vs_miss"] == {"1": 0.46}  # 115 / 250, the warm-up pair left out
    assert s["ratio_hit_vs_miss_paired"]["1"]["median"] == 0.45  # 80/200 and 150/300
    assert s["cpu_ms"]["epd"]["1"]["miss"]["stages_median"] == 210 and s["ratio_hit_vs_miss_cpu"] == {"1": 0.476}
    assert s["ratio_epd_vs_colocated"] == {"1": {"miss": 1.0, "hit": 0.46}}
    calls = s["encoder_calls"]
    assert calls["ttft_workload"] == {"unique_images": 3, "encoded": 4, "calls_per_unique_image": 1.3333}
    assert calls["overall_calls_per_unique_image"] == round(16 / 15, 4)
    assert calls["requests_with_a_wrong_count"] == [{"n": 1, "case": "hit", "room": 7, "encoded": 1}]
    assert (s["wake_ms"]["all"]["median"], s["wake_ms"]["waited"], s["wake_ms"]["misses"]) == (1.8, 2, 3)
    assert same_texts(_runs()) == {"compared": 6, "differ": [{"round": 1, "n": 1, "case": "hit"}]}


def test_goals_and_figures_of_a_summary():
    s = summarize(_runs(), [1])
    assert goals(s) == {"hit_le_half_miss": {"1": True}, "hit_le_half_miss_paired": {"1": True},
                        "one_encode_per_unique_image": False, "wake_p50_under_2ms": True}
    named = {f.name: (f.value, f.unit) for f in figures(s, [1])}
    assert named["TTFT hit / miss, 1 image"] == (0.46, "x")
    assert named["TTFT hit / miss paired (median), 1 image"] == (0.45, "x")
    assert named["encoder calls per unique image"] == (1.0667, "calls")
    assert named["wake p50, landing -> waiting prefill starts"] == (1.8, "ms")
