"""What one step costs in the engine itself, by token budget: 8 streams decoding alone, then the same
8 decoding beside a chunk of a long prompt (a step of ``budget`` tokens: the decodes and
``budget - streams`` prompt tokens), until the prompt is done. No server, no HTTP: one process, the
engine thread's work only, ``torch`` threads as the server's. Each step is timed in wall seconds and in
the thread's CPU seconds (with one torch thread, all of the step's work; outside load does not
change it)."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from bench.common.machine import loadavg
from bench.common.stats import ratio

DECODE_STEPS = 20  # timed decode-only steps per budget, after WARM_STEPS
WARM_STEPS = 3


def chunk_costs(model_dir: Path, budgets: list[int], text: str, streams: int, threads: int,
                device: str = "cpu") -> list[dict]:
    """One row per budget (``step_costs``); a fresh engine for each."""
    from stages.engine.config import EngineConfig
    from stages.loading import load_engine

    rows = []
    for budget in budgets:
        engine, builder = load_engine(EngineConfig(model=str(model_dir), max_batched_tokens=budget, threads=threads,
                                                   device=device), pixels=False)
        rows.append(step_costs(engine, builder, budget, text, streams))
        print(f"budget {budget:>6}: decode step {rows[-1]['decode_step_ms']:.1f} ms, {rows[-1]['chunk_steps']} chunk "
              f"step(s) of {rows[-1]['chunk_step_ms']:.1f} ms ({rows[-1]['chunk_over_decode']}x), prompt "
              f"{rows[-1]['prefill_ms']:.0f} ms; in CPU time {rows[-1]['chunk_over_decode_cpu']}x and "
              f"{rows[-1]['prefill_cpu_ms']:.0f} ms; load {loadavg()}", flush=True)
        del engine
    return rows


def step_costs(engine, builder, budget: int, text: str, streams: int) -> dict:
    """Time ``DECODE_STEPS`` steps of ``streams`` decodes, then every step of ``text``'s prompt beside them."""
    from stages.engine.sampling_params import SamplingParams

    def prompt(words: str):
        return builder.build([{"role": "user", "content": [{"type": "text", "text": words}]}], [])

    running = [engine.add_request(f"s{i}", prompt(f"Stream {i}: tell me a long story about the sea."),
                                  SamplingParams(max_tokens=DECODE_STEPS + 200, temperature=0, ignore_eos=True))
               for i in range(streams)]
    for _ in range(100):  # bounded: every short prompt is in by then
        if all(r.prompt_done for r in running):
            break
        engine.step()
    decode = [_timed(engine) for _ in range(WARM_STEPS + DECODE_STEPS)][WARM_STEPS:]
    long = engine.add_request("long", prompt(text), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    chunks: list[tuple[float, float]] = []
    while not long.prompt_done and len(chunks) < 10_000:
        chunks.append(_timed(engine))
    for request_id in [r.request_id for r in running] + ["long"]:
        engine.abort(request_id)
    (decode_ms, decode_cpu_ms), (chunk_ms, chunk_cpu_ms) = _medians_ms(decode), _medians_ms(chunks)
    return {"budget": budget, "streams": streams, "prompt_tokens": long.prompt_len,
            "decode_step_ms": decode_ms, "chunk_steps": len(chunks), "chunk_step_ms": chunk_ms,
            "chunk_step_max_ms": round(1e3 * max(wall for wall, _ in chunks), 2),
            "chunk_over_decode": ratio(chunk_ms, decode_ms, 2), "prefill_ms": round(1e3 * sum(w for w, _ in chunks), 1),
            "decode_step_cpu_ms": decode_cpu_ms, "chunk_step_cpu_ms": chunk_cpu_ms,
            "chunk_over_decode_cpu": ratio(chunk_cpu_ms, decode_cpu_ms, 2),
            "prefill_cpu_ms": round(1e3 * sum(c for _, c in chunks), 1),
            "chunk_steps_ms": [round(1e3 * wall, 1) for wall, _ in chunks]}


def _timed(engine) -> tuple[float, float]:
    """One step's wall seconds and this thread's CPU seconds (the engine's work, whatever else runs)."""
    start, cpu = time.perf_counter(), time.thread_time()
    engine.step()
    return time.perf_counter() - start, time.thread_time() - cpu


def _medians_ms(steps: list[tuple[float, float]]) -> tuple[float, float]:
    return (round(1e3 * statistics.median(w for w, _ in steps), 2), round(1e3 * statistics.median(c for _, c in steps), 2))
