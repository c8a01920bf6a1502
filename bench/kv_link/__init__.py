"""KV moved between two hosts of the multi-host rig: our transfer layer vs the raw library vs a
plain TCP socket carrying the same bytes over the same link.

    .venv/bin/python -m bench.kv_link                  # full run (~1-2 minutes on 2 cores)
    .venv/bin/python -m bench.kv_link --quick          # smoke run (16 MiB contiguous only, 5 repetitions)
    .venv/bin/python -m bench.kv_link --backends nixl --sizes-mib 64 --reps 60

Runs from a checkout, as root: it builds the rig of ``tests/multihost/rig.py`` (one network
namespace per host on a private bridge, one veth link each; the import is lazy, inside ``main``,
so ``--help`` works anywhere; bench/'s import rules do not cover ``tests``). Two hosts are used:
``p1`` (the source, a prefill's role) and ``d1`` (the sink, a decode's role). Each side is a spawned
process that enters its host's namespace before anything else (``tests.support.server_forks.enter_netns``),
pins itself (``--source-cores`` 0, ``--sink-cores`` 1) and holds a ``KVPool`` on the ``small``
model's KV layout (built from its ``config.json``: 128 KiB blocks, 8 KiB per token), registered with
the backend under test, whose ``TransferConfig.host`` is its host's rig address. Every byte from p1
to d1 crosses p1's veth, the bridge and d1's veth: what a two-host deployment's KV does, less the
physical wire.

What moves: ``--sizes-mib`` (16, 64) of KV, the source's blocks ``0..n-1`` into the sink's pool at
*contiguous* remote ids (one op) and *fragmented* ones (one op per block), per backend: mooncake
over tcp, and nixl with ``UCX_TLS=tcp`` in both workers (``--ucx-tls``): left to its own choice,
UCX finds the two namespaces on one machine and moves the bytes through shared memory, never over
the link (``wire_ratio`` 0), which two real hosts cannot do. Paths, the same byte ranges,
interleaved in a shuffled order per repetition:

- ``ours``: ``block_ops`` + ``backend.write(peer, ops)``, what the prefill server does per request;
- ``raw``: the library called directly on the same engine / agent (``bench.kv_transfer.paths``:
  Mooncake ``batch_transfer_sync_write``, NIXL create/post/busy-poll/release);
- ``tcp``: one plain TCP connection from the source process to a listener thread in the sink
  process: a header (op count, then each op's remote offset and length), ``sendall`` of each op's
  bytes from the source pool, ``recv_into`` the sink pool at the remote offset, both in pieces of
  ``--tcp-chunk-kib`` (128: faster than one call per multi-MiB op, so the baseline is the better
  plain socket), a 1-byte ack once all have landed; timed until the ack, as a write is timed until
  it completes.

Each path's bytes are checked once per cell (the sink hashes the written blocks), and that check's
move also counts the bytes the source's ``eth0`` sent (``/proc/self/net/dev`` in its namespace):
``wire_ratio`` = those / the payload; a path below 1.0 did not carry its bytes over the link (UCX's
shared memory between two namespaces of one machine would), and the run says so. ``tcp_opens``:
the TCP connections the source's namespace opened during that move (a library that connected
per move would show it; the first move of a fresh engine shows its connection set-up).

Ratios on the medians (bandwidth, time of the reference over the path's): ``ours / tcp`` (goal >=
0.8), ``raw / tcp`` (the library's own path against the socket) and ``ours / raw`` (ours / tcp is
their product). Where ours / tcp misses the goal, ``limit`` says which factor is short: ``library``
(raw / tcp < 0.8 while ours / raw >= 0.9: the library's own path is the limit), ``our layer``
(ours / raw < 0.9 while raw / tcp >= 0.8), ``library and our layer``, or ``neither alone``.

Output: a table on stdout, ``bench/results/kv_link.json``, ``kv_link.png`` and the summary in
``bench/summaries/``. The rig's namespaces are deleted in ``finally`` (and swept at start when a
killed run left them).

One job per module::

    workload.py  sizes in MiB -> blocks, the remote block lists, the pool size, the repetitions   pure
    worker.py    the two processes in their namespaces: pools, backend, TCP sender / receiver, link bytes
    measure.py   one backend: both processes, every cell's paths checked, warmed up, timed
    analysis.py  per cell: times, GB/s, ours / tcp, raw / tcp, ours / raw, the limit; the goal     pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the rig, each backend's run, the JSON
"""
