"""``stage env``: what this machine has for the stage servers, and whether each role can run here
(vLLM's ``collect-env``, for this project). One job per module::

    facts.py      the facts, frozen dataclasses (no I/O): torch and its GPUs, the transfer builds, UCX, RDMA, Redis
    gather.py     gather_facts(): reads them off this machine (imports torch; mooncake and nixl in child processes)
    ucx_probe.py  the UCX transports of the UCX that NIXL bundles (uct's own query, in a child process)
    verdict.py    verdicts(facts, device, transfers): per role, ok or what is missing and the fix (pure)
    render.py     one screen of text, or JSON for bug reports (pure)

Importing the package imports no torch (``stage --help`` stays fast).
"""
