"""Decode throughput of ``stage serve colocated`` at 1, 8 and 32 concurrent streams, side by side with
Hugging Face ``generate()`` run one request at a time on the same checkpoint and the same torch
thread count.

    .venv/bin/python -m bench.decode_throughput                 # full run (a few minutes on 2 cores)
    .venv/bin/python -m bench.decode_throughput --quick         # smoke run (~1-2 minutes)
    .venv/bin/python -m bench.decode_throughput --family llava --model-dir /path/to/ckpt --max-tokens 128

Workload: every request is a short image+text chat (a generated 64x64 PNG as a ``data:`` URL plus
one of a few short questions), ``temperature=0``, ``max_tokens`` tokens with ``ignore_eos=true``
(our request extension), so every request produces exactly ``max_tokens`` tokens. For each
concurrency C the client sends N requests (N = clamp(2C, 8, --max-requests)), at most C in flight,
non-streaming, and measures wall time from the first send to the last response;
tokens/s = completion tokens / wall time (so prefill and HTTP time are included, as a client sees them).

The HF baseline builds the same prompt (our ``PromptBuilder``: chat template, image processor,
placeholder expansion, identical to the HF processor token for token), then calls
``model.generate(max_new_tokens=T, min_new_tokens=T, do_sample=False)`` one request at a time;
tokens/s = generated tokens / time (prefill included likewise).

CPU pinning (2 cores): the server process gets ``--server-cores`` (default core 1), this process
(the HTTP client and the HF baseline) ``--client-cores`` (default core 0); both use ``--threads``
torch threads (default 1). HF runs while the server is idle (after /health, before any request).

Devices: ``--device`` (default ``cpu``) is the server's ``--device`` and where HF runs too, so a GPU
run compares both on the same GPU (``--device cuda --server-cores '' --client-cores ''``; the CPU
figures in the table then measure the host side only). scripts/gpu-check.sh runs it that way.

Output: a table on stdout, ``bench/results/decode_throughput.json`` (machine, config, per-concurrency
results, ratios vs HF) and ``decode_throughput.png`` next to it. ``--py-spy`` additionally records
the server with py-spy during the largest concurrency (raw collapsed stacks + a summary in the JSON).

One job per module::

    workload.py  the requests (image + question), how many per concurrency                     pure
    hf.py        the HF ``generate()`` baseline, one request at a time
    server.py    one timed level against our server: OpenAI client, /metrics steps, /proc CPU
    analysis.py  the best run per level, ratios vs HF, the goal                                 pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the server, the levels, the JSON
"""
