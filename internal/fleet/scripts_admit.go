package fleet

import "github.com/redis/go-redis/v9"

// The admission's script. A request's limits (internal/limits) and its
// holds of its budgets (the spend accounts') are admitted together, all
// or none, in one script call: the script is here so that both sides
// read the one layout of its keys, arguments and answer.

// AdmitScript admits one request against the limits of one thing, or of
// several at once (a request's key, end user and channel), and holds its
// worst case against the budgets of its spend accounts (HoldsLua): all are
// checked before any is written, so a request one of them refuses takes
// nothing from the others. ARGV[1] is the number of things, ARGV[2] the number of slots given
// back with the call (r, slots other requests of this relay freed: the
// call carries them rather than the worker that gives back). KEYS: first
// the r slots' lease sets, their ids the next r of ARGV; removed before
// anything is counted. Then, three per thing: the lease
// set, the rate's arrival time, the token bucket; then per hold: the
// account's holds, its held total, and one spend total per budget. ARGV,
// thirteen per thing: the lease id, max concurrency (0: none), lease ms, rate
// emission interval in ms (0: the rate is not asked), rate burst, the
// requests to take (1: this one; more: a block of up to that many, at least
// one), the requests of an ended block to give back first, tokens per ms
// (0: the tokens are not asked), token burst, the tokens to charge (-1: do
// not hold the request to tokens), the tokens to take (0: charge the
// request; more: a block of up to that many, at least one), the tokens of
// an ended block to give back first (negative: its debt, charged), the
// concurrency slots to take (0: this request's, the lease id; more: a
// block of up to that many, at least one, members <lease id>/1,
// <lease id>/2, ...: internal/limits's fleet_slots.go); then per hold: its member (<id>=<billionths of a dollar>), its expiry in ms,
// how long the account's hold keys are kept at least (ms), its amount, the number of budgets, and per budget its cap and what this
// relay spent that Redis has not yet added. What is given back is written
// whatever the verdict. It returns, per thing, {scope, wait, requests
// left, ms until the rate is full again, tokens left, ms until the bucket
// is full again, requests taken, tokens taken, slots taken}: scope 0 for all when
// admitted, else the limit that refused (1 concurrency, 2 rate, 3 tokens)
// on the thing it refused, and wait the ms until it may pass (0: unknown).
// What is left counts what this request took when it was admitted, and is
// 0 for a limit not asked; the times are ms from Redis's own now, so the
// relays' clocks need not agree with it. What was taken is the block
// granted (0 when none was asked or the request was refused). Then, per
// hold, {verdict (0 taken, 1 wait for holds in flight, 2 refused: what was
// spent and the hold exceed a budget), the budget's index (1-based), what
// was spent in its period, what the account held}. Holds are judged first:
// a hold that does not fit takes nothing, and neither does anything else.
var AdmitScript = redis.NewScript(HoldsLua + `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, r = tonumber(ARGV[1]), tonumber(ARGV[2])
for i = 1, r do redis.call('ZREM', KEYS[i], ARGV[2 + i]) end
local function settat(th)
  if th.tat > now then
    redis.call('SET', th.kr, th.tat, 'PX', math.ceil(th.tat - now) + 1000)
  else
    redis.call('DEL', th.kr)
  end
end
local function setlevel(th)
  redis.call('HSET', th.kt, 'level', th.level, 'last', now)
  redis.call('PEXPIRE', th.kt, math.ceil(th.tburst / th.perms) + 60000)
end
local things = {}
for i = 1, n do
  local k, a = r + (i - 1) * 3, 2 + r + (i - 1) * 13
  local th = {lease = ARGV[a + 1], maxc = tonumber(ARGV[a + 2]), ttl = tonumber(ARGV[a + 3]),
    emission = tonumber(ARGV[a + 4]), burst = tonumber(ARGV[a + 5]),
    rtake = tonumber(ARGV[a + 6]), rret = tonumber(ARGV[a + 7]),
    perms = tonumber(ARGV[a + 8]), tburst = tonumber(ARGV[a + 9]), charge = tonumber(ARGV[a + 10]),
    ttake = tonumber(ARGV[a + 11]), tret = tonumber(ARGV[a + 12]), ctake = tonumber(ARGV[a + 13]),
    kl = KEYS[k + 1], kr = KEYS[k + 2], kt = KEYS[k + 3], tat = now, level = 0, rgot = 0, tgot = 0, cgot = 0, count = 0}
  if th.emission > 0 then
    th.tat = math.max(tonumber(redis.call('GET', th.kr) or 0), now)
    if th.rret > 0 then
      th.tat = math.max(now, th.tat - th.rret * th.emission)
      settat(th)
    end
  end
  if th.perms > 0 then
    local h = redis.call('HMGET', th.kt, 'level', 'last')
    th.level = tonumber(h[1]) or th.tburst
    local last = tonumber(h[2]) or now
    if now > last then th.level = math.min(th.tburst, th.level + (now - last) * th.perms) end
    if th.tret ~= 0 then
      th.level = math.min(th.tburst, th.level + th.tret)
      setlevel(th)
    end
  end
  things[i] = th
end
local holds, verdicts = {}, {}
local ki, ai = r + n * 3 + 1, 2 + r + n * 13 + 1
while ai <= #ARGV do
  local h = {kz = KEYS[ki], kh = KEYS[ki + 1], member = ARGV[ai], ttl = tonumber(ARGV[ai + 1]),
    keep = tonumber(ARGV[ai + 2]), amount = ARGV[ai + 3], np = tonumber(ARGV[ai + 4]), periods = {}}
  for j = 1, h.np do
    h.periods[j] = {key = KEYS[ki + 1 + j], cap = tonumber(ARGV[ai + 3 + 2 * j]), pending = tonumber(ARGV[ai + 4 + 2 * j])}
  end
  h.held = held(h.kz, h.kh, now)
  holds[#holds + 1] = h
  ki, ai = ki + 2 + h.np, ai + 5 + 2 * h.np
end
local function answers(refused, scope, wait)
  local out = {}
  for i, th in ipairs(things) do
    local rleft, rfull, tleft, tfull = 0, 0, 0, 0
    if th.emission > 0 then
      rleft = math.max(0, math.floor(th.burst - (th.tat - now) / th.emission))
      rfull = math.ceil(th.tat - now)
    end
    if th.perms > 0 then
      tleft = math.max(0, math.floor(th.level))
      tfull = math.max(0, math.ceil((th.tburst - th.level) / th.perms))
    end
    if i == refused then
      out[#out + 1], out[#out + 2] = scope, wait
    else
      out[#out + 1], out[#out + 2] = 0, 0
    end
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = rleft, rfull, tleft, tfull
    out[#out + 1], out[#out + 2], out[#out + 3] = th.rgot, th.tgot, th.cgot
  end
  for i = 1, #holds do
    local v = verdicts[i] or {0, 0, 0, 0}
    out[#out + 1], out[#out + 2], out[#out + 3], out[#out + 4] = v[1], v[2], v[3], v[4]
  end
  return out
end
local wait = false
for i, h in ipairs(holds) do
  local amount = tonumber(h.amount)
  local v = {0, 0, 0, h.held}
  for j, p in ipairs(h.periods) do
    local spent = tonumber(redis.call('GET', p.key) or '0') + p.pending
    if spent >= p.cap or spent + amount > p.cap then
      verdicts[i] = {2, j, spent, h.held}
      return answers(0, 0, 0)
    end
    if v[1] == 0 and spent + h.held + amount > p.cap then v = {1, j, spent, h.held} end
  end
  verdicts[i] = v
  wait = wait or v[1] == 1
end
if wait then return answers(0, 0, 0) end
for i, th in ipairs(things) do
  if th.maxc > 0 then
    redis.call('ZREMRANGEBYSCORE', th.kl, '-inf', now)
    th.count = redis.call('ZCARD', th.kl)
    if th.count >= th.maxc then return answers(i, 1, 0) end
  end
  if th.emission > 0 then
    local allow = th.tat + th.emission - th.burst * th.emission
    if now < allow then return answers(i, 2, math.ceil(allow - now)) end
  end
  if th.perms > 0 and th.charge >= 0 and th.level < 1 then
    return answers(i, 3, math.ceil((1 - th.level) / th.perms))
  end
end
for _, th in ipairs(things) do
  if th.maxc > 0 then
    if th.ctake > 0 then
      th.cgot = math.max(1, math.min(th.ctake, th.maxc - th.count))
      for j = 1, th.cgot do redis.call('ZADD', th.kl, now + th.ttl, th.lease .. '/' .. j) end
    else
      redis.call('ZADD', th.kl, now + th.ttl, th.lease)
    end
    redis.call('PEXPIRE', th.kl, th.ttl * 2)
  end
  if th.emission > 0 then
    th.rgot = 1
    if th.rtake > 1 then
      th.rgot = math.max(1, math.min(th.rtake, math.floor(th.burst - (th.tat - now) / th.emission + 1e-9)))
    end
    th.tat = th.tat + th.rgot * th.emission
    settat(th)
  end
  if th.perms > 0 and th.charge >= 0 then
    if th.ttake > 0 then
      th.tgot = math.max(1, math.floor(math.min(th.ttake, th.level)))
      th.level = th.level - th.tgot
    else
      th.level = th.level - th.charge
    end
    setlevel(th)
  end
end
for _, h in ipairs(holds) do
  redis.call('ZADD', h.kz, now + h.ttl, h.member)
  redis.call('INCRBY', h.kh, h.amount)
  keep(h.kz, h.keep)
  keep(h.kh, h.keep)
end
return answers(0, 0, 0)
`)

