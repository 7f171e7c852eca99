package limits

import (
	"github.com/redis/go-redis/v9"
)

// Limits shared by a fleet. Each key's and channel's limits live in Redis
// under its own hash tag, and one Lua script admits a request against all
// of them at once (atomic, so two relays never both take the last slot),
// reading the time from Redis so the relays' clocks need not agree:
//
//   - concurrency: a sorted set of leases, scored by their expiry; expired
//     leases are dropped before counting. A relay renews the leases it
//     holds every third of the lease time, so a relay that dies frees its
//     slots within that time. The slots of a large limit's blocks are
//     members too, one each (fleet_slots.go).
//   - request rate: GCRA (the generic cell rate algorithm), one timestamp
//     per limit: the theoretical arrival time of the next request. With a
//     burst of n it admits exactly what a token bucket of n would.
//   - tokens: a bucket that may go into debt, as the local one: a level and
//     the time it was last refilled; the estimate is charged at admission
//     and corrected with the real usage when the request ends.
//
// Numbers go to Redis as arguments of redis.call, which writes them in full
// (Lua's tostring keeps 14 digits: a millisecond timestamp would lose
// everything under a tenth of a millisecond, and rates over 10,000/s would
// never advance).
//
// A request admitted by Redis is given back to Redis, off its path: its
// lease is removed and its tokens corrected by a background worker that
// pipelines what many requests give back.

// chargeScript charges (or, negative, gives back) tokens, whatever the
// bucket's level. KEYS: the token bucket. ARGV: tokens per ms, burst, the
// tokens.
var chargeScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local perms, tburst, charge = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local h = redis.call('HMGET', KEYS[1], 'level', 'last')
local level = tonumber(h[1]) or tburst
local last = tonumber(h[2]) or now
if now > last then level = math.min(tburst, level + (now - last) * perms) end
redis.call('HSET', KEYS[1], 'level', math.min(tburst, level - charge), 'last', now)
redis.call('PEXPIRE', KEYS[1], math.ceil(tburst / perms) + 60000)
return 0
`)

// renewScript moves the expiry of leases still held. KEYS: a lease set.
// ARGV: the lease ms, then the lease ids. It returns how many of them the
// set still held (a lease that expired, or that a Redis emptied, is not
// added back).
var renewScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local found = 0
for i = 2, #ARGV do
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) then
    found = found + 1
    redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i])
  end
end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) * 2 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2) end
return found
`)
