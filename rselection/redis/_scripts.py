"""The Lua scripts of the Redis lease (:mod:`rselection.redis.lease`), its handover
requests (:mod:`rselection.redis.handover`), its membership
(:mod:`rselection.redis.membership`) and its retirement (:mod:`rselection.redis.retire`).

Each script runs atomically on the server and touches only keys of one lease, which share
a hash slot. The lease value is a JSON document written by :data:`ACQUIRE`; the lease
module's docstring explains the protocol.
"""

from __future__ import annotations

__all__ = [
    "ACQUIRE",
    "CANCEL_HANDOVER",
    "HEARTBEAT",
    "HELD_FOR",
    "LEAVE",
    "NODES",
    "READ",
    "RELEASE",
    "RENEW",
    "REOPEN_HANDOVER",
    "REQUEST_HANDOVER",
    "RETIRE",
]

#: The Lua functions of a lease's history stream (KEYS[n] of the calling script):
#: ``_history_unusable(key)``, an error reply when the key is not a stream (checked
#: before anything is written), and ``_history_close(key, reason, by, now)``, which
#: appends the end of the term the last entry began, if it began one (its holder did not
#: end it). Entries are flat field lists:
#: ``kind`` (``began`` or ``ended``), ``term``, then ``node``, ``version``, ``host``,
#: ``pid``, ``at`` (server ms) for a beginning, ``reason``, ``to``, ``by``, ``at`` for an
#: end (see :mod:`rselection.redis.history`).
_HISTORY = """
-- An error reply when the history key holds something other than a stream (nil when
-- usable): checked before a script writes anything, as Redis undoes nothing of a
-- script that fails half way.
local function _history_unusable(key)
  local kind = redis.call('TYPE', key).ok
  if kind ~= 'none' and kind ~= 'stream' then
    return redis.error_reply('WRONGTYPE the leadership history key ' .. key ..
      ' holds a ' .. kind .. ', not a stream: delete it, or use another key_prefix')
  end
end
local function _history_close(key, reason, by, now)
  local last = redis.call('XREVRANGE', key, '+', '-', 'COUNT', 1)[1]
  if not last then return end
  local f = last[2]
  if f[1] == 'kind' and f[2] == 'began' and f[3] == 'term' then
    redis.call('XADD', key, '*', 'kind', 'ended', 'term', f[4], 'reason', reason,
      'to', '', 'by', by, 'at', now)
  end
end
"""

