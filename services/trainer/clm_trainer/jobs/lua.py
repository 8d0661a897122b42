"""The job state machine as atomic Lua scripts (see ``keys`` for the layout).

::

    submit ──► queued ──claim──► running ──finish──► succeeded | failed | cancelled
                 ▲  │               │ lease expired (reap): attempts < max ──► queued (front of the queue)
                 │  │               │                       attempts >= max ──► failed (worker_lost)
                 │  │               │                       cancel requested ──► cancelled
                 │  └──cancel──► cancelled        release (graceful worker stop) ──► queued
                 └──────────────────┘

**Fencing.** Every claim takes a fresh token from ``<prefix>:fence``. The
worker's later writes (heartbeat, progress, finish, release) carry it and
apply only while the job is ``running`` under that same token, so a zombie
worker (paused, partitioned, or simply late after its lease expired) can
never renew, report on, or finish a job that was requeued or completed.

**Time.** Lease expiries use Redis' own clock (``TIME``), so workers with
skewed clocks agree on who is late. Human-readable timestamps
(``created_at`` ...) come from the caller.

Each script returns plain strings/ints; the Python wrappers map them.
"""

from __future__ import annotations

_NOW_MS = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

_EVENT = """
local function event(stream, max_events, payload)
  redis.call('XADD', stream, 'MAXLEN', '~', max_events, '*', 'data', payload)
end
-- A finished job and its events expire after the retention (set in the same script that finishes it,
-- so no finished job can be left without a TTL); checkpoints and reports live on disk and stay.
local function retire(job, stream, ttl_s)
  redis.call('EXPIRE', job, ttl_s)
  redis.call('EXPIRE', stream, ttl_s)
end
"""

# KEYS: job, jobs index, queue, events, idempotency key (or the job key again when none)
# ARGV: id, created score, idem value ('' = none), idem ttl, event json, max events, field, value, ...
SUBMIT = _EVENT + """
if ARGV[3] ~= '' then
  local existing = redis.call('GET', KEYS[5])
  if existing then return {'existing', existing} end
  redis.call('SET', KEYS[5], ARGV[3], 'EX', tonumber(ARGV[4]))
end
redis.call('HSET', KEYS[1], unpack(ARGV, 7))
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
redis.call('LPUSH', KEYS[3], ARGV[1])
event(KEYS[4], ARGV[6], ARGV[5])
return {'created', ARGV[1]}
"""

# KEYS: queue, leases, fence ; ARGV: prefix, worker, lease ms, now iso, max events
CLAIM = _NOW_MS + _EVENT + """
for _ = 1, 1000 do
  local id = redis.call('RPOP', KEYS[1])
  if not id then return false end
  local job = ARGV[1] .. ':job:' .. id
  -- Ids of jobs cancelled while queued are normally removed; skip any left (or unknown ids).
  if redis.call('HGET', job, 'status') == 'queued' then
    local token = redis.call('INCR', KEYS[3])
    local attempts = redis.call('HINCRBY', job, 'attempts', 1)
    redis.call('HSET', job, 'status', 'running', 'worker', ARGV[2], 'token', token, 'cancel_requested', '0')
    if (redis.call('HGET', job, 'started_at') or '') == '' then redis.call('HSET', job, 'started_at', ARGV[4]) end
    redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), id)
    event(ARGV[1] .. ':events:' .. id, ARGV[5], cjson.encode({type = 'claimed', ts = ARGV[4], status = 'running',
      worker = ARGV[2], attempt = attempts}))
    return {id, tostring(token), tostring(attempts)}
  end
end
return false
"""

# KEYS: job, leases ; ARGV: id, token, lease ms
# Returns 0 = lease lost (requeued, finished, or another worker's now), 1 = renewed, 2 = renewed + cancel requested.
HEARTBEAT = _NOW_MS + """
local fields = redis.call('HMGET', KEYS[1], 'status', 'token', 'cancel_requested')
if fields[1] ~= 'running' or fields[2] ~= ARGV[2] then return 0 end
redis.call('ZADD', KEYS[2], now_ms + tonumber(ARGV[3]), ARGV[1])
if fields[3] == '1' then return 2 end
return 1
"""

# KEYS: job, events ; ARGV: token, phase, progress json, event json ('' = no event), max events
PROGRESS = _EVENT + """
local fields = redis.call('HMGET', KEYS[1], 'status', 'token')
if fields[1] ~= 'running' or fields[2] ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'phase', ARGV[2], 'progress', ARGV[3])
if ARGV[4] ~= '' then event(KEYS[2], ARGV[5], ARGV[4]) end
return 1
"""

