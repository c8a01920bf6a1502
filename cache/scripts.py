"""The Redis key layout and the Lua scripts that change it. Each script runs atomically on the server,
so the entry, the LRU index and the byte count move together.

Layout (one Redis node; the scripts touch keys they compute, so Redis Cluster is not supported):
  epd:emb:<key>     hash {meta: msgpack Entry, payload: bytes}: entry and payload in ONE key, so an
                    index entry can never point at a payload that is gone. PEXPIRE = the TTL.
  epd:lru           sorted set <key> -> last use (Redis server clock, microseconds; strictly increasing,
                    so equal clock readings still keep the order of use).
  epd:sizes         hash <key> -> stored bytes (meta + payload) of that entry.
  epd:bytes         integer: sum of epd:sizes, the bytes the budget is held against.
  epd:claim:<key>   string "<state>:<tag>:<owner>", SET NX PX lease: the encoder that is to encode <key>,
                    and whether the router holds it in that encoder's name (state "c", ``Claimed``;
                    tag: the room of the request it was taken for) or the encoder has taken it up
                    (state "e", ``Encoding``; no tag); the states and who moves them: ``contract.claims``.
  epd:events        pub/sub channel; JSON ``Event`` messages (ready / failed / abandoned) naming a key.

Bookkeeping keys carry no TTL, so a server's volatile-* maxmemory policy evicts only entries and
claims; an entry that vanished without the scripts (TTL, server eviction, FLUSHALL) leaves an LRU
member behind, which the next read of that key, the TTL sweep at put time, or eviction repairs.
The TTL is an idle TTL: every read refreshes both the LRU score and the PEXPIRE.
"""

from __future__ import annotations

PREFIX = "epd:"
ENTRY_PREFIX = PREFIX + "emb:"
CLAIM_PREFIX = PREFIX + "claim:"
LRU = PREFIX + "lru"
SIZES = PREFIX + "sizes"
BYTES = PREFIX + "bytes"
CHANNEL = PREFIX + "events"
EXPIRED_PER_PUT = 64  # the TTL sweep at put time drops at most this many stale LRU members

# A claim's holder: its owner, state ("c" Claimed, "e" Encoding) and tag, or nil when no claim is held.
_HOLDER = """
local function holder(claim)
  local value = redis.call('GET', claim)
  if not value then return nil, nil, nil end
  local state, tag, owner = string.match(value, '^(%a):([^:]*):(.*)$')
  return owner, state, tag
end
"""

# KEYS[1..3] = LRU, SIZES, BYTES; ARGV[1] = ENTRY_PREFIX in every script that uses this prelude.
_PRELUDE = _HOLDER + """
local LRU, SIZES, BYTES, ENTRY_PREFIX = KEYS[1], KEYS[2], KEYS[3], ARGV[1]
local function now_us()  -- a use stamp: the server clock, but after every stamp already given
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
  local top = redis.call('ZREVRANGE', LRU, 0, 0, 'WITHSCORES')
  if top[2] and tonumber(top[2]) >= now then now = tonumber(top[2]) + 1 end
  return now
end
local function stored_bytes()
  return tonumber(redis.call('GET', BYTES) or '0')
end
local function add_bytes(delta)
  if delta ~= 0 and redis.call('INCRBY', BYTES, delta) < 0 then redis.call('SET', BYTES, 0) end
end
local function index(member, size)  -- record the size of an entry that was just written or found
  add_bytes(size - tonumber(redis.call('HGET', SIZES, member) or '0'))
  redis.call('HSET', SIZES, member, size)
end
local function forget(member)  -- drop an entry and its bookkeeping, whatever is left of them
  local existed = redis.call('DEL', ENTRY_PREFIX .. member)
  redis.call('ZREM', LRU, member)
  add_bytes(-tonumber(redis.call('HGET', SIZES, member) or '0'))
  redis.call('HDEL', SIZES, member)
  return existed
end
"""

