"""What the benchmark scripts in ``bench/`` share; one job per module::

    args.py      the common flags (--family, --size, --model-dir, --cache-dir, --quick, --out,
                 --summary-dir, --threads, timeouts, --server-arg/--server-env), the checkpoint
    machine.py   where a run was measured: CPU, cores, memory, versions, git commit and dirty flag
    proc.py      CPU time and process trees from /proc; machine and per-core busy fractions     reads /proc
    pinning.py   core lists, pinning this process or every thread of another
    meter.py     CpuMeter (one interval's CPU and load) and LoadSampler (load over a whole run)
    children.py  Child: a pinned subprocess with a log and a health wait; Server: ``stage serve <role>``
    images.py    the generated test image, PNG data: URLs
    stats.py     percentiles, the n/median/p90/min/max dict, ratios, py-spy stack summaries        pure
    output.py    the JSON and the plot files
    record.py    Recorder: one run's machine, load and duration; writes the full JSON and the summary

Importing any of them imports neither torch nor matplotlib (the benchmarks start their servers first).
"""
