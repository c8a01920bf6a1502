"""The embedding cache of a 1E1P1D stack (encoder + prefill + decode behind the router, KV over
mooncake, a private Redis) against one colocated server behind the router, side by side in one run:
TTFT with the images cached and not, encoder calls per unique image, and the time from an
embedding landing in the cache to the waiting prefill starting.

    .venv/bin/python -m bench.epd_cache                  # full run (~2-6 minutes on 2 cores, with the load)
    .venv/bin/python -m bench.epd_cache --quick          # smoke run (~1-2 minutes)
    .venv/bin/python -m bench.epd_cache --images 1,4,8 --image-size 448 --requests 6

Both systems are driven through the router (``stages.launch.stack.Stack``, what ``stage up`` starts), the
product's front door: in epd mode the router computes each image's key, asks the cache index which
are missing, claims them for the encoder and sends encoder, prefill and decode their parts at once.

Workload: each request is one user turn with N images (``--images``: 1, 4, 8) of
``--image-size`` pixels (224: 64 image tokens each) and a question; ``stream=true``,
``max_tokens=8``, ``temperature=0``, ``ignore_eos=true``. Every image is a distinct PNG (a
gradient, a square and the image's index written as pixels). Per round and N, ``--requests``
pairs: a *miss* (N images never sent before) then a *hit* (the same N images again), with
``--gap-s`` idle before each request; one untimed pair per N first. The colocated server (no cache)
gets the same bodies in the same order.

Measures:
- TTFT: send -> first SSE chunk with non-empty ``delta.content`` (the router's stream). Medians per
  system, N and case; the goal is epd hit <= 0.5x epd miss. Each request also records every
  server's CPU ms over its stream (``/proc``): the stage servers' sum is the steadier view of the
  work a hit saves when other load shares the cores.
- Encoder calls per unique image: the encoder's ``epd_encoder_images_encoded_total`` over the run /
  the distinct images sent. Over the TTFT requests (every miss image once, each then repeated) and a
  concurrent burst (``--burst-requests`` requests at ``--burst-concurrency``, each with 1-4 images
  from a pool of ``--burst-unique`` new ones, the first ``--burst-concurrency`` all holding one hot
  image). Goal: exactly 1.0. Each TTFT request also checks its own delta (N for a miss, 0 for a hit).
- Wake: for every miss whose prefill waited (its ``epd_cache_misses_total`` moved and it was queued,
  when its read starts, before the last image landed), the prefill's ``embeddings_ready`` room event (``GET /rooms/{room}``:
  its room's inputs are in hand and the request goes to the engine next) minus the landing time of
  the request's last image. Landing = the kernel's receive stamp (``SO_TIMESTAMPNS``) of the image's
  ``ready`` event on this process's own subscriber socket (``LandingClock``): the event is the last
  step of the cache's write script, and on loopback the stamp is taken inside Redis's write of it,
  when it reaches every subscriber, the prefill included, however late this process reads it. Also
  reported: from the entry's ``created_at`` (the encoder's clock before it sends the write: an upper
  bound that includes the write's own trip). Wall clocks of one machine. Goal: p50 under 2 ms.
  (Rejected: Redis MONITOR dates the PUBLISH too but echoes every payload, which delayed the
  prefill's wake by ~10 ms; a subscriber's own read time is late by however long its thread waits
  for a core, up to several ms on this machine.)

Pinning (``--*-cores``): encoder core 0, prefill core 1, decode core 0; colocated core 1 (the
prefill's core: both run the forward pass of the first token there); router, Redis and this client
not pinned. Every thread of a process is pinned once it is healthy (``/proc/PID/task``), so threads
started later inherit it. Servers run ``--threads`` (1) torch threads. Phases run one after another
(colocated, then epd), the sequence ``--rounds`` times (2; 1 with ``--quick``), samples pooled.

Output: a table on stdout, ``bench/results/epd_cache.json`` and ``epd_cache.png``, and every
process's log under ``bench/results/epd_cache_<phase>_r<round>/``.

One job per module::

    workload.py  distinct PNGs, the chat bodies, a round's miss/hit pairs                      pure
    landing.py   when each image landed: RESP parsing, the timestamping subscriber; created_at
    stack.py     a started, pinned ``Stack`` of a mode
    client.py    one timed request with its counters, room events and landing; the TTFT
                 sequence and the concurrent burst
    phase.py     one phase: start the stack, measure, stop it
    analysis.py  the wake of a miss; medians, ratios, encoder calls, wake stats; goals         pure
    report.py    per-phase lines, the table, the plot, the summary's figures
    __main__.py  flags, the rounds, the JSON
"""
