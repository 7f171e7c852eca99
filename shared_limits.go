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

// admitScript admits one request against a thing's limits. KEYS: the
// lease set, the rate's arrival time, the token bucket. ARGV: the lease id,
// max concurrency (0: none), lease ms, rate emission interval in ms (0:
// none), rate burst, tokens per ms (0: none), token burst, the tokens to
// charge (-1: do not hold the request to tokens). It returns {scope, wait,
// requests left, ms until the rate is full again, tokens left, ms until the
// bucket is full again}: scope 0 when admitted, else the limit that refused
// (1 concurrency, 2 rate, 3 tokens) and wait the ms until it may pass (0:
// unknown). What is left counts this request when it was admitted, and is 0
// for a limit the thing does not have; the times are ms from Redis's own
// now, so the relays' clocks need not agree with it.
var admitScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lease, maxc, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local emission, burst = tonumber(ARGV[4]), tonumber(ARGV[5])
local perms, tburst, charge = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
local tat = now
if emission > 0 then
  tat = math.max(tonumber(redis.call('GET', KEYS[2]) or 0), now)
end
local level = 0
if perms > 0 then
  local h = redis.call('HMGET', KEYS[3], 'level', 'last')
  level = tonumber(h[1]) or tburst
  local last = tonumber(h[2]) or now
  if now > last then level = math.min(tburst, level + (now - last) * perms) end
end
local function answer(scope, wait)
  local rleft, rfull, tleft, tfull = 0, 0, 0, 0
  if emission > 0 then
    rleft = math.max(0, math.floor(burst - (tat - now) / emission))
    rfull = math.ceil(tat - now)
  end
  if perms > 0 then
    tleft = math.max(0, math.floor(level))
    tfull = math.max(0, math.ceil((tburst - level) / perms))
  end
  return {scope, wait, rleft, rfull, tleft, tfull}
end
if maxc > 0 then
  redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
  if redis.call('ZCARD', KEYS[1]) >= maxc then return answer(1, 0) end
end
if emission > 0 then
  local allow = tat + emission - burst * emission
  if now < allow then return answer(2, math.ceil(allow - now)) end
end
if perms > 0 and charge >= 0 and level < 1 then
  return answer(3, math.ceil((1 - level) / perms))
end
if maxc > 0 then
  redis.call('ZADD', KEYS[1], now + ttl, lease)
  redis.call('PEXPIRE', KEYS[1], ttl * 2)
end
if emission > 0 then
  tat = tat + emission
  redis.call('SET', KEYS[2], tat, 'PX', math.ceil(tat - now) + 1000)
end
if perms > 0 and charge >= 0 then
  level = level - charge
  redis.call('HSET', KEYS[3], 'level', level, 'last', now)
  redis.call('PEXPIRE', KEYS[3], math.ceil(tburst / perms) + 60000)
end
return answer(0, 0)
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
redis.call('PEXPIRE', KEYS[1], tonumber(ARGV[1]) * 2)
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
// tokens when estimate >= 0. With err set, Redis did not answer. Admitted
// or refused, g.left is what the limits have left, as of now.
func (s *sharedLimit) admit(now time.Time, spec limits, estimate int64) (g grant, scope limitScope, wait time.Duration, err error) {
	f := s.f
	g.store = s
	if spec.concurrency > 0 {
		g.lease = f.leaseID()
	}
	var emission, perMs float64
	if spec.rate.n > 0 {
		emission = float64(spec.rate.period.Milliseconds()) / spec.rate.n
	}
	if spec.tokens.n > 0 && estimate >= 0 {
		perMs = spec.tokens.n / float64(spec.tokens.period.Milliseconds())
		g.tokens, g.charged = true, estimate
	} else {
		estimate = -1
	}
	var res []int64
	err = f.do("admit", func(ctx context.Context) error {
		var e error
		res, e = admitScript.Run(ctx, f.client, []string{s.lease, s.rate, s.bkt},
			g.lease, spec.concurrency, f.lease.Milliseconds(), emission, math.Ceil(spec.rate.n), perMs, spec.tokens.n, estimate).Int64Slice()
		return e
	})
	if err != nil {
		return grant{}, scopeNone, 0, err
	}
	if len(res) != 6 || res[0] < 0 || res[0] >= int64(len(scriptScopes)) {
		return grant{}, scopeNone, 0, errStorageDown
	}
	left := headroom{known: true,
		requests: res[2], requestsFull: now.Add(time.Duration(res[3]) * time.Millisecond),
		tokens: res[4], tokensFull: now.Add(time.Duration(res[5]) * time.Millisecond)}
	if scope = scriptScopes[res[0]]; scope != scopeNone {
		return grant{left: left}, scope, time.Duration(res[1]) * time.Millisecond, nil
	}
	g.left = left
	if g.lease != "" {
		f.hold(leaseRef{s.lease, g.lease})
	}
	return g, scopeNone, 0, nil
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
		s.f.drop(leaseRef{s.lease, r.lease})
	}
	if r.lease != "" || r.tokens != 0 {
		s.queue(r)
	}
}

// queue hands r to the worker that gives back to Redis. It never waits for
// Redis: when the worker is behind by a full queue, r is sent on the
// caller's time, within the timeout.
func (s *sharedLimit) queue(r release) {
	select {
	case s.f.releases <- r:
	default:
		s.f.flush([]release{r})
	}
}

// release is what one request gives back.
type release struct {
	limit  *sharedLimit
	lease  string
	tokens int64 // correction, charged (negative: given back)
	perMs  float64
	burst  float64
}

// hold records a lease this node renews until it is given back.
func (f *fleet) hold(l leaseRef) {
	f.leaseMu.Lock()
	f.leases[l] = struct{}{}
	f.leaseMu.Unlock()
}

// drop stops renewing a lease.
func (f *fleet) drop(l leaseRef) {
	f.leaseMu.Lock()
	delete(f.leases, l)
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

// renew moves the expiry of every lease this node holds.
func (f *fleet) renew() {
	bySet := map[string][]any{}
	f.leaseMu.Lock()
	for l := range f.leases {
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
