"""bench/prefix_cache's pure parts: the conversation's bodies and the analysis (per turn medians,
on / off, the goal, same texts)."""

import pytest

from bench.prefix_cache.analysis import per_turn, summarize
from bench.prefix_cache.workload import QUESTIONS, TURNS, chat_body, messages

pytestmark = pytest.mark.unit


def test_each_turn_carries_the_whole_history():
    assert messages("data:x", []) == [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:x"}}, {"type": "text", "text": QUESTIONS[0]}]}]
    third = messages("data:x", ["a1", "a2"])
    assert [m["role"] for m in third] == ["user", "assistant", "user", "assistant", "user"]
    assert [third[1]["content"], third[2]["content"], third[3]["content"], third[4]["content"]] == \
        ["a1", QUESTIONS[1], "a2", QUESTIONS[2]]
    body = chat_body("data:x", ["a1"], 16)
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 16
    with pytest.raises(ValueError, match="5 turns; 5 answers given"):
        messages("data:x", ["a"] * TURNS)


def sample(turn: int, ttft_ms: float, cached: int = 0, text: str = "t") -> dict:
    return {"turn": turn, "ttft_s": ttft_ms / 1e3, "prompt_tokens": 100 * turn, "cached_tokens": cached, "text": text}


def phase(mode: str, caching: bool, conversations: list[list[dict]]) -> dict:
    return {"mode": mode, "prefix_caching": caching, "conversations": conversations}


def test_per_turn_pools_conversations_and_rounds():
    turns = per_turn([phase("epd", True, [[sample(1, 100), sample(2, 30, 96)]]),
                      phase("epd", True, [[sample(1, 300), sample(2, 10, 96)], [sample(1, 200), sample(2, 20, 96)]])])
    assert turns == {1: {"n": 3, "ttft_ms_median": 200.0, "ttft_ms_min": 100.0, "prompt_tokens": 100, "cached_tokens": 0},
                     2: {"n": 3, "ttft_ms_median": 20.0, "ttft_ms_min": 10.0, "prompt_tokens": 200, "cached_tokens": 96}}


def test_summary_ratios_goal_and_same_texts():
    on = phase("colocated", True, [[sample(t, ms, text=f"a{t}") for t, ms in ((1, 100), (2, 40), (3, 30), (4, 25))]])
    off = phase("colocated", False, [[sample(t, 100, text=f"a{t}") for t in (1, 2, 3, 4)]])
    s = summarize([on, off])["colocated"]
    assert s["ratio_on_off"] == {1: 1.0, 2: 0.4, 3: 0.3, 4: 0.25}
    assert s["worst_ratio_from_turn_3"] == 0.3 and s["goal_met"] and s["same_texts"]
    slow = phase("colocated", True, [[sample(t, ms, text=f"a{t}") for t, ms in ((1, 100), (2, 40), (3, 31), (4, 25))]])
    assert not summarize([slow, off])["colocated"]["goal_met"]
    other = phase("colocated", True, [[sample(t, 10, text="b") for t in (1, 2, 3, 4)]])
    assert not summarize([other, off])["colocated"]["same_texts"]
    assert summarize([on]) == {}  # no off phase: nothing to compare


def test_epd_samples_give_the_prefills_forward_pass_on_off():
    def forward(turn: int, ttft_ms: float, prefill_ms: float | None) -> dict:
        return {**sample(turn, ttft_ms), "prefill_s": None if prefill_ms is None else prefill_ms / 1e3}

    on = phase("epd", True, [[forward(1, 900, 300), forward(2, 150, 60)], [forward(1, 800, None), forward(2, 140, 40)]])
    off = phase("epd", False, [[forward(1, 900, 300), forward(2, 400, 300)]])
    s = summarize([on, off])["epd"]
    assert s["on"][2]["prefill_ms_median"] == 50.0 and s["on"][1]["prefill_ms_median"] == 300.0
    assert s["prefill_ratio_on_off"] == {1: 1.0, 2: 0.167} and s["ratio_on_off"] == {1: 0.944, 2: 0.362}
    assert "prefill_ms_median" not in per_turn([phase("colocated", True, [[sample(1, 10)]])])[1]


def test_the_summarys_figures():
    from bench.prefix_cache.report import figures

    on = phase("epd", True, [[{**sample(t, 50), "prefill_s": 0.02} for t in (1, 2, 3)]])
    off = phase("epd", False, [[{**sample(t, 100), "prefill_s": 0.08} for t in (1, 2, 3)]])
    names = [(f.name, f.value, f.unit) for f in figures(summarize([on, off]))]
    assert names == [("epd: turn 1 TTFT on / off", 0.5, "x"), ("epd: turn 2 TTFT on / off", 0.5, "x"),
                     ("epd: turn 3 TTFT on / off", 0.5, "x"),
                     ("epd: worst TTFT on / off, turns 3+ (goal <= 0.3)", 0.5, "x"),
                     ("epd: turn 3 TTFT p50, prefix caching on", 50.0, "ms"),
                     ("epd: turn 3 TTFT p50, prefix caching off", 100.0, "ms"),
                     ("epd: turn 1 prefill forward pass on / off", 0.25, "x"),
                     ("epd: turn 2 prefill forward pass on / off", 0.25, "x"),
                     ("epd: turn 3 prefill forward pass on / off", 0.25, "x")]
