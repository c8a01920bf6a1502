"""The baseline: Hugging Face ``generate()`` on the same checkpoint, prompts built by our
``PromptBuilder`` (identical to the HF processor token for token), one request at a time."""

from __future__ import annotations

import time
from pathlib import Path

from bench.common.machine import loadavg
from bench.decode_throughput.analysis import best_hf
from bench.decode_throughput.workload import workload


def hf_baseline(model_dir: Path, n_requests: int, max_tokens: int, threads: int, repeat: int = 1,
                device: str = "cpu") -> dict:
    """``n_requests`` image+question prompts (``workload``) through ``model.generate`` one at a time,
    ``max_tokens`` each (min = max), ``repeat`` times after a warm-up; the best run (highest tokens/s)
    with every run's totals, CPU share and tokens per CPU second."""
    import torch

    from stages.engine.config import EngineConfig, resolve_device
    from stages.engine.models import load_adapter
    from stages.prompt import PromptBuilder

    target = resolve_device(device)
    if target.type == "cpu":
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    # load_adapter = AutoModelForImageTextToText.from_pretrained(dir, dtype=..., attn_implementation="sdpa");
    # with "sdpa" the model is plain HF, and the adapter gives PromptBuilder its image-token rule. The dtype is
    # the server's by default (--dtype auto: float32 on a CPU, the checkpoint's on a GPU).
    dtype = EngineConfig(model=str(model_dir), device=device).torch_dtype
    adapter = load_adapter(model_dir, dtype, "sdpa", device=target)
    model = adapter.model
    builder = PromptBuilder.load(model_dir, adapter)
    load_s = time.perf_counter() - t0

    def inputs_for(index: int) -> dict:
        image, question = workload(index)
        prompt = builder.build([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}],
                               [image])
        ids = torch.tensor([prompt.token_ids], device=target)
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if prompt.images[0].grid_thw is not None:  # Qwen family
            inputs["pixel_values"] = torch.cat([im.pixel_values for im in prompt.images]).to(target)
            inputs["image_grid_thw"] = torch.tensor([im.grid_thw for im in prompt.images], device=target)
            inputs["mm_token_type_ids"] = (ids == adapter.image_token_id).int()
        else:
            inputs["pixel_values"] = torch.stack([im.pixel_values for im in prompt.images]).to(target)
        return inputs

    def synchronize() -> None:
        if target.type == "cuda":
            torch.cuda.synchronize(target)

    def run(index: int) -> tuple[int, float, int]:
        inputs = inputs_for(index)
        synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
        synchronize()
        elapsed = time.perf_counter() - start
        return out.shape[1] - inputs["input_ids"].shape[1], elapsed, inputs["input_ids"].shape[1]

    run(0)  # warm-up
    runs = []
    for _ in range(repeat):
        tokens = seconds = 0.0
        cpu0 = time.process_time()
        per_request = []
        for index in range(n_requests):
            generated, elapsed, prompt_len = run(index)
            tokens += generated
            seconds += elapsed
            per_request.append({"prompt_tokens": prompt_len, "completion_tokens": generated,
                                "seconds": round(elapsed, 4)})
        cpu = time.process_time() - cpu0
        runs.append({
            "requests": n_requests,
            "completion_tokens": int(tokens),
            "seconds": round(seconds, 3),
            "tokens_per_s": round(tokens / seconds, 2),
            "ms_per_token": round(1000 * seconds / tokens, 2),
            "cpu_s": round(cpu, 2),
            "cpu_share": round(cpu / seconds, 2),  # < 1: this process waited for its core (other load)
            "tokens_per_cpu_s": round(tokens / cpu, 1),
            "loadavg_1m": loadavg(),
            "per_request": per_request,
        })
    model = adapter = None  # free the weights (cleared rather than del: the closures above use the names)
    return best_hf(runs, load_s)
