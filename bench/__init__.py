"""Benchmarks. ``bench.serve`` (``stage bench serve``) drives any OpenAI-compatible chat endpoint; the
scripts beside it (``decode_throughput.py``, ``kv_transfer.py``, ``ttft_pd.py``) start our own servers
and measure them. ``bench/README.md`` says how to run each one."""
