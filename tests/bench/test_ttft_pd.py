"""The pure parts of bench/ttft_pd/: a workload's TTFT and KV figures, the rounds pooled, PD /
colocated (the ratios bench/README.md quotes), the same-text check, hit and miss workloads, the
TTFT's breakdown from the room timelines and the summary's figures."""

from __future__ import annotations

import math

import pytest

from bench.ttft_pd.analysis import (CHAIN, breakdown, cache_problems, median_breakdown, merge_runs,
                                     ratios_vs_colocated, same_texts, summarize)
from bench.ttft_pd.report import figures, label
from bench.ttft_pd.workload import CACHE, HIT_NUMBER, WORKLOADS, Bodies, request_number, tag

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0  # a wall-clock send time


def timelines(sent=T0, wait=None, overlap=False, paired=5.0):
    """A PD request's two timelines: P queued 1 ms after the send, paired at 5 (or ``paired``),
    (embeddings at 1 + ``wait``), prefilled at 15, kv_written 17 (2 ms after both), ready_sent 17.5;
    D queued at 2, reserved 3, kv_ready 18, first_token 25."""
    late = max(0.0, paired - 15)
    p = [("queued", 1), ("paired", paired), ("prefilled", 15), ("kv_written", 17 + late), ("ready_sent", 17.5 + late)]
    prefill = sorted(({"event": e, "t": sent + ms / 1e3} for e, ms in p), key=lambda e: e["t"])
    if wait is not None:
        ready = {"event": "embeddings_ready", "t": sent + (1 + wait) / 1e3}
        prefill.insert(2, {**ready, "overlap_s": 0.001, "computed_tokens": 30} if overlap else ready)
    d = [("queued", 2), ("blocks_reserved", 3), ("kv_requested", 6), ("kv_ready", 18), ("first_token", 25),
         ("finished", 40)]
    return prefill, [{"event": e, "t": sent + ms / 1e3} for e, ms in d]


def sample(ttft_ms, warmup=False, kv=False, text="abc", number=1, cached=0):
    out = {"ttft_s": ttft_ms / 1e3, "first_chunk_s": ttft_ms / 2e3, "total_s": ttft_ms / 1e3 + 0.1, "text": text,
           "prompt_tokens": 20, "completion_tokens": 8, "cached_tokens": cached, "server_cpu_s": {"colocated": 0.05},
           "number": number}
    if kv:
        prefill, decode = timelines()
        out |= {"kv_write_s": 0.002, "kv_bytes": 4_000_000, "kv_writes": 1, "prefill_reply_s": 0.03,
                "server_cpu_s": {"prefill": 0.04, "decode": 0.02}, "sent_t": T0, "prefill_events": prefill,
                "decode_events": decode}
    return {**out, "warmup": True} if warmup else out


def test_summarize_leaves_the_warmup_out_and_gives_the_kv_write():
    s = summarize([sample(900.0, warmup=True), sample(40.0), sample(30.0), sample(50.0)])
    assert (s["n"], s["ttft_ms_median"], s["ttft_ms_p90"], s["ttft_ms_min"], s["warmup_ttft_ms"]) == \
        (3, 40.0, 50.0, 30.0, 900.0)
    assert "kv_write_ms_median" not in s and "breakdown_ms_median" not in s
    assert s["server_cpu_s_median"] == {"colocated": 0.05} and s["cached_tokens_median"] == 0
    pd = summarize([sample(50.0, kv=True), sample(60.0, kv=True)])
    assert (pd["kv_write_ms_median"], pd["kv_bytes"], pd["kv_gbps_median"]) == (2.0, 4_000_000, 2.0)
    assert pd["breakdown_ms_median"]["n"] == 2 and pd["breakdown_ms_median"]["handshake"] == 4.0


def test_rounds_are_pooled_and_pd_over_colocated_is_the_ratio_of_medians():
    coloc = merge_runs("colocated", [{"samples": {"text_short": [sample(40.0, number=1)]}},
                                     {"samples": {"text_short": [sample(60.0, number=2)]}}], ["text_short"])
    pd = merge_runs("pd-nixl", [{"samples": {"text_short": [sample(62.0, kv=True, number=1),
                                                            sample(63.0, kv=True, number=2)]}}], ["text_short"])
    assert coloc["workloads"]["text_short"]["ttft_ms_median"] == 50.0 and len(coloc["runs"]) == 2
    assert coloc["texts"] == {"text_short": {"1": "abc", "2": "abc"}}
    ratios = ratios_vs_colocated([coloc, pd], ["text_short"])
    assert ratios == {"pd-nixl": {"text_short": 1.25}}
    assert ratios_vs_colocated([pd], ["text_short"]) == {}
    names = [(f.name, f.value, f.unit) for f in figures([coloc, pd], ratios, ["text_short"])]
    assert names[:3] == [
        ("text_short (miss): TTFT p50, colocated", 50.0, "ms"), ("text_short (miss): TTFT p50, pd-nixl", 62.5, "ms"),
        ("text_short (miss): TTFT pd-nixl / colocated", 1.25, "x")]
    # the short text's breakdown goes into the summary, the chain in order, for the PD phase only
    assert [n for n, _, _ in names[3:]] == [f"text_short (miss): pd-nixl {name} ({what}) p50" for name, what in CHAIN]
    assert [v for _, v, _ in names[3:]] == [1.0, 14.0, 0.0, 2.0, 0.5, 0.5, 7.0, 37.5]


