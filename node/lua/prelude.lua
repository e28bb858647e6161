-- prelude.lua: the shared head of every ringlimit script (a fragment, not a script).
-- KEYS: none read here (see check.lua: KEYS[i] is the state key of rule i).
-- ARGV: reads the call header, ARGV[1] = now in seconds as a float string ('' = take
--   it from Redis TIME), ARGV[2] = cost (integer >= 0), ARGV[3] = TTL slack in ms.
--
-- Every algorithm fragment registers ALG.<name> = {decide = ..., commit = ...}:
--   decide(key, now, p, cost) -> decision, pending
--     reads the state (never writes); decision = {allowed, remaining, reset_after,
--     retry_after or nil, reason or nil, available_after}; pending is the state to
--     store, or nil when nothing changes (peeks and denials).
--   commit(key, pending, now, p)
--     stores pending with a TTL that ends when the state is fresh again (fresh_at).
-- The arithmetic repeats node/algorithms.py operation for operation (same formulas,
-- same order, same EPS, same clamping), so both give identical decisions. Floats are
-- stored and returned with '%.17g' (exact round trip; an injected now is returned as
-- sent); Lua's tostring keeps only 14 digits, so it is never used on a float.

local EPS = 1e-9
-- GCRA's slack in units (its tat picks up about ulp(now) of rounding per addition).
local UNIT_EPS = 1e-6
local floor = math.floor
local ceil = math.ceil
local COST_EXCEEDS_CAPACITY = 'cost_exceeds_capacity'
local ALG = {}

local function fmt(x)
  return string.format('%.17g', x)
end

local NOW
if ARGV[1] == '' then
  -- Effects replication is the default since Redis 5 and the only mode in 7 (which
  -- defines REDIS_VERSION_NUM, and where the call is a no-op that still costs time);
  -- older servers need it switched on before a non-deterministic command and writes.
  if not redis.REDIS_VERSION_NUM and redis.replicate_commands then
    redis.replicate_commands()
  end
  local t = redis.call('TIME')
  NOW = tonumber(t[1]) + tonumber(t[2]) / 1000000
else
  NOW = tonumber(ARGV[1])
end
local COST = tonumber(ARGV[2])
local SLACK_MS = tonumber(ARGV[3]) or 0
if NOW == nil or COST == nil or COST < 0 or COST ~= floor(COST) then
  return redis.error_reply('ERR ringlimit: bad call header (now, cost, slack)')
end

-- node.algorithms._aligned: the start of the window of the grid k * period holding
-- now (floor(now / period) * period alone can miss it by a window at a boundary).
local function aligned(now, period)
  local start = floor(now / period) * period
  while start > now do
    start = start - period
  end
  while now >= start + period do
    start = start + period
  end
  return start
end

-- node.algorithms._advance: move a window start forward to the window holding now;
-- returns the new start and how many windows it moved (at least one, corrected
-- until now is inside, since floor((now - start) / period) can round low).
local function advance(start, now, period)
  local windows = floor((now - start) / period)
  if windows < 1 then
    windows = 1
  end
  start = start + windows * period
  while now >= start + period do
    start = start + period
    windows = windows + 1
  end
  return start, windows
end

-- The longest TTL written: 2^53 ms (285,000 years), the largest integer '%d' formats
-- exactly. A bucket can be fresh again ~3e16 s ahead (burst 1e9, 1 per 366 days), more
-- milliseconds than SET PX accepts (about 2^63 minus the time): uncapped, the write
-- failed with "invalid expire time" after the rules before it had been committed.
local MAX_TTL_MS = 2 ^ 53

-- Milliseconds until fresh_at, rounded up (a key never expires before its state is
-- fresh again), plus the configured slack; at least 1 ms, at most MAX_TTL_MS.
local function ttl_number(fresh_at, now)
  local ms = ceil((fresh_at - now) * 1000) + SLACK_MS
  if ms < 1 then
    ms = 1
  elseif not (ms <= MAX_TTL_MS) then
    ms = MAX_TTL_MS
  end
  return ms
end

local function ttl_ms(fresh_at, now)
  return string.format('%d', ttl_number(fresh_at, now))
end

-- How far short of fresh_at a kept key's TTL may end before keep() stretches it: more
-- than the rounding between the TTL written and the one read back (a few ms), so that
-- a check that writes nothing under an unchanged rule writes nothing at all.
local KEEP_TOLERANCE_MS = 10

-- A key left as it was (a denial, a peek) keeps the TTL of its last write, which ended
-- at fresh_at under the rule in force then. A rule changed since (a lower rate with
-- the same burst, a longer period) makes the state fresh again later: stretch the TTL
-- to fresh_at = now + reset_after under this rule (never shorten it), so that Redis
-- does not drop a state that still matters while its user is being denied.
local function keep(key, reset_after, now)
  if not (reset_after > 0) then
    return
  end
  local have = redis.call('PTTL', key)
  if have < 0 then
    return -- absent (nothing to keep) or without a TTL (not written by these scripts)
  end
  local want = ttl_number(now + reset_after, now)
  if want > have + KEEP_TOLERANCE_MS then
    redis.call('PEXPIRE', key, string.format('%d', want))
  end
end

-- A plain state (token bucket, fixed and sliding window): space-separated numbers,
-- '%.17g' each, read back in order; nothing at all for a fresh (absent) state.
-- A value that is not numbers was not written by ringlimit: an error reply (the
-- check is decided by its rules' on_error, reason backend_error), never a fresh
-- state (a string such as 'x' read as absent gave its user a whole new quota).
-- A plain string, without the key (the node's warning names it): Redis 7.0
-- turns line breaks in an error's text into spaces, but a review read a version
-- that writes it as it is, where a key's line break would split the reply.
local function read_numbers(key)
  local s = redis.call('GET', key)
  if not s then
    return nil
  end
  local numbers = {}
  for part in string.gmatch(s, '%S+') do
    local number = tonumber(part)
    if number == nil then
      error('ringlimit: a key holds no ringlimit state (not numbers)')
    end
    numbers[#numbers + 1] = number
  end
  if #numbers == 0 then
    error('ringlimit: a key holds no ringlimit state (empty)')
  end
  return unpack(numbers)
end
