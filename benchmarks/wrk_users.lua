-- wrk script for `ringlimit bench`: random users from a fixed population.
--
--   wrk -t1 -c50 -d5s -s benchmarks/wrk_users.lua URL -- MODE USERS PREFIX [RULE] [COUNT] [BATCH] [HOT]
--
-- MODE   proxy:  GET URL with "X-User-Id: PREFIX<n>" (n uniform in 1..USERS)
--        single: POST URL (the decision API) with {"key":"PREFIX<n>","rule":RULE}
--        batch:  POST URL with {"checks":[BATCH such checks]}
-- USERS  population size; PREFIX makes a run's users its own (fresh quotas)
-- RULE   rule name for the decision API ("-": the default rule)
-- COUNT  "count": read every answer and count allowed/denied (proxy: 200/429;
--        decision API: "allowed":true/false in the body). Without it the
--        answers are not read (cheaper for wrk), and only wrk's own count of
--        statuses >= 400 is reported.
-- HOT    proxy: the share of requests sent as one hot user, PREFIX.."hot" (default 0)
--
-- Requests are built in init() (one per user, or 1024 random batches), so
-- request() is a table lookup: wrk shares the machine with the servers.
-- done() prints one JSON line, read by benchmarks/bench.py.

local threads = {}
local counter = 0

function setup(thread)
  counter = counter + 1
  thread:set("id", counter)
  table.insert(threads, thread)
end

local reqs = {}
local nreqs = 0
allowed = 0
denied = 0
other = 0

local function check_json(key, rule)
  if rule == nil or rule == "-" or rule == "" then
    return '{"key":"' .. key .. '"}'
  end
  return '{"key":"' .. key .. '","rule":"' .. rule .. '"}'
end

local function count_proxy(status, headers, body)
  if status == 200 then
    allowed = allowed + 1
  elseif status == 429 then
    denied = denied + 1
  else
    other = other + 1
  end
end

local function count_decisions(status, headers, body)
  if status ~= 200 or body == nil then
    other = other + 1
    return
  end
  local _, yes = string.gsub(body, '"allowed":%s*true', "")
  local _, no = string.gsub(body, '"allowed":%s*false', "")
  allowed = allowed + yes
  denied = denied + no
  if yes + no == 0 then
    other = other + 1
  end
end

function init(args)
  local mode = args[1] or "proxy"
  local users = tonumber(args[2] or "10000")
  local prefix = args[3] or "u"
  local rule = args[4] or "-"
  local count = args[5] == "count"
  local batch = tonumber(args[6] or "100")
  local hot = tonumber(args[7] or "0")
  math.randomseed((id or 1) * 7919 + os.time())
  if mode == "proxy" then
    for i = 1, users do
      reqs[i] = wrk.format("GET", wrk.path, { ["X-User-Id"] = prefix .. i }, nil)
    end
    nreqs = users
    if hot > 0 then
      -- copies of the hot user's request: a uniform pick is the hot user with probability HOT
      local copies = math.floor(hot * users / (1 - hot) + 0.5)
      local hot_req = wrk.format("GET", wrk.path, { ["X-User-Id"] = prefix .. "hot" }, nil)
      for j = 1, copies do
        reqs[users + j] = hot_req
      end
      nreqs = users + copies
    end
    if count then
      response = count_proxy
    end
  else
    local headers = { ["Content-Type"] = "application/json" }
    if mode == "single" then
      for i = 1, users do
        reqs[i] = wrk.format("POST", wrk.path, headers, check_json(prefix .. i, rule))
      end
      nreqs = users
    else
      for b = 1, 1024 do
        local items = {}
        for j = 1, batch do
          items[j] = check_json(prefix .. math.random(users), rule)
        end
        reqs[b] = wrk.format("POST", wrk.path, headers, '{"checks":[' .. table.concat(items, ",") .. "]}")
      end
      nreqs = 1024
    end
    if count then
      response = count_decisions
    end
  end
end

function request()
  return reqs[math.random(nreqs)]
end

function done(summary, latency, requests)
  local a, d, o = 0, 0, 0
  for _, thread in ipairs(threads) do
    a = a + (thread:get("allowed") or 0)
    d = d + (thread:get("denied") or 0)
    o = o + (thread:get("other") or 0)
  end
  local e = summary.errors
  io.write(string.format(
    '\nRINGLIMIT_BENCH {"requests":%d,"duration_us":%d,"p50_us":%d,"p99_us":%d,"mean_us":%.1f,'
      .. '"status_errors":%d,"socket_errors":%d,"allowed":%d,"denied":%d,"other":%d}\n',
    summary.requests, summary.duration, latency:percentile(50.0), latency:percentile(99.0),
    latency.mean, e.status, e.connect + e.read + e.write + e.timeout, a, d, o))
end
