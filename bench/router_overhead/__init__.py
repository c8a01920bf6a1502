"""Router overhead in PD mode (text only): our router, sglang-router and vllm-router in front of the same
fake prefill + decode pair, against the client driving the pair itself, in one run.

    .venv/bin/python -m bench.router_overhead              # full run, ~3-4 minutes (+ the peers' install once)
    .venv/bin/python -m bench.router_overhead --quick      # smoke run, ~1 minute
    .venv/bin/python -m bench.router_overhead --py-spy     # also profile our router at concurrency 32

Backends: ``bench/fake_backend.py`` (one process, a prefill port and a decode port, no model), so a
router's cost is not buried under model time: a JSON answer comes back at once, a stream paces its
tokens ``--itl-ms`` apart. Measured per target (``direct`` = the client sends the body with
``bootstrap_host/port/room`` to the prefill and the decode at once and takes the decode's answer,
as a PD router does):
- c=1, non-stream: latency p50/p99; added = router - direct;
- c=1, stream: time to the first body byte and to the first token (first non-empty ``delta.content``);
- c=32, non-stream: throughput (requests/s) and latency p50/p99;
- CPU per request of the router process (and its children): their threads' CPU time over each phase, in the
  scheduler's nanoseconds (``/proc/PID/task/TID/schedstat``; 10 ms ticks would round a phase's few hundred ms).
Phases run one target at a time; the sequence of targets runs ``--rounds`` times (order reversed
every other round) and samples are pooled, so drifting outside load hits every target.

Tracing's cost (``--tracing``, on by default): our router again, as ``ours-traced`` and ``ours-traced-1pct``,
with ``--otlp-traces-endpoint`` at a sink in the benchmark's process (``bench/common/otlp_sink.py``:
decodes each export to count its spans, keeps nothing) and ``--otlp-traces-sample-ratio`` 1 and 0.01; the
requests carry no ``traceparent``, so the router's sampler decides. ``tracing_cost`` in the JSON and the
summary: each traced target / ``ours`` on router CPU per request (median over rounds); the spans the sink
received are under ``traces_exported``.

Peers are installed from PyPI into their own venv (``--peers-venv``), never the project's:
``sglang-router==0.3.2`` (``python -m sglang_router.launch_router --pd-disaggregation``, bootstrap
fields like ours, prefill and decode at once) and ``vllm-router==0.1.17`` (``--vllm-pd-disaggregation``:
the prefill first with ``max_tokens=1`` and ``kv_transfer_params``, then the decode, so its added
latency includes one extra sequential round trip by design). A peer that fails to install or start
is recorded under ``skipped`` and the run goes on. Every router uses round-robin for both roles.

Every phase checks that each router reached the prefill and the decode exactly once per request
(``each_stage_reached_once``); the run exits 1, naming the phases, when one did not.

One job per module::

    peers.py     the peer routers' venv and every router's command line
    client.py    the requests: direct to the pair or through a router; each answer's text checked
    measure.py   one target's round: warm-up, the three phases, the router's CPU; py-spy
    analysis.py  pooled numbers per target, added vs direct, ours / best peer, the stage check   pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the processes, the rounds, the JSON
"""
