package relay

import (
	"context"
	"strconv"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
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
func (f *member) holdKeys(id string) (set, total string) {
	t := tag("s:", id)
	return f.Key(t, "holds"), f.Key(t, "held")
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
func (f *member) prepareHold(a *spendAccount, now time.Time, n nanoUSD, member string, ttl time.Duration) *holdCall {
	set, total := f.holdKeys(a.id)
	c := &holdCall{member: member, keys: []string{set, total}}
	var budgets []any
	a.mu.Lock()
	a.roll(now)
	keep := a.holdKeysFor(now, ttl)
	for p := range numPeriods {
		if a.caps[p] > 0 {
			ps := a.periods[p]
			c.periods = append(c.periods, p)
			c.keys = append(c.keys, f.spendKey(a.id, p, ps.start))
			budgets = append(budgets, int64(a.caps[p]), int64(ps.pending))
		}
	}
	a.mu.Unlock()
	c.args = append([]any{member, ttl.Milliseconds(), keep.Milliseconds(), int64(n), len(c.periods)}, budgets...)
	return c
}

// prepareHolds prepares the holds of hs (nil: none), each as a lease of
// this relay's.
func (f *member) prepareHolds(now time.Time, hs *holds) []*holdCall {
	if hs == nil {
		return nil
	}
	hcs := make([]*holdCall, hs.n)
	for i := range hs.n {
		h := &hs.list[i]
		hcs[i] = f.prepareHold(h.a, now, h.usd, holdMember(f.LeaseID(), h.usd), f.Lease)
	}
	return hcs
}

// readHolds reads the verdicts on holds from the admission script's
// answer (res, the holds' part of it).
func readHolds(res []int64, holds []*holdCall) (holdAnswer, error) {
	var ans holdAnswer
	for i, h := range holds {
		v := res[4*i:]
		if v[0] == 0 {
			continue
		}
		j := int(v[1]) - 1
		if j < 0 || j >= len(h.periods) {
			return holdAnswer{}, fleet.ErrDown // not an answer of this script
		}
		ans = holdAnswer{verdict: holdWait, i: i, period: h.periods[j], spent: nanoUSD(v[2]), held: nanoUSD(v[3])}
		if v[0] == 2 {
			ans.verdict = holdRefused
			break
		}
	}
	return ans, nil
}

// admitAny is admitAll, but in a Redis Cluster, where one script cannot
// touch two things' keys (a key's and its channel's, a key's account and
// its group's), each thing and each hold takes a script of its own, all
// sent in one pipeline (to the nodes that hold their slots, at once); what
// was taken is given back when another refused.
func (f *member) admitAny(now time.Time, calls []*admitCall, hcs []*holdCall) (refused int, scope limitScope, wait time.Duration, ans holdAnswer, err error) {
	if !f.Cluster || len(calls)+len(hcs) < 2 {
		return f.admitAll(now, calls, hcs)
	}
	refused = -1
	cmds := make([]*redis.Cmd, len(calls)+len(hcs))
	asked := len(hcs) > 0
	for _, c := range calls {
		asked = asked || c.redis
	}
	if asked {
		err = f.Do("admit", func(ctx context.Context) error {
			_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
				for i, c := range calls {
					if c.redis {
						c.sent = true
						cmds[i] = admitScript.Eval(ctx, pipe, c.keys, append([]any{1, 0}, c.args...)...)
					}
				}
				for i, h := range hcs {
					cmds[len(calls)+i] = admitScript.Eval(ctx, pipe, h.keys, append([]any{0, 0}, h.args...)...)
				}
				return nil
			})
			return err
		})
	}
	failed := false
	type answer struct {
		left     headroom
		got      taken
		admitted bool
		lost     bool // its answer did not come
	}
	got := make([]answer, len(calls))
	for i, c := range calls {
		if !c.redis {
			got[i].admitted = true
			continue
		}
		res, e := cmds[i].Int64Slice()
		if e != nil || len(res) != admitAnswer {
			failed, got[i].lost = true, true
			continue
		}
		left, s, w, taken := c.read(now, res)
		got[i] = answer{left: left, got: taken, admitted: s == scopeNone}
		if s != scopeNone && refused < 0 {
			refused, scope, wait = i, s, w
		}
	}
	taken := make([]bool, len(hcs))
	for i := range hcs {
		res, e := cmds[len(calls)+i].Int64Slice()
		if e != nil || len(res) != 4 {
			failed = true
			continue
		}
		a, e := readHolds(res, hcs[i:i+1])
		switch {
		case e != nil:
			failed = true
		case a.verdict == holdTaken:
			taken[i] = true
		case ans.verdict == holdTaken || a.verdict == holdRefused && ans.verdict != holdRefused:
			ans, ans.i = a, i
		}
	}
	if !failed && refused < 0 && ans.verdict == holdTaken {
		for i, c := range calls {
			c.g = c.granted(now, got[i].left, got[i].got)
		}
		return -1, scopeNone, 0, ans, nil
	}
	// not admitted: what the others took goes back
	for i, c := range calls {
		if c.redis && got[i].admitted {
			g := c.granted(now, got[i].left, got[i].got)
			c.s.giveBack(c.spec, g, -g.charged)
			c.g = grant{left: g.left}
			continue
		}
		var lost []string
		if got[i].lost {
			lost = c.lostBlock()
		}
		c.down = got[i].lost
		c.undo()
		f.releaseSlots(c.s, lost)
		c.g = grant{left: c.refusedLeft(got[i].left)}
	}
	for i, h := range hcs {
		if taken[i] {
			f.queueRelease(release{holdSet: h.keys[0], holdTotal: h.keys[1], member: h.member})
		}
	}
	if failed {
		return -1, scopeNone, 0, holdAnswer{}, fleet.ErrDown
	}
	return refused, scope, wait, ans, nil
}

