"""Time to first token of a 1P1D pair (prefill + decode servers, KV moved by mooncake or nixl) vs one
colocated server, at low load: one request at a time.

    .venv/bin/python -m bench.ttft_pd                     # full run (~6-8 minutes on 2 cores)
    .venv/bin/python -m bench.ttft_pd --quick             # smoke run (~2-3 minutes)
    .venv/bin/python -m bench.ttft_pd --backends nixl --requests 12

Workloads (``--workloads``), each one user turn after a system turn, ``stream=true``, ``max_tokens=8``,
``temperature=0``, ``ignore_eos=true``; each says whether it measures a prefix-cache hit or a miss:

- ``text_short`` (miss): a one-line question;
- ``image_64`` (miss): one generated 64x64 PNG (``data:`` URL) and a short question;
- ``text_2k`` (miss): ~2000 prompt tokens of text (common words, sized with the checkpoint's tokenizer);
- ``text_2k_hit`` (hit): the same 2000-token prompt every time, so every timed request after the
  warm-up finds all but its last partial block in the prefix cache.

The system turn starts with a 6-digit number, then "You are a helpful assistant." (the template's
default). A miss workload gives every request of a phase its own number (the digits are tokens 3-8,
inside the first 16-token KV block, so no block is shared; fixed width, so every request has the same
length); request k of round r has the same number in every phase, so each system gets the same
prompts and PD's replies can be compared with colocated's, request by request. A hit workload uses one
number throughout. The table shows each request's cached prompt tokens (``usage``'s
``prompt_tokens_details.cached_tokens``, median): 0 for a miss.

TTFT = time from sending the request to the first SSE chunk whose delta carries non-empty content
(the server's first chunk, role only, does not count). For PD the client sends the same body with
``bootstrap_host/port`` and a random 63-bit ``bootstrap_room`` to the prefill and the decode at the
same moment (as a PD router does) and times the decode's stream, which is the reply. Per workload:
one untimed warm-up, then ``--requests`` (6) requests, one at a time with ``--gap-s`` (0.25 s) idle
before each, workloads interleaved; median,
p90 and min; ratio PD / colocated of the medians. Each PD request also records the prefill's KV
write time and bytes (the delta of ``/server_info`` ``transfer`` between requests), and each PD
reply is compared with the colocated reply to the same prompt (greedy: identical text expected).

Breakdown (PD): after each request the client reads the prefill's and the decode's timeline of its
room (``GET /rooms/{room}``, wall-clock events) and splits the TTFT into the chain client send -> P
``queued`` (arrival_p) -> ``prefilled`` (p_compute: the prefill's forward pass starts on arrival) ->
``paired`` where the decode's KV request came later (pair_wait, else 0) -> ``kv_written`` (kv_write) ->
``ready_sent`` -> D ``kv_ready`` (ready_to_d) -> ``first_token`` (d_first_step) -> the client's first
content (to_client), with the handshake (P ``queued`` -> ``paired``, overlapping the forward), send ->
D ``queued`` (arrival_d) and D ``queued`` -> ``blocks_reserved`` beside it (``analysis.CHAIN``, ``SIDE``); medians
per workload and backend in the table and the JSON, and text_short's in the summary. Colocated has no
timeline: its TTFT only.

Phases run one after another, never at once: colocated (server on ``--colocated-cores``, core 1),
then per backend a pair (prefill on ``--prefill-cores``, core 0; decode on ``--decode-cores``, core 1);
the whole sequence runs ``--rounds`` times (2; 1 with ``--quick``) and each system's samples are
pooled, so that outside load drifting over the minutes of a run hits every system.
Servers run ``--threads`` torch threads (1). The client is pinned to ``--client-cores`` (default:
not pinned; it shares the cores with the servers). Each phase records the 1-minute load average,
the machine-wide CPU busy fraction and each server's CPU seconds.

Output: a table on stdout, ``bench/results/ttft_pd.json`` and ``ttft_pd.png`` (plus server logs
``ttft_pd_<phase>_r<round>_<role>.log``).

One job per module::

    workload.py  the four chat bodies, hit or miss, the request numbers; text_2k sized with the tokenizer
    client.py    one request (colocated, or PD: both sides at once) with KV and CPU figures and, for PD,
                 both rooms' timelines; a phase's sequence
    phase.py     one phase: start the servers, measure, stop them
    analysis.py  per workload: medians, p90, min, KV figures, the breakdown; rounds pooled; PD /
                 colocated; the same-text check                                                pure
    report.py    the tables (TTFT; PD's breakdown), the plot, the summary's figures
    __main__.py  flags, the rounds of phases, the JSON
"""
