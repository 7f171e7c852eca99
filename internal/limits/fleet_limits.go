package limits

import (
	"context"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
)

// sharedLimit is a key's or a channel's limits as the fleet keeps them,
// and the blocks of them this node holds (fleet_leases.go).
type sharedLimit struct {
	f     *Shared
	thing string // its hash tag's content: k:<key>, c:<channel>, ...
	lease string // the keys of its limits
	rate  string
	bkt   string

	mu   sync.Mutex
	rb   block     // of its request rate
	tb   block     // of its token limit
	cb   slotBlock // of its concurrency limit (fleet_slots.go)
	gens uint64    // numbers the blocks' lives
	// refills counts the blocks a request is taking (fleet_refills.go):
	// while there are none, a request does not look for one to wait on
	refills atomic.Int32
	// last is what Redis last said the limits had left, for the requests
	// admitted without asking it
	last Headroom
}

func newSharedLimit(f *Shared, thing string) *sharedLimit {
	return &sharedLimit{f: f, thing: thing, lease: f.Key(thing, "leases"), rate: f.Key(thing, "rate"), bkt: f.Key(thing, "tokens")}
}

// leaseRef is one slot this node holds.
type leaseRef struct{ set, id string }

// scopes of the scripts' answers.
var scriptScopes = [...]Scope{ScopeNone, ScopeConcurrency, ScopeRate, ScopeTokens}

// admit admits one request under spec, charging estimate tokens when
// estimate >= 0: from this node's blocks when they serve it, else in one
// round trip to Redis. With err set, Redis did not answer.
func (s *sharedLimit) admit(now time.Time, spec Spec, estimate int64) (Grant, Scope, time.Duration, error) {
	c, r := s.prepare(now, spec, estimate, true)
	if r != nil {
		waited := time.Now()
		if s.f.awaitRefill(r) {
			return Grant{}, ScopeNone, 0, fleet.ErrDown
		}
		now = now.Add(time.Since(waited)) // on the caller's clock
		c, _ = s.prepare(now, spec, estimate, false)
	}
	_, scope, wait, _, err := s.f.admitAll(now, []*admitCall{c}, nil)
	return c.g, scope, wait, err
}

