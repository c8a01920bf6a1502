"""Video through a 1E1P1D stack (encoder + prefill + decode behind the router, KV over mooncake, a
private Redis) against one colocated server behind the router, side by side in one run: the TTFT of
a 1-video chat cached and not, the encoder's frames per second alone and batched, and what a video
arriving costs a stream that is decoding.

    .venv/bin/python -m bench.video                    # full run (small model)
    .venv/bin/python -m bench.video --quick            # smoke run (tiny model)
    .venv/bin/python -m bench.video --systems colocated --frames 16,64 --requests 8

Workload: generated MP4s (``--video``: 96 frames of 320x240 at 24 fps, H.264; a new seed gives new
bytes), each chat one user turn of a question and the video, sampled at ``--frames`` frames
(``mm_processor_kwargs.num_frames``: 16 and 64, i.e. 8 and 32 temporal patches), ``stream=true``,
``max_tokens=8``, ``temperature=0``, ``ignore_eos=true``, sent through the router one at a time with
``--gap-s`` idle before each. Both systems get the same videos and questions in the same order.

Measures:
- TTFT (send -> first SSE chunk with content): per frame count and kind, ``--requests`` pairs after one
  untimed pair, kinds interleaved: a *miss* (a video the stack has not seen) then a *hit* (the same
  bytes, a different question). Two kinds:
  - *hit (embedding cache only)* (cases ``miss``, ``hit``): the question comes before the video, so
    the prefix cache can reuse only the chat template's head: in epd the hit is the embedding cache's
    alone (the video's placeholders are prefilled again); colocated has no embedding cache. The
    issue's goal (epd hit <= 0.3x miss) is judged on this one.
  - *follow-up (embedding + prefix cache)* (``follow_up_miss``, ``follow_up_hit``): the video comes
    first and the question after it, as a second question about the same video in a chat; the miss
    a new video in that layout, the hit the same video with another question, so the prefix cache
    covers the video's span too. Reported against its own miss.
  Each answer's ``cached_tokens`` (usage) and the KV server's ``epd_prefix_cache_hit_tokens_total``
  over it are recorded (which cache hit), and in epd the videos the encoder ran (1 per miss, 0 per hit).
  Medians; per kind epd hit / its miss (goal <= 0.3x; also paired, each hit over its own miss) and
  epd / colocated.
- Encoder frames per second (epd): ``POST /v1/encode`` straight to the encoder, each video new and
  sampled at ``--encoder-frames`` frames within the encoder's own sampling: ``--encoder-trials``
  videos one at a time, then as many rounds of ``--encoder-batch`` videos sent at once (one request
  each). Frames/s = sampled frames of a round / the round's wall time (median); also per answer
  (frames / its ``seconds``: arrival -> embedding in the cache) and the tower's mean batch
  (``epd_encoder_batch_size``) over each part.
- A stream beside a video: a long text-only stream (``--stream-tokens`` 200, ``ignore_eos``) alone,
  then again with a new video sent once the stream has ``--arrive-after`` tokens, once for each of
  ``--tpot-frames`` (64 then 16: the first is the headline and the goal's, the second shows how the
  stall scales with the video's KV); ``--tpot-trials`` rounds. The stream's TPOT ((last token -
  first) / (tokens - 1)), p99 over trials (nearest rank: the worst with few trials), its token gaps
  pooled (ITL p50, p99, max), the mean gap while the video was in flight (its send -> its first
  token) and the CPU seconds of the server decoding the stream over each trial (epd: the decode);
  ratio with / alone (goal for epd <= 1.2x; colocated: what it costs).

Pinning (``--*-cores``, for the 2-core dev machine): encoder and prefill core 1, decode core 0, the
colocated server core 1; router, Redis and this client not pinned. Servers run ``--threads`` (1) torch
threads. Systems run one after another (``--systems``), each its own fresh stack.

Output: a table on stdout, ``bench/results/video.json`` and ``video.png``, every process's log under
``bench/results/video_<system>/``, the summary ``bench/summaries/video.json`` (with ``notes``: the
pinning, the hit the goal is judged on, the TPOT result's explanation with the run's numbers). A part that fails (e.g.
a build whose router or encoder cannot take video yet) is recorded with its error under
``summary.errors`` and the run goes on.

One job per module::

    workload.py  generated videos, chat / stream / encode bodies, the miss/hit pairs           pure
    client.py    a timed chat with its counters; the pairs; the encoder's frames/s; the stream
    phase.py     one system: start the stack, pin it, measure, stop it
    analysis.py  medians, ratios, frames/s, TPOT and gaps; goals                                pure
    report.py    the table, the plot, the summary's figures
    __main__.py  flags, the phases, the JSON
"""