# KEYS: LRU, SIZES, BYTES, entry, claim. ARGV: ENTRY_PREFIX, member, ttl_ms.
# Hit:  {1, meta, payload, use stamp (us), stored_bytes}   (LRU score and PEXPIRE refreshed)
# Miss: {0, claim 0 none|1 Claimed|2 Encoding, repaired 0|1, stored_bytes} (a half entry or a dangling LRU
# member is dropped)
READ = _PRELUDE + """
local member, ttl = ARGV[2], tonumber(ARGV[3])
local got = redis.call('HMGET', KEYS[4], 'meta', 'payload')
if got[1] and got[2] then
  local now = now_us()
  if redis.call('ZADD', LRU, now, member) == 1 then  -- found but not indexed: count it again
    index(member, string.len(got[1]) + string.len(got[2]))
  end
  redis.call('PEXPIRE', KEYS[4], ttl)
  return {1, got[1], got[2], now, stored_bytes()}
end
local repaired = 0
if got[1] or got[2] or redis.call('ZSCORE', LRU, member) then
  forget(member)
  repaired = 1
end
local _, state = holder(KEYS[5])
local claim = 0
if state == 'c' then claim = 1 elseif state then claim = 2 end
return {0, claim, repaired, stored_bytes()}
"""

# KEYS: LRU, SIZES, BYTES, entry, claim. ARGV: ENTRY_PREFIX, member, meta, payload, ttl_ms, budget, channel,
# event, owner. Returns {evicted, expired, stored_bytes, use stamp (us)}, or {-1, 0, stored_bytes, 0} if the
# entry alone exceeds the budget (then nothing changes). Once the entry is in, drops the claim if ``owner``
# holds it and publishes ``event`` on ``channel`` (Encoding -> Cached, ``contract.claims``).
PUT = _PRELUDE + """
local member, meta, payload = ARGV[2], ARGV[3], ARGV[4]
local ttl, budget = tonumber(ARGV[5]), tonumber(ARGV[6])
local size = string.len(meta) + string.len(payload)
if size > budget then return {-1, 0, stored_bytes(), 0} end
local now = now_us()
local stale = redis.call('ZRANGEBYSCORE', LRU, '-inf', now - ttl * 1000, 'LIMIT', 0, %(expired_per_put)d)
for _, old in ipairs(stale) do forget(old) end
forget(member)
local evicted = 0
while stored_bytes() + size > budget do
  local oldest = redis.call('ZRANGE', LRU, 0, 0)
  if #oldest == 0 then redis.call('SET', BYTES, 0) break end  -- the count had drifted: nothing is left
  forget(oldest[1])
  evicted = evicted + 1
end
redis.call('HSET', KEYS[4], 'meta', meta, 'payload', payload)
redis.call('PEXPIRE', KEYS[4], ttl)
redis.call('ZADD', LRU, now, member)
index(member, size)
if holder(KEYS[5]) == ARGV[9] then redis.call('DEL', KEYS[5]) end
redis.call('PUBLISH', ARGV[7], ARGV[8])
return {evicted, #stale, stored_bytes(), now}
""" % {"expired_per_put": EXPIRED_PER_PUT}

# KEYS: LRU, SIZES, BYTES. ARGV: ENTRY_PREFIX, ttl_ms, member... Returns one 0|1 per member; a
# present entry is touched (it is about to be used), a half entry or dangling LRU member is dropped.
CONTAINS = _PRELUDE + """
local ttl, out = tonumber(ARGV[2]), {}
for i = 3, #ARGV do
  local member = ARGV[i]
  local fields = redis.call('HLEN', ENTRY_PREFIX .. member)
  if fields == 2 then
    redis.call('PEXPIRE', ENTRY_PREFIX .. member, ttl)
    redis.call('ZADD', LRU, now_us(), member)
    out[#out + 1] = 1
  else
    if fields > 0 or redis.call('ZSCORE', LRU, member) then forget(member) end
    out[#out + 1] = 0
  end
end
return out
"""

# KEYS: LRU, SIZES, BYTES. ARGV: ENTRY_PREFIX, member. Returns 1 if an entry was deleted.
DELETE = _PRELUDE + """
return forget(ARGV[2])
"""

# The transitions of ``contract.claims`` that take or move a claim. ``takeover`` (router only): a claim
# held by one of these owners (encoders the router will not send to) is taken for the new owner.
_TAKE = """
local function take(claim, value, owner, lease, takeover)  -- 1 if the router holds ``claim`` for ``owner`` now
  if redis.call('SET', claim, value, 'NX', 'PX', lease) then return 1 end
  local held = holder(claim)
  if held and held ~= owner and takeover[held] then
    redis.call('SET', claim, value, 'PX', lease)
    return 1
  end
  return 0
end
local function owners(first, count)  -- ARGV[first .. first + count - 1] as a set
  local set = {}
  for i = first, first + count - 1 do set[ARGV[i]] = true end
  return set
end
"""