// admitCall is one thing's part of an admission, prepared: what it takes
// from this node's blocks, and what it asks of Redis.
type admitCall struct {
	s    *sharedLimit
	spec Spec  // the limits it admits under
	g    Grant // what it grants when admitted
	keys []string
	args []any
	// redis says the call must go to Redis: a concurrency slot, a new
	// block, or a limit that is not leased
	redis bool
	// sent says the call was sent to Redis (what it gives back with it,
	// then, went too, or was lost with the answer); down, that its answer
	// did not come
	sent, down bool
	// askRate and askTokens say that Redis is asked for the rate and for
	// the tokens (for this request, or for a block)
	askRate, askTokens bool
	rate, tokens       blockUse
	slots              slotUse
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
// or ended block is ended, and the call takes a new one. With wait set,
// when another request is taking a block the call would otherwise ask
// Redis beside, prepare takes nothing and returns that refill, to wait
// for (fleet_refills.go).
func (s *sharedLimit) prepare(now time.Time, spec Spec, estimate int64, wait bool) (*admitCall, *refill) {
	c := &admitCall{s: s, spec: spec, estimate: -1}
	c.g.store = s
	var free []string // slots given back
	emission, perMs := spec.emission(), 0.0
	if spec.Tokens.N > 0 && estimate >= 0 {
		perMs = spec.tokensPerMs()
		c.g.Tokens, c.g.Charged, c.estimate = true, estimate, estimate
	}
	burst := math.Ceil(spec.Rate.N)
	rtake, ttake := int64(1), int64(0)
	s.mu.Lock()
	if wait && s.refills.Load() != 0 {
		if r := s.refillLocked(now, spec, estimate); r != nil {
			r.waiters++
			s.mu.Unlock()
			return nil, r
		}
	}
	if spec.Concurrency > 0 {
		free = s.prepareSlots(c, now, spec)
	}
	if emission > 0 {
		b := &s.rb
		switch size := s.f.blockSize(burst, minRateBlock); {
		case size == 0: // not leased: a block still held goes back with the call
			c.rret = max(0, math.Floor(b.end(&s.gens)))
		case b.live(now) && b.left >= 1:
			b.left--
			c.rate = blockUse{local: true, gen: b.gen, took: 1}
			emission = 0 // the rate is not asked
		case b.refill != nil: // another request is taking the next block: this one asks alone
		default:
			c.rret = max(0, math.Floor(b.end(&s.gens)))
			s.startRefill(&b.refill)
			rtake = size
			c.rate = blockUse{ask: size, nodes: s.f.RelaysUp(), lease: s.f.blockLease(spec.Rate.Period)}
		}
	}
	if perMs > 0 {
		b := &s.tb
		switch size := s.f.blockSize(spec.Tokens.N, minTokenBlock); {
		case size == 0:
			c.tret = b.end(&s.gens)
		case b.live(now) && b.left >= 1:
			b.left -= float64(estimate)
			c.tokens = blockUse{local: true, gen: b.gen, took: float64(estimate)}
			c.g.fromBlock = true
			perMs = 0 // the tokens are not asked
		case b.refill != nil:
		default:
			c.tret = b.end(&s.gens)
			s.startRefill(&b.refill)
			ttake = size
			c.tokens = blockUse{ask: size, nodes: s.f.RelaysUp(), lease: s.f.blockLease(spec.Tokens.Period)}
		}
	}
	s.mu.Unlock()
	s.f.releaseSlots(s, free)
	c.askRate, c.askTokens = emission > 0, perMs > 0
	if c.tret != 0 && perMs == 0 { // a debt or a rest to give back, the tokens not asked
		perMs = spec.tokensPerMs()
	}
	c.redis = c.redis || emission > 0 || perMs > 0
	if !c.redis {
		return c, nil
	}
	charge := estimate
	if !c.askTokens {
		charge = -1
	}
	if c.rret > 0 && emission == 0 {
		c.rret = 0 // cannot happen: a rate's rest is given back only by a call that asks the rate
	}
	c.keys = []string{s.lease, s.rate, s.bkt}
	c.args = []any{c.g.lease, spec.Concurrency, s.f.Lease.Milliseconds(), emission, burst, rtake, c.rret,
		perMs, spec.Tokens.N, charge, ttake, c.tret, c.slots.ask}
	if c.slots.gen != 0 {
		c.args[1] = 0 // its slot is held: the concurrency is not asked
	}
	return c, nil
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
		s.endRefill(&s.rb.refill, c.down)
	}
	if c.tokens.ask > 0 {
		s.endRefill(&s.tb.refill, c.down)
	}
	back := c.undoSlots()
	s.mu.Unlock()
	if back != "" {
		s.f.releaseSlots(s, []string{back})
	}
	c.rate, c.tokens = blockUse{}, blockUse{}
	if !c.sent && (c.rret > 0 || c.tret != 0) {
		s.f.queueRelease(blockRelease(s, c.rret, c.spec.emission(), c.tret, c.spec.tokensPerMs(), c.spec.Tokens.N))
	}
	c.rret, c.tret = 0, 0
}

// taken is what blocks an admission took: requests, tokens and slots.
type taken struct{ requests, tokens, slots int64 }

// read takes one thing's answer of the script: what is left, the limit
// that refused (none: ScopeNone) with its wait, and the blocks taken.
func (c *admitCall) read(now time.Time, res []int64) (left Headroom, scope Scope, wait time.Duration, got taken) {
	left = Headroom{Known: true,
		Requests: res[2], RequestsFull: now.Add(time.Duration(res[3]) * time.Millisecond),
		Tokens: res[4], TokensFull: now.Add(time.Duration(res[5]) * time.Millisecond)}
	if res[0] < 0 || res[0] >= int64(len(scriptScopes)) {
		return left, ScopeConcurrency, 0, taken{} // not an answer of this script: refuse, do not guess
	}
	return left, scriptScopes[res[0]], time.Duration(res[1]) * time.Millisecond, taken{res[6], res[7], res[8]}
}

// leftLocked is what the thing has left as the call knows it (s.mu held):
// what Redis answered (ans) for what it was asked, what it said last for
// the rest; and, when admitted, with what this node's blocks that served
// the request hold.
func (c *admitCall) leftLocked(ans Headroom, admitted bool) Headroom {
	s := c.s
	if c.askRate {
		s.last.Requests, s.last.RequestsFull = ans.Requests, ans.RequestsFull
	}
	if c.askTokens {
		s.last.Tokens, s.last.TokensFull = ans.Tokens, ans.TokensFull
	}
	s.last.Known = s.last.Known || c.askRate || c.askTokens
	left := s.last
	left.Known = true
	if !admitted {
		return left
	}
	if b := &s.rb; b.held() && (c.rate.local || c.rate.ask > 0) {
		left.Requests, left.RequestsFull = b.fleetLeft+max(0, int64(b.left)), b.full
	}
	if b := &s.tb; b.held() && (c.tokens.local || c.tokens.ask > 0) {
		left.Tokens, left.TokensFull = b.fleetLeft+max(0, int64(b.left)), b.full
	}
	return left
}

