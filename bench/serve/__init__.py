"""``stage bench serve``: a serving benchmark for any OpenAI-compatible chat endpoint.

One job per module::

    config.py    Mix (synthetic workload), Load (arrivals), Slo, Target: frozen, validated   pure
    images.py    generated PNGs as data: URLs (seeded, cached per image)
    workload.py  Request; the seeded synthetic mix; JSONL read/write; workload summary        pure but JSONL I/O
    arrivals.py  send offsets: Poisson or gamma at a rate, or all at once                     pure
    stream.py    one SSE stream's tally: TTFT, chunk times, text, usage, in-band errors      pure
    client.py    one streamed chat request over aiohttp -> Outcome
    runner.py    arrivals + concurrency cap + progress bar -> Outcomes of one run
    tokens.py    output tokens when the server sent no usage: tokenizer, else chunks
    metrics.py   Outcomes -> the result dict (vllm bench serve key names)                     pure
    report.py    the printed summary                                                         pure
    plots.py     latency CDFs; latency against request rate
    cli.py       flags -> configs; run; exit codes

Imports of the ``stage`` parser stay light: ``cli.add_args`` imports only ``config``.
"""
