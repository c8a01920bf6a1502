"""Launching: starting, watching and stopping our servers as processes. The CLI, the benchmarks and
the tests use it; it imports nothing of the CLI (``cli``), of ``router`` or of ``bench``.
One job per module::

    ports.py      bind a server's port first (PortError names the flag), probe a port, a free port
    instance.py   a process's start id (EPD_INSTANCE_ID), reported in every /server_info
    processes.py  a child leading its own process group that dies with its starter; stop (TERM, KILL)
    health.py     wait until /health answers 200 (and /server_info shows the child's instance id)
    models.py     the generated checkpoint run without --model (ensure_model), the cache dir
    run_logs.py   per-run log directories, the newest 10 kept
    stack.py      Stack: a mode's whole stack (Redis, stages, router) started healthy and stopped together
    up.py         ``stage up``: a Stack until Ctrl-C
    demo.py       ``stage demo``: one image+text request through a Stack

Importing any of them imports no torch (a generated model is made, and servers load, in their own
processes or on first use).
"""
