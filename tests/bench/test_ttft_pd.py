"""The pure parts of bench/ttft_pd/: a workload's TTFT and KV figures, the rounds pooled, PD /
colocated (the ratios bench/README.md quotes) and the summary's figures."""

from __future__ import annotations

import pytest

from bench.ttft_pd.analysis import merge_runs, ratios_vs_colocated, summarize
from bench.ttft_pd.report import figures

pytestmark = pytest.mark.unit


def sample(ttft_ms, warmup=False, kv=False, text="abc"):
    out = {"ttft_s": ttft_ms / 1e3, "first_chunk_s": ttft_ms / 2e3, "total_s": ttft_ms / 1e3 + 0.1, "text": text,
           "prompt_tokens": 20, "completion_tokens": 8, "server_cpu_s": {"colocated": 0.05}}
    if kv:
        out |= {"kv_write_s": 0.002, "kv_bytes": 4_000_000, "kv_writes": 1, "prefill_reply_s": 0.03,
                "server_cpu_s": {"prefill": 0.04, "decode": 0.02}}
    return {**out, "warmup": True} if warmup else out


def test_summarize_leaves_the_warmup_out_and_gives_the_kv_write():
    s = summarize([sample(900.0, warmup=True), sample(40.0), sample(30.0), sample(50.0)])
    assert (s["n"], s["ttft_ms_median"], s["ttft_ms_p90"], s["ttft_ms_min"], s["warmup_ttft_ms"]) == \
        (3, 40.0, 50.0, 30.0, 900.0)
    assert "kv_write_ms_median" not in s and s["server_cpu_s_median"] == {"colocated": 0.05}
    pd = summarize([sample(50.0, kv=True), sample(60.0, kv=True)])
    assert (pd["kv_write_ms_median"], pd["kv_bytes"], pd["kv_gbps_median"]) == (2.0, 4_000_000, 2.0)


def test_rounds_are_pooled_and_pd_over_colocated_is_the_ratio_of_medians():
    coloc = merge_runs("colocated", [{"samples": {"text_short": [sample(40.0)]}},
                                     {"samples": {"text_short": [sample(60.0)]}}], ["text_short"])
    pd = merge_runs("pd-nixl", [{"samples": {"text_short": [sample(62.0, kv=True), sample(63.0, kv=True, text="x")]}}],
                    ["text_short"])
    assert coloc["workloads"]["text_short"]["ttft_ms_median"] == 50.0 and len(coloc["runs"]) == 2
    assert pd["distinct_texts"] == {"text_short": 2}
    ratios = ratios_vs_colocated([coloc, pd], ["text_short"])
    assert ratios == {"pd-nixl": {"text_short": 1.25}}
    assert ratios_vs_colocated([pd], ["text_short"]) == {}
    assert [(f.name, f.value, f.unit) for f in figures([coloc, pd], ratios, ["text_short"])] == [
        ("text_short: TTFT p50, colocated", 50.0, "ms"), ("text_short: TTFT p50, pd-nixl", 62.5, "ms"),
        ("text_short: TTFT pd-nixl / colocated", 1.25, "x")]