// admitHolds takes holds alone (a batch's), as admitAny does.
func (f *member) admitHolds(now time.Time, calls []*admitCall, hcs []*holdCall) ([]headroom, int, limitScope, time.Duration, holdAnswer, error) {
	refused, scope, wait, ans, err := f.admitAny(now, calls, hcs)
	return nil, refused, scope, wait, ans, err
}

// takeAll is takeAll (limiter.go) for a request whose limits f keeps
// (some of them) and whose holds it keeps (hs; nil: none): the limits f
// keeps go in one script with the holds (in a Redis Cluster, one pipeline
// of a script each), and only when this node's blocks do not serve them
// all; the others are taken first, on their own. While Redis does not
// answer, the holds are taken on this relay, with the limits, as the
// limits are (or, on_error deny, refused).
func (f *member) takeAll(now time.Time, asks []ask, hs *holds) (refused int, scope limitScope, wait time.Duration, ans holdAnswer) {
	var inScript [4]bool
	for i := range asks {
		if l := asks[i].l; l != nil {
			if s := l.shared.Load(); s != nil && s.f == f {
				inScript[i] = true
			}
		}
	}
	isIn := func(i int) bool { return inScript[i] }
	if i, scope, wait := inTurn(now, asks, isIn, (*limiter).take); i >= 0 {
		return i, scope, wait, ans
	}
	undo := func() { // what was taken outside the script
		giveBackAsks(now, asks, isIn)
	}
	if hs != nil { // a group's share of a channel cap's room, as this relay sees it
		if ans = hs.shares(now); ans.verdict != holdTaken {
			return -1, scopeNone, 0, ans
		}
	}
	var calls [4]*admitCall
	var which [4]int
	var hcs []*holdCall
	r, rscope, rwait, hans := -1, scopeNone, time.Duration(0), holdAnswer{}
	n, err := f.prepareAll(&now, asks, isIn, &calls, &which)
	if err == nil {
		hcs = f.prepareHolds(now, hs)
		r, rscope, rwait, hans, err = f.admitAny(now, calls[:n], hcs)
	}
	switch {
	case err != nil && f.Deny:
		undo()
		return 0, scopeFleetDown, 0, holdAnswer{}
	case err != nil: // Redis is down: this relay's own holds and limits meanwhile
		if hs != nil {
			if ans = hs.reserve(now); ans.verdict != holdTaken {
				undo()
				return -1, scopeNone, 0, ans
			}
		}
		notIn := func(i int) bool { return !inScript[i] }
		if i, scope, wait := inTurn(now, asks, notIn, (*limiter).takeLocal); i >= 0 {
			if hs != nil {
				hs.unreserve()
			}
			undo()
			return i, scope, wait, holdAnswer{}
		}
		return -1, scopeNone, 0, holdAnswer{}
	case hans.verdict != holdTaken:
		undo()
		return -1, scopeNone, 0, hans
	case r >= 0:
		undo()
		i := which[r]
		a := &asks[i]
		a.g, _, _, _ = a.l.settle(now, calls[r].s, calls[r].g, rscope, rwait, nil)
		return i, rscope, rwait, holdAnswer{}
	}
	for k := range n {
		a := &asks[which[k]]
		a.g, _, _, _ = a.l.settle(now, calls[k].s, calls[k].g, scopeNone, 0, nil)
	}
	if hs != nil {
		for i := range hs.n {
			h := &hs.list[i]
			h.lease = hcs[i].member
			h.a.holdsHere(h.usd, h.group)
			f.hold(leaseRef{hcs[i].keys[0], h.lease}, true)
		}
	}
	return -1, scopeNone, 0, holdAnswer{}
}

// releaseHold gives back, off the request's path, a hold of a in Redis
// that cost nothing.
func (f *member) releaseHold(a *spendAccount, member string) {
	set, total := f.holdKeys(a.id)
	f.drop(leaseRef{set, member}, true)
	f.queueRelease(release{holdSet: set, holdTotal: total, member: member})
}
