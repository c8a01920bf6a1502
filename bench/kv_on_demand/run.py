"""One mode's run: the requests added at once, stepped to the end, each cut at its output length."""

from __future__ import annotations

import random
import time

from stages.engine.config import EngineConfig
from stages.engine.sampling_params import SamplingParams
from stages.loading import load_engine

WORDS = ("describe", "the", "picture", "in", "a", "few", "plain", "words", "please", "now")


def output_lengths(requests: int, mean: int, seed: int = 0) -> list[int]:
    """Each request's output tokens: uniform in mean +- 25%, seeded."""
    rng = random.Random(seed)
    return [rng.randint(mean - mean // 4, mean + mean // 4) for _ in range(requests)]


def messages(index: int) -> list[dict]:
    """A short user turn of 4..13 words, different per request."""
    words = [WORDS[(index + k) % len(WORDS)] for k in range(4 + index % 10)]
    return [{"role": "user", "content": [{"type": "text", "text": " ".join(words)}]}]


def run_mode(model: str, mode: str, kv_cache_mib: int, lengths: list[int], max_tokens: int, threads: int,
             max_steps: int = 100_000) -> dict:
    """Serve ``len(lengths)`` requests at once with ``--kv-allocation mode``; per step the requests
    running and the blocks used; per request its tokens."""
    engine, builder = load_engine(EngineConfig(model=model, kv_cache_mib=kv_cache_mib, kv_allocation=mode,
                                               max_num_seqs=len(lengths), threads=threads, device="cpu"),
                                  pixels=False)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    prompts = [builder.build(messages(i), []) for i in range(len(lengths))]
    started = time.perf_counter()
    requests = [engine.add_request(f"r{i}", prompt, params) for i, prompt in enumerate(prompts)]
    running, blocks, done_at = [], [], {}
    for step in range(max_steps):
        if not engine.has_work():
            break
        engine.step()
        running.append(engine.scheduler.num_running)
        blocks.append(engine.allocator.num_used)
        for request, length in zip(requests, lengths):
            if request.request_id not in done_at and len(request.output_ids) >= length:
                engine.abort(request.request_id)  # as an end-of-sequence token would: its blocks freed
                done_at[request.request_id] = time.perf_counter() - started
    else:
        raise RuntimeError(f"{mode}: not done within {max_steps} steps")
    elapsed = time.perf_counter() - started
    return {"mode": mode, "pool_blocks": engine.allocator.num_blocks, "block_size": engine.allocator.block_size,
            "watermark_blocks": engine.scheduler.watermark, "prompt_tokens": [len(p.token_ids) for p in prompts],
            "steps": len(running), "seconds": round(elapsed, 3), "max_running": max(running),
            "mean_running": round(sum(running) / len(running), 2), "max_blocks_used": max(blocks),
            "preemptions": dict(engine.scheduler.preemptions),
            "preempted_requests": sum(r.num_preemptions > 0 for r in requests),
            "running_per_step": running, "blocks_per_step": blocks,
            "outputs": [r.output_ids[:length] for r, length in zip(requests, lengths)]}
