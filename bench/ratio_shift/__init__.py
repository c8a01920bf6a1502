"""Auto E:P:D ratio under a shifting load (issue 34): one fleet of switchable EPD workers, a load that
goes image-heavy, text-only, image-heavy; goodput of fixed splits against the router's automatic
ratio loop with the encoders fixed, with them switchable, and with local encoding too.

    .venv/bin/python -m bench.ratio_shift            # full run, ~12 minutes (small model)
    .venv/bin/python -m bench.ratio_shift --quick    # smoke run, ~2.5 minutes (tiny model, 10 s phases, one fixed split)

Fleet (started once): an embedded Redis and ``--workers`` (4) switchable workers (``stage serve pd
--redis-url --admin-token``, each its own ``--bootstrap-port``, KV over Mooncake, ``--threads`` 1 torch
thread, ``--kv-cache-mib 256 --max-batch-images 4``; not pinned: on the 2-core dev machine a role's
workers get at most one core each, so the split decides how many cores the bottleneck role can use).
``--max-batch-images 4`` keeps an encoder's vision-tower call to about one request's images: with the
default 16, 4 requests of 448 px images sent at once to a 2:1:1 fleet took 18 s in all against ~1.6 s
for one alone on this CPU (a probe, not part of the run).

Configurations, one after the other, each with Redis flushed (FLUSHALL: no embedding of another run
is reused) and its own router (``stage serve router``, the role flags giving the starting split;
``--drain-timeout-s 60``), stopped after the run:

- ``fixed-E:P:D`` for each of ``--fixed`` (2:1:1, 1:2:1): ``--auto-ratio-interval-s 0 --local-encode
  never``. 1:1:2 is not tried: 12 decoded tokens a request keep a decode mostly idle. The best of
  them (highest overall goodput) is the baseline, and its split the auto configurations' start.
- ``auto-pd`` (b, today): ``--auto-ratio-interval-s 2 --ratio-window-s 8 --auto-ratio-roles
  prefill,decode --local-encode never``: the encoders stay as they start.
- ``auto-epd`` (c): the same with ``--auto-ratio-roles encoder,prefill,decode``.
- ``auto-epd-local`` (d): (c) with ``--local-encode auto`` (a prefill encodes its own images when
  every encoder has >= 2 encode calls in flight).
The interval and window (``--auto-interval-s``, ``--ratio-window-s``) are short enough for the loop
(a target stable 2 ticks) to react within a phase.

Load: ``--clients`` (6) closed-loop clients, each sending one streamed chat at a time (``stream=true``,
``max_tokens=12``, ``ignore_eos``, ``temperature=0``), the kind of the phase running when it is sent;
``--phases`` images,text,images of ``--phase-s`` (40) seconds each. Image-heavy: 3 or 4 images of
``--image-size`` (448) px (~800-1070 prompt tokens on qwen2_vl-small; the vision tower dominates) and
a short question; text-only: ``--prompt-words`` (400) words (~970 tokens) beginning with the request's
own number (the prefix cache never hits). Every image's pixels are unique in the run (the request's
serial written into its first row), so nothing is an embedding-cache hit.

Measures (``analysis.py``):
- Per request, client-side: TTFT (send -> first content chunk) and TPOT ((end - first content) /
  (tokens - 1)); a failure is any non-200, in-band error event, empty stream or transport error.
- SLO: TTFT and TPOT each <= ``--slo-factor`` (2) x the median over the whole run of the fixed split
  with the highest answered throughput (requests/s). Goodput: requests meeting both, per second of
  the phase they were sent in, per phase and overall (all phases' time). The baseline ("best
  fixed") is the fixed split with the highest overall goodput under that SLO; every configuration's
  goodput is reported over it. Goal: (c) or (d) >= 1.3x overall.
- The split: ``GET /admin/workers`` every ``--sample-s`` (1 s). A change is a sample whose workers
  per role differ from the one before. Re-balance time after a shift: per phase after the first,
  seconds from the phase's start to the first and to the last change within the phase (the last
  is the headline: when the split settled).
- Failures per configuration, and the requests in flight during a switch (a span from the sample
  before a draining worker or a new split to that sample) and those of them that failed (goal: none).

Output: a table on stdout, ``bench/results/ratio_shift.json`` (every request and sample) and
``ratio_shift.png`` (per configuration: workers per role over time, TTFT of each request at its send
time with the SLO), logs in ``bench/results/ratio_shift_logs/``, the summary
``bench/summaries/ratio_shift.json``.

One job per module::

    workload.py  phases, unique images and prompts, chat bodies                     pure
    fleet.py     Redis, the workers, a router per configuration
    client.py    the closed-loop clients over the phases; the split sampler
    analysis.py  SLO, goodput, split changes, re-balance times, failures, ratios    pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the configurations, the JSON
"""
