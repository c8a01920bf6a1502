"""Planning: who gets what for one request. Pure where it can be (no I/O in ``policy``, ``prefix_tree``,
``images``, ``image_refs``, ``limits``, ``ratio``; ``videos`` but for PyAV's reading).

  1. ``images``, ``image_fetch``  a chat body's image (and video) parts; remote ones fetched from allowed hosts
  2. ``image_refs``, ``videos``   each image as a cache reference (content key, size); never pixels; each
                                  video probed and planned with the stages' published settings (epd: a reference)
  3. ``limits``                   the stages' published limits, enforced before any fan-out
  4. ``modes``, ``epd``           a ``Plan``: the answering call, the side calls, one bootstrap room
                                  (epd: the embedding cache read, missing images claimed for one encoder)
  5. ``policy``, ``prefix_tree``  which worker of a role (round robin, least load, cache- and prefix-aware)
  6. ``ratio``                    the recommended E:P:D split and when to apply it
"""
