"""Time to first token of a 1P1D pair (prefill + decode servers, KV moved by mooncake or nixl) vs one
colocated server, at low load: one request at a time.

    .venv/bin/python -m bench.ttft_pd                     # full run (~6-8 minutes on 2 cores)
    .venv/bin/python -m bench.ttft_pd --quick             # smoke run (~2-3 minutes)
    .venv/bin/python -m bench.ttft_pd --backends nixl --requests 12

Workloads (``--workloads``), each one user turn, ``stream=true``, ``max_tokens=8``, ``temperature=0``,
``ignore_eos=true``:

- ``text_short``: a one-line question (~20 prompt tokens with the chat template);
- ``image_64``: one generated 64x64 PNG (``data:`` URL) and a short question;
- ``text_2k``: ~2000 prompt tokens of text (common words, sized with the checkpoint's tokenizer).

TTFT = time from sending the request to the first SSE chunk whose delta carries non-empty content
(the server's first chunk, role only, does not count). For PD the client sends the same body with
``bootstrap_host/port`` and a random 63-bit ``bootstrap_room`` to the prefill and the decode at the
same moment (as a PD router does) and times the decode's stream, which is the reply. Per workload:
one untimed warm-up, then ``--requests`` (6) requests, one at a time with ``--gap-s`` (0.25 s) idle
before each, workloads interleaved; median,
p90 and min; ratio PD / colocated of the medians. Each PD request also records the prefill's KV
write time and bytes (the delta of ``/server_info`` ``transfer`` between requests), and each PD
reply is compared with the colocated reply of the same workload (greedy: identical text expected).

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

    workload.py  the three chat bodies; text_2k sized with the tokenizer
    client.py    one request (colocated, or PD: both sides at once) with KV and CPU figures; a phase's sequence
    phase.py     one phase: start the servers, measure, stop them
    analysis.py  per workload: medians, p90, min, KV figures; rounds pooled; PD / colocated      pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the rounds of phases, the JSON
"""
