"""Benchmarks. ``bench.serve`` (``stage bench serve``) drives any OpenAI-compatible chat endpoint and
``bench.compare`` (``stage bench compare``) runs the three deployments side by side; the packages
``decode_throughput``, ``kv_transfer``, ``ttft_pd``, ``router_overhead``, ``epd_cache`` and the module
``check_against_aiperf`` (each ``python -m bench.<name>``) start our own servers and measure them.
``bench.common`` is what they share; ``bench.summaries`` holds each run's summary and makes
bench/README.md's "Latest figures" table from them. ``bench/README.md`` says how to run each one."""
