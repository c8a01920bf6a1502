"""An attempt's life: running one planned request to its end.

  1. ``dispatcher``     plan, lease the workers, run an attempt, retry on a fresh plan while nothing
                        reached the client, commit, settle (metrics, room record, leases)
  2. ``attempt``        one attempt: the side calls and the answering call, up to the answer's head
  3. ``relay``          the committed answer to the client: a whole body, or the stream event by event
  4. ``sse``, ``tally`` reading a stage's server-sent events just enough to relay and count them
  5. ``verdict``        what went wrong and whose fault it was (``contract.errors`` names the codes)
  6. ``client_params``  a stage's refusal, naming what the client sent
  7. ``timeline``       the router's side of a room's timeline (``GET /admin/rooms/{room}``)
"""
