"""The EPD prefill's overlap (``stage serve prefill --prefill-overlap``, the default: the prompt is
computed while its images are encoded) against the same stack with ``--no-prefill-overlap`` and a
colocated server, on a ~1k-token system prompt then 1, 2 and 4 images: TTFT as a user sees it.

    .venv/bin/python -m bench.prefill_overlap                  # full run (~7-8 minutes on 2 cores)
    .venv/bin/python -m bench.prefill_overlap --quick          # smoke run (~2-3 minutes)
    .venv/bin/python -m bench.prefill_overlap --images 1,4 --image-size 336 --requests 6

Its own package, not a phase of ``bench.epd_cache``: that benchmark measures the embedding cache (hit
vs miss on one stack that ``stages.launch.stack.Stack`` starts, whose stage flags reach every stage),
while this one compares two EPD stacks that differ in one prefill flag, on a workload that misses
every cache, so it starts its own stacks (``stack.py``) and keeps its own summary.

Systems, each behind a router (``stage serve router``) so TTFT includes the router, as a user sees it:
- ``overlap``: 1E1P1D, ``stage serve encoder``, ``prefill --redis-url``, ``decode --redis-url``, an
  embedded Redis (``cache.embedded.EmbeddedRedis``), KV over ``--transfer`` (mooncake), the router
  given ``--encoder/--prefill/--decode --redis-url`` (it claims and encodes the images, as in production);
- ``no_overlap``: the same with the prefill's ``--no-prefill-overlap``;
- ``colocated``: one ``stage serve colocated`` behind ``stage serve router --colocated``.

Workload: one request at a time (``--gap-s`` idle before each), streamed, ``max_tokens=8``,
``temperature=0``, ``ignore_eos=true``: a system message of ~``--system-tokens`` (1000) tokens that
starts with a number no other request carries (so no prefix-cache block is shared: a miss), then a
user turn with N images (``--images``: 1, 2, 4) of ``--image-size`` pixels (616: 484 image tokens each;
on the quiet 2-core machine the small model's vision tower took ~490 ms for one, about what the
prefill spends on the 1k tokens of text: ~620 ms for all 1486 prompt tokens; at 448 px it was ~205
ms), each a distinct PNG (so the embedding cache misses), and a question. Per round and
system: one untimed request per N, then ``--requests`` (5) per N, the Ns interleaved; every system
gets the same bodies in the same order.

Measures, per N:
- TTFT (send -> first SSE chunk with non-empty ``delta.content``, the router's stream): median, p90,
  min per system; overlap / no_overlap (goal <= 0.75x) and overlap / colocated (goal <= 1.0x).
- From the prefill's room timeline (``GET /rooms/{room}``, the room from the router's ``x-epd-room``
  header), ``embeddings_ready``: ``overlap_s`` (how long the request had been in the engine when its
  last embedding came) and ``computed_tokens`` (the prompt tokens computed by then); without overlap
  the wait for the embeddings (queued -> ``embeddings_ready``); the forward (the request in the
  engine -> ``prefilled``); and the encoder's time for the room (its ``queued`` -> last ``encoded``). Medians.
- Whether overlap and no_overlap answer every request with the same text (greedy; colocated too).

Pinning (``--*-cores``): encoder core 0, prefill core 1, decode core 0; colocated core 1 (the
prefill's); router, Redis and this client not pinned. ``--threads`` (1) torch threads per server.
Phases run one after another (colocated, overlap, no_overlap), the sequence ``--rounds`` times (2; 1
with ``--quick``), samples pooled.

Output: a table on stdout, ``bench/results/prefill_overlap.json`` and ``prefill_overlap.png``, each
process's log under ``bench/results/prefill_overlap_<system>_r<round>/``.

One job per module::

    workload.py  the system prompt (sized with the tokenizer), distinct PNGs, the chat bodies, a round's plan
    stack.py     a started, pinned system: Redis, stage servers, the router
    client.py    one timed request with its rooms' events; a phase's sequence
    analysis.py  medians per system and N, the ratios and their goals, the timeline figures     pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the rounds of phases, the JSON
"""