// refusedLeft is what a refused call says is left.
func (c *admitCall) refusedLeft(ans Headroom) Headroom {
	c.s.mu.Lock()
	defer c.s.mu.Unlock()
	return c.leftLocked(ans, false)
}

// granted is what an admitted request holds: its lease is this node's to
// renew until given back, and the blocks the call took (got) are this
// node's to admit from, this request's share taken out.
func (c *admitCall) granted(now time.Time, ans Headroom, got taken) Grant {
	s := c.s
	g := c.g
	rgot, tgot := got.requests, got.tokens
	s.mu.Lock()
	slots := c.grantSlots(now, &g, got.slots)
	installed := len(slots) > 0
	if c.rate.ask > 0 {
		s.endRefill(&s.rb.refill, false)
		if rgot > 0 {
			s.gens++
			s.rb = block{gen: s.gens, until: now.Add(c.rate.lease), left: float64(rgot - 1), size: c.rate.ask, nodes: c.rate.nodes,
				per: c.spec.emission(), burst: math.Ceil(c.spec.Rate.N), fleetLeft: ans.Requests, full: ans.RequestsFull}
			installed = true
		}
	}
	if c.tokens.ask > 0 {
		s.endRefill(&s.tb.refill, false)
		if tgot > 0 {
			s.gens++
			s.tb = block{gen: s.gens, until: now.Add(c.tokens.lease), left: float64(tgot - c.estimate), size: c.tokens.ask, nodes: c.tokens.nodes,
				per: c.spec.tokensPerMs(), burst: c.spec.Tokens.N, fleetLeft: ans.Tokens, full: ans.TokensFull}
			g.fromBlock = true
			installed = true
		}
	}
	g.Left = c.leftLocked(ans, true)
	s.mu.Unlock()
	if installed {
		s.f.holdSlots(s, slots)
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
// its scope and wait, and the hold not taken (-1: none; its answer says
// why). Each call's g is then what it grants (what is left, when
// refused); a request not admitted took nothing.
func (f *Shared) admitAll(now time.Time, calls []*admitCall, holds []*Hold) (refused int, scope Scope, wait time.Duration, notHeld int, err error) {
	refused, notHeld = -1, -1
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
		args = make([]any, 0, 2+len(carried)+12*asked+9*len(holds))
		args = append(args, asked, len(carried))
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
			keys = append(keys, h.Keys...)
			args = append(args, h.Args...)
		}
		var res []int64
		err = f.Do("admit", func(ctx context.Context) error {
			var e error
			res, e = fleet.AdmitScript.Run(ctx, f.Redis, keys, args...).Int64Slice()
			return e
		})
		if err == nil && len(res) != fleet.AdmitAnswer*asked+4*len(holds) {
			err = fleet.ErrDown
		}
		if err == nil {
			notHeld, err = readHolds(res[fleet.AdmitAnswer*asked:], holds)
		}
		if err != nil {
			for _, c := range calls {
				var lost []string
				if c.sent {
					lost = c.lostBlock()
				}
				c.down = true
				c.undo()
				f.releaseSlots(c.s, lost)
			}
			f.pendSlots(carried...) // removing one twice is harmless
			return -1, ScopeNone, 0, -1, err
		}
		lefts := make([]Headroom, len(calls))
		gots := make([]taken, len(calls))
		i := 0
		for j, c := range calls {
			if !c.redis {
				continue
			}
			left, s, w, got := c.read(now, res[fleet.AdmitAnswer*i:fleet.AdmitAnswer*(i+1)])
			i++
			lefts[j], gots[j] = left, got
			if s != ScopeNone && refused < 0 {
				refused, scope, wait = j, s, w
			}
		}
		if refused >= 0 || notHeld >= 0 {
			for j, c := range calls {
				c.undo()
				c.g = Grant{Left: c.refusedLeft(lefts[j])}
			}
			return refused, scope, wait, notHeld, nil
		}
		for j, c := range calls {
			c.g = c.granted(now, lefts[j], gots[j])
		}
		return -1, ScopeNone, 0, -1, nil
	}
	for _, c := range calls { // this node's blocks served them all
		c.g = c.granted(now, Headroom{}, taken{})
	}
	return -1, ScopeNone, 0, -1, nil
}
