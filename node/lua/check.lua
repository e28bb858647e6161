-- check.lua: the dispatcher, the tail of every ringlimit script (after prelude.lua and
-- the algorithm fragments). Decides a request against one or more rules atomically,
-- exactly like node.limiter.decide_all: every rule must allow; when one denies, nothing
-- is stored and the allowing rules' decisions are recomputed as peeks (cost 0). A key
-- not written keeps its TTL, stretched if needed to last until its state is fresh
-- again under these rules (prelude's keep: the rule may have changed since the write).
-- KEYS[i]: the state key of rule i (all keys of one call share the user's hash tag).
-- ARGV[1] now ('' = Redis TIME), ARGV[2] cost, ARGV[3] TTL slack in ms (see prelude),
--   then 6 per rule i, from ARGV[4 + 6 * (i - 1)]: algorithm, limit, period, capacity,
--   rate, interval (floats as Python repr, so they parse to the engine's exact values).
-- Reply: { now (ARGV[1], or '%.17g' of TIME), allowed (1/0), then 6 per rule: allowed (1/0),
--   remaining (integer), reset_after ('%.17g'), retry_after ('%.17g' or nil),
--   reason (string or nil), available_after ('%.17g') }.

local n = #KEYS
if n == 0 or #ARGV ~= 3 + 6 * n then
  return redis.error_reply('ERR ringlimit: expected 6 ARGV per key after the header')
end

local params = {}
local algs = {}
for i = 1, n do
  local base = 4 + 6 * (i - 1)
  local alg = ALG[ARGV[base]]
  if alg == nil then
    return redis.error_reply('ERR ringlimit: algorithm ' .. ARGV[base] .. ' not in this script')
  end
  algs[i] = alg
  params[i] = {
    limit = tonumber(ARGV[base + 1]),
    period = tonumber(ARGV[base + 2]),
    capacity = tonumber(ARGV[base + 3]),
    rate = tonumber(ARGV[base + 4]),
    interval = tonumber(ARGV[base + 5]),
  }
end

local decisions = {}
local pendings = {}
local allowed = true
for i = 1, n do
  decisions[i], pendings[i] = algs[i].decide(KEYS[i], NOW, params[i], COST)
  if not decisions[i][1] then
    allowed = false
  end
end

if allowed then
  for i = 1, n do
    if pendings[i] ~= nil then
      algs[i].commit(KEYS[i], pendings[i], NOW, params[i])
    end
  end
elseif COST ~= 0 then
  for i = 1, n do
    if decisions[i][1] then
      decisions[i] = algs[i].decide(KEYS[i], NOW, params[i], 0)
    end
  end
end
-- The states nothing was written to keep their keys until fresh under these rules.
for i = 1, n do
  if not allowed or pendings[i] == nil then
    keep(KEYS[i], decisions[i][3], NOW)
  end
end

-- An injected now comes back as it was sent (it parsed to NOW exactly).
local reply = { ARGV[1] ~= '' and ARGV[1] or fmt(NOW), allowed and 1 or 0 }
for i = 1, n do
  local d = decisions[i]
  reply[#reply + 1] = d[1] and 1 or 0
  reply[#reply + 1] = d[2]
  reply[#reply + 1] = fmt(d[3])
  reply[#reply + 1] = d[4] ~= nil and fmt(d[4]) or false
  reply[#reply + 1] = d[5] or false
  reply[#reply + 1] = fmt(d[6])
end
return reply
