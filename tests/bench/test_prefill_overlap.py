"""The pure parts of bench/prefill_overlap/: the prefill's overlap figures and the encoder's time from
the room timelines, the medians per system and image count, the ratios and their goals, the same-text
check, the summary's figures, and a workload where every request misses both caches."""

from __future__ import annotations

import pytest

from bench.prefill_overlap.analysis import encode_ms, prefill_figures, same_text, summarize, summarize_all
from bench.prefill_overlap.report import figures
from bench.prefill_overlap.workload import Bodies, plan_round

pytestmark = pytest.mark.unit

T0 = 1_700_000_000.0


def prefill_events(overlap: bool):
    """Paired at 0; with overlap the last embedding at 300 ms (request in the engine 0.3 s, 800 tokens
    computed) and prefilled at 500; without, embeddings_ready at 300 and prefilled at 800."""
    if overlap:
        return [{"event": "queued", "t": T0}, {"event": "paired", "t": T0},
                {"event": "embeddings_ready", "t": T0 + 0.3, "overlap_s": 0.3, "computed_tokens": 800},
                {"event": "prefilled", "t": T0 + 0.5}]
    return [{"event": "queued", "t": T0}, {"event": "paired", "t": T0}, {"event": "embeddings_ready", "t": T0 + 0.3},
            {"event": "prefilled", "t": T0 + 0.8}]


def sample(n, ttft_ms, number, warmup=False, overlap=None, text="t"):
    out = {"n": n, "ttft_s": ttft_ms / 1e3, "number": number, "warmup": warmup, "text": text, "prompt_tokens": 1258,
           "cached_tokens": 0}
    if overlap is not None:
        out["prefill_events"] = prefill_events(overlap)
        out["encoder_events"] = [{"event": "queued", "t": T0}, {"event": "encoded", "t": T0 + 0.1},
                                 {"event": "encoded", "t": T0 + 0.25}]
    return out


def test_prefill_figures_with_and_without_overlap():
    assert prefill_figures(prefill_events(True)) == {"overlap_ms": 300.0, "computed_tokens": 800, "wait_ms": None,
                                                     "forward_ms": 500.0}
    assert prefill_figures(prefill_events(False)) == {"overlap_ms": None, "computed_tokens": None, "wait_ms": 300.0,
                                                      "forward_ms": 500.0}
    assert prefill_figures(None) == {"overlap_ms": None, "computed_tokens": None, "wait_ms": None, "forward_ms": None}


def test_encode_ms_is_queued_to_the_last_encoded():
    assert encode_ms(sample(2, 1, 1, overlap=True)["encoder_events"]) == 250.0
    assert encode_ms([{"event": "queued", "t": T0}]) is None and encode_ms(None) is None


def test_summarize_leaves_the_warmup_and_other_counts_out():
    rows = [sample(1, 900, 1, warmup=True, overlap=True), sample(1, 500, 2, overlap=True),
            sample(1, 700, 3, overlap=True), sample(2, 5000, 4, overlap=True)]
    s = summarize(rows, 1)
    assert s["ttft_ms"]["n"] == 2 and s["ttft_ms"]["median"] == 600.0 and s["cached_tokens_median"] == 0
    assert (s["computed_tokens_median"], s["overlap_ms_median"], s["encode_ms_median"]) == (800, 300.0, 250.0)
    assert "computed_tokens_median" not in summarize([sample(1, 500, 2)], 1)  # colocated: no timelines


def test_ratios_goals_and_figures():
    samples = {"colocated": [sample(1, 800, 2)], "overlap": [sample(1, 600, 2, overlap=True)],
               "no_overlap": [sample(1, 1000, 2, overlap=False)]}
    summary = summarize_all(samples, [1])
    assert summary["ratios"] == {"overlap / no_overlap": {"1": 0.6}, "overlap / colocated": {"1": 0.75}}
    assert summary["goals_met"] == {"overlap / no_overlap": {"1": True}, "overlap / colocated": {"1": True}}
    assert summary["same_text"] == {"colocated": True, "no_overlap": True}
    samples["overlap"] = [sample(1, 900, 2, overlap=True)]
    assert summarize_all(samples, [1])["goals_met"] == {"overlap / no_overlap": {"1": False},
                                                        "overlap / colocated": {"1": False}}
    assert summarize_all({"overlap": samples["overlap"]}, [1])["ratios"] == {}  # nothing to compare with
    names = [(f.name, f.value, f.unit) for f in figures(summary, [1])]
    assert names == [("1 images: TTFT p50, colocated", 800.0, "ms"), ("1 images: TTFT p50, overlap", 600.0, "ms"),
                     ("1 images: TTFT p50, no_overlap", 1000.0, "ms"),
                     ("1 images: TTFT overlap / no_overlap (goal 0.75x)", 0.6, "x"),
                     ("1 images: TTFT overlap / colocated (goal 1.0x)", 0.75, "x"),
                     ("1 images: overlap, prompt tokens computed when the last embedding came", 800, "tokens"),
                     ("1 images: overlap, in the engine when the last embedding came", 300.0, "ms")]


def test_same_text_compares_by_request_number():
    base = [sample(1, 1, 1, text="a"), sample(1, 1, 2, text="b")]
    assert same_text({"overlap": base, "no_overlap": [sample(1, 1, 2, text="b")]}) == {"no_overlap": True}
    assert same_text({"overlap": base, "no_overlap": [sample(1, 1, 2, text="x")]}) == {"no_overlap": False}
    assert same_text({"overlap": base, "no_overlap": [sample(1, 1, 9, text="b")]}) == {"no_overlap": None}


def test_every_request_has_its_own_number_and_images():
    plan = [r for k in (1, 2) for r in plan_round([1, 2, 4], 5, k)]
    assert len({r.number for r in plan}) == len(plan) == 2 * 3 * 6
    assert sum(r.warmup for r in plan) == 6
    bodies = Bodies("words", 64, 8)  # 64 px: the number is written into the top row
    pngs = [p for r in plan for p in bodies.pngs(r)]
    assert len(set(pngs)) == len(pngs) == 2 * 6 * (1 + 2 + 4)
    body = bodies.body(plan_round([2], 1, 1)[1])
    system, user = body["messages"]
    assert system == {"role": "system", "content": "010102 words"}  # the number first: no prefix block shared
    assert [c["type"] for c in user["content"]] == ["image_url", "image_url", "text"]
    assert (body["max_tokens"], body["stream"]) == (8, True)
