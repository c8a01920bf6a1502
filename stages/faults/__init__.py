"""Fault points: named places in a stage server where something can be made to go wrong on purpose,
for tests and fault-injection runs. A feature, not a test hook: documented (``points.POINTS``), off
by default, and injected only through seams, as vLLM's ``random_drop_connector`` and SGLang's
``fake/conn.py`` inject theirs; no production function names a fault point.

1. A server started with ``--debug-faults`` (refused off loopback: ``stages.config``) builds
   ``seams.FaultSeams``; without the flag it builds ``seams.Seams``, which plugs in nothing.
2. It plugs each seam in while it is built: the engine's ``before_step`` (``engine``), the room
   coordinators' hooks (``rooms``; defaults in ``stages.disagg.hooks``), the encoder thread's hooks
   (``encoder``; ``stages.encoder.worker.EncoderHooks``), the transfer backend wrapped
   (``transfer.FaultyBackend``), the HTTP layer's ``generate`` and a middleware (``http``).
3. A client arms a point by name: ``POST /debug/faults {"point": ..., "times": N, "delay_s": S}``
   (``http.add_fault_routes``; ``GET`` lists the points and what is armed).
4. The seam at that point takes it (``points.Faults.take``, one use) and does what the point says:
   raise, sleep, or end the process with ``points.EXIT_CODE``.
"""
