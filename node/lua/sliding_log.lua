-- sliding_log.lua: ALG.sliding_log, node.algorithms.sliding_log in Lua (a fragment).
-- KEYS: one state key per rule; a sorted set with one entry per admitted unit:
--   score = the unit's time, member = "<time>#<n>" (n numbers the units that share a
--   time, which a cost above 1 creates), with a PX TTL ending at fresh_at = newest
--   time + period; absent = fresh. Entries at or before now - period count for
--   nothing; like the Python tuple, they are pruned only when a request consumes.
-- ARGV: none read here; the rule fields come from check.lua's per-rule ARGV
--   (p.limit, p.period).
do
  -- The score of the entry at 0-based rank i (scores round-trip exactly: Redis
  -- replies with '%.17g' or the shortest exact form).
  local function score_at(key, i)
    local r = redis.call('ZRANGE', key, i, i, 'WITHSCORES')
    return tonumber(r[2])
  end

  ALG.sliding_log = {
    decide = function(key, now, p, cost)
      local period = p.period
      local limit = p.limit
      local cutoff = now - period
      local total = redis.call('ZCARD', key)
      local drop = 0
      if total > 0 then
        -- bisect_right(state, now - period): the entries <= cutoff.
        drop = redis.call('ZCOUNT', key, '-inf', fmt(cutoff))
      end
      local count = total - drop
      local newest = nil
      local oldest = nil
      if count > 0 then
        newest = score_at(key, total - 1)
        oldest = score_at(key, drop)
      end
      -- One more unit comes back when the oldest live entry expires; with more
      -- entries than the limit (a limit lowered at runtime), when enough have.
      local available = 0.0
      if oldest ~= nil then
        if count > limit then
          available = score_at(key, drop + count - limit) + period - now
        else
          available = oldest + period - now
        end
      end
      local left = limit - count
      if left < 0 then
        left = 0
      end
      local need = cost
      if need == 0 then
        need = 1
      end
      if need > limit then
        local reset = 0.0
        if newest ~= nil then
          reset = newest + period - now
        end
        return { false, left, reset, nil, COST_EXCEEDS_CAPACITY, available }
      end
      if count + need <= limit then
        local pending = nil
        if cost ~= 0 then
          local stamp = now
          if newest ~= nil and not (now >= newest) then
            stamp = newest
          end
          newest = stamp
          if oldest == nil then
            oldest = stamp
            available = oldest + period - now
          end
          count = count + cost
          pending = { drop, cutoff, stamp, cost }
        end
        local reset = 0.0
        if newest ~= nil then
          reset = newest + period - now
        end
        return { true, limit - count, reset, nil, nil, available }, pending
      end
      local oldest_needed = score_at(key, drop + count + need - limit - 1)
      return {
        false, left, newest + period - now, oldest_needed + period - now, nil, available,
      }
    end,

    commit = function(key, s, now, p)
      local drop, cutoff, stamp, cost = s[1], s[2], s[3], s[4]
      if drop > 0 then
        redis.call('ZREMRANGEBYSCORE', key, '-inf', fmt(cutoff))
      end
      local at = fmt(stamp)
      -- Units already logged at this very time are numbered 1..n (pruning removes a
      -- time's units together), so the new ones continue at n + 1.
      local n = redis.call('ZCOUNT', key, at, at)
      local batch = {}
      for i = 1, cost do
        batch[#batch + 1] = at
        batch[#batch + 1] = at .. '#' .. string.format('%d', n + i)
        if #batch >= 2000 then
          redis.call('ZADD', key, unpack(batch))
          batch = {}
        end
      end
      if #batch > 0 then
        redis.call('ZADD', key, unpack(batch))
      end
      redis.call('PEXPIRE', key, ttl_ms(stamp + p.period, now))
    end,
  }
end
