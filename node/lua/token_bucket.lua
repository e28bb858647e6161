-- token_bucket.lua: ALG.token_bucket, node.algorithms.token_bucket in Lua (a fragment).
-- KEYS: one state key per rule; a string "<tokens> <updated_at>" ('%.17g' each) with a
--   PX TTL ending at fresh_at = updated_at + (capacity - tokens) / rate; absent = fresh.
-- ARGV: none read here; the rule fields come from check.lua's per-rule ARGV
--   (p.capacity = burst, p.rate = limit / period).
do
  local read = read_numbers

  -- node.algorithms._tb_reset
  local function reset(tokens, capacity, rate, lag)
    local r = (capacity - tokens) / rate
    if r > 0.0 then
      return r + lag
    end
    return r
  end

  -- node.algorithms._tb_next: seconds until whole + 1 tokens (0 when full).
  local function next_unit(whole, tokens, capacity, rate, lag)
    if whole >= capacity then
      return 0.0
    end
    local wait = (whole + 1 - tokens) / rate
    if wait > 0.0 then
      return wait + lag
    end
    return 0.0
  end

  ALG.token_bucket = {
    decide = function(key, now, p, cost)
      local capacity = p.capacity
      local rate = p.rate
      local tokens, last = read(key)
      if tokens == nil then
        tokens = capacity
        last = now
      elseif now > last then
        tokens = tokens + (now - last) * rate
        if tokens > capacity then
          tokens = capacity
        end
        last = now
      elseif tokens > capacity then
        -- A burst lowered at runtime: full, no fuller.
        tokens = capacity
      end
      -- last > now only after the clock stepped back: nothing refills until it catches up.
      local lag = last - now
      local need = cost
      if need == 0 then
        need = 1
      end
      local whole
      if need > capacity then
        whole = floor(tokens + EPS)
        return {
          false, whole, reset(tokens, capacity, rate, lag), nil, COST_EXCEEDS_CAPACITY,
          next_unit(whole, tokens, capacity, rate, lag),
        }
      end
      if tokens + EPS >= need then
        local pending = nil
        if cost ~= 0 then
          tokens = tokens - cost
          pending = { tokens, last }
        end
        whole = floor(tokens + EPS)
        return {
          true, whole, reset(tokens, capacity, rate, lag), nil, nil,
          next_unit(whole, tokens, capacity, rate, lag),
        }, pending
      end
      whole = floor(tokens + EPS)
      return {
        false, whole, reset(tokens, capacity, rate, lag), lag + (need - tokens) / rate, nil,
        next_unit(whole, tokens, capacity, rate, lag),
      }
    end,

    commit = function(key, s, now, p)
      local fresh_at = s[2] + (p.capacity - s[1]) / p.rate
      redis.call('SET', key, fmt(s[1]) .. ' ' .. fmt(s[2]), 'PX', ttl_ms(fresh_at, now))
    end,
  }
end
