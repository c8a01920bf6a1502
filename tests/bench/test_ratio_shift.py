"""The pure parts of bench/ratio_shift/: the phases, unique images and prompts, the SLO from the
fixed split's medians, goodput per phase, split changes and re-balance times, switch spans and the
failures that overlap them, the baseline and ratios, the goal and the summary's figures (the
benchmark itself is run by hand, bench/README.md)."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.ratio_shift.__main__ import parse_split, router_flags
from bench.ratio_shift.analysis import (failures, goals, goodput, meets, rebalance_s, slo_from, split_changes,
                                        summarize, switch_windows)
from bench.ratio_shift.report import figures
from bench.ratio_shift.workload import chat_body, phase_at, plan_phases, text_prompt, unique_image

pytestmark = pytest.mark.unit
PHASES = plan_phases(["images", "text", "images"], 10.0)


def _req(phase, send, ttft=0.5, tpot=0.02, ok=True, end=None, kind="images"):
    r = {"phase": phase, "kind": kind, "send_s": send, "end_s": send + 1 if end is None else end, "ok": ok}
    return {**r, "ttft_s": ttft, "tpot_s": tpot} if ok else r


def _sample(t, roles, draining=()):
    return {"t_s": t, "workers": [{"id": f"w{i}", "role": role, "draining": i in draining}
                                  for i, role in enumerate(roles)]}


def test_phases_back_to_back():
    assert [(p.name, p.start_s, p.end_s) for p in PHASES] == [("1-images", 0, 10), ("2-text", 10, 20),
                                                             ("3-images", 20, 30)]
    assert phase_at(PHASES, 0) == PHASES[0] and phase_at(PHASES, 19.9) == PHASES[1]
    assert phase_at(PHASES, 30) is None and phase_at(PHASES, -1) is None


def test_images_and_prompts_are_unique():
    pixels = {unique_image(s, k, 64).tobytes() for s in range(40) for k in range(4)}
    assert len(pixels) == 160
    assert text_prompt(7, 50) == text_prompt(7, 50) != text_prompt(8, 50)
    assert text_prompt(7, 50).startswith("Request 7: ")
    args = Namespace(image_size=32, prompt_words=10, max_tokens=12)
    parts = chat_body("images", 3, args)["messages"][0]["content"]
    assert [p["type"] for p in parts] == ["text"] + ["image_url"] * 4
    assert len(chat_body("images", 4, args)["messages"][0]["content"]) == 4  # 3 images
    body = chat_body("text", 3, args)
    assert isinstance(body["messages"][0]["content"], str)
    assert body["ignore_eos"] and body["stream"] and body["temperature"] == 0 and body["max_tokens"] == 12


def test_slo_and_goodput():
    reqs = [_req("1-images", 1, ttft=0.4), _req("1-images", 2, ttft=0.6), _req("2-text", 11, ttft=0.5),
            _req("3-images", 21, ttft=2.0), _req("3-images", 22, ok=False)]
    slo = slo_from(reqs, 2.0)
    assert slo == {"ttft_s": 1.1, "tpot_s": 0.04, "factor": 2.0}  # medians 0.55 s, 0.02 s of the answered
    assert meets(reqs[0], slo) and not meets(reqs[3], slo) and not meets(reqs[4], slo)
    assert not meets(_req("x", 0, tpot=0.05), slo)
    assert goodput(reqs, PHASES, slo) == {"1-images": 0.2, "2-text": 0.1, "3-images": 0.0, "overall": 0.1}
    assert slo_from([reqs[4]], 2.0) is None


def test_split_changes_and_rebalance():
    samples = [_sample(1, ["encoder", "encoder", "prefill", "decode"]), {"t_s": 5, "error": "timeout"},
               _sample(11, ["encoder", "encoder", "prefill", "decode"], draining={1}),
               _sample(12, ["encoder", "prefill", "prefill", "decode"]),
               _sample(14, ["encoder", "prefill", "decode", "decode"]),
               _sample(23, ["encoder", "encoder", "prefill", "decode"])]
    changes = split_changes(samples)
    assert changes == [{"t_s": 12, "from": "2:1:1", "to": "1:2:1"}, {"t_s": 14, "from": "1:2:1", "to": "1:1:2"},
                       {"t_s": 23, "from": "1:1:2", "to": "2:1:1"}]
    assert rebalance_s(changes, PHASES) == {"2-text": {"first_s": 2, "last_s": 4},
                                            "3-images": {"first_s": 3, "last_s": 3}}
    assert rebalance_s([], PHASES)["2-text"] == {"first_s": None, "last_s": None}
    windows = switch_windows(samples)
    assert windows == [(1, 23)]  # draining at 11, then a change at every sample: one span, merged
    reqs = [_req("1-images", 0, end=0.5), _req("2-text", 13, ok=False, end=13.5), _req("3-images", 24, ok=False, end=25)]
    assert failures(reqs, [(10, 14)]) == {"failed": 2, "during_switch": 1, "failed_during_switch": 1}


def test_summarize_picks_the_slo_source_and_baseline():
    fast = [_req(p.name, p.start_s + i, ttft=0.5) for p in PHASES for i in range(5)]
    slow = [_req(p.name, p.start_s + i, ttft=0.5 if p.kind == "text" else 3.0) for p in PHASES for i in range(4)]
    auto = [_req(p.name, p.start_s + i, ttft=0.5) for p in PHASES for i in range(8)]
    idle = [_sample(0, ["encoder", "encoder", "prefill", "decode"])]
    runs = {"fixed-2:1:1": {"requests": fast, "samples": idle}, "fixed-1:2:1": {"requests": slow, "samples": idle},
            "auto-epd": {"requests": auto, "samples": idle}}
    summary = summarize(runs, ["fixed-2:1:1", "fixed-1:2:1"], PHASES, 2.0)
    assert summary["slo_source"] == summary["best_fixed"] == "fixed-2:1:1"
    assert summary["slo"]["ttft_s"] == 1.0
    configs = summary["configs"]
    assert configs["fixed-1:2:1"]["goodput"] == {"1-images": 0.0, "2-text": 0.4, "3-images": 0.0, "overall": 0.133}
    assert configs["auto-epd"]["vs_best_fixed"]["overall"] == 1.6
    assert configs["auto-epd"]["failed"] == 0
    result = goals(summary, ["auto-epd", "auto-epd-local"], 1.3)
    assert result == {"overall_goodput_vs_best_fixed": {"auto-epd": 1.6}, "target": 1.3, "met": True,
                      "no_failures": True}
    names = [f.name for f in figures(summary, PHASES, ["auto-epd"])]
    assert "auto-epd goodput overall / best fixed (fixed-2:1:1)" in names and "auto-epd goodput 2-text" in names
    assert summarize({}, ["fixed-2:1:1"], PHASES, 2.0) == {"error": "no fixed split ran"}


def test_router_flags_per_configuration():
    args = Namespace(ratio_window_s=8.0, auto_interval_s=2.0)
    assert parse_split("2:1:1") == {"encoder": 2, "prefill": 1, "decode": 1}
    fixed = router_flags("fixed-2:1:1", args)
    assert fixed[fixed.index("--auto-ratio-interval-s") + 1] == "0" and "--auto-ratio-roles" not in fixed
    pd = router_flags("auto-pd", args)
    assert pd[pd.index("--auto-ratio-roles") + 1] == "prefill,decode"
    local = router_flags("auto-epd-local", args)
    assert local[local.index("--local-encode") + 1] == "auto"
    assert local[local.index("--auto-ratio-roles") + 1] == "encoder,prefill,decode"
