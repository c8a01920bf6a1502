"""The router's HTTP/1.1 client to its stages (httptools' parser, kept-alive connections).

  ``client``      ``Upstream``: fetch, post, read, chunks, follow; the pool per worker; deadlines
  ``connection``  ``StageConnection``: one connection to a stage and the answer it reads
"""