#: Take the lease if it is free, or if its holder's connection is known gone, unless a
#: handover request reserves it against this node.
#: KEYS: lease key, term key, handover key, term origin key, history key. ARGV: token,
#: node id, ttl (ms), this keeper's client id, "1" when it offers fast takeover (else
#: "0"), the dead holder's client id and term ('' when none), this keeper's server
#: run_id, channel, the process's liveness identity (``<process>:<secret>``, '' when
#: none; see :mod:`rselection.redis.liveness`), the node's version ('' for none), host
#: name, pid, and the history entries to keep (two per term). The term taken is
#: recorded in the history stream, after closing the previous one as ``session_lost``
#: (its holder's connection gone) or ``expired`` if its holder did not.
#: Returns {1 when acquired (else 0), lease value ('' when free but reserved by a handover
#: request), PTTL (ms) of the lease key (of the handover key when reserved), server time
#: (ms)}.
#:
#: The new term is the counter's ``INCR``, except when the counter may lack terms issued
#: before: when there is no counter (a new lease, or its counter was evicted, deleted or
#: lost in a restart) or the origin key does not hold this server's replication id
#: (``master_replid``: a promoted replica, a restart, a slot moved), the term is at least
#: the server's ``TIME`` in microseconds (the lease module's docstring says what that
#: guarantees). Terms are computed as strings, exact to 2^63 - 1. Refused with a
#: ``READONLY`` error on a replica.
ACQUIRE = (
    _HISTORY
    + """
local unusable = _history_unusable(KEYS[5])
if unusable then return unusable end
local function run_id()
  return string.match(redis.call('INFO', 'server'), 'run_id:(%x+)') or ''
end
-- a < b for decimal integers as strings (b non-negative, neither with leading zeros).
local function below(a, b)
  if string.sub(a, 1, 1) == '-' then return true end
  if #a ~= #b then return #a < #b end
  return a < b
end
local cur = redis.call('GET', KEYS[1])
local run = ''
local t = redis.call('TIME')
local now = tostring(t[1] * 1000 + math.floor(t[2] / 1000))
if cur then
  local ok, h = pcall(cjson.decode, cur)
  local gone = ok and type(h) == 'table' and ARGV[6] ~= '' and h.fast == '1'
    and h.client == ARGV[6] and h.term == ARGV[7]
  if gone then
    run = run_id()
    gone = run ~= '' and h.run == run and ARGV[8] == run
  end
  if not gone then
    return {0, cur, redis.call('PTTL', KEYS[1]), now}
  end
end
local r = redis.call('GET', KEYS[3])
if r then
  local okq, q = pcall(cjson.decode, r)
  if okq and type(q) == 'table' and q.term == tostring(redis.call('GET', KEYS[2])) then
    local to = q.to or ''
    if (to ~= '' and to ~= ARGV[2]) or (to == '' and q.from == ARGV[2]) then
      if cur then return {0, cur, redis.call('PTTL', KEYS[1]), now} end
      return {0, '', redis.call('PTTL', KEYS[3]), now}
    end
  end
end
local repl = redis.call('INFO', 'replication')
if string.find(repl, 'role:slave', 1, true) then
  -- A writable replica (replica-read-only no) would count terms its primary never sees.
  return redis.error_reply('READONLY this server is a replica: the lease is taken on its primary')
end
if run == '' then run = run_id() end
local counted = redis.call('EXISTS', KEYS[2]) == 1
local id = string.match(repl, 'master_replid:(%x+)') or ''
local origin = redis.call('GET', KEYS[4])
-- A missing counter (a new lease, or one evicted, deleted, lost in a restart) or one
-- written under another replication id (a promoted replica, a restart, a moved slot)
-- may lack terms issued before: start from the clock instead.
local foreign = not counted or (id ~= '' and origin ~= id)
if id ~= '' and origin ~= id then redis.call('SET', KEYS[4], id) end
redis.call('INCR', KEYS[2])
-- Terms stay strings: Lua numbers are doubles, exact only up to 2^53.
local ts = redis.call('GET', KEYS[2])
if foreign then
  local floor = t[1] .. string.format('%06d', tonumber(t[2]))
  if below(ts, floor) then
    ts = floor
    redis.call('SET', KEYS[2], floor)
  end
end
local v = cjson.encode({token = ARGV[1], node = ARGV[2], term = ts,
  client = ARGV[4], run = run, fast = ARGV[5], at = now, beats = ARGV[10]})
if cur then
  redis.call('SET', KEYS[1], v, 'PX', ARGV[3], 'XX')
else
  redis.call('SET', KEYS[1], v, 'NX', 'PX', ARGV[3])
end
redis.call('DEL', KEYS[3])
_history_close(KEYS[5], cur and 'session_lost' or 'expired', '', now)
redis.call('XADD', KEYS[5], 'MAXLEN', ARGV[14], '*', 'kind', 'began', 'term', ts,
  'node', ARGV[2], 'version', ARGV[11], 'host', ARGV[12], 'pid', ARGV[13], 'at', now)
redis.call('PUBLISH', ARGV[9], 'acquired:' .. ts)
return {1, v, tonumber(ARGV[3]), now}
"""
)

#: Common start of RENEW and RELEASE: return 0 unless KEYS[1] holds token ARGV[1] and
#: term ARGV[2].
_HOLDS = """
local cur = redis.call('GET', KEYS[1])
if not cur then return 0 end
local ok, h = pcall(cjson.decode, cur)
if not ok or type(h) ~= 'table' or h.token ~= ARGV[1] or h.term ~= ARGV[2] then
  return 0
end
"""

#: Extend the lease if this token and term hold it. KEYS: lease key, handover key. ARGV:
#: token, term, ttl (ms). Returns 0 when not held, else {1, 1 when a handover request for
#: this term is pending (else 0), the node it names ('' for any), its PTTL (ms)}.
RENEW = (
    _HOLDS
    + """
redis.call('PEXPIRE', KEYS[1], ARGV[3])
local r = redis.call('GET', KEYS[2])
if r then
  local okq, q = pcall(cjson.decode, r)
  if okq and type(q) == 'table' and q.term == ARGV[2] then
    return {1, 1, q.to or '', redis.call('PTTL', KEYS[2])}
  end
end
return {1, 0, '', 0}
"""
)

