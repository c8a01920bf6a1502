"""How many requests one fixed KV pool serves at once: KV on demand (with preemption) vs reservation
(prompt + ``max_tokens`` on admission, the engine's ``--kv-allocation reserve``).

    .venv/bin/python -m bench.kv_on_demand              # full run (~2-4 minutes on 2 cores)
    .venv/bin/python -m bench.kv_on_demand --quick      # smoke run (~1 minute)

One engine in this process (``stages.loading.load_engine``, ``--threads`` torch threads, the CPU)
per mode, each with the same pool (``--kv-cache-mib``) and ``--max-num-seqs`` = ``--requests``, so
only the pool limits admission. ``--requests`` (128) text requests of a few words each are added at
once, each ``max_tokens=1024`` (``--max-tokens``), greedy, ``ignore_eos``; request i's output ends
after n_i tokens, n_i drawn once (seeded) from 48..80 (``--output-tokens`` +- 25%, so "~64"): the
engine aborts it there, between steps, which frees its blocks exactly as an end-of-sequence token
would (a random-weight checkpoint has no meaningful end of sequence). Per step it records the
requests holding KV (``scheduler.running``) and the blocks in use.

Figures: the most requests running at once, each mode, and on demand / reserve (goal >= 3x); the
time to serve all of them and its ratio; preemptions; and whether each request's tokens are the same
in both modes (greedy: a preempted request is recomputed, exact on the CPU)."""
