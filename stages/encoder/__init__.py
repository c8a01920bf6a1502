"""``stage serve encoder``: images in, embeddings into the shared cache, one encode per unique image.

  batcher.py  pure: the job of encoding one image (or video), the queue that batches jobs, recently aborted rooms
  worker.py   the encoder thread: takes batches, runs the vision tower (a video in chunks), hands each result back
  flights.py  per image: claim, queue, put or report the failure, release; shared by requests; cancel
  service.py  per request: cache check, decode and preprocess, join flights, wait, abort by room
  metrics.py  the ``epd_encoder_*`` series
  server.py   the HTTP edge: ``/v1/encode``, ``/v1/abort``, ``/health``, ``/server_info``, ``/metrics``

Threads: the event loop owns the cache, the claims and every ``Job``'s futures; the encoder thread
owns the vision tower. They meet only in the ``Batcher`` (a locked queue) and in the worker's
``Flights.deliver`` callback, which crosses back with ``loop.call_soon_threadsafe``.
"""
