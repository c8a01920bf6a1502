"""Prefix caching: time to first token per turn of a five-turn chat about one image (the history
grows each turn), with ``--prefix-caching`` on vs off, colocated and 1E1P1D, both through the router.

    .venv/bin/python -m bench.prefix_cache                # full run (~6-10 minutes on 2 cores)
    .venv/bin/python -m bench.prefix_cache --quick        # smoke run (~3-4 minutes)

A conversation: turn 1 is one generated ``--image-size`` PNG (``data:`` URL; a new image per
conversation) and a question; turns 2-5 are text questions about it; every turn sends the whole
history, the earlier answers included, ``stream=true``, ``max_tokens=--max-tokens``,
``temperature=0``, ``ignore_eos=true``, ``stream_options.include_usage``. With prefix caching each
turn finds the previous turns' prompt blocks cached (``usage.prompt_tokens_details.cached_tokens``):
the colocated server computes only the new tail and does not encode the image again; the 1E1P1D
prefill computes only the tail too (the encoder is not asked again either way: the embedding cache
has the image after turn 1) but still sends the decode the whole prompt's KV.

TTFT = time from sending the request to the first SSE chunk with non-empty content, through the
router. Per phase: one untimed two-turn warm-up conversation, then ``--conversations`` (4)
conversations one turn at a time with ``--gap-s`` idle before each request. Phases one after another,
never at once: colocated on, colocated off, epd on, epd off (on and off swapped in even rounds, so
neither always runs first); ``--rounds`` (2) times, samples pooled.
Per mode and turn: TTFT median on / off (the goal: turns 3-5 at or under 0.3x), the cached tokens,
and whether on and off answered every turn with the same text (greedy: they must). For epd also the
prefill's forward pass alone (its room timeline, ``GET /rooms/{room}``: ``prefilled`` -
``embeddings_ready``; the router names the room in ``x-epd-room``), on / off: the compute prefix
caching saves, without the fixed costs around it (router, HTTP, prompt building, the KV write).

Output: a table on stdout, ``bench/results/prefix_cache.json`` and ``prefix_cache.png`` (server logs
under ``bench/results/prefix_cache_<phase>_r<round>/``), the summary in ``bench/summaries/``.

One job per module::

    workload.py  the conversation's turns and its request bodies
    client.py    one streamed request through the router; one conversation
    phase.py     one phase: start the stack, warm up, run the conversations, stop it
    analysis.py  per mode and turn: medians, on / off, the goal, same texts      pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the rounds of phases, the JSON
"""
