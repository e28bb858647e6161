-- sliding_window.lua: ALG.sliding_window, node.algorithms.sliding_window in Lua (a fragment).
-- KEYS: one state key per rule; a string "<window_start> <previous> <current>"
--   ('%.17g' each) with a PX TTL ending at fresh_at = window_start + 2 * period
--   (+ period when current is 0); absent = fresh. Windows align like fixed_window's.
-- ARGV: none read here; the rule fields come from check.lua's per-rule ARGV
--   (p.limit, p.period).
do
  local read = read_numbers

  local function reset(start, prev, curr, now, period)
    if curr ~= 0 then
      return start + 2 * period - now
    end
    if prev ~= 0 then
      return start + period - now
    end
    return 0.0
  end

  -- node.algorithms._sw_wait: seconds until need units fit under the estimate.
  local function wait_for(need, start, prev, curr, now, period, limit)
    local retry_at
    if curr + need <= limit and prev ~= 0 then
      -- Wait inside this window until enough of the previous window has slid out.
      retry_at = start + period * (1.0 - (limit - curr - need) / prev)
    elseif curr ~= 0 then
      -- Wait until the current count becomes the previous one and has slid enough.
      retry_at = start + period + period * (1.0 - (limit - need) / curr)
    else
      return 0.0
    end
    local wait = retry_at - now
    -- node.algorithms.SW_MIN_WAIT: at or before now is rounding, never 0.0.
    if wait > 1e-6 then
      return wait
    end
    return 1e-6
  end

  -- node.algorithms._sw_next: seconds until remaining + 1 units fit.
  local function next_unit(r, start, prev, curr, now, period, limit)
    if r >= limit then
      return 0.0
    end
    return wait_for(r + 1, start, prev, curr, now, period, limit)
  end

  local function fresh_at(start, curr, period)
    if curr ~= 0 then
      return start + 2 * period
    end
    return start + period
  end

  ALG.sliding_window = {
    decide = function(key, now, p, cost)
      local period = p.period
      local limit = p.limit
      local start, prev, curr = read(key)
      if start == nil then
        start = aligned(now, period)
        prev = 0
        curr = 0
      elseif now >= start + period then
        local windows
        start, windows = advance(start, now, period)
        if windows == 1 then
          prev = curr
        else
          prev = 0
        end
        curr = 0
      end
      local weight = (period - (now - start)) / period
      if weight > 1.0 then
        weight = 1.0
      elseif weight < 0.0 then
        weight = 0.0
      end
      local estimate = prev * weight + curr
      local need = cost
      if need == 0 then
        need = 1
      end
      local remaining
      if need > limit then
        remaining = floor(limit - estimate + EPS)
        if not (remaining > 0) then
          remaining = 0
        end
        return {
          false, remaining, reset(start, prev, curr, now, period), nil, COST_EXCEEDS_CAPACITY,
          next_unit(remaining, start, prev, curr, now, period, limit),
        }
      end
      if estimate + need <= limit + EPS then
        local pending = nil
        if cost ~= 0 then
          curr = curr + cost
          estimate = estimate + cost
          pending = { start, prev, curr }
        end
        remaining = floor(limit - estimate + EPS)
        if not (remaining > 0) then
          remaining = 0
        end
        return {
          true, remaining, reset(start, prev, curr, now, period), nil, nil,
          next_unit(remaining, start, prev, curr, now, period, limit),
        }, pending
      end
      remaining = floor(limit - estimate + EPS)
      if not (remaining > 0) then
        remaining = 0
      end
      return {
        false, remaining, reset(start, prev, curr, now, period),
        wait_for(need, start, prev, curr, now, period, limit), nil,
        next_unit(remaining, start, prev, curr, now, period, limit),
      }
    end,

    commit = function(key, s, now, p)
      local value = fmt(s[1]) .. ' ' .. fmt(s[2]) .. ' ' .. fmt(s[3])
      redis.call('SET', key, value, 'PX', ttl_ms(fresh_at(s[1], s[3], p.period), now))
    end,
  }
end
