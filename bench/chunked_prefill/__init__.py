"""Chunked prefill: the TPOT of running streams while long prompts arrive, chunked vs not (issue 18,
item 5b), and what a chunk costs in the engine, by ``--max-batched-tokens``.

    .venv/bin/python -m bench.chunked_prefill                 # full run (~8-10 minutes on 2 cores)
    .venv/bin/python -m bench.chunked_prefill --quick         # smoke run (~3 minutes)
    .venv/bin/python -m bench.chunked_prefill --sweep 128,256,512 --cost-budgets 128,256,2048

Goal: with a ~2000-token prompt arriving every 2 s, the TPOT p99 of 8 running streams at the
default ``--max-batched-tokens`` is at most 2x their TPOT p99 with no arrivals.

Phases, each against a real ``stage serve colocated`` over HTTP, every request streamed through
``stage bench serve``'s client (aiohttp), greedy, ``ignore_eos``:

- ``alone`` (a): ``--streams`` (8) closed-loop streams of short prompts, ``--stream-tokens`` (64)
  tokens each, starting requests for ``--duration-s``; no arrivals. The server has the default
  ``--max-batched-tokens`` (no flag given).
- ``chunked`` (b): the same server and streams, plus a ``--long-tokens`` (2000) prompt (common words
  sized with the checkpoint's tokenizer, as bench.ttft_pd's text_2k; each arrival the same words in
  another order, so a prefix cache cannot serve one from another) every ``--period-s`` (2 s) while
  any stream runs, each generating ``--long-max-tokens`` (8).
- ``unchunked`` (c): as (b) on a server with ``--max-batched-tokens`` ``--unchunked`` (65536): a
  long prompt is one step.
- ``budget=N`` for each of ``--sweep`` (none by default): as (b) on a server with
  ``--max-batched-tokens N``.

TPOT is vLLM's, per request ``(e2el - ttft) / (output tokens - 1)``, p99 over the streams' requests;
ITL is every gap between two token chunks of those requests, pooled. Chunking cannot lower the work a prompt adds, only spread it: a
stream that lives through the whole prefill pays for all of it either way, so TPOT (an average over
a request) moves little, while ITL p99 (the longest stalls) is what chunking bounds; both are
reported with their ratios to ``alone``. Each server first answers one long prompt alone (a warm-up),
then ``--lone-requests`` (2) more per round, one at a time: the lone long prompt's TTFT at that budget.

Every server is started at once, pinned to the same cores (an idle server uses no CPU), and the
phases run one at a time, ``--duration-s`` (20 s) each, in ``--rounds`` (2) rounds, the order
reversed every other round; each phase's rounds are pooled, so that outside load drifting over the
minutes of a run hits every phase alike. Each round records the server's CPU share and the load.

Replay (``--replay-s``, 20 s; 0: none): before the servers, in this process on the server cores,
each phase again on the engine alone (a fresh engine per phase, no HTTP), on a clock of the engine
thread's CPU seconds: the streams, and a long prompt every period of that clock, each token stamped
with the clock after its step. It shows the phases as a server with a core to itself would run
them, which the HTTP phases cannot on a shared machine; the same TPOT / ITL ratios to ``alone``.

Engine step costs (``--cost-budgets``): in this process, pinned to the server cores, no server
running, a fresh engine per budget: a step of 8 decodes alone (median of 20), then each step of the
same decodes beside a chunk of the long prompt (``budget - 8`` prompt tokens) until it is done. A
chunk step over a decode step is what a stream's inter-token gap grows by while a prompt is
chunked; the sum of the chunk steps over the largest budget's is what chunking costs the prompt.

Pinning: each server on ``--server-cores`` (core 1), this process on ``--client-cores`` (core 0),
``--threads`` (1) torch threads.

Output: tables on stdout, ``bench/results/chunked_prefill.json`` (config, step costs, each phase's
figures, ratios, the goal) and ``chunked_prefill.png`` next to it (HTTP ratios, replayed ratios, lone TTFT, step costs), the server logs
``chunked_prefill_<server>.log``, and the summary (none when a request failed).

One job per module::

    workload.py  the stream and long-prompt bodies; long prompts sized with the tokenizer   pure but sizing
    cost.py      the engine's step costs by budget, in process
    replay.py    the phases on the engine alone, on its CPU clock
    client.py    a lone long prompt's TTFT; a phase of streams and arrivals
    rounds.py    the servers at once, the phases in rounds
    analysis.py  TPOT / ITL percentiles, ratios vs alone, the goal, the run's problems      pure
    report.py    the tables, the plot, the summary's figures
    __main__.py  flags, the servers and their phases, the JSON
"""
