"""Overload through the router: many concurrent clients against a real router in front of a real
prefill and decode on loopback, every answer 200, 429 or 503 with Retry-After, the processes' RSS bounded.

The stack (``stack.py``): ``stage serve prefill`` + ``stage serve decode`` (KV over Mooncake) with
small admission limits (``--max-num-seqs`` 4, ``--max-waiting`` 8: more get 503 with Retry-After)
and ``stage serve router`` in front (``--max-in-flight`` 256: more get 503 with Retry-After).
The burst (``burst.py``): ``--clients`` (500) concurrent clients, one connection each, each sending
``--requests-per-client`` (2) short greedy chats (``--max-tokens`` 4 with ``ignore_eos``, every other
one streamed) one after another without retrying, all within ``--deadline-s`` (180 s; a request
still running then fails the run) and ``--request-timeout`` (120 s) each. Every answer is checked
(``analysis.check_outcome``): a 200 must be a whole answer (the stream ends with ``[DONE]`` and the
usage reports ``--max-tokens`` tokens; JSON likewise), a 429 or 503 must carry a ``Retry-After`` of
whole seconds; anything else (another status, a timeout, a reset) fails the run.
RSS, open fds and threads of the router, the prefill and the decode are sampled from ``/proc`` every
``--sample-s`` (0.5 s) from before the burst to after it; the peak RSS growth over the pre-burst
sample must stay <= ``--max-rss-growth-mib`` (256) per process. Afterwards every process must answer
/health and a plain request must succeed within 30 s.
"""
