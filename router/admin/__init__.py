"""The admin API (docs/admin.md): token-guarded routes on the router's own port.

  ``auth``        who may call ``/admin/*`` (pure)
  ``routes``      the routes: workers, pairing, ratio, rooms
  ``ratio_loop``  ``GET /admin/ratio``'s report and the automatic ratio loop
  ``rooms``       one room's timeline merged across the router and its stages
The terminal client is ``cli.admin`` (``stage admin``).
"""
