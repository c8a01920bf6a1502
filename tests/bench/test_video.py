"""The pure parts of bench/video/: the miss/hit pairs, the ratios the summary quotes (epd hit / miss,
epd / colocated), the encoder's frames per second, the stream's TPOT with and without a video, the
goals and the summary's figures (the benchmark itself is run by hand, bench/README.md)."""

from __future__ import annotations

import pytest

from bench.video.__main__ import parse_video
from bench.video.analysis import goals, summarize, trial_figures
from bench.video.report import figures, notes
from bench.video.workload import chat_body, plan_pairs

pytestmark = pytest.mark.unit


def test_pairs_have_fresh_seeds_and_two_questions():
    pairs = plan_pairs([16, 64], requests=3, first_seed=10)
    assert [(p.frames, p.index, p.kind) for p in pairs[:4]] == [(16, -1, "embedding"), (16, -1, "follow_up"),
                                                               (64, -1, "embedding"), (64, -1, "follow_up")]
    assert len({p.seed for p in pairs}) == len(pairs) == 16  # a follow-up's miss is a new video too
    assert all(p.questions[0] != p.questions[1] for p in pairs)
    assert plan_pairs([16, 64], 3, 10) == pairs
    assert [p.cases for p in pairs[:2]] == [("miss", "hit"), ("follow_up_miss", "follow_up_hit")]
    assert {p.kind for p in plan_pairs([16], 1, 10, kinds=("embedding",))} == {"embedding"}


def test_chat_body_puts_the_question_before_the_video():
    body = chat_body(b"\x00\x01", "Why?", 16, 8)
    content = body["messages"][0]["content"]
    assert [part["type"] for part in content] == ["text", "video_url"]
    assert content[1]["video_url"]["url"] == "data:video/mp4;base64,AAE="
    assert body["mm_processor_kwargs"] == {"num_frames": 16} and body["ignore_eos"] is True
    assert parse_video("96x320x240@24") == (96, 320, 240, 24)
    follow_up = chat_body(b"\x00\x01", "Why?", 16, 8, video_first=True)["messages"][0]["content"]
    assert [part["type"] for part in follow_up] == ["video_url", "text"]


def _ttft(frames, case, ms, index=0, warmup=False, hits=16.0, encoded=None):
    kind = "follow_up" if case.startswith("follow_up") else "embedding"
    return {"frames": frames, "kind": kind, "case": case, "ttft_s": ms / 1e3, "index": index, "warmup": warmup,
            "prompt_tokens": 800, "prefix_hit_tokens": hits, "cached_tokens": int(hits), "videos_encoded": encoded}


def _stream(with_video, gap_ms, tokens=5, video=None, frames=None, cpu=None):
    return {"with_video": with_video, "token_s": [i * gap_ms / 1e3 for i in range(tokens)], "video": video,
            "video_frames": frames, "stream_server_cpu_s": cpu}


def _runs():
    epd = [_ttft(16, "miss", 900, -1, True, encoded=1.0), _ttft(16, "hit", 300, -1, True, encoded=0.0),
           _ttft(16, "miss", 400, 0, encoded=1.0), _ttft(16, "hit", 100, 0, encoded=0.0),
           _ttft(16, "miss", 600, 1, encoded=1.0), _ttft(16, "hit", 120, 1, encoded=0.0),
           _ttft(16, "follow_up_miss", 500, 0, encoded=1.0), _ttft(16, "follow_up_hit", 50, 0, hits=784.0, encoded=0.0)]
    coloc = [_ttft(s["frames"], s["case"], 250, s["index"], s["warmup"]) for s in epd]
    encoder = {"frames_per_video": 64, "parts": {
        "batch_1": {"batch": 1, "metrics": {}, "rounds": [
            {"wall_s": 2.0, "answers": [{"status": "encoded", "seconds": 1.6}]},
            {"wall_s": 1.0, "answers": [{"status": "encoded", "seconds": 0.8}]}]},
        "batch_4": {"batch": 4, "metrics": {"epd_encoder_video_frames_encoded_total": 256.0,
                                            "epd_encoder_seconds_sum": 1.6},
                    "rounds": [{"wall_s": 2.0, "answers": [{"status": "encoded", "seconds": 2.0}] * 4}]}}}
    tpot = [_stream(False, 10.0, cpu=0.5), _stream(True, 12.0, video={"sent_s": 0.013, "ttft_s": 0.030}, frames=64, cpu=0.9),
            _stream(True, 11.0, video={"sent_s": 0.0, "ttft_s": 0.1, "prompt_tokens": 822}, frames=16, cpu=0.6)]
    return {"colocated": {"ttft": coloc, "encoder": None, "tpot": {"error": "RuntimeError: boom"}},
            "epd": {"ttft": epd, "encoder": encoder, "tpot": tpot}}