#: Delete the lease key if this token and term hold it, record the term's end in the
#: history stream, and publish. KEYS: lease key, handover key, history key. ARGV: token,
#: term, channel, why it ended (an ``end_reason``), who ended it ('' for nobody).
#: Returns 1 when released, else 0. A release while a handover request of this term
#: names a node hands the lease to that node (a drained holder's stays ``drained``), and
#: a ``handed_over`` that names nobody is a step-down, as on Postgres.
RELEASE = (
    _HISTORY
    + _HOLDS
    + """
local unusable = _history_unusable(KEYS[3])
if unusable then return unusable end
redis.call('DEL', KEYS[1])
local reason, to = ARGV[4], ''
local r = redis.call('GET', KEYS[2])
if r then
  local okq, q = pcall(cjson.decode, r)
  if okq and type(q) == 'table' and q.term == ARGV[2] and type(q.to) == 'string' then
    to = q.to
  end
end
if to ~= '' and (reason == 'released' or reason == 'handed_over' or reason == 'stepped_down') then
  reason = 'handed_over'
elseif to == '' and reason == 'handed_over' then
  reason = 'stepped_down'
end
local t = redis.call('TIME')
redis.call('XADD', KEYS[3], '*', 'kind', 'ended', 'term', ARGV[2], 'reason', reason,
  'to', to, 'by', ARGV[5], 'at', tostring(t[1] * 1000 + math.floor(t[2] / 1000)))
redis.call('PUBLISH', ARGV[3], 'released:' .. ARGV[2])
return 1
"""
)

#: Record a handover request for the current term and publish it. KEYS: lease key,
#: handover key. ARGV: node asked to take over ('' for any), the request's ttl (ms),
#: channel, optionally "1" to ask nothing of a holder that is that node already, and
#: optionally the term to ask it of (another term is asked nothing).
#: Returns {0, '', 0, ''} when nobody holds the lease (or, with that "1", the node asked
#: holds it, or another term holds it), {-1, value, 0, ''} when the value cannot be read,
#: else {1, value, PTTL (ms), server time (ms)}.
REQUEST_HANDOVER = """
local cur = redis.call('GET', KEYS[1])
if not cur then return {0, '', 0, ''} end
local ok, h = pcall(cjson.decode, cur)
if not ok or type(h) ~= 'table' or type(h.term) ~= 'string' or type(h.node) ~= 'string' then
  return {-1, cur, 0, ''}
end
if ARGV[4] == '1' and h.node == ARGV[1] then return {0, '', 0, ''} end
if ARGV[5] and ARGV[5] ~= '' and h.term ~= ARGV[5] then return {0, '', 0, ''} end
local t = redis.call('TIME')
local now = tostring(t[1] * 1000 + math.floor(t[2] / 1000))
redis.call('SET', KEYS[2], cjson.encode({term = h.term, from = h.node, to = ARGV[1]}),
  'PX', ARGV[2])
redis.call('PUBLISH', ARGV[3], 'resign:' .. h.term)
return {1, cur, redis.call('PTTL', KEYS[1]), now}
"""

#: Delete a handover request for a term and publish. KEYS: handover key. ARGV: term,
#: channel. Returns 1 when a request for that term was deleted, else 0.
CANCEL_HANDOVER = """
local r = redis.call('GET', KEYS[1])
if not r then return 0 end
local ok, q = pcall(cjson.decode, r)
if not ok or type(q) ~= 'table' or q.term ~= ARGV[1] then return 0 end
redis.call('DEL', KEYS[1])
redis.call('PUBLISH', ARGV[2], 'cancelled:' .. ARGV[1])
return 1
"""

#: Open to every node (but the one that gave it up) a handover request reserved for a
#: node. KEYS: handover key. ARGV: the node it is reserved for, channel. Returns 1 when
#: one was opened (and ``cancelled:<term>`` published, so that waiting nodes attempt),
#: else 0.
REOPEN_HANDOVER = """
local r = redis.call('GET', KEYS[1])
if not r then return 0 end
local ok, q = pcall(cjson.decode, r)
if not ok or type(q) ~= 'table' or q.to ~= ARGV[1] then return 0 end
local left = redis.call('PTTL', KEYS[1])
if left <= 0 then return 0 end
q.to = ''
redis.call('SET', KEYS[1], cjson.encode(q), 'PX', left)
redis.call('PUBLISH', ARGV[2], 'cancelled:' .. q.term)
return 1
"""

