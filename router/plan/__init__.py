"""Planning: who gets what for one request. Pure where it can be (no I/O in ``policy``, ``prefix_tree``,
``images``, ``image_refs``, ``limits``, ``ratio``).

  1. ``images``, ``image_fetch``  a chat body's image parts; remote ones fetched from allowed hosts
  2. ``image_refs``               each image as a cache reference (content key, size); never pixels
  3. ``limits``                   the stages' published limits, enforced before any fan-out
  4. ``modes``, ``epd``           a ``Plan``: the answering call, the side calls, one bootstrap room
                                  (epd: the embedding cache read, missing images claimed for one encoder)
  5. ``policy``, ``prefix_tree``  which worker of a role (round robin, least load, cache- and prefix-aware)
  6. ``ratio``                    the recommended E:P:D split and when to apply it
"""
