"""The wire contract between the router and the stages: what both sides write and read, written once.

Torch-free and a leaf (it imports nothing of ours); the router, the stages, ``cache`` and
``transfer`` import it, and neither side imports the other.

- ``paths``: the HTTP paths the router calls on a stage (and serves under the same names).
- ``bootstrap``: the body fields the router adds in pd and epd modes (``BOOTSTRAP_FIELDS``), which
  no client sends, and the bound of a room.
- ``errors``: every error code on the wire (``Code``) with its HTTP status and whom it blames
  (``Blame``), and the typed fields of an error body (``TYPED_FIELDS``).
- ``json_depth``: the nesting bound of a request body and the one check of it on the raw bytes.
- ``encode``: the encoder's ``/v1/encode`` and ``/v1/abort`` request and answer bodies.
"""
