-- fixed_window.lua: ALG.fixed_window, node.algorithms.fixed_window in Lua (a fragment).
-- KEYS: one state key per rule; a string "<window_start> <count>" ('%.17g' each) with a
--   PX TTL ending at fresh_at = window_start + period; absent = fresh. A key's first
--   window is aligned to the grid of multiples of period (prelude's aligned), later
--   ones continue its grid.
-- ARGV: none read here; the rule fields come from check.lua's per-rule ARGV
--   (p.limit, p.period).
do
  local read = read_numbers

  ALG.fixed_window = {
    decide = function(key, now, p, cost)
      local period = p.period
      local limit = p.limit
      local start, count = read(key)
      if start == nil then
        start = aligned(now, period)
        count = 0
      elseif now >= start + period then
        start = advance(start, now, period)
        count = 0
      end
      local need = cost
      if need == 0 then
        need = 1
      end
      local reset_after = start + period - now
      -- A count above the limit (a limit lowered at runtime) has nothing left, not less.
      local left = limit - count
      if left < 0 then
        left = 0
      end
      if need > limit then
        local reset = 0.0
        if count ~= 0 then
          reset = reset_after
        end
        return { false, left, reset, nil, COST_EXCEEDS_CAPACITY, reset }
      end
      if count + need <= limit then
        local pending = nil
        if cost ~= 0 then
          count = count + cost
          pending = { start, count }
        end
        local reset = 0.0
        if count ~= 0 then
          reset = reset_after
        end
        return { true, limit - count, reset, nil, nil, reset }, pending
      end
      return { false, left, reset_after, reset_after, nil, reset_after }
    end,

    commit = function(key, s, now, p)
      local fresh_at = s[1] + p.period
      redis.call('SET', key, fmt(s[1]) .. ' ' .. fmt(s[2]), 'PX', ttl_ms(fresh_at, now))
    end,
  }
end
