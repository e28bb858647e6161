-- gcra.lua: ALG.gcra, node.algorithms.gcra in Lua (a fragment).
-- KEYS: one state key per rule; a string "<tat>" ('%.17g', the theoretical arrival
--   time) with a PX TTL ending at fresh_at = tat; absent = fresh.
-- ARGV: none read here; the rule fields come from check.lua's per-rule ARGV
--   (p.capacity = burst, p.interval = period / limit).
do
  -- node.algorithms._gcra_remaining
  local function remaining(tat, now, tolerance, interval)
    local r = floor((tolerance - (tat - now)) / interval + UNIT_EPS)
    if r > 0 then
      return r
    end
    return 0
  end

  -- node.algorithms._gcra_next: seconds until remaining + 1 units conform.
  local function next_unit(r, capacity, tat, now, tolerance, interval)
    if r >= capacity then
      return 0.0
    end
    local wait = (tat - now) + (r + 1) * interval - tolerance
    if wait > 0.0 then
      return wait
    end
    return 0.0
  end

  ALG.gcra = {
    decide = function(key, now, p, cost)
      local interval = p.interval
      local tolerance = p.capacity * interval
      local state = redis.call('GET', key)
      local tat = now
      if state then
        state = tonumber(state)
        if state > now then
          tat = state
        end
      end
      local need = cost
      if need == 0 then
        need = 1
      end
      local capacity = p.capacity
      local r
      if need > capacity then
        r = remaining(tat, now, tolerance, interval)
        return {
          false, r, tat - now, nil, COST_EXCEEDS_CAPACITY,
          next_unit(r, capacity, tat, now, tolerance, interval),
        }
      end
      local allow_at = tat + need * interval - tolerance
      if now + UNIT_EPS * interval >= allow_at then
        local pending = nil
        if cost ~= 0 then
          tat = tat + cost * interval
          pending = tat
        end
        r = remaining(tat, now, tolerance, interval)
        return {
          true, r, tat - now, nil, nil, next_unit(r, capacity, tat, now, tolerance, interval),
        }, pending
      end
      r = remaining(tat, now, tolerance, interval)
      return {
        false, r, tat - now, allow_at - now, nil,
        next_unit(r, capacity, tat, now, tolerance, interval),
      }
    end,

    commit = function(key, tat, now, p)
      redis.call('SET', key, fmt(tat), 'PX', ttl_ms(tat, now))
    end,
  }
end
