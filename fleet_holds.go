package relay

import (
	"context"
	"strconv"
	"time"

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
// Both are kept holdKeysTTL after their last change. Every script that
// reads them first drops the expired members and their amounts.
//
// A hold is taken in admitScript, with the request's other admissions
// after its body. It is given back in settleScript, run by the sync that
// adds the request's cost to the account's spend totals (INCRBY): in one
// script, so that no relay ever reads the fleet's spend without that cost
// and without the hold. Until then its relay renews it.

// holdKeysTTL is how long an account's holds are kept after their last
// change: longer than a batch's hold.
const holdKeysTTL = batchHoldFor + 24*time.Hour

// holdsLua is the Lua the hold scripts share: keep extends a key's expiry
// to at least ttl ms; amountOf is a member's amount; held drops the
// expired members of an account's holds and returns what the others hold
// (counted again from the members should the total have been lost).
const holdsLua = `
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

// settleScript adds what a relay spent to an account's totals and gives
// back the holds of the requests that spent it, at once. KEYS: the
// account's holds, its held total, then one spend total per period. ARGV:
// the number of periods, then per period the billionths to add (0: only
// read) and the total's expiry (Unix ms); then the members to give back.
// It returns each period's total, then what the account holds.
var settleScript = redis.NewScript(holdsLua + `
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

// releaseHoldScript gives back holds that cost nothing (a request that
// was not sent after all). KEYS: the account's holds, its held total.
// ARGV: the members.
var releaseHoldScript = redis.NewScript(holdsLua + `
for i = 1, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then redis.call('DECRBY', KEYS[2], amountOf(ARGV[i])) end
end
return 0
`)

// holdKeys are the Redis keys of an account's holds and of their total.
func (f *fleet) holdKeys(id string) (set, total string) {
	t := tag("s:", id)
	return f.key(t, "holds"), f.key(t, "held")
}

// holdMember is the member of a hold of n under id in an account's holds.
func holdMember(id string, n nanoUSD) string {
	return id + "=" + strconv.FormatInt(int64(n), 10)
}

// holdCall is one hold's part of an admission, prepared.
type holdCall struct {
	member  string
	periods []budgetPeriod // the budgets the script judges, in order
	keys    []string
	args    []any
}

// prepareHold makes the script's keys and arguments that hold n against
// every budget of a, as member, for ttl.
func (f *fleet) prepareHold(a *spendAccount, now time.Time, n nanoUSD, member string, ttl time.Duration) *holdCall {
	set, total := f.holdKeys(a.id)
	c := &holdCall{member: member, keys: []string{set, total}}
	var budgets []any
	a.mu.Lock()
	a.roll(now)
	for p := range numPeriods {
		if a.caps[p] > 0 {
			ps := a.periods[p]
			c.periods = append(c.periods, p)
			c.keys = append(c.keys, f.spendKey(a.id, p, ps.start))
			budgets = append(budgets, int64(a.caps[p]), int64(ps.pending))
		}
	}
	a.mu.Unlock()
	c.args = append([]any{member, ttl.Milliseconds(), int64(n), len(c.periods)}, budgets...)
	return c
}

// admitAll admits one request against the limits of things and holds its
// worst case against its accounts' budgets, in one round trip: all or
// none. It returns what each thing has left, the thing that refused
// (-1: none) with its scope and wait, and the verdict on the holds.
func (f *fleet) admitAll(now time.Time, things []*admitCall, holds []*holdCall) (lefts []headroom, refused int, scope limitScope, wait time.Duration, ans holdAnswer, err error) {
	keys := make([]string, 0, 3*len(things)+4*len(holds))
	args := make([]any, 0, 2+8*len(things)+8*len(holds))
	args = append(args, len(things), holdKeysTTL.Milliseconds())
	for _, c := range things {
		keys = append(keys, c.keys...)
		args = append(args, c.args...)
	}
	for _, h := range holds {
		keys = append(keys, h.keys...)
		args = append(args, h.args...)
	}
	var res []int64
	err = f.do("admit", func(ctx context.Context) error {
		var e error
		res, e = admitScript.Run(ctx, f.client, keys, args...).Int64Slice()
		return e
	})
	if err == nil && len(res) != 6*len(things)+4*len(holds) {
		err = errFleetDown
	}
	if err != nil {
		return nil, -1, scopeNone, 0, holdAnswer{}, err
	}
	base := 6 * len(things)
	for i, h := range holds {
		v := res[base+4*i:]
		if v[0] == 0 {
			continue
		}
		j := int(v[1]) - 1
		if j < 0 || j >= len(h.periods) {
			return nil, -1, scopeNone, 0, holdAnswer{}, errFleetDown // not an answer of this script
		}
		ans = holdAnswer{verdict: holdWait, i: i, period: h.periods[j], spent: nanoUSD(v[2]), held: nanoUSD(v[3])}
		if v[0] == 2 {
			ans.verdict = holdRefused
			break
		}
	}
	refused = -1
	lefts = make([]headroom, len(things))
	for i, c := range things {
		left, s, w := c.read(now, res[6*i:6*i+6])
		lefts[i] = left
		if s != scopeNone && refused < 0 {
			refused, scope, wait = i, s, w
		}
	}
	return lefts, refused, scope, wait, ans, nil
}

// admitHolds is admitAll, but in a Redis Cluster, where one script cannot
// touch two accounts' keys (a key's and its group's), each hold takes a
// script of its own, in order, and those taken are given back when a
// later one is not. (In a cluster, calls is empty: the limits go on their
// own.)
func (f *fleet) admitHolds(now time.Time, calls []*admitCall, hcs []*holdCall) (lefts []headroom, refused int, scope limitScope, wait time.Duration, ans holdAnswer, err error) {
	if !f.cluster || len(hcs) < 2 || len(calls) > 0 {
		return f.admitAll(now, calls, hcs)
	}
	for i := range hcs {
		if _, _, _, _, ans, err = f.admitAll(now, nil, hcs[i:i+1]); err != nil || ans.verdict != holdTaken {
			for _, taken := range hcs[:i] {
				f.queueRelease(release{holdSet: taken.keys[0], holdTotal: taken.keys[1], member: taken.member})
			}
			ans.i = i
			return nil, -1, scopeNone, 0, ans, err
		}
	}
	return nil, -1, scopeNone, 0, holdAnswer{}, nil
}

// takeHeld is takeHeld (hold.go) for holds the fleet keeps: the end
// user's and the channel's limits that f keeps go in one script with the
// holds; the others are taken first, on their own. While Redis does not
// answer, the holds are taken on this relay, with the limits, as the
// limits are (or, on_error deny, refused).
func (f *fleet) takeHeld(now time.Time, user *limiter, ue int64, ch *limiter, ce int64, hs *holds) (gu, gc grant, scope limitScope, wait time.Duration, byUser bool, ans holdAnswer) {
	var su, sc *sharedLimit
	if !f.cluster { // a Redis Cluster runs no script over two things' keys
		if user != nil {
			if s := user.shared.Load(); s != nil && s.f == f {
				su = s
			}
		}
		if s := ch.shared.Load(); s != nil && s.f == f {
			sc = s
		}
	}
	if user != nil && su == nil {
		if gu, scope, wait = user.take(now, ue); scope != scopeNone {
			return grant{}, grant{}, scope, wait, true, ans
		}
	}
	if sc == nil {
		if gc, scope, wait = ch.take(now, ce); scope != scopeNone {
			if user != nil && su == nil {
				user.done(now, gu, 0)
			}
			return grant{}, grant{}, scope, wait, false, ans
		}
	}
	undo := func() { // what was taken outside the script
		if sc == nil {
			ch.done(now, gc, 0)
		}
		if user != nil && su == nil {
			user.done(now, gu, 0)
		}
	}
	var calls []*admitCall
	if su != nil {
		calls = append(calls, su.prepare(user.limits(), ue))
	}
	if sc != nil {
		calls = append(calls, sc.prepare(ch.limits(), ce))
	}
	hcs := make([]*holdCall, hs.n)
	for i := range hs.n {
		h := &hs.list[i]
		hcs[i] = f.prepareHold(h.a, now, h.usd, holdMember(f.leaseID(), h.usd), f.lease)
	}
	lefts, refused, rscope, rwait, hans, err := f.admitHolds(now, calls, hcs)
	switch {
	case err != nil && f.deny:
		undo()
		return grant{}, grant{}, scopeFleetDown, 0, false, holdAnswer{}
	case err != nil: // Redis is down: this relay's own holds and limits meanwhile
		if ans = hs.reserve(now); ans.verdict != holdTaken {
			undo()
			return grant{}, grant{}, scopeNone, 0, false, ans
		}
		if su != nil {
			if gu, scope, wait = user.takeLocal(now, ue); scope != scopeNone {
				hs.unreserve()
				undo()
				return grant{}, grant{}, scope, wait, true, holdAnswer{}
			}
		}
		if sc != nil {
			if gc, scope, wait = ch.takeLocal(now, ce); scope != scopeNone {
				if su != nil {
					user.done(now, gu, 0)
				}
				hs.unreserve()
				undo()
				return grant{}, grant{}, scope, wait, false, holdAnswer{}
			}
		}
		return gu, gc, scopeNone, 0, false, holdAnswer{}
	case hans.verdict != holdTaken:
		undo()
		return grant{}, grant{}, scopeNone, 0, false, hans
	case refused >= 0:
		undo()
		l := ch
		if calls[refused].s == su && su != nil {
			l, byUser = user, true
		}
		l.settle(now, calls[refused].s, grant{left: lefts[refused]}, rscope, rwait, nil)
		return grant{}, grant{}, rscope, rwait, byUser, holdAnswer{}
	}
	i := 0
	if su != nil {
		gu, _, _, _ = user.settle(now, su, calls[i].granted(lefts[i]), scopeNone, 0, nil)
		i++
	}
	if sc != nil {
		gc, _, _, _ = ch.settle(now, sc, calls[i].granted(lefts[i]), scopeNone, 0, nil)
	}
	for i := range hs.n {
		h := &hs.list[i]
		h.lease = hcs[i].member
		h.a.holdsHere(h.usd)
		f.hold(leaseRef{hcs[i].keys[0], h.lease}, true)
	}
	return gu, gc, scopeNone, 0, false, holdAnswer{}
}

// releaseHold gives back, off the request's path, a hold of a in Redis
// that cost nothing.
func (f *fleet) releaseHold(a *spendAccount, member string) {
	set, total := f.holdKeys(a.id)
	f.drop(leaseRef{set, member}, true)
	f.queueRelease(release{holdSet: set, holdTotal: total, member: member})
}