// AdmitAnswer is the length of one thing's answer of AdmitScript.
const AdmitAnswer = 9

// HoldsLua is the Lua the hold scripts share: keep extends a key's expiry
// to at least ttl ms; amountOf is a member's amount; held drops the
// expired members of an account's holds and returns what the others hold
// (counted again from the members should the total have been lost).
const HoldsLua = `
local function keep(k, ttl)
  if redis.call('PTTL', k) < ttl then redis.call('PEXPIRE', k, ttl) end
end
local function amountOf(m) return string.match(m, '=(%d+)$') or '0' end
local function held(kz, kh, now)
  for _, m in ipairs(redis.call('ZRANGEBYSCORE', kz, '-inf', now)) do
    if redis.call('ZREM', kz, m) == 1 then redis.call('DECRBY', kh, amountOf(m)) end
  end
  local v = tonumber(redis.call('GET', kh) or '0')
  local members = redis.call('ZCARD', kz)
  if v < 0 or (v > 0 and members == 0) or (v == 0 and members > 0) then
    v = 0
    for _, m in ipairs(redis.call('ZRANGE', kz, 0, -1)) do v = v + tonumber(amountOf(m)) end
    local ttl = redis.call('PTTL', kh)
    redis.call('SET', kh, v)
    if ttl > 0 then redis.call('PEXPIRE', kh, ttl) else keep(kh, redis.call('PTTL', kz)) end
  end
  return v
end
`

// ReleaseHoldScript gives back holds that cost nothing (a request that
// was not sent after all). KEYS: the account's holds, its held total.
// ARGV: the members.
var ReleaseHoldScript = redis.NewScript(HoldsLua + `
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then redis.call('DECRBY', KEYS[2], amountOf(ARGV[i])) end
end
return 0
`)