#: Read the lease. KEYS: lease key. Returns {value or '', PTTL (ms), server time (ms)}.
READ = """
local t = redis.call('TIME')
return {redis.call('GET', KEYS[1]) or '', redis.call('PTTL', KEYS[1]),
  tostring(t[1] * 1000 + math.floor(t[2] / 1000))}
"""

#: Retire a lease unless it is held. KEYS: lease key, term key, retired key, history
#: key, drains key. Returns {0, lease value, PTTL (ms)} when held, {-1} when the lease
#: never had a term, {2, term} when already retired at the current term, else {1, term}
#: once retired (a term its holder did not end is recorded as ``retired``, by the
#: operator, and its drained nodes are forgotten with it).
RETIRE = (
    _HISTORY
    + """
local unusable = _history_unusable(KEYS[4])
if unusable then return unusable end
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {0, redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}
end
local term = redis.call('GET', KEYS[2])
if not term then return {-1} end
if redis.call('GET', KEYS[3]) == term then return {2, term} end
redis.call('SET', KEYS[3], term)
local t = redis.call('TIME')
_history_close(KEYS[4], 'retired', 'operator', tostring(t[1] * 1000 + math.floor(t[2] / 1000)))
redis.call('DEL', KEYS[5])
return {1, term}
"""
)

#: How long the lease still holds a value (a follower's check at its expiry). KEYS: lease
#: key. ARGV: the value. Returns its PTTL (ms; -1 without an expiry) while the key holds
#: that value, else -3. One integer back: the value is sent, never read.
HELD_FOR = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PTTL', KEYS[1]) end
return -3
"""

#: Record a node's heartbeat at the server's time. KEYS: nodes (sorted set: node id ->
#: last heartbeat, ms), node info (hash: node id -> JSON). ARGV: node id, its info (JSON:
#: host, pid, addr, version, eligible, inc), "1" to rewrite the info (a new connection),
#: "1" to purge, purge age (ms), keys' idle expiry (ms). Steady state is TIME and ZADD;
#: the info is written when the node is new or asks, and lost nodes older than the purge
#: age go on a purge beat. Its first heartbeat (``started``) is kept while the process
#: that heartbeats (``inc``) is the same: a node restarted under its id starts anew.
#: Returns the server time (ms).
HEARTBEAT = """
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
local new = redis.call('ZADD', KEYS[1], now, ARGV[1])
if new == 1 or ARGV[3] == '1' then
  local doc = cjson.decode(ARGV[2])
  doc.started = now
  if new == 0 then
    local old = redis.call('HGET', KEYS[2], ARGV[1])
    local ok, o = pcall(cjson.decode, old or '')
    if ok and type(o) == 'table' and o.started and o.inc == doc.inc then
      doc.started = o.started
    end
  end
  redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(doc))
end
if ARGV[4] == '1' then
  local gone = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - tonumber(ARGV[5]))
  for _, node in ipairs(gone) do
    if node ~= ARGV[1] then
      redis.call('ZREM', KEYS[1], node)
      redis.call('HDEL', KEYS[2], node)
    end
  end
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  redis.call('PEXPIRE', KEYS[2], ARGV[6])
end
return tostring(now)
"""

#: Remove a node from the membership at once (a graceful stop). KEYS: nodes, node info.
#: ARGV: node id. Returns 1 when it was listed, else 0.
LEAVE = """
redis.call('HDEL', KEYS[2], ARGV[1])
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

#: List the membership. KEYS: nodes, node info, lease key. Returns {server time (ms),
#: {node id, last heartbeat (ms), ...}, {node id, info JSON, ...}, the lease value or ''}.
NODES = """
local t = redis.call('TIME')
return {tostring(t[1] * 1000 + math.floor(t[2] / 1000)),
  redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES'), redis.call('HGETALL', KEYS[2]),
  redis.call('GET', KEYS[3]) or ''}
"""
