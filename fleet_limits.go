package relay

import (
	"context"
	"math"
	"strings"
	"sync"
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
// several at once (a request's key, end user and channel), and holds its
// worst case against the budgets of its spend accounts (holdsLua): all are
// checked before any is written, so a request one of them refuses takes
// nothing from the others. ARGV[1] is the number of things, ARGV[2] the
// time the keys of holds are kept (ms), ARGV[3] the number of slots given
// back with the call (r, slots other requests of this relay freed: the
// call carries them rather than the worker that gives back). KEYS: first
// the r slots' lease sets, their ids the next r of ARGV; removed before
// anything is counted. Then, three per thing: the lease
// set, the rate's arrival time, the token bucket; then per hold: the
// account's holds, its held total, and one spend total per budget. ARGV,
// twelve per thing: the lease id, max concurrency (0: none), lease ms, rate
// emission interval in ms (0: the rate is not asked), rate burst, the
// requests to take (1: this one; more: a block of up to that many, at least
// one), the requests of an ended block to give back first, tokens per ms
// (0: the tokens are not asked), token burst, the tokens to charge (-1: do
// not hold the request to tokens), the tokens to take (0: charge the
// request; more: a block of up to that many, at least one), the tokens of
// an ended block to give back first (negative: its debt, charged); then
// per hold: its member (<id>=<billionths of a dollar>), its expiry in ms,
// its amount, the number of budgets, and per budget its cap and what this
// relay spent that Redis has not yet added. What is given back is written
// whatever the verdict. It returns, per thing, {scope, wait, requests
// left, ms until the rate is full again, tokens left, ms until the bucket
// is full again, requests taken, tokens taken}: scope 0 for all when
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
var admitScript = redis.NewScript(holdsLua + `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local n, keyttl, r = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 1, r do redis.call('ZREM', KEYS[i], ARGV[3 + i]) end
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
  local k, a = r + (i - 1) * 3, 3 + r + (i - 1) * 12
  local th = {lease = ARGV[a + 1], maxc = tonumber(ARGV[a + 2]), ttl = tonumber(ARGV[a + 3]),
    emission = tonumber(ARGV[a + 4]), burst = tonumber(ARGV[a + 5]),
    rtake = tonumber(ARGV[a + 6]), rret = tonumber(ARGV[a + 7]),
    perms = tonumber(ARGV[a + 8]), tburst = tonumber(ARGV[a + 9]), charge = tonumber(ARGV[a + 10]),
    ttake = tonumber(ARGV[a + 11]), tret = tonumber(ARGV[a + 12]),
    kl = KEYS[k + 1], kr = KEYS[k + 2], kt = KEYS[k + 3], tat = now, level = 0, rgot = 0, tgot = 0}
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
local ki, ai = r + n * 3 + 1, 3 + r + n * 12 + 1
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
    out[#out + 1], out[#out + 2] = th.rgot, th.tgot
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
  keep(h.kz, keyttl)
  keep(h.kh, keyttl)
end
return answers(0, 0, 0)
`)

// admitAnswer is the length of one thing's answer of admitScript.
const admitAnswer = 8

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

// sharedLimit is a key's or a channel's limits as the fleet keeps them,
// and the blocks of them this node holds (fleet_leases.go).
type sharedLimit struct {
	f     *fleet
	thing string // its hash tag's content: k:<key>, c:<channel>, ...
	lease string // the keys of its limits
	rate  string
	bkt   string

	mu   sync.Mutex
	rb   block  // of its request rate
	tb   block  // of its token limit
	gens uint64 // numbers the blocks' lives
	// last is what Redis last said the limits had left, for the requests
	// admitted without asking it
	last headroom
}

func newSharedLimit(f *fleet, thing string) *sharedLimit {
	return &sharedLimit{f: f, thing: thing, lease: f.key(thing, "leases"), rate: f.key(thing, "rate"), bkt: f.key(thing, "tokens")}
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

// admit admits one request under spec, charging estimate tokens when
// estimate >= 0: from this node's blocks when they serve it, else in one
// round trip to Redis. With err set, Redis did not answer.
func (s *sharedLimit) admit(now time.Time, spec limits, estimate int64) (grant, limitScope, time.Duration, error) {
	c := s.prepare(now, spec, estimate)
	_, scope, wait, _, err := s.f.admitAll(now, []*admitCall{c}, nil)
	return c.g, scope, wait, err
}

// admitCall is one thing's part of an admission, prepared: what it takes
// from this node's blocks, and what it asks of Redis.
type admitCall struct {
	s    *sharedLimit
	spec limits // the limits it admits under
	g    grant  // what it grants when admitted
	keys []string
	args []any
	// redis says the call must go to Redis: a concurrency slot, a new
	// block, or a limit that is not leased
	redis bool
	// sent says the call was sent to Redis (what it gives back with it,
	// then, went too, or was lost with the answer)
	sent bool
	// askRate and askTokens say that Redis is asked for the rate and for
	// the tokens (for this request, or for a block)
	askRate, askTokens bool
	rate, tokens       blockUse
	estimate           int64 // tokens charged; -1: not held to tokens
	// what ended blocks left, given back with the call: requests, and
	// tokens (negative: a debt, charged)
	rret, tret float64
}

// blockUse is how an admission uses one of a thing's blocks.
type blockUse struct {
	local bool    // it took took from the block of gen
	gen   uint64  // the block's life
	took  float64 // requests or tokens
	ask   int64   // > 0: it takes a new block of up to ask
	nodes int64   // the relays up ask was sized for
	lease time.Duration
}

// prepare makes the script's keys and arguments that admit one request
// under spec, charging estimate tokens when estimate >= 0. What this
// node's blocks serve is taken from them now (undo puts it back); a spent
// or ended block is ended, and the call takes a new one.
func (s *sharedLimit) prepare(now time.Time, spec limits, estimate int64) *admitCall {
	c := &admitCall{s: s, spec: spec, estimate: -1}
	c.g.store = s
	if spec.concurrency > 0 {
		c.g.lease = s.f.leaseID()
		c.redis = true
	}
	emission, perMs := spec.emission(), 0.0
	if spec.tokens.n > 0 && estimate >= 0 {
		perMs = spec.tokensPerMs()
		c.g.tokens, c.g.charged, c.estimate = true, estimate, estimate
	}
	burst := math.Ceil(spec.rate.n)
	rtake, ttake := int64(1), int64(0)
	s.mu.Lock()
	if emission > 0 {
		b := &s.rb
		switch size := s.f.blockSize(burst, minRateBlock); {
		case size == 0: // not leased: a block still held goes back with the call
			c.rret = max(0, math.Floor(b.end(&s.gens)))
		case b.live(now) && b.left >= 1:
			b.left--
			c.rate = blockUse{local: true, gen: b.gen, took: 1}
			emission = 0 // the rate is not asked
		case b.refilling: // another request is taking the next block: this one asks alone
		default:
			c.rret = max(0, math.Floor(b.end(&s.gens)))
			b.refilling = true
			rtake = size
			c.rate = blockUse{ask: size, nodes: s.f.relaysUp(), lease: s.f.blockLease(spec.rate.period)}
		}
	}
	if perMs > 0 {
		b := &s.tb
		switch size := s.f.blockSize(spec.tokens.n, minTokenBlock); {
		case size == 0:
			c.tret = b.end(&s.gens)
		case b.live(now) && b.left >= 1:
			b.left -= float64(estimate)
			c.tokens = blockUse{local: true, gen: b.gen, took: float64(estimate)}
			c.g.fromBlock = true
			perMs = 0 // the tokens are not asked
		case b.refilling:
		default:
			c.tret = b.end(&s.gens)
			b.refilling = true
			ttake = size
			c.tokens = blockUse{ask: size, nodes: s.f.relaysUp(), lease: s.f.blockLease(spec.tokens.period)}
		}
	}
	s.mu.Unlock()
	c.askRate, c.askTokens = emission > 0, perMs > 0
	if c.tret != 0 && perMs == 0 { // a debt or a rest to give back, the tokens not asked
		perMs = spec.tokensPerMs()
	}
	c.redis = c.redis || emission > 0 || perMs > 0
	if !c.redis {
		return c
	}
	charge := estimate
	if !c.askTokens {
		charge = -1
	}
	if c.rret > 0 && emission == 0 {
		c.rret = 0 // cannot happen: a rate's rest is given back only by a call that asks the rate
	}
	c.keys = []string{s.lease, s.rate, s.bkt}
	c.args = []any{c.g.lease, spec.concurrency, s.f.lease.Milliseconds(), emission, burst, rtake, c.rret,
		perMs, spec.tokens.n, charge, ttake, c.tret}
	return c
}

// undo puts back what the call took from this node's blocks, when the
// request was not admitted; what ended blocks left goes back to Redis
// when the call did not carry it.
func (c *admitCall) undo() {
	s := c.s
	s.mu.Lock()
	if c.rate.local && s.rb.gen == c.rate.gen {
		s.rb.left += c.rate.took
	}
	if c.tokens.local && s.tb.gen == c.tokens.gen {
		s.tb.left += c.tokens.took
	}
	if c.rate.ask > 0 {
		s.rb.refilling = false
	}
	if c.tokens.ask > 0 {
		s.tb.refilling = false
	}
	s.mu.Unlock()
	c.rate, c.tokens = blockUse{}, blockUse{}
	if !c.sent && (c.rret > 0 || c.tret != 0) {
		s.f.queueRelease(blockRelease(s, c.rret, c.spec.emission(), c.tret, c.spec.tokensPerMs(), c.spec.tokens.n))
	}
	c.rret, c.tret = 0, 0
}

// read takes one thing's answer of the script: what is left, the limit
// that refused (none: scopeNone) with its wait, and the blocks taken.
func (c *admitCall) read(now time.Time, res []int64) (left headroom, scope limitScope, wait time.Duration, rgot, tgot int64) {
	left = headroom{known: true,
		requests: res[2], requestsFull: now.Add(time.Duration(res[3]) * time.Millisecond),
		tokens: res[4], tokensFull: now.Add(time.Duration(res[5]) * time.Millisecond)}
	if res[0] < 0 || res[0] >= int64(len(scriptScopes)) {
		return left, scopeConcurrency, 0, 0, 0 // not an answer of this script: refuse, do not guess
	}
	return left, scriptScopes[res[0]], time.Duration(res[1]) * time.Millisecond, res[6], res[7]
}

// leftLocked is what the thing has left as the call knows it (s.mu held):
// what Redis answered (ans) for what it was asked, what it said last for
// the rest; and, when admitted, with what this node's blocks that served
// the request hold.
func (c *admitCall) leftLocked(ans headroom, admitted bool) headroom {
	s := c.s
	if c.askRate {
		s.last.requests, s.last.requestsFull = ans.requests, ans.requestsFull
	}
	if c.askTokens {
		s.last.tokens, s.last.tokensFull = ans.tokens, ans.tokensFull
	}
	s.last.known = s.last.known || c.askRate || c.askTokens
	left := s.last
	left.known = true
	if !admitted {
		return left
	}
	if b := &s.rb; b.held() && (c.rate.local || c.rate.ask > 0) {
		left.requests, left.requestsFull = b.fleetLeft+max(0, int64(b.left)), b.full
	}
	if b := &s.tb; b.held() && (c.tokens.local || c.tokens.ask > 0) {
		left.tokens, left.tokensFull = b.fleetLeft+max(0, int64(b.left)), b.full
	}
	return left
}

// refusedLeft is what a refused call says is left.
func (c *admitCall) refusedLeft(ans headroom) headroom {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	return c.leftLocked(ans, false)
}

// granted is what an admitted request holds: its lease is this node's to
// renew until given back, and the blocks the call took (rgot requests,
// tgot tokens) are this node's to admit from, this request's share taken
// out.
func (c *admitCall) granted(now time.Time, ans headroom, rgot, tgot int64) grant {
	s := c.s
	g := c.g
	installed := false
	s.mu.Lock()
	if c.rate.ask > 0 {
		s.rb.refilling = false
		if rgot > 0 {
			s.gens++
			s.rb = block{gen: s.gens, until: now.Add(c.rate.lease), left: float64(rgot - 1), size: c.rate.ask, nodes: c.rate.nodes,
				per: c.spec.emission(), burst: math.Ceil(c.spec.rate.n), fleetLeft: ans.requests, full: ans.requestsFull}
			installed = true
		}
	}
	if c.tokens.ask > 0 {
		s.tb.refilling = false
		if tgot > 0 {
			s.gens++
			s.tb = block{gen: s.gens, until: now.Add(c.tokens.lease), left: float64(tgot - c.estimate), size: c.tokens.ask, nodes: c.tokens.nodes,
				per: c.spec.tokensPerMs(), burst: c.spec.tokens.n, fleetLeft: ans.tokens, full: ans.tokensFull}
			g.fromBlock = true
			installed = true
		}
	}
	g.left = c.leftLocked(ans, true)
	s.mu.Unlock()
	if installed {
		s.f.leaseBlocks(s)
	}
	if g.lease != "" {
		s.f.hold(leaseRef{s.lease, g.lease}, false)
	}
	return g
}

// admitAll admits one request against the limits of calls and holds its
// worst case against its accounts' budgets (holds), all or none: in one
// round trip when any of them must ask Redis, in none when this node's
// blocks serve them all. It returns the call that refused (-1: none) with
// its scope and wait, and the verdict on the holds. Each call's g is then
// what it grants (what is left, when refused); a request not admitted
// took nothing.
func (f *fleet) admitAll(now time.Time, calls []*admitCall, holds []*holdCall) (refused int, scope limitScope, wait time.Duration, ans holdAnswer, err error) {
	refused = -1
	var keys []string
	var args []any
	asked := 0
	for _, c := range calls {
		if c.redis {
			asked++
		}
	}
	if asked > 0 || len(holds) > 0 {
		carried := f.takeSlots(maxCarried)
		keys = make([]string, 0, len(carried)+3*asked+4*len(holds))
		args = make([]any, 0, 3+len(carried)+12*asked+8*len(holds))
		args = append(args, asked, holdKeysTTL.Milliseconds(), len(carried))
		for _, l := range carried {
			keys = append(keys, l.set)
		}
		for _, l := range carried {
			args = append(args, l.id)
		}
		for _, c := range calls {
			if c.redis {
				keys = append(keys, c.keys...)
				args = append(args, c.args...)
				c.sent = true
			}
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
		if err == nil && len(res) != admitAnswer*asked+4*len(holds) {
			err = errFleetDown
		}
		if err == nil {
			ans, err = readHolds(res[admitAnswer*asked:], holds)
		}
		if err != nil {
			for _, c := range calls {
				c.undo()
			}
			f.pendSlots(carried...) // removing one twice is harmless
			return -1, scopeNone, 0, holdAnswer{}, err
		}
		lefts := make([]headroom, len(calls))
		gots := make([][2]int64, len(calls))
		i := 0
		for j, c := range calls {
			if !c.redis {
				continue
			}
			left, s, w, rgot, tgot := c.read(now, res[admitAnswer*i:admitAnswer*(i+1)])
			i++
			lefts[j], gots[j] = left, [2]int64{rgot, tgot}
			if s != scopeNone && refused < 0 {
				refused, scope, wait = j, s, w
			}
		}
		if refused >= 0 || ans.verdict != holdTaken {
			for j, c := range calls {
				c.undo()
				c.g = grant{left: c.refusedLeft(lefts[j])}
			}
			return refused, scope, wait, ans, nil
		}
		for j, c := range calls {
			c.g = c.granted(now, lefts[j], gots[j][0], gots[j][1])
		}
		return -1, scopeNone, 0, ans, nil
	}
	for _, c := range calls { // this node's blocks served them all
		c.g = c.granted(now, headroom{}, 0, 0)
	}
	return -1, scopeNone, 0, holdAnswer{}, nil
}

// correct charges n more tokens (negative: gives them back) to a request
// that holds g: to this node's token block when it was charged to one and
// one is held (the block it was charged to, or the one after it: the
// block that ended gave back its rest without this), else to Redis, off
// the request's path (the worker that gives back leases sends it).
func (s *sharedLimit) correct(spec limits, g *grant, n int64) {
	if g.fromBlock && s.chargeBlock(n) {
		return
	}
	s.queue(release{limit: s, tokens: n, perMs: spec.tokensPerMs(), burst: spec.tokens.n})
}

// chargeBlock charges n tokens to this node's token block, when it holds
// one.
func (s *sharedLimit) chargeBlock(n int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.tb.held() {
		return false
	}
	s.tb.left -= float64(n)
	return true
}

// giveBack gives back what a request admitted by the fleet holds: its
// lease, and the correction of its tokens to what it used. Outside a
// Redis Cluster, the lease goes with the next admission this relay sends,
// or with the worker that gives back when none comes soon (pendSlots).
func (s *sharedLimit) giveBack(spec limits, g grant, correction int64) {
	r := release{limit: s, lease: g.lease}
	if correction != 0 && spec.tokens.n > 0 && !(g.fromBlock && s.chargeBlock(correction)) {
		r.tokens, r.perMs, r.burst = correction, spec.tokensPerMs(), spec.tokens.n
	}
	if r.lease != "" {
		l := leaseRef{s.lease, r.lease}
		s.f.drop(l, false)
		if !s.f.cluster {
			s.f.pendSlots(l)
			r.lease = ""
		}
	}
	if r.lease != "" || r.tokens != 0 {
		s.queue(r)
	}
}

// Slots given back with the next admission. At one request at a time, a
// slot freed by one request goes with the next one's admission instead of
// a round trip of its own; the worker gives back what no admission took
// within the fleet's slotDelay (defaultSlotDelay). A slot so given back
// counts a moment longer (at most slotDelay) against its limit on the
// other relays: the safe side.
const (
	defaultSlotDelay = 2 * time.Millisecond
	maxCarried       = 64 // slots one admission carries at most
)

// pendSlots queues slots freed on this relay, to be given back with the
// next admission or by the worker.
func (f *fleet) pendSlots(ls ...leaseRef) {
	if len(ls) == 0 {
		return
	}
	f.slotsMu.Lock()
	f.slots = append(f.slots, ls...)
	f.slotsMu.Unlock()
	select {
	case f.slotsNew <- struct{}{}:
	default:
	}
}

// takeSlots takes at most n of the slots freed and not yet given back.
func (f *fleet) takeSlots(n int) []leaseRef {
	f.slotsMu.Lock()
	defer f.slotsMu.Unlock()
	if len(f.slots) == 0 {
		return nil
	}
	k := min(n, len(f.slots))
	out := append([]leaseRef(nil), f.slots[len(f.slots)-k:]...)
	f.slots = f.slots[:len(f.slots)-k]
	return out
}

// giveBackSlots gives back, slotDelay after they were freed, the slots no
// admission carried, until ctx ends.
func (f *fleet) giveBackSlots(ctx context.Context) {
	t := time.NewTimer(time.Duration(f.slotDelay.Load()))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.slotsNew:
		}
		t.Reset(time.Duration(f.slotDelay.Load()))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		f.flushSlots()
	}
}

// flushSlots gives back every slot freed and not given back yet, in one
// round trip.
func (f *fleet) flushSlots() {
	slots := f.takeSlots(math.MaxInt)
	if len(slots) == 0 {
		return
	}
	_ = f.do("release", func(ctx context.Context) error {
		_, err := f.client.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, l := range slots {
				pipe.ZRem(ctx, l.set, l.id)
			}
			return nil
		})
		return err
	})
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

// release is what one request, or one ended block, gives back.
type release struct {
	limit  *sharedLimit
	lease  string
	tokens int64 // correction, charged (negative: given back)
	perMs  float64
	burst  float64
	// requests are a rate block's, not used, given back at its emission
	// interval (ms)
	requests, emission float64
	// member is a hold that cost nothing, in the account's holds
	// (holdSet) and its total (holdTotal)
	member, holdSet, holdTotal string
}

// blockRelease is the release that gives back what ended blocks of s
// left: requests of its rate's (at emission), tokens of its token
// limit's (at perMs, burst; negative: a debt to charge).
func blockRelease(s *sharedLimit, requests, emission, tokens, perMs, burst float64) release {
	return release{limit: s, requests: max(0, math.Floor(requests)), emission: emission,
		tokens: -int64(math.Round(tokens)), perMs: perMs, burst: burst}
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
				if r.tokens != 0 && r.perMs > 0 {
					chargeScript.Eval(ctx, pipe, []string{r.limit.bkt}, r.perMs, r.burst, r.tokens)
				}
				if r.requests > 0 && r.emission > 0 {
					giveBackRateScript.Eval(ctx, pipe, []string{r.limit.rate}, r.emission, r.requests)
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
