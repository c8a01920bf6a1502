"""``stage bench serve``: pure parts (configs, arrivals, workload, SSE tally, metrics, token counts,
summary) alone; the command end to end against a real colocated server on the tiny model, against an
unreachable port, and against a small aiohttp server on loopback that fails every other request and
sends no usage. Every run is bounded (request count, --request-timeout-s, subprocess timeout)."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.common.record import problems
from bench.serve import arrivals, metrics, tokens
from bench.serve.client import Outcome
from bench.serve.config import Load, Mix, Slo, Target, parse_rates, parse_size, parse_slo, parse_weighted
from bench.serve.report import summary
from bench.serve.stream import StreamTally
from bench.serve.workload import Request, read_jsonl, summarize, synthesize, write_jsonl
from cli import main as stage_main
from process.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120
LATENCY_KEYS = [f"{stat}_{name}_ms" for name in ("ttft", "tpot", "itl", "e2el")
                for stat in ("mean", "median", "std", "p50", "p90", "p99")]
RESULT_KEYS = ["date", "backend", "model_id", "num_prompts", "request_rate", "burstiness", "max_concurrency",
               "duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
               "request_goodput", "output_throughput", "total_token_throughput", *LATENCY_KEYS, "good_requests", "slo",
               "failure_reasons", "token_counts", "client_cpu_s", "client_cpu_share", "workload", "machine"]
SMALL_IMAGES = ["--image-sizes", "32x32:1,48x40:1"]


def stage_bench(*args: str) -> subprocess.CompletedProcess:
    """``python -m cli bench serve ARGS`` with no progress bar, bounded in time."""
    return subprocess.run([sys.executable, "-m", "cli", "bench", "serve", "--no-progress", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S)


def outcome(ttft: float | None, latency: float, itl: list[float] = (), tokens_out: int | None = None,
            ok: bool = True, error: str | None = None, prompt: int | None = 10) -> Outcome:
    return Outcome(ok, 0.0, latency, error=error, ttft=ttft, itl=list(itl), text="x" * len(itl), chunks=len(itl) + 1,
                   prompt_tokens=prompt if ok else None, output_tokens=tokens_out)


# --- configs -----------------------------------------------------------------------------------
@pytest.mark.unit
def test_flag_values_parse_and_bad_ones_name_their_flag():
    assert parse_weighted("--images-per-request", "0:0.5, 2:1.5,3", int) == ((0, 0.5), (2, 1.5), (3, 1.0))
    assert parse_weighted("--image-sizes", "448x448:1,640X480:3", parse_size) == (((448, 448), 1.0), ((640, 480), 3.0))
    assert parse_slo("ttft_ms=500,tpot_ms=50") == Slo(ttft_ms=500.0, tpot_ms=50.0)
    assert parse_slo(None).given() == {}
    assert parse_rates("1,2.5,inf") == (1.0, 2.5, math.inf)
    with pytest.raises(ValueError, match=r"^--image-sizes: cannot read '448' \(expected VALUE or VALUE:WEIGHT\)$"):
        parse_weighted("--image-sizes", "448", parse_size)
    with pytest.raises(ValueError, match=r"^--slo: cannot read 'ttft=5' \(expected KEY=MS with KEY one of "):
        parse_slo("ttft=5")
    with pytest.raises(ValueError, match=r"^--slo tpot_ms must be > 0, got -1.0$"):
        parse_slo("tpot_ms=-1")
    with pytest.raises(ValueError, match=r"^--sweep: give request rates > 0, got '0,1'$"):
        parse_rates("0,1")
    with pytest.raises(ValueError, match=r"^--repeat-image-share must be in \[0, 1\], got 1.5$"):
        Mix(repeat_image_share=1.5)
    with pytest.raises(ValueError, match=r"^--images-per-request: weights must be >= 0 and sum to more than 0$"):
        Mix(images_per_request=((1, 0.0),))
    with pytest.raises(ValueError, match=r"^--burstiness must be > 0, got 0$"):
        Load(burstiness=0)
    with pytest.raises(ValueError, match=r"^--max-concurrency must be >= 1, got 0$"):
        Load(max_concurrency=0)
    with pytest.raises(ValueError, match=r"^--url must start with http:// or https://, got '127.0.0.1:8000'$"):
        Target("127.0.0.1:8000", "m")
    assert Target("http://h:1/", "m").chat_url == "http://h:1/v1/chat/completions"


# --- arrivals ----------------------------------------------------------------------------------
@pytest.mark.unit
def test_arrivals_are_seeded_offer_the_mean_rate_and_bunch_by_burstiness():
    poisson = arrivals.offsets(2001, Load(request_rate=4.0, seed=7))
    assert poisson == arrivals.offsets(2001, Load(request_rate=4.0, seed=7))
    assert poisson != arrivals.offsets(2001, Load(request_rate=4.0, seed=8))
    assert poisson[0] == 0.0 and poisson[-1] == pytest.approx(500.0)  # (n - 1) / rate
    assert all(b >= a for a, b in zip(poisson, poisson[1:]))

    def cv(offsets: list[float]) -> float:  # coefficient of variation of the gaps: 1 / sqrt(shape)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        return statistics.pstdev(gaps) / statistics.mean(gaps)

    assert cv(poisson) == pytest.approx(1.0, abs=0.1)
    assert cv(arrivals.offsets(2001, Load(request_rate=4.0, burstiness=4.0))) == pytest.approx(0.5, abs=0.06)
    assert cv(arrivals.offsets(2001, Load(request_rate=4.0, burstiness=0.25))) == pytest.approx(2.0, abs=0.3)
    assert arrivals.offsets(3, Load()) == [0.0, 0.0, 0.0]  # rate inf: all at once
    assert arrivals.offsets(4, Load(request_rate=2.0, burstiness=math.inf)) == [0.0, 0.5, 1.0, 1.5]  # evenly spaced


# --- workload ----------------------------------------------------------------------------------
def test_synthetic_mix_is_seeded_and_follows_its_distributions():
    mix = Mix(num_requests=300, images_per_request=((0, 1), (1, 1), (3, 2)), image_sizes=(((16, 16), 1), ((24, 8), 1)),
              repeat_image_share=0.5, input_len=20, output_len=10, range_ratio=0.5, seed=3)
    requests = synthesize(mix)
    assert [r.body() for r in requests] == [r.body() for r in synthesize(mix)]
    assert [r.body() for r in requests] != [r.body() for r in synthesize(Mix(**{**mix.__dict__, "seed": 4}))]
    stats = summarize(requests)
    assert stats["requests"] == 300
    assert stats["mean_images_per_request"] == pytest.approx(1.75, abs=0.2)  # (0 + 1 + 2 * 3) / 4
    assert stats["repeated_image_share"] == pytest.approx(0.5, abs=0.06)
    assert stats["distinct_images"] == stats["images"] - round(stats["repeated_image_share"] * stats["images"])
    assert all(5 <= r.max_tokens <= 15 for r in requests)
    assert stats["mean_prompt_words"] == pytest.approx(2 + 20, abs=1.5)  # "Request N:" + words
    no_repeats = summarize(synthesize(Mix(num_requests=40, images_per_request=((2, 1),), image_sizes=(((8, 8), 1),))))
    assert (no_repeats["images"], no_repeats["distinct_images"], no_repeats["repeated_image_share"]) == (80, 80, 0.0)


@pytest.mark.unit
def test_jsonl_workload_round_trips_and_bad_lines_name_file_and_line(tmp_path):
    requests = synthesize(Mix(num_requests=5, image_sizes=(((16, 16), 1),), seed=1))
    path = tmp_path / "w.jsonl"
    write_jsonl(path, requests)
    assert [r.body() for r in read_jsonl(path)] == [r.body() for r in requests]
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "model": "x", "stream": false, "top_p": 0.5}\n'
                    "\n" '{"messages": []}\n')
    with pytest.raises(ValueError, match=rf"^--workload {path} line 3: 'messages' must be a non-empty list$"):
        read_jsonl(path)
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "model": "x", "stream": false, "top_p": 0.5}\n')
    assert read_jsonl(path) == [Request([{"role": "user", "content": "hi"}], None, {"top_p": 0.5})]
    path.write_text('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": true}\n')
    with pytest.raises(ValueError, match=r"line 1: 'max_tokens' must be an integer >= 1, got True$"):
        read_jsonl(path)
    with pytest.raises(ValueError, match=r"^--workload: cannot read .*missing.jsonl: No such file or directory$"):
        read_jsonl(tmp_path / "missing.jsonl")


# --- SSE tally ---------------------------------------------------------------------------------
def sse(body: dict | str) -> bytes:
    return f"data: {body if isinstance(body, str) else json.dumps(body, ensure_ascii=False)}\n\n".encode()


def delta(content: str | None = None, finish: str | None = None, **extra) -> dict:
    d = {"role": "assistant", "content": ""} if content is None and finish is None else \
        ({"content": content} if content is not None else {})
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}], **extra}


@pytest.mark.unit
def test_stream_tally_times_token_chunks_by_read_and_keeps_usage():
    tally = StreamTally()
    stream = sse(delta()) + sse(delta("hé")) + sse(delta("llo")) + sse(delta(finish="length")) + \
        sse({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}) + sse("[DONE]")
    cut = stream.index("é".encode()) + 1  # split inside a UTF-8 character and inside an event
    tally.feed(stream[:cut], 1.0)
    tally.feed(stream[cut:cut + 40], 2.0)
    tally.feed(stream[cut + 40:], 3.0)
    tally.close(3.5)
    assert (tally.text, tally.finish_reason, tally.done, tally.error) == ("héllo", "length", True, None)
    assert tally.usage == {"prompt_tokens": 7, "completion_tokens": 3}
    assert tally.token_times == [2.0, 3.0]  # the role chunk is no token; "hé" completed in the second read


@pytest.mark.unit
def test_stream_tally_reads_crlf_and_in_band_errors():
    tally = StreamTally()
    tally.feed(sse(delta("a")).replace(b"\n", b"\r\n") + b": keep-alive comment\r\n\r\n", 1.0)
    tally.feed(sse({"error": {"message": "engine died", "type": "server_error"}}) + b"data: [DONE]", 2.0)
    tally.close(2.0)
    assert (tally.pieces, tally.error, tally.done) == (["a"], "engine died", True)
    bad = StreamTally()
    bad.feed(b"data: {not json\n\n", 1.0)
    assert bad.error == "unreadable SSE event: '{not json'"


# --- metrics and token counts ------------------------------------------------------------------
@pytest.mark.unit
def test_metrics_follow_vllm_definitions_and_group_failures():
    outcomes = [outcome(0.1, 0.5, [0.1, 0.1, 0.2], 5), outcome(0.3, 0.7, [0.2, 0.2], 3),
                outcome(None, 0.2, [], 0), outcome(None, 1.0, ok=False, error="HTTP 500: boom"),
                outcome(None, 0.1, ok=False, error="HTTP 500: boom"), outcome(None, 0.1, ok=False, error="cut off")]
    counts = tokens.Counts([10, 10, 10, 0, 0, 0], [5, 3, 0, 0, 0, 0], {})
    result = metrics.summarize(outcomes, counts, duration=2.0, slo=Slo(ttft_ms=200, tpot_ms=150))
    assert (result["completed"], result["failed"], result["total_input_tokens"], result["total_output_tokens"]) == (3, 3, 30, 8)
    assert (result["request_throughput"], result["output_throughput"], result["total_token_throughput"]) == (1.5, 4.0, 19.0)
    assert result["mean_ttft_ms"] == pytest.approx(200.0) and result["p50_ttft_ms"] == result["median_ttft_ms"]
    assert result["p90_ttft_ms"] == pytest.approx(280.0)  # linear interpolation between 100 and 300
    # TPOT: (0.5 - 0.1) / 4 = 100 ms and (0.7 - 0.3) / 2 = 200 ms; ITL pooled over both
    assert (result["mean_tpot_ms"], result["median_itl_ms"], result["mean_e2el_ms"]) == (150.0, 200.0, pytest.approx(466.667))
    # good: the first only (the second misses TPOT 150 ms; the third has no first token, missing TTFT)
    assert (result["good_requests"], result["request_goodput"], result["slo"]) == (1, 0.5, {"ttft_ms": 200, "tpot_ms": 150})
    assert result["failure_reasons"] == {"HTTP 500: boom": 2, "cut off": 1}
    nothing = metrics.summarize(outcomes[3:], tokens.Counts([0] * 3, [0] * 3, {}), 1.0, Slo())
    assert nothing["mean_ttft_ms"] is None and nothing["p99_e2el_ms"] is None and nothing["request_goodput"] is None


@pytest.mark.unit
def test_tokens_without_usage_are_streamed_chunks_when_there_is_no_tokenizer():
    outcomes = [outcome(0.1, 0.5, [0.1, 0.1], tokens_out=None, prompt=None), outcome(0.1, 0.2, [0.1], tokens_out=9),
                outcome(None, 0.1, ok=False, error="x")]
    requests = [Request([{"role": "user", "content": "a b"}], 4)] * 3
    counts = tokens.count(outcomes, requests, tokenizer_dir=None)
    assert (counts.input_tokens, counts.output_tokens) == ([0, 10, 0], [3, 9, 0])
    assert counts.sources == {"input": {"unknown": 1, "usage": 1}, "output": {"chunks": 1, "usage": 1}}
    text = summary({**metrics.summarize(outcomes, counts, 1.0, Slo()), "request_rate": "inf", "burstiness": 1.0,
                    "max_concurrency": None})
    assert "note: counted as one token per streamed chunk (pass --tokenizer DIR to count them exactly)" in text
    assert "     1 x x" in text


# --- end to end --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def colocated(start_server, tiny_model):
    return start_server("colocated", "--model", str(tiny_model("qwen2_vl")))


@pytest.mark.timeout(240)
def test_run_against_a_colocated_server_writes_every_key_and_the_plots(colocated, tiny_model, tmp_path):
    workload = tmp_path / "mix.jsonl"
    done = stage_bench("--url", colocated.base_url, "--model", str(tiny_model("qwen2_vl")), "--num-requests", "6",
                       "--max-concurrency", "3", "--output-len", "8", "--input-len", "12", *SMALL_IMAGES,
                       "--repeat-image-share", "0.5", "--slo", "ttft_ms=60000,tpot_ms=60000", "--save-workload",
                       str(workload), "--out", str(tmp_path / "one"), "--request-timeout-s", "60")
    assert done.returncode == 0, done.stderr + done.stdout
    result = json.loads((tmp_path / "one" / "result.json").read_text())
    assert [key for key in RESULT_KEYS if key not in result] == []
    assert (result["completed"], result["failed"], result["total_output_tokens"]) == (6, 0, 48)  # ignore_eos
    assert result["good_requests"] == 6 and result["request_goodput"] == result["request_throughput"] > 0
    assert result["token_counts"] == {"input": {"usage": 6}, "output": {"usage": 6}}
    assert all(result[key] is not None and result[key] >= 0 for key in LATENCY_KEYS)
    assert result["p99_ttft_ms"] >= result["p90_ttft_ms"] >= result["median_ttft_ms"] > 0
    assert result["max_concurrency"] == 3 and result["request_rate"] == "inf"
    assert (tmp_path / "one" / "latency_cdf.png").stat().st_size > 10_000
    assert len(workload.read_text().splitlines()) == 6
    assert "Successful requests:                     6" in done.stdout

    # the recorded workload replayed over a sweep of two rates
    sweep = stage_bench("--url", colocated.url, "--workload", str(workload), "--sweep", "50,inf", "--warmup", "0",
                        "--out", str(tmp_path / "sweep"), "--request-timeout-s", "60", "--label", "tiny colocated",
                        "--summary-dir", str(tmp_path / "summaries"))
    assert sweep.returncode == 0, sweep.stderr + sweep.stdout
    runs = json.loads((tmp_path / "sweep" / "result.json").read_text())["runs"]
    assert [(r["request_rate"], r["completed"], r["num_prompts"]) for r in runs] == [(50.0, 6, 6), ("inf", 6, 6)]
    assert runs[0]["workload"] == result["workload"]
    assert (tmp_path / "sweep" / "latency_vs_rate.png").stat().st_size > 10_000
    summary = json.loads((tmp_path / "summaries" / "serve--tiny_colocated.json").read_text())
    assert problems(summary) == [] and summary["configuration"] == "tiny colocated"
    assert [f["name"] for f in summary["figures"][:2]] == ["rate 50.0: TTFT p50", "rate 50.0: TTFT p99"]
    assert summary["figures"][5] == {"name": "rate 50.0: requests", "value": runs[0]["request_throughput"],
                                     "unit": "req/s"}
    assert json.loads((tmp_path / "sweep" / "result.json").read_text())["load_1m"]["samples"] >= 2


@pytest.mark.timeout(60)
def test_unreachable_url_is_a_counted_failure_without_traceback():
    port = free_port()
    done = stage_bench("--url", f"http://127.0.0.1:{port}", "--served-model-name", "m", "--num-requests", "4",
                       *SMALL_IMAGES, "--request-timeout-s", "10")
    assert done.returncode == 3, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "Failed requests:                         4" in done.stdout
    assert f"     4 x cannot connect to 127.0.0.1:{port}: Connection refused" in done.stdout
    assert "no request completed: nothing was measured" in done.stdout
    # no model name: the model list cannot be read, one line says so
    listing = stage_bench("--url", f"http://127.0.0.1:{port}", "--num-requests", "2", *SMALL_IMAGES)
    assert listing.returncode == 3 and listing.stdout == ""
    assert listing.stderr == (f"stage bench serve: error: cannot reach http://127.0.0.1:{port}/v1/models: Connection "
                              "refused; is the server up at --url? (or pass --served-model-name)\n")


@pytest.mark.unit
def test_bad_flags_exit_2_naming_the_flag(capsys):
    assert stage_main(["bench", "serve", "--url", "http://127.0.0.1:1", "--summary-dir", "s", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("stage bench serve: error: --summary-dir needs --out (the full results) and "
                                       "--label (what the server is)\n")
    assert stage_main(["bench", "serve", "--url", "http://127.0.0.1:1", "--slo", "p99=5", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("stage bench serve: error: --slo: cannot read 'p99=5' (expected KEY=MS with KEY "
                                       "one of ttft_ms, tpot_ms, e2el_ms)\n")


@pytest.fixture(scope="module")
def flaky_server() -> Iterator[str]:
    """A chat endpoint on loopback that answers every other request 500 and streams four one-character
    chunks (no usage, even when asked) to the others."""
    from aiohttp import web

    counter = itertools.count()

    async def chat(request: web.Request) -> web.StreamResponse:
        await request.read()
        if next(counter) % 2:
            return web.json_response({"error": {"message": "injected failure", "type": "server_error"}}, status=500)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for body in [delta(), *(delta(c) for c in "abcd"), delta(finish="stop")]:
            await response.write(sse(body))
            await asyncio.sleep(0.002)
        await response.write(sse("[DONE]"))
        return response

    ready, stop = threading.Event(), threading.Event()
    port = free_port()

    async def serve() -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", chat)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await runner.cleanup()

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10)
    yield f"http://127.0.0.1:{port}"
    stop.set()
    thread.join(10)


@pytest.mark.timeout(120)
def test_half_failing_server_without_usage_is_measured_with_the_tokenizer(flaky_server, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    model = tiny_model("qwen2_vl")
    done = stage_bench("--url", flaky_server, "--served-model-name", "m", "--tokenizer", str(model),
                       "--num-requests", "10", "--max-concurrency", "1", "--warmup", "0", "--images-per-request", "0",
                       "--out", str(tmp_path), "--request-timeout-s", "10")
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    assert "     5 x HTTP 500: injected failure" in done.stdout
    result = json.loads((tmp_path / "result.json").read_text())
    assert (result["completed"], result["failed"], result["failure_reasons"]) == (5, 5, {"HTTP 500: injected failure": 5})
    per_answer = len(AutoTokenizer.from_pretrained(model).encode("abcd", add_special_tokens=False))
    assert result["total_output_tokens"] == 5 * per_answer
    assert result["token_counts"]["output"] == {"tokenizer": 5}
    assert result["token_counts"]["input"] == {"tokenizer_text_only": 5}
    assert result["mean_ttft_ms"] > 0 and result["median_itl_ms"] > 0
