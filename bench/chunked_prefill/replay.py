"""The phases replayed on the engine alone, on a clock of the engine thread's CPU seconds: what a
server with a core to itself would do, whatever else runs on the machine. The same streams (closed
loop, ``stream_tokens`` each) and the same long prompts, one every ``period_s`` of that clock; each
token is stamped with the clock after the step that made it. No HTTP, no tokenizer on the way out:
the engine's own work only."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from bench.chunked_prefill.analysis import tpot_and_gaps
from bench.common.machine import loadavg

MAX_STEPS = 200_000  # bound on the steps of one replay


def replay_phases(model_dir: Path, plan: dict[str, int | None], texts: list[str], streams: int, stream_tokens: int,
                  duration_s: float, period_s: float, long_max_tokens: int, threads: int, device: str = "cpu") -> dict:
    """``plan``: phase -> budget (None: the default); the baseline (no arrivals) is the phase without
    texts, named ``alone``. A fresh engine per phase; per phase the token stamps' figures."""
    from stages.engine.config import EngineConfig
    from stages.loading import load_engine

    out = {}
    for phase, budget in plan.items():
        config = EngineConfig(model=str(model_dir), threads=threads, device=device)
        if budget is not None:
            config = replace(config, max_batched_tokens=budget)
        engine, builder = load_engine(config, pixels=False)
        longs = [] if phase == "alone" else texts
        requests = run(engine, builder, longs, streams, stream_tokens, duration_s, period_s, long_max_tokens)
        out[phase] = {"budget": budget, **tpot_and_gaps(requests)}
        print(f"replay {phase:<12} budget {budget or 'default'}: TPOT p99 {out[phase]['p99_tpot_ms']} ms, ITL p99 "
              f"{out[phase]['p99_itl_ms']} ms, {out[phase]['arrivals']} long prompts, {out[phase]['clock_s']:.1f} CPU s; "
              f"load {loadavg()}", flush=True)
        del engine
    return out


def run(engine, builder, longs: list[str], streams: int, stream_tokens: int, duration_s: float, period_s: float,
        long_max_tokens: int) -> dict:
    """One replay: {"streams": [[token stamps of each request]], "longs": [(sent, first token)], "clock_s"}."""
    from stages.engine.sampling_params import SamplingParams

    def add(request_id: str, text: str, max_tokens: int) -> None:
        prompt = builder.build([{"role": "user", "content": [{"type": "text", "text": text}]}], [])
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))

    clock, stamps = 0.0, {}  # request id -> [sent, token stamps...]
    by_stream: list[list[list[float]]] = [[] for _ in range(streams)]
    counts = [0] * streams
    for i in range(streams):
        add(f"s{i}-0", f"Stream {i}, request 0: tell me a long story about the sea.", stream_tokens)
        stamps[f"s{i}-0"] = [clock]
    arrived = 0
    for _ in range(MAX_STEPS):
        if not engine.has_work():
            break
        if arrived < len(longs) and clock >= (arrived + 1) * period_s and clock < duration_s + period_s:
            add(f"long-{arrived}", longs[arrived], long_max_tokens)
            stamps[f"long-{arrived}"] = [clock]
            arrived += 1
        start = time.thread_time()
        outputs = engine.step()
        clock += time.thread_time() - start
        for output in outputs:
            stamps[output.request_id] += [clock] * max(1, len(output.token_ids))
            if output.finished and output.request_id.startswith("s"):
                i = int(output.request_id[1:].split("-")[0])
                by_stream[i].append(stamps.pop(output.request_id))
                if clock < duration_s:
                    counts[i] += 1
                    request_id = f"s{i}-{counts[i]}"
                    add(request_id, f"Stream {i}, request {counts[i]}: tell me a long story about the sea.", stream_tokens)
                    stamps[request_id] = [clock]
    longs_out = [(v[0], v[1]) for k, v in stamps.items() if k.startswith("long-") and len(v) > 1]
    return {"streams": by_stream, "longs": longs_out, "clock_s": clock}
