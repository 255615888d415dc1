"""Lua scripts: each one a single atomic step of the request protocol in Redis.

Atomicity is what the contracts rest on: a worker's events reach the log and the channel only while it
holds the lease (so a fenced-off worker can never add a duplicate), and a request's terminal status is
written together with its last event (so whoever sees the status also finds every event in the log).
Per-request scripts take ``keys.request_keys(id)``: KEYS[1] record, [2] log, [3] owner, [4] cancel.

Fencing. The lease (the owner key) lapses, so it alone cannot keep a stalled worker out: once it is
gone, that worker would take it back. Two tokens in the record do:

- ``epoch``: START counts every claim; the claimant passes its epoch to every later write, and a write
  whose epoch is not the record's is refused. A worker whose lease lapsed while another claimed the
  request can never write again, even after that other worker's lease lapses in turn.
- the terminal status: no script writes an event, a lease or a record field after it, so the log ends
  with exactly one terminal event.

A record without an epoch (Redis lost it, or a worker older than epochs claimed it) falls back to the
owner key alone. Under ``maxmemory`` (OOM) or on a replica (READONLY) Redis refuses every script's
first write; each script reads first and writes after, so such a refusal leaves nothing half written.
"""

from __future__ import annotations

_NOW_MS = (
    "local t = redis.call('TIME'); local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)"
)

_TERMINAL = "local function terminal(s) return s == 'completed' or s == 'failed' or s == 'cancelled' end"

# The pending set expires with its latest reservation (scores are expiry times in ms), never sooner: a
# reservation with a short TTL must not cut the others short.
_EXPIRE_WITH_LAST = "redis.call('PEXPIREAT', KEYS[1], redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2])"

# KEYS: pending. ARGV: id, max_pending, ttl_ms. Returns 1 when admitted, 0 when full.
# Expired reservations (their gateway died before producing) are dropped first: self-healing. The set
# itself expires with its newest reservation: with every gateway gone, nothing of it stays behind.
ADMIT = f"""
{_NOW_MS}
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
{_EXPIRE_WITH_LAST}
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
if #alive > 0 then {_EXPIRE_WITH_LAST} end
return alive
"""