def test_summary_ratios_encoder_and_stream():
    s = summarize(_runs(), [16])
    assert s["ttft_ms"]["epd"]["16"]["miss"]["median"] == 500.0  # the warm-up pair left out
    assert s["ratio_epd_hit_vs_miss"] == {"16": 0.22}  # 110 / 500
    assert s["ratio_epd_hit_vs_miss_paired"]["16"]["median"] == 0.23  # 100/400 and 120/600 (describe: 2 decimals)
    assert s["ratio_epd_vs_colocated"] == {"16": {"miss": 2.0, "hit": 0.44, "follow_up_miss": 2.0,
                                                  "follow_up_hit": 0.2}}
    assert s["videos_encoded"]["epd"]["16"] == {"miss": 1.0, "hit": 0.0, "follow_up_miss": 1.0, "follow_up_hit": 0.0}
    assert s["ratio_epd_follow_up_hit_vs_miss"] == {"16": 0.1}  # each kind over its own miss
    assert s["ratio_epd_follow_up_hit_vs_miss_paired"]["16"]["median"] == 0.1
    assert s["usage_cached_tokens"]["epd"]["16"] == {"miss": 16, "hit": 16, "follow_up_miss": 16, "follow_up_hit": 784}
    enc = s["encoder"]["parts"]
    assert enc["batch_1"]["fps_wall_median"] == 48.0  # 64/2 and 64/1
    assert enc["batch_4"]["fps_wall_median"] == 128.0 and enc["batch_4"]["tower_fps"] == 160.0
    assert enc["batch_1"]["tower_fps"] is None and enc["batch_4"]["decode_fps"] is None
    assert s["encoder"]["ratio_batched_vs_1"] == round(128 / 48, 3)
    t = s["tpot"]["epd"]
    assert (t["alone"]["tpot_p99_ms"], t["with_video"]["tpot_p99_ms"], t["ratio_tpot_p99"]) == (10.0, 12.0, 1.2)
    assert t["with_video"]["window_gaps"] == 2  # the gaps ending after 13 ms and starting before 30 ms
    assert t["video_frames"] == 64 and t["extra_stream_server_cpu_s"] == 0.4  # the first frame count: the headline
    small = t["by_frames"]["16"]
    assert (small["ratio_tpot_p99"], small["extra_stream_server_cpu_s"], small["extra_stream_s"]) == (1.1, 0.1, 0.004)
    assert small["with_video"]["video_prompt_tokens"] == 822
    assert "colocated" not in s["tpot"] and s["errors"] == {"colocated.tpot": "RuntimeError: boom"}
    assert goals(s) == {"epd_hit_le_0.3x_miss": {"16": True}, "epd_follow_up_hit_le_0.3x_miss": {"16": True},
                        "epd_tpot_p99_with_video_le_1.2x": True}


def test_trial_figures_of_a_stream_and_the_summary_figures():
    f = trial_figures(_stream(True, 20.0, tokens=3, video={"sent_s": 0.0, "ttft_s": 0.5}))
    assert (f["tokens"], f["tpot_ms"], f["window_tpot_ms"], f["video_ttft_ms"]) == (3, 20.0, 20.0, 500.0)
    named = {fig.name: (fig.value, fig.unit) for fig in figures(summarize(_runs(), [16]), [16])}
    assert named["16 frames: TTFT epd hit (embedding cache only) / epd miss (goal <= 0.3, judged)"] == (0.22, "x")
    assert named["16 frames: TTFT epd follow-up hit (embedding + prefix cache) / its miss (goal <= 0.3)"] == (0.1, "x")
    assert named["16 frames: TTFT epd / colocated, miss"] == (2.0, "x")
    assert named["16 frames: cached tokens (usage), epd follow-up hit (embedding + prefix cache)"] == (784, "tokens")
    assert named["16 frames: videos encoded per request, epd hit (embedding cache only)"] == (0.0, "videos")
    assert named["epd: stream TPOT p99 with a 16-frame video / alone"] == (1.1, "x")
    assert named["epd: decode CPU s per stream, with a 64-frame video - alone"] == (0.4, "s")
    assert named["encoder frames/s, batch 4 (64 frames a video)"] == (128.0, "frames/s")
    assert named["epd: stream TPOT p99 with video / alone (goal <= 1.2)"] == (1.2, "x")


def test_notes_say_the_pinning_the_judged_hit_and_the_stall():
    from bench.video.__main__ import build_parser

    text = " ".join(notes(summarize(_runs(), [16]), build_parser().parse_args([])))
    assert "decode alone on core(s) 0" in text and "embedding-cache-only" in text
    assert "16 frames (822 prompt tokens): TPOT p99 1.10x" in text
