"""Lua scripts: each one a single atomic step of the request protocol in Redis.

Atomicity is what the contracts rest on: a worker's events reach the log and the channel only while it
holds the lease (so a fenced-off worker can never add a duplicate), and a request's terminal status is
written together with its last event (so whoever sees the status also finds every event in the log).
Per-request scripts take ``keys.request_keys(id)``: KEYS[1] record, [2] log, [3] owner, [4] cancel.
"""

from __future__ import annotations

_NOW_MS = (
    "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"
)

_TERMINAL = "local function terminal(s) return s == 'completed' or s == 'failed' or s == 'cancelled' end"

# KEYS: pending. ARGV: id, max_pending, ttl_ms. Returns 1 when admitted, 0 when full.
# Expired reservations (their gateway died before producing) are dropped first: self-healing.
ADMIT = f"""
{_NOW_MS}
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
return 1
"""

# KEYS: pending. ARGV: ttl_ms, id... Extends the reservations still present; returns those ids.
REFRESH_PENDING = f"""
{_NOW_MS}
local alive = {{}}
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
    alive[#alive + 1] = ARGV[i]
  end
end
return alive
"""

# ARGV: worker, lease_ms, seed, default_ttl_s, now_s.
# Returns {'terminal', status} | {'busy', owner} | {'ok', seed, cancelled(0/1), log...}.
START = f"""
{_TERMINAL}
local status = redis.call('HGET', KEYS[1], 'status')
if status and terminal(status) then return {{'terminal', status}} end
local owner = redis.call('GET', KEYS[3])
if owner and owner ~= ARGV[1] then return {{'busy', owner}} end
redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
redis.call('HSETNX', KEYS[1], 'seed', ARGV[3])
redis.call('HSETNX', KEYS[1], 'started', ARGV[5])
redis.call('HSET', KEYS[1], 'status', 'in_progress', 'worker', ARGV[1])
redis.call('EXPIRE', KEYS[1], tonumber(redis.call('HGET', KEYS[1], 'ttl') or ARGV[4]))
local out = {{'ok', redis.call('HGET', KEYS[1], 'seed'), redis.call('EXISTS', KEYS[4])}}
for _, ev in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = ev end
return out
"""

# ARGV: worker, lease_ms, ttl_s, channel, final(0/1), num_field_args, fields..., events...
# Returns 0 when another worker holds the lease (this one is fenced off), else 1.
# A missing lease is taken: after a Redis restart the holder carries on instead of stalling.
PUBLISH = """
local owner = redis.call('GET', KEYS[3])
if owner and owner ~= ARGV[1] then return 0 end
local nfields = tonumber(ARGV[6])
local first_event = 7 + nfields
for i = first_event, #ARGV do
  redis.call('RPUSH', KEYS[2], ARGV[i])
  redis.call('PUBLISH', ARGV[4], ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
if nfields > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 7, first_event - 1))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[3])
else
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
end
return 1
"""

# KEYS: owner. ARGV: worker, lease_ms. 1: still ours (extended), 0: lost to another worker.
REFRESH_LEASE = """
local owner = redis.call('GET', KEYS[1])
if owner and owner ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: owner. ARGV: worker. Hands a request back without finishing it (drain, lost Redis).
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# ARGV: cancel_ttl_s, channel, done_event (seq 1), now_s.
# Returns the record's status afterwards: 'unknown', a terminal status, or 'cancelling' when a worker
# has it (the caller then tells the workers on the cancel channel).
CANCEL = f"""
{_TERMINAL}
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'unknown' end
if terminal(status) then return status end
redis.call('SET', KEYS[4], '1', 'EX', ARGV[1])
if status == 'queued' and redis.call('LLEN', KEYS[2]) == 0 then
  local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl') or ARGV[1])
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[4])
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ttl)
  return 'cancelled'
end
return 'cancelling'
"""

# ARGV: channel, done_event (seq 1), now_s, error. Fails a request no worker has started (lost in
# Kafka, or never produced). Returns 1 when it did, 0 when a worker got there first.
FAIL_QUEUED = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' or redis.call('LLEN', KEYS[2]) ~= 0 then return 0 end
local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl') or '900')
redis.call('HSET', KEYS[1], 'status', 'failed', 'finished', ARGV[3], 'error', ARGV[4])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('PUBLISH', ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ttl)
return 1
"""
