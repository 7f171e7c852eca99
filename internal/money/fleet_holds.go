package money

import (
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"

	"github.com/redis/go-redis/v9"
)

// Holds shared by a fleet. An account's holds live in Redis under the hash
// tag of its spend totals ({s:<id>}), so one script sees both:
//
//   - <prefix>{s:<id>}:holds, a sorted set: one member per hold,
//     `<lease id>=<billionths of a dollar>`, scored by its expiry on
//     Redis's clock. A request's hold is leased like a concurrency slot:
//     its relay renews it every third of `lease` until it is given back,
//     so a relay that dies leaves holds that expire within `lease`. A
//     batch's hold (`b:<digest>=<amount>`) is not renewed: it expires
//     batchHoldFor after the batch was made, unless its results settle it
//     first.
//   - <prefix>{s:<id>}:held, the sum of the members' amounts.
//
// Both are kept holdKeysTTL after their last change; a session's, an hour
// after its budget's window ends, as its spend (holdKeysFor). Every script
// that reads them first drops the expired members and their amounts.
//
// A hold is taken in admitScript, with the request's other admissions
// after its body. It is given back in settleScript, run by the sync that
// adds the request's cost to the account's spend totals (INCRBY): in one
// script, so that no relay ever reads the fleet's spend without that cost
// and without the hold. Until then its relay renews it.

// holdKeysTTL is how long an account's holds are kept after their last
// change: longer than a batch's hold.
const holdKeysTTL = batchHoldFor + 24*time.Hour

// settleScript adds what a relay spent to an account's totals and gives
// back the holds of the requests that spent it, at once. KEYS: the
// account's holds, its held total, then one spend total per period. ARGV:
// the number of periods, then per period the billionths to add (0: only
// read) and the total's expiry (Unix ms); then the members to give back.
// It returns each period's total, then what the account holds.
var settleScript = redis.NewScript(fleet.HoldsLua + `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local np = tonumber(ARGV[1])
local out = {}
for j = 1, np do
  local k, amount = KEYS[2 + j], ARGV[2 * j]
  if amount ~= '0' then
    out[j] = redis.call('INCRBY', k, amount)
    redis.call('PEXPIREAT', k, ARGV[2 * j + 1])
  else
    out[j] = tonumber(redis.call('GET', k) or '0')
  end
end
for i = 2 * np + 2, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then redis.call('DECRBY', KEYS[2], amountOf(ARGV[i])) end
end
out[np + 1] = held(KEYS[1], KEYS[2], now)
return out
`)

// holdKeys are the Redis keys of an account's holds and of their total.
func (f *Shared) holdKeys(id string) (set, total string) {
	t := fleet.Tag("s:", id)
	return f.Key(t, "holds"), f.Key(t, "held")
}

// holdMember is the member of a hold of n under id in an account's holds.
func holdMember(id string, n NanoUSD) string {
	return id + "=" + strconv.FormatInt(int64(n), 10)
}

// holdCall is one hold's part of an admission, prepared, and the budgets
// the script judges it against, in order: what its answer names.
type holdCall struct {
	part    limits.Hold
	periods []Period
}

// prepareHold makes the script's keys and arguments that hold n against
// every budget of a, as member, for ttl.
func (f *Shared) prepareHold(a *Account, now time.Time, n NanoUSD, member string, ttl time.Duration) *limits.Hold {
	set, total := f.holdKeys(a.id)
	c := &holdCall{part: limits.Hold{Member: member, Keys: []string{set, total}}}
	c.part.Of = c
	var budgets []any
	a.mu.Lock()
	a.roll(now)
	keep := a.holdKeysFor(now, ttl)
	for p := range NumPeriods {
		if a.caps[p] > 0 {
			ps := a.periods[p]
			c.periods = append(c.periods, p)
			c.part.Keys = append(c.part.Keys, f.spendKey(a.id, p, ps.start))
			budgets = append(budgets, int64(a.caps[p]), int64(ps.pending))
		}
	}
	a.mu.Unlock()
	c.part.Args = append([]any{member, ttl.Milliseconds(), keep.Milliseconds(), int64(n), len(c.periods)}, budgets...)
	return &c.part
}

// prepareHolds prepares the holds of hs (nil: none), each as a lease of
// this relay's.
func (f *Shared) prepareHolds(now time.Time, hs *Holds) []*limits.Hold {
	if hs == nil {
		return nil
	}
	hcs := make([]*limits.Hold, hs.n)
	for i := range hs.n {
		h := &hs.list[i]
		hcs[i] = f.prepareHold(h.a, now, h.usd, holdMember(f.LeaseID(), h.usd), f.Lease)
	}
	return hcs
}

// heldAnswer is what the admission script's answer on the hold part i,
// which it did not take, says: the budget that did not have room for it.
func heldAnswer(i int, part *limits.Hold) HoldAnswer {
	c := part.Of.(*holdCall)
	v := part.Answer
	ans := HoldAnswer{Verdict: HoldWait, Index: i, Period: c.periods[v[1]-1], Spent: NanoUSD(v[2]), Held: NanoUSD(v[3])}
	if v[0] == 2 {
		ans.Verdict = HoldRefused
	}
	return ans
}

// releaseHold gives back, off the request's path, a hold of a in Redis
// that cost nothing.
func (f *Shared) releaseHold(a *Account, member string) {
	set, total := f.holdKeys(a.id)
	f.limits.DropHoldLease(set, member)
	f.limits.ReleaseHold(set, total, member)
}
