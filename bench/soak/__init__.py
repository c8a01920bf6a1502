"""Soak through the router: a real router in front of a real prefill and decode on loopback
(``bench.overload.stack``), held at ~70% of its measured capacity for a long time, with the open
fds, threads and RSS of every process sampled: none may grow.

First the ramp (``load.ramp``): ``--ramp-concurrency`` (1,2,4,8,16) clients in turn, each step
``--ramp-step-s`` (15 s) of requests back to back; it stops at the first step that does not beat the
best by 5% or gets a refusal; capacity = the best step's 200s per second. Then the hold
(``load.hold``): requests started on a fixed schedule at ``--load-fraction`` (0.7) x capacity for
``--duration-s`` (1200 s), at most ``--max-in-flight`` (64) at once (an arrival past that is skipped
and counted). Requests as in bench/overload/ (short greedy chats, ``--max-tokens`` 8, every other one
streamed), every answer checked the same way (200 whole, or 429/503 with Retry-After).
Every ``--sample-s`` (30 s) during the hold: RSS, open fds and threads of the router, the prefill
and the decode (``/proc``). The verdict (``analysis``): after ``--warmup-s`` (default 10% of the
hold), the median of the last third of each series minus the median of the first third must stay
within a bound (RSS: max(``--rss-growth-mib`` 32, 5% of it); ``--fd-growth`` 32; ``--thread-growth``
8: keep-alive pools and worker threads follow the requests in flight, a plateau and not a leak); the least-squares
slope per minute is reported. Stage limits are the servers' defaults unless given.
"""