# ARGV: worker, lease_ms, seed, default_ttl_s, now_s.
# Returns {'terminal', status} | {'busy', owner} | {'ok', seed, cancelled(0/1), epoch, log...}: the epoch
# is this claim's fencing token (see above).
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
local epoch = redis.call('HINCRBY', KEYS[1], 'epoch', 1)
redis.call('EXPIRE', KEYS[1], tonumber(redis.call('HGET', KEYS[1], 'ttl') or ARGV[4]))
local out = {{'ok', redis.call('HGET', KEYS[1], 'seed'), redis.call('EXISTS', KEYS[4]), epoch}}
for _, ev in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do out[#out + 1] = ev end
return out
"""

# The fencing check of every write by a worker that claimed a request. ARGV[1] worker, ARGV[epoch_arg]
# its epoch. Returns 'ok', 'lost' (another claim since, or another worker holds the lease) or
# 'terminal' (the request is finished: nothing may be written any more).
_FENCE = f"""
{_TERMINAL}
local function fence(record, owner_key, epoch_arg)
  local state = redis.call('HMGET', record, 'status', 'epoch')
  if state[1] and terminal(state[1]) then return 'terminal' end
  if state[2] and state[2] ~= ARGV[epoch_arg] then return 'lost' end
  local owner = redis.call('GET', owner_key)
  if owner and owner ~= ARGV[1] then return 'lost' end
  return 'ok'
end
"""

# ARGV: worker, lease_ms, ttl_s, channel, final(0/1), epoch, num_field_args, fields..., events...
# Returns 0 when this worker is fenced off (another claim, or the request is terminal), else 1.
# A missing lease is taken back when the epoch is still this worker's: after a Redis restart, or an
# outage longer than the lease, the holder carries on instead of stalling.
# A final call of the claim that finished the request returns 1 and writes nothing: the same call run
# again (a batch retried after NOSCRIPT) must neither fail the finish nor log a second terminal event.
PUBLISH = f"""
{_FENCE}
local verdict = fence(KEYS[1], KEYS[3], 6)
if verdict == 'terminal' and ARGV[5] == '1' and redis.call('HGET', KEYS[1], 'epoch') == ARGV[6] then
  return 1
end
if verdict ~= 'ok' then return 0 end
local nfields = tonumber(ARGV[7])
local first_event = 8 + nfields
for i = first_event, #ARGV do
  redis.call('RPUSH', KEYS[2], ARGV[i])
  redis.call('PUBLISH', ARGV[4], ARGV[i])
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
if nfields > 0 then
  redis.call('HSET', KEYS[1], unpack(ARGV, 8, first_event - 1))
  redis.call('EXPIRE', KEYS[1], ARGV[3])
end
if ARGV[5] == '1' then
  redis.call('DEL', KEYS[3])
else
  redis.call('SET', KEYS[3], ARGV[1], 'PX', ARGV[2])
end
return 1
"""

# KEYS: record, owner. ARGV: worker, lease_ms, epoch.
# 1: still ours (extended); 0: lost to another claim; -1: the request is terminal (nothing to hold).
REFRESH_LEASE = f"""
{_FENCE}
local verdict = fence(KEYS[1], KEYS[2], 3)
if verdict == 'terminal' then return -1 end
if verdict == 'lost' then return 0 end
redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: record, owner. ARGV: worker, epoch. Hands a request back without finishing it (drain, lost
# Redis); only the claim that holds the lease can.
RELEASE = """
local epoch = redis.call('HGET', KEYS[1], 'epoch')
if epoch and epoch ~= ARGV[2] then return 0 end
if redis.call('GET', KEYS[2]) == ARGV[1] then return redis.call('DEL', KEYS[2]) end
return 0
"""

# ARGV: cancel_ttl_s (for a record without its own "ttl"), channel, done_event (seq 1), now_s.
# Returns the record's status afterwards: 'unknown', a terminal status, or 'cancelling' when a worker
# has it (the caller then tells the workers on the cancel channel). The cancel key lives as long as the
# record (15 minutes for a synchronous request, a day for a job): a redelivery within it is skipped.
CANCEL = f"""
{_TERMINAL}
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'unknown' end
if terminal(status) then return status end
local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl') or ARGV[1])
redis.call('SET', KEYS[4], '1', 'EX', ttl)
if status == 'queued' and redis.call('LLEN', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished', ARGV[4])
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('PUBLISH', ARGV[2], ARGV[3])
  redis.call('EXPIRE', KEYS[2], ttl)
  return 'cancelled'
end
return 'cancelling'
"""

# ARGV: channel, done_event (seq 1), now_s, error, code. Fails a request no worker has started (lost in
# Kafka, never produced, or past its deadline). Returns 1 when it did, 0 when a worker got there first.
FAIL_QUEUED = """
if redis.call('HGET', KEYS[1], 'status') ~= 'queued' or redis.call('LLEN', KEYS[2]) ~= 0 then return 0 end
local ttl = tonumber(redis.call('HGET', KEYS[1], 'ttl') or '900')
redis.call('HSET', KEYS[1], 'status', 'failed', 'finished', ARGV[3], 'error', ARGV[4], 'code', ARGV[5])
redis.call('RPUSH', KEYS[2], ARGV[2])
redis.call('PUBLISH', ARGV[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ttl)
return 1
"""

# KEYS: record. ARGV: default_ttl_s, field, value, ... The gateway's writes to a record it created: only
# while the record exists and is not terminal (a worker's finish, or a cancel, is never overwritten),
# and never leaving a key without a TTL (a record that lost its TTL gets its own "ttl" back, else the
# default). Returns 1 when written, 0 when refused.
# HSET on a hash only while it exists (a batch record past its TTL is not re-created without one).
# ARGV: field, value, ... Returns 1 written, 0 missing.
UPDATE_EXISTING = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

SET_FIELDS = f"""
{_TERMINAL}
local status = redis.call('HGET', KEYS[1], 'status')
if not status or terminal(status) then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 2))
if redis.call('TTL', KEYS[1]) < 0 then
  redis.call('EXPIRE', KEYS[1], tonumber(redis.call('HGET', KEYS[1], 'ttl') or ARGV[1]))
end
return 1
"""
