"""The fleet: the workers the router knows, and keeping that picture true while it serves.

  ``workers``                       a worker and a role's pool (pure), leases, pairs
  ``registry``                      the one list of workers, per role a pool with its policy
  ``breaker``                       a circuit breaker per worker (pure, injected clock)
  ``discovery``                     a worker's ``/server_info``, and the health loop
  ``membership``                    adding, draining, switching and removing workers at runtime
  ``pairing``                       which prefills may feed which decodes (pure rules)
  ``scrape``, ``load``              the workers' ``/metrics`` read into a sliding load window
  ``dns_source``, ``dns_resolve``, ``dns_watch``   ``--discover``: workers found by DNS
"""
