"""KV move time and bandwidth of our transfer layer vs the raw library vs an in-process memcpy.

    .venv/bin/python -m bench.kv_transfer                 # full run (~2-3 minutes on 2 cores)
    .venv/bin/python -m bench.kv_transfer --quick         # smoke run (~1 minute)
    .venv/bin/python -m bench.kv_transfer --backends nixl --tokens 512,2048 --reps 60

What moves: the KV of a 512 / 2048 / 8192-token prompt on the ``small`` model's KV layout (built
from its ``config.json`` without loading weights: block-major ``[blocks, layers, 2, 16, kv_heads,
head_dim]``, float32, ``KVLayout.block_bytes`` per block), from a pool in this process (the
initiator, a prefill server's role) into a pool in a spawned target process (a decode server's
role), over loopback, for each backend (mooncake, nixl). Two remote block layouts:

- contiguous: remote block ids are one run, so ``block_ops`` coalesces the prompt into one op;
- fragmented: remote block ids are a random sample of the target pool (checked: one op per block),
  as in a decode pool that has served many requests.

Paths, all moving the same byte ranges (the coalesced op list), interleaved in a random order
within each repetition so that drift in the machine's load hits them alike:

- ``ours``: ``block_ops(local ids, remote ids, block_bytes)`` + ``backend.write(peer, ops)``, i.e.
  what the prefill server does per request (coalescing, validation, locking, statistics, and the
  backend's own call path: Mooncake's worker thread, NIXL's descriptor building and sleep/backoff poll);
- ``raw``: the library called directly on the *same* engine / agent (same registered memory, same
  connection), with the address lists computed beforehand: Mooncake ``batch_transfer_sync_write``
  with the op list (the call our backend makes, on the calling thread); NIXL ``createXferReq`` +
  ``postXferReq`` + busy-poll ``getXferStatus`` + ``releaseXferReq`` (what the ``nixl_agent``
  wrapper's ``initialize_xfer`` / ``transfer`` / ``check_xfer_state`` call; the wrapper itself is
  not used because its agent's progress thread busy-polls a whole core);
- ``raw_in_thread`` (Mooncake only): the same raw batch call, run on a fresh worker thread while the
  caller waits, as our backend does (to bound a call that cannot be cancelled): separates the
  thread hop from the rest of our layer;
- ``raw_sync`` (Mooncake only): ``transfer_sync_write`` once per op (one call per contiguous run);
- ``raw_sleep_poll`` (NIXL only): the raw calls, polled with our backend's sleep/backoff schedule
  (on loopback ``postXferReq`` completes the copy itself, so this is the same work as ``raw``: the
  gap between the two is the measurement noise);
- ``memcpy``: ``torch`` ``copy_`` of the same ops between two CPU tensors in this process (one
  torch thread): the ceiling for any loopback move.

Each cell is measured ``--reps`` times (4x for the 4 MiB cells, 2/3 for 64 MiB) after warm-up
writes; the table gives median, p90 and min time,
GB/s at the median (1 GB = 1e9 B) and the ratios ours/raw (goal >= 0.9) and each/memcpy. Every
path's bytes are checked once (the target hashes its blocks). A breakdown times our layer's parts
in isolation (block_ops, coalesce + check_ops, the worker-thread hop, descriptor building).

Pinning: this process (initiator + memcpy) on ``--initiator-cores`` (core 0), the target on
``--target-cores`` (core 1); the libraries' threads inherit their process's core. Recorded with
the 1-minute load average, the machine-wide CPU busy fraction and each process's CPU seconds.

Output: a table on stdout, ``bench/results/kv_transfer.json`` and ``kv_transfer.png``.

One job per module::

    layout.py     the KV layout from the checkpoint's config; remote block lists; repetitions   pure
    target.py     the target process: a registered pool that hashes and zeroes blocks on request
    paths.py      the paths (ours, raw, raw_in_thread, raw_sync, raw_sleep_poll, memcpy); byte checks
    breakdown.py  our layer's parts timed in isolation; NIXL's raw calls split
    measure.py    one backend: every cell's paths interleaved, timed, checked
    analysis.py   per cell: median/p90/min, GB/s, ours / raw, each / memcpy; the goal           pure
    report.py     the table, the plot, the summary's figures
    __main__.py   flags, the pools, the backends, the JSON
"""
