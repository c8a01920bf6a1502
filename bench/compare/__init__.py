"""``stage bench compare``: colocated vs 1P1D vs 1E1P1D on this machine, the same workloads, one run.

One job per module::

    config.py    Pinning (role -> cores), Workload (name + Mix + Load), the built-in workloads,
                 CompareConfig: frozen, validated                                          pure
    pinning.py   pin a started Stack's processes (every thread) to their role's cores
    probe.py     each stage's busy seconds from /metrics and CPU seconds from /proc, before/after a run
    session.py   one deployment: start its Stack, pin, warm up, run each workload, stop -> its results
    analysis.py  ratios against colocated, per-core work per request, the goals with reasons  pure
    report.py    the printed table                                                          pure
    plots.py     bars per metric and workload; latency CDFs per workload
    cli.py       flags -> CompareConfig; the run; JSON, plots, exit codes

The client side (requests, streaming, metrics) is ``bench.serve``'s, used as a library.
"""