# KEYS: claim, entry. ARGV: owner, lease_ms. 1 = claimed (the caller encodes); 0 = cached or claimed by another.
# Unclaimed -> Encoding.
CLAIM = """
if redis.call('EXISTS', KEYS[2]) == 1 then return 0 end
if redis.call('SET', KEYS[1], 'e::' .. ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
return 0
"""

# CLAIM for several keys in one call, for the router (Unclaimed -> Claimed, or taken over). KEYS: claim,
# entry of each key in turn. ARGV: lease_ms, tag, n, n takeover owners, then each key's owner. 1 or 0 per key.
CLAIM_MANY = _HOLDER + _TAKE + """
local lease, tag, n, out = ARGV[1], ARGV[2], tonumber(ARGV[3]), {}
local takeover = owners(4, n)
for i = 1, #KEYS / 2 do
  local claim, entry, owner = KEYS[2 * i - 1], KEYS[2 * i], ARGV[i + 3 + n]
  out[i] = 0
  if redis.call('EXISTS', entry) == 0 then out[i] = take(claim, 'c:' .. tag .. ':' .. owner, owner, lease, takeover) end
end
return out
"""

# CONTAINS and CLAIM_MANY in one call, for callers that know each key's owner before the lookup.
# KEYS: LRU, SIZES, BYTES, then each key's claim key in turn. ARGV: ENTRY_PREFIX, ttl_ms, lease_ms, tag, n,
# n takeover owners, then each key's member and owner in turn. Per key: 2 = cached (touched, as CONTAINS
# does), 1 = claimed for its owner (as CLAIM_MANY), 0 = another owner is encoding it. A half entry or a
# dangling LRU member is dropped.
LOOKUP_CLAIM = _PRELUDE + _TAKE + """
local ttl, lease, tag, n, out = tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5]), {}
local takeover = owners(6, n)
for i = 1, #KEYS - 3 do
  local member, owner = ARGV[2 * i + 4 + n], ARGV[2 * i + 5 + n]
  local fields = redis.call('HLEN', ENTRY_PREFIX .. member)
  if fields == 2 then
    redis.call('PEXPIRE', ENTRY_PREFIX .. member, ttl)
    redis.call('ZADD', LRU, now_us(), member)
    out[i] = 2
  else
    if fields > 0 or redis.call('ZSCORE', LRU, member) then forget(member) end
    out[i] = take(KEYS[i + 3], 'c:' .. tag .. ':' .. owner, owner, lease, takeover)
  end
end
return out
"""

# An encode that ended without an entry (Encoding -> Abandoned or Failed, then Unclaimed). KEYS: claim.
# ARGV: owner, channel, event. The owner's claim is dropped and ``event`` published: 1. No claim held
# (it lapsed): ``event`` published, so waiters hear why rather than a lapse: 2. Another owner's claim
# (taken over, or claimed anew after a lapse): nothing, its waiters wait for that owner: 0.
END = _HOLDER + """
local held = holder(KEYS[1])
if held and held ~= ARGV[1] then return 0 end
if held then redis.call('DEL', KEYS[1]) end
redis.call('PUBLISH', ARGV[2], ARGV[3])
if held then return 1 end
return 2
"""

# The router's claims for an encoder that refused or never got its request (Claimed -> Abandoned, then
# Unclaimed). KEYS: claim_1..claim_n. ARGV: owner, tag, channel, event_1..event_n. Each claim the router
# took with ``tag`` for the owner that the owner has not taken up is released and its event published; one
# the owner took up (Encoding: it is its to end), another owner's, or one taken for another request (the
# claim lapsed and was taken anew) is left alone, and its waiters hear nothing. The number released.
ABANDON = """
local released = 0
for i = 1, #KEYS do
  if redis.call('GET', KEYS[i]) == 'c:' .. ARGV[2] .. ':' .. ARGV[1] then
    redis.call('DEL', KEYS[i])
    redis.call('PUBLISH', ARGV[3], ARGV[3 + i])
    released = released + 1
  end
end
return released
"""

# KEYS: claim. ARGV: owner, lease_ms. 1 if the owner still holds the claim (its lease restarts):
# Claimed -> Encoding (the encoder takes up the router's claim), Encoding -> Encoding.
RENEW = _HOLDER + """
if holder(KEYS[1]) == ARGV[1] then
  redis.call('SET', KEYS[1], 'e::' .. ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


def entry_key(key: str) -> str:
    return ENTRY_PREFIX + key


def claim_key(key: str) -> str:
    return CLAIM_PREFIX + key
