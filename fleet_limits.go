package relay

import (
	"context"
	"math"
	"strings"
	"time"

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
//     slots within that time.
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

// admitScript admits one request against the limits of one thing, or of
// two at once (a request's end user and its channel), and holds its worst
// case against the budgets of its spend accounts (holdsLua): all are
// checked before any is written, so a request one of them refuses takes
// nothing from the others. ARGV[1] is the number of things, ARGV[2] the
// time the keys of holds are kept (ms). KEYS, three per thing: the lease
// set, the rate's arrival time, the token bucket; then per hold: the
// account's holds, its held total, and one spend total per budget. ARGV,
// eight per thing: the lease id, max concurrency (0: none), lease ms, rate
// emission interval in ms (0: none), rate burst, tokens per ms (0: none),
// token burst, the tokens to charge (-1: do not hold the request to
// tokens); then per hold: its member (<id>=<billionths of a dollar>), its
// expiry in ms, its amount, the number of budgets, and per budget its cap
// and what this relay spent that Redis has not yet added. It returns, per
// thing, {scope, wait, requests left, ms until the rate is full again,
// tokens left, ms until the bucket is full again}: scope 0 for all when
// admitted, else the limit that refused (1 concurrency, 2 rate, 3 tokens)
// on the thing it refused, and wait the ms until it may pass (0: unknown).
// What is left counts this request when it was admitted, and is 0 for a
// limit the thing does not have; the times are ms from Redis's own now, so
// the relays' clocks need not agree with it. Then, per hold, {verdict
// (0 taken, 1 wait for holds in flight, 2 refused: what was spent and the
// hold exceed a budget), the budget's index (1-based), what was spent in
// its period, what the account held}. Holds are judged first: a hold that
// does not fit takes nothing, and neither does anything else.
var admitScript = redis.NewScript(holdsLua + `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, keyttl = tonumber(ARGV[1]), tonumber(ARGV[2])
local things = {}
for i = 1, n do
  local k, a = (i - 1) * 3, (i - 1) * 8 + 2
  local th = {lease = ARGV[a + 1], maxc = tonumber(ARGV[a + 2]), ttl = tonumber(ARGV[a + 3]),
    emission = tonumber(ARGV[a + 4]), burst = tonumber(ARGV[a + 5]),
    perms = tonumber(ARGV[a + 6]), tburst = tonumber(ARGV[a + 7]), charge = tonumber(ARGV[a + 8]),
    kl = KEYS[k + 1], kr = KEYS[k + 2], kt = KEYS[k + 3], tat = now, level = 0}
  if th.emission > 0 then
    th.tat = math.max(tonumber(redis.call('GET', th.kr) or 0), now)
  end
  if th.perms > 0 then
    local h = redis.call('HMGET', th.kt, 'level', 'last')
    th.level = tonumber(h[1]) or th.tburst
    local last = tonumber(h[2]) or now
    if now > last then th.level = math.min(th.tburst, th.level + (now - last) * th.perms) end
  end
  things[i] = th
end
local holds, verdicts = {}, {}
local ki, ai = n * 3 + 1, n * 8 + 3
while ai <= #ARGV do
  local h = {kz = KEYS[ki], kh = KEYS[ki + 1], member = ARGV[ai], ttl = tonumber(ARGV[ai + 1]),
    amount = ARGV[ai + 2], np = tonumber(ARGV[ai + 3]), periods = {}}
  for j = 1, h.np do
    h.periods[j] = {key = KEYS[ki + 1 + j], cap = tonumber(ARGV[ai + 2 + 2 * j]), pending = tonumber(ARGV[ai + 3 + 2 * j])}
  end
  h.held = held(h.kz, h.kh, now)
  holds[#holds + 1] = h
  ki, ai = ki + 2 + h.np, ai + 4 + 2 * h.np
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
    if redis.call('ZCARD', th.kl) >= th.maxc then return answers(i, 1, 0) end
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
    redis.call('ZADD', th.kl, now + th.ttl, th.lease)
    redis.call('PEXPIRE', th.kl, th.ttl * 2)
  end
  if th.emission > 0 then
    th.tat = th.tat + th.emission
    redis.call('SET', th.kr, th.tat, 'PX', math.ceil(th.tat - now) + 1000)
  end
  if th.perms > 0 and th.charge >= 0 then
    th.level = th.level - th.charge
    redis.call('HSET', th.kt, 'level', th.level, 'last', now)
    redis.call('PEXPIRE', th.kt, math.ceil(th.tburst / th.perms) + 60000)
  end
end
for _, h in ipairs(holds) do
  redis.call('ZADD', h.kz, now + h.ttl, h.member)
  redis.call('INCRBY', h.kh, h.amount)
  keep(h.kz, keyttl)
  keep(h.kh, keyttl)
end
return answers(0, 0, 0)
`)

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
// ARGV: the lease ms, then the lease ids.
var renewScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], 'XX', now + tonumber(ARGV[1]), ARGV[i]) end
if redis.call('PTTL', KEYS[1]) < tonumber(ARGV[1]) * 2 then redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2) end
return 0
`)

// sharedLimit is a key's or a channel's limits as the fleet keeps them.
type sharedLimit struct {
	f     *fleet
	lease string // the keys of its limits
	rate  string
	bkt   string
}

func newSharedLimit(f *fleet, thing string) *sharedLimit {
	return &sharedLimit{f: f, lease: f.key(thing, "leases"), rate: f.key(thing, "rate"), bkt: f.key(thing, "tokens")}
}

// tag is the hash tag of a thing: its kind and name, or a digest of the
// name when the name holds a brace, which would end the tag early.
func tag(kind, name string) string {
	if strings.ContainsAny(name, "{}") {
		return kind + digest(name)
	}
	return kind + name
}

// leaseRef is one slot this node holds.
type leaseRef struct{ set, id string }

// scopes of the scripts' answers.
var scriptScopes = [...]limitScope{scopeNone, scopeConcurrency, scopeRate, scopeTokens}

// admit asks Redis to admit one request under spec, charging estimate
// tokens when estimate >= 0. With err set, Redis did not answer.
func (s *sharedLimit) admit(now time.Time, spec limits, estimate int64) (grant, limitScope, time.Duration, error) {
	c := s.prepare(spec, estimate)
	var res []int64
	err := s.f.do("admit", func(ctx context.Context) error {
		var e error
		res, e = admitScript.Run(ctx, s.f.client, c.keys, append([]any{1, holdKeysTTL.Milliseconds()}, c.args...)...).Int64Slice()
		return e
	})
	if err == nil && len(res) != 6 {
		err = errFleetDown
	}
	if err != nil {
		return grant{}, scopeNone, 0, err
	}
	left, scope, wait := c.read(now, res)
	if scope != scopeNone {
		return grant{left: left}, scope, wait, nil
	}
	return c.granted(left), scopeNone, 0, nil
}

// admitPair admits one request against a and b in one round trip, both or
// neither: refused is 1 or 2 for the one that refused, 0 when both
// admitted. With err set, Redis did not answer.
func (f *fleet) admitPair(now time.Time, a, b *admitCall) (ga, gb grant, refused int, scope limitScope, wait time.Duration, err error) {
	var res []int64
	err = f.do("admit", func(ctx context.Context) error {
		var e error
		res, e = admitScript.Run(ctx, f.client, append(a.keys[:3:3], b.keys...), append(append([]any{2, holdKeysTTL.Milliseconds()}, a.args...), b.args...)...).Int64Slice()
		return e
	})
	if err == nil && len(res) != 12 {
		err = errFleetDown
	}
	if err != nil {
		return grant{}, grant{}, 0, scopeNone, 0, err
	}
	leftA, scopeA, waitA := a.read(now, res[:6])
	leftB, scopeB, waitB := b.read(now, res[6:])
	switch {
	case scopeA != scopeNone:
		return grant{left: leftA}, grant{left: leftB}, 1, scopeA, waitA, nil
	case scopeB != scopeNone:
		return grant{left: leftA}, grant{left: leftB}, 2, scopeB, waitB, nil
	}
	return a.granted(leftA), b.granted(leftB), 0, scopeNone, 0, nil
}

// admitCall is one thing's part of an admission, prepared.
type admitCall struct {
	s    *sharedLimit
	g    grant // what it grants when admitted
	keys []string
	args []any
}

// prepare makes the script's keys and arguments that admit one request
// under spec, charging estimate tokens when estimate >= 0.
func (s *sharedLimit) prepare(spec limits, estimate int64) *admitCall {
	c := &admitCall{s: s}
	c.g.store = s
	if spec.concurrency > 0 {
		c.g.lease = s.f.leaseID()
	}
	var emission, perMs float64
	if spec.rate.n > 0 {
		emission = float64(spec.rate.period.Milliseconds()) / spec.rate.n
	}
	if spec.tokens.n > 0 && estimate >= 0 {
		perMs = spec.tokens.n / float64(spec.tokens.period.Milliseconds())
		c.g.tokens, c.g.charged = true, estimate
	} else {
		estimate = -1
	}
	c.keys = []string{s.lease, s.rate, s.bkt}
	c.args = []any{c.g.lease, spec.concurrency, s.f.lease.Milliseconds(), emission, math.Ceil(spec.rate.n), perMs, spec.tokens.n, estimate}
	return c
}

// read takes one thing's answer of the script: what is left, and the
// limit that refused (none: scopeNone) with its wait.
func (c *admitCall) read(now time.Time, res []int64) (headroom, limitScope, time.Duration) {
	left := headroom{known: true,
		requests: res[2], requestsFull: now.Add(time.Duration(res[3]) * time.Millisecond),
		tokens: res[4], tokensFull: now.Add(time.Duration(res[5]) * time.Millisecond)}
	if res[0] < 0 || res[0] >= int64(len(scriptScopes)) {
		return left, scopeConcurrency, 0 // not an answer of this script: refuse, do not guess
	}
	return left, scriptScopes[res[0]], time.Duration(res[1]) * time.Millisecond
}

// granted is what an admitted request holds: its lease is this node's to
// renew until given back.
func (c *admitCall) granted(left headroom) grant {
	g := c.g
	g.left = left
	if g.lease != "" {
		c.s.f.hold(leaseRef{c.s.lease, g.lease}, false)
	}
	return g
}

// correct charges n more tokens (negative: gives them back), off the
// request's path: the worker that gives back leases sends it.
func (s *sharedLimit) correct(spec limits, n int64) {
	s.queue(release{limit: s, tokens: n, perMs: spec.tokens.n / float64(spec.tokens.period.Milliseconds()), burst: spec.tokens.n})
}

// giveBack gives back what a request admitted by Redis holds: its lease,
// and the correction of its tokens to what it used.
func (s *sharedLimit) giveBack(spec limits, lease string, correction int64) {
	r := release{limit: s, lease: lease}
	if correction != 0 && spec.tokens.n > 0 {
		r.tokens, r.perMs, r.burst = correction, spec.tokens.n/float64(spec.tokens.period.Milliseconds()), spec.tokens.n
	}
	if r.lease != "" {
		s.f.drop(leaseRef{s.lease, r.lease}, false)
	}
	if r.lease != "" || r.tokens != 0 {
		s.queue(r)
	}
}

// queue hands r to the worker that gives back to Redis. It never waits for
// Redis: when the worker is behind by a full queue, r is sent on the
// caller's time, within the timeout.
func (s *sharedLimit) queue(r release) { s.f.queueRelease(r) }

// queueRelease hands r to the worker that gives back to Redis, or sends
// it on the caller's time when the worker is behind by a full queue.
func (f *fleet) queueRelease(r release) {
	select {
	case f.releases <- r:
	default:
		f.flush([]release{r})
	}
}

// release is what one request gives back.
type release struct {
	limit  *sharedLimit
	lease  string
	tokens int64 // correction, charged (negative: given back)
	perMs  float64
	burst  float64
	// member is a hold that cost nothing, in the account's holds
	// (holdSet) and its total (holdTotal)
	member, holdSet, holdTotal string
}

// hold records a lease this node renews until it is given back: a
// concurrency slot, or a request's hold of a budget (held).
func (f *fleet) hold(l leaseRef, held bool) {
	f.leaseMu.Lock()
	if held {
		f.holdLeases[l] = struct{}{}
	} else {
		f.leases[l] = struct{}{}
	}
	f.leaseMu.Unlock()
}

// drop stops renewing a lease.
func (f *fleet) drop(l leaseRef, held bool) {
	f.leaseMu.Lock()
	if held {
		delete(f.holdLeases, l)
	} else {
		delete(f.leases, l)
	}
	f.leaseMu.Unlock()
}

// giveBack pipelines the queued releases to Redis, as many at once as have
// queued, until ctx ends.
func (f *fleet) giveBack(ctx context.Context) {
	batch := make([]release, 0, 256)
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-f.releases:
			batch = append(batch[:0], r)
		}
	more:
		for len(batch) < cap(batch) {
			select {
			case r := <-f.releases:
				batch = append(batch, r)
			default:
				break more
			}
		}
		f.flush(batch)
	}
}

// flush gives back a batch in one round trip. What Redis does not take
// expires: a lease within its lease time, a token correction never (the
// bucket is as if the estimate had been right).
func (f *fleet) flush(batch []release) {
	_ = f.do("release", func(ctx context.Context) error {
		_, err := f.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, r := range batch {
				if r.lease != "" {
					pipe.ZRem(ctx, r.limit.lease, r.lease)
				}
				if r.tokens != 0 {
					chargeScript.Eval(ctx, pipe, []string{r.limit.bkt}, r.perMs, r.burst, r.tokens)
				}
				if r.member != "" {
					releaseHoldScript.Eval(ctx, pipe, []string{r.holdSet, r.holdTotal}, r.member)
				}
			}
			return nil
		})
		return err
	})
}

// renewLeases moves the expiry of every lease this node holds, every third
// of the lease time, until ctx ends.
func (f *fleet) renewLeases(ctx context.Context) {
	every(ctx, f.lease/3, nil, f.renew)
}

// renew moves the expiry of every lease this node holds: its concurrency
// slots and its requests' holds.
func (f *fleet) renew() {
	bySet := map[string][]any{}
	f.leaseMu.Lock()
	for l := range f.leases {
		bySet[l.set] = append(bySet[l.set], l.id)
	}
	for l := range f.holdLeases {
		bySet[l.set] = append(bySet[l.set], l.id)
	}
	f.leaseMu.Unlock()
	if len(bySet) == 0 {
		return
	}
	_ = f.do("renew", func(ctx context.Context) error {
		_, err := f.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for set, ids := range bySet {
				renewScript.Eval(ctx, pipe, []string{set}, append([]any{f.lease.Milliseconds()}, ids...)...)
			}
			return nil
		})
		return err
	})
}