# KEYS: job, leases, events ; ARGV: id, token, status, now iso, error json, result json, event json, max events,
#       retention seconds
FINISH = _EVENT + """
local fields = redis.call('HMGET', KEYS[1], 'status', 'token')
if fields[1] ~= 'running' or fields[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'status', ARGV[3], 'finished_at', ARGV[4], 'error', ARGV[5], 'result', ARGV[6])
redis.call('ZREM', KEYS[2], ARGV[1])
event(KEYS[3], ARGV[8], ARGV[7])
retire(KEYS[1], KEYS[3], ARGV[9])
return 1
"""

# A worker stopping gracefully hands its job back at once (the attempt is not counted as a loss).
# KEYS: job, leases, queue, events ; ARGV: id, token, now iso, max events
RELEASE = _EVENT + """
local fields = redis.call('HMGET', KEYS[1], 'status', 'token')
if fields[1] ~= 'running' or fields[2] ~= ARGV[2] then return 0 end
redis.call('HINCRBY', KEYS[1], 'attempts', -1)
redis.call('HSET', KEYS[1], 'status', 'queued', 'worker', '')
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('RPUSH', KEYS[3], ARGV[1])
event(KEYS[4], ARGV[4], cjson.encode({type = 'released', ts = ARGV[3], status = 'queued',
  message = 'the worker stopped; the job goes back to the front of the queue'}))
return 1
"""

# Jobs whose lease expired: back to the queue front, or failed after max attempts, or cancelled if asked.
# KEYS: leases, queue ; ARGV: prefix, max attempts, now iso, max events, retention seconds
# Returns a flat list: id1, outcome1, id2, outcome2, ...
REAP = _NOW_MS + _EVENT + """
local expired = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now_ms, 'LIMIT', 0, 100)
local out = {}
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[1], id)
  local job = ARGV[1] .. ':job:' .. id
  local stream = ARGV[1] .. ':events:' .. id
  local fields = redis.call('HMGET', job, 'status', 'attempts', 'cancel_requested', 'worker')
  if fields[1] == 'running' then
    local attempts = tonumber(fields[2] or '0')
    local outcome
    if fields[3] == '1' then
      outcome = 'cancelled'
      redis.call('HSET', job, 'status', 'cancelled', 'finished_at', ARGV[3])
      event(stream, ARGV[4], cjson.encode({type = 'cancelled', ts = ARGV[3], status = 'cancelled',
        message = 'cancelled (its worker was lost before it could stop)'}))
      retire(job, stream, ARGV[5])
    elseif attempts >= tonumber(ARGV[2]) then
      outcome = 'failed'
      local message = 'the job lost its worker ' .. attempts .. ' times (last: ' .. (fields[4] or '?') ..
        '; lease expired without a heartbeat); giving up after max_attempts=' .. ARGV[2]
      redis.call('HSET', job, 'status', 'failed', 'finished_at', ARGV[3],
        'error', cjson.encode({code = 'worker_lost', message = message}))
      event(stream, ARGV[4], cjson.encode({type = 'failed', ts = ARGV[3], status = 'failed',
        error = {code = 'worker_lost', message = message}}))
      retire(job, stream, ARGV[5])
    else
      outcome = 'requeued'
      redis.call('HSET', job, 'status', 'queued', 'worker', '')
      redis.call('RPUSH', KEYS[2], id)
      event(stream, ARGV[4], cjson.encode({type = 'requeued', ts = ARGV[3], status = 'queued',
        message = 'lease of worker ' .. (fields[4] or '?') .. ' expired; the job goes back to the queue',
        attempt = attempts}))
    end
    table.insert(out, id)
    table.insert(out, outcome)
  end
end
return out
"""

# KEYS: job, queue, events ; ARGV: id, now iso, max events, retention seconds
# Returns the outcome: 'missing', 'dequeued' (was queued, now cancelled), 'requested' (running), or 'already:<status>'.
CANCEL = _EVENT + """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status == 'queued' then
  redis.call('HSET', KEYS[1], 'status', 'cancelled', 'finished_at', ARGV[2])
  redis.call('LREM', KEYS[2], 0, ARGV[1])
  event(KEYS[3], ARGV[3], cjson.encode({type = 'cancelled', ts = ARGV[2], status = 'cancelled',
    message = 'cancelled before a worker picked it up'}))
  retire(KEYS[1], KEYS[3], ARGV[4])
  return 'dequeued'
end
if status == 'running' then
  if redis.call('HGET', KEYS[1], 'cancel_requested') ~= '1' then
    redis.call('HSET', KEYS[1], 'cancel_requested', '1')
    event(KEYS[3], ARGV[3], cjson.encode({type = 'cancel_requested', ts = ARGV[2], status = 'running',
      message = 'cancel requested; the worker stops at its next step'}))
  end
  return 'requested'
end
return 'already:' .. status
"""