def test_cache_problems_hold_each_workload_to_its_label():
    def phase(cached):
        return {"phase": "pd-nixl", "workloads": {"text_short": {"cached_tokens_median": cached},
                                                  "text_2k_hit": {"cached_tokens_median": 1984 if cached else 0}}}

    cache = {"text_short": "miss", "text_2k_hit": "hit"}
    assert cache_problems([phase(0)], ["text_short"], cache) == []
    assert cache_problems([phase(16)], ["text_short", "text_2k_hit"], cache) == [
        "pd-nixl text_short: a miss workload, but 16 prompt tokens came from the cache"]
    assert cache_problems([phase(0)], ["text_2k_hit"], cache) == [
        "pd-nixl text_2k_hit: a hit workload, but no prompt token came from the cache"]
    assert cache_problems([{"phase": "x", "workloads": {"text_short": {"cached_tokens_median": None}}}],
                          ["text_short"], cache) == []  # not reported: no claim either way


def test_same_texts_compares_the_replies_to_the_same_prompts():
    base = {"texts": {"w": {"1": "a", "2": "b"}}}
    assert same_texts({"texts": {"w": {"1": "a", "2": "b", "3": "z"}}}, base, "w")
    assert not same_texts({"texts": {"w": {"1": "a", "2": "c"}}}, base, "w")
    assert not same_texts({"texts": {"w": {"9": "a"}}}, base, "w")  # nothing shared: no evidence, not "yes"


def test_breakdown_follows_the_chain_and_adds_up_to_the_ttft():
    prefill, decode = timelines()
    b = breakdown({"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill, "decode_events": decode})
    assert b == {"arrival_p": 1.0, "p_compute": 14.0, "pair_wait": 0.0, "kv_write": 2.0, "ready_send": 0.5,
                 "ready_to_d": 0.5, "d_first_step": 7.0, "to_client": 2.0, "handshake": 4.0, "embeddings_wait": 0.0,
                 "arrival_d": 2.0, "d_reserve": 1.0, "unaccounted": 0.0}
    assert math.isclose(sum(b[name] for name, _ in CHAIN), 27.0)


def test_breakdown_puts_a_pairing_later_than_the_forward_on_the_chain():
    prefill, decode = timelines(paired=20.0)  # the decode's KV request came 5 ms after the forward ended
    b = breakdown({"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill, "decode_events": decode})
    assert b is not None and (b["p_compute"], b["pair_wait"], b["kv_write"], b["handshake"]) == (14.0, 5.0, 2.0, 19.0)


def test_breakdown_takes_the_embeddings_wait_out_of_the_compute_only_without_overlap():
    prefill, decode = timelines(wait=2.0)
    b = breakdown({"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill, "decode_events": decode})
    assert b is not None and (b["p_compute"], b["embeddings_wait"], b["unaccounted"]) == (12.0, 2.0, 0.0)
    prefill, decode = timelines(wait=2.0, overlap=True)  # overlapped: the compute holds the wait
    b = breakdown({"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill, "decode_events": decode})
    assert b is not None and (b["p_compute"], b["embeddings_wait"]) == (14.0, 0.0)


def test_breakdown_is_none_without_timelines_or_with_an_event_missing():
    assert breakdown({"ttft_s": 0.02}) is None  # colocated
    prefill, decode = timelines()
    assert breakdown({"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill[:-1], "decode_events": decode}) is None
    assert breakdown({"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill, "decode_events": None}) is None
    assert median_breakdown([{"ttft_s": 0.02}]) is None
    # a missing side event is left out of that phase's median, not a failure
    no_queue = [e for e in decode if e["event"] != "queued"]
    b = median_breakdown([{"sent_t": T0, "ttft_s": 0.027, "prefill_events": prefill, "decode_events": no_queue}])
    assert b is not None and (b["n"], b["arrival_d"], b["d_reserve"], b["handshake"]) == (1, None, None, 4.0)


def test_every_workload_says_hit_or_miss_and_a_miss_never_repeats_a_prompt():
    assert set(CACHE) == set(WORKLOADS) and set(CACHE.values()) == {"hit", "miss"}
    assert label("text_2k_hit") == "text_2k_hit (hit)" and label("text_2k") == "text_2k (miss)"
    bodies = Bodies(tuple(WORKLOADS), "Summarize this: words", 8)
    misses = [request_number(w, r, i) for w in WORKLOADS if CACHE[w] == "miss" for r in (1, 2) for i in range(-1, 20)]
    assert len(set(misses)) == len(misses) and HIT_NUMBER not in misses  # distinct across workloads too
    assert {request_number("text_2k_hit", r, i) for r in (1, 2) for i in range(-1, 20)} == {HIT_NUMBER}
    assert request_number("image_64", 2, 4) == 210005
    with pytest.raises(ValueError):
        request_number("text_short", 10, 0)
    # the number leads the system turn, fixed width: the prompt length is the same for every request
    for w in WORKLOADS:
        first = bodies.body(w, 7)["messages"][0]
        assert first == {"role": "system", "content": "000007 You are a helpful assistant."}
    assert len(tag(123456)) == len(tag(7)) == 6
    assert bodies.body("image_64", 7)["messages"][1]["content"][0]["type"] == "image_url"
    assert bodies.body("text_2k", 5)["messages"][1]["content"][0]["text"] == "Summarize this: words"
    with pytest.raises(ValueError):
        tag(10**6)
