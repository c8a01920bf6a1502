"""The ratio planner and the router's registry at 8, 64 and 256 workers per role, with fake workers
driven by a recorded load.

    .venv/bin/python -m bench.fleet_scale [--sizes 8,64,256] [--quick]

Three measures per fleet size N (workers per role):

The two in-process measures (``inproc.py``) use the router's own objects, no sockets.

- **Planner decision time** (in process): a ``router.fleet.load.History`` filled with a window of
  samples of 3N workers (encoder, prefill, decode), each the parse (``parse_sample``) of the
  Prometheus text a stage publishes, its counters following the recorded load (``load.py``: a
  deterministic per-worker trajectory, image-heavy then text-only phases); timed:
  ``role_loads`` + ``recommend`` (the decision), the whole ``GET /admin/ratio`` body
  (``ratio_loop.report`` over a ``Registry`` of the 3N workers), and ``parse_sample`` of one scrape
  (what each worker costs the sampler per round). Median and p99 over bounded repeats.
- **The per-request path** (in process): what the router does per request that reads the workers,
  timed on a pd-mode ``Router`` of 2N known, healthy workers (no sockets): the stage limits, the
  model check, the video settings, and the pd plan under each prefill policy (``round_robin``,
  ``least_load``, ``prefix_aware``) with decode ``least_load``. These are the costs linear in N.
- **Router CPU** (processes on loopback): a real ``stage serve router`` in pd mode in front of N
  fake prefills and N fake decodes (``fleet.py``: one process, one listening port per worker, the
  routes and answers of ``bench/fake_backend.py`` plus ``/metrics`` of the recorded load), its health
  checks and load sampling at their defaults. Its CPU (``/proc``, the scheduler's ns) while idle
  (cores: the health checks and scrapes alone) and while a bounded number of requests is driven
  through it (CPU per request, and the same less the idle rate over the phase's wall time).
"""
