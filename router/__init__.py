"""The router: the OpenAI front door over encoder, prefill and decode workers (docs/router.md).

One request's life, room by room:
  1. ``http/``      a client's connection is read (``router.http``), and ``app.py`` routes the request;
  2. ``plan/``      its images are checked and fetched, their content keys computed, and a plan names
                    one worker per role and one bootstrap room (``modes``, ``epd``, ``policy``);
  3. ``dispatch/``  the attempt runs: side calls and the answering call go out through ``upstream/``,
                    the answer is relayed when it commits, a failure gets a verdict and whom it
                    blames, and a retry is a fresh attempt (``dispatcher``, ``attempt``, ``relay``,
                    ``verdict``);
  4. ``fleet/``     meanwhile the workers are checked, scraped, discovered and paired (``registry``,
                    ``membership``, ``discovery``, ``dns_*``, ``breaker``, ``load``);
  5. ``admin/``     the token-guarded API lists, adds, drains and switches workers, and applies ratios.

Top level: the process (``server``, ``runtime``: what one router owns), its frozen ``config``, its
``errors``, ``metrics``, ``openapi`` and ``server_info``. The wire contract with the stages is
``contract``; the command line is ``cli.router``.
"""
