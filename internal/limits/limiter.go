package limits

import (
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"golang.org/x/time/rate"
)

// Rate is a parsed `N/period` limit.
type Rate struct {
	N      float64       // requests or tokens a period; 0: no limit
	Period time.Duration // the period
}

// PerSecond is the rate's refill a second.
func (s Rate) PerSecond() float64 { return s.N / s.Period.Seconds() }

// ParseRate reads `N/period`, period being s, m, h, d or a duration
// such as 10s. An empty string is no limit.
func ParseRate(s string) (Rate, error) {
	if s == "" {
		return Rate{}, nil
	}
	num, per, ok := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(num, 64)
	if !ok || err != nil || n <= 0 || math.IsInf(n, 0) {
		return Rate{}, fmt.Errorf("%q is not a limit such as 600/m", s)
	}
	units := map[string]time.Duration{"s": time.Second, "m": time.Minute, "h": time.Hour, "d": 24 * time.Hour}
	d, known := units[per]
	if !known {
		if d, err = caddy.ParseDuration(per); err != nil || d <= 0 {
			return Rate{}, fmt.Errorf("%q: the period must be s, m, h, d or a duration", s)
		}
	}
	return Rate{N: n, Period: d}, nil
}

// Spec are the resolved `rate`, `tokens` and `concurrency` of a key or a
// channel; zero values mean no limit.
type Spec struct {
	Rate        Rate  // requests a period
	Tokens      Rate  // tokens a period: input, cache writes and output
	Concurrency int64 // requests in flight at once
}

// Parse reads a key's or a channel's rate, tokens and concurrency.
func Parse(rateStr, tokensStr string, concurrency int) (Spec, error) {
	var l Spec
	var err error
	if l.Rate, err = ParseRate(rateStr); err != nil {
		return l, fmt.Errorf("rate: %w", err)
	}
	if l.Tokens, err = ParseRate(tokensStr); err != nil {
		return l, fmt.Errorf("tokens: %w", err)
	}
	if concurrency < 0 {
		return l, fmt.Errorf("concurrency must not be negative")
	}
	l.Concurrency = int64(concurrency)
	return l, nil
}

// Limiter enforces limits. It outlives config reloads (keys and channels
// keep theirs by name), and new limits are pushed into it without losing
// what was already spent.
type Limiter struct {
	mu       sync.Mutex
	spec     Spec
	requests *rate.Limiter // nil: no request rate limit
	tokens   *tokenBucket  // nil: no token limit
	maxConc  atomic.Int64  // 0: no concurrency limit
	inflight atomic.Int64  // this relay's, whoever admitted them

	// shared, when set, is where the limits are kept for the whole fleet;
	// refusedUntil is when the store last said a refused limit lifts, and
	// refusedBy which limit it was (a limitScope's index in scriptScopes)
	shared       atomic.Pointer[sharedLimit]
	refusedUntil atomic.Int64
	refusedBy    atomic.Int32
	// waiting counts the requests that passed this relay's gate of limits
	// the fleet keeps (Enter) and wait to be admitted with their first
	// channel
	waiting atomic.Int64
}

// Share keeps the limits in the fleet f, as thing ("k:" and a key's name,
// "c:" and a channel's), when there are limits to keep (nil f: in this
// relay alone).
func (l *Limiter) Share(f *Shared, thing string) {
	spec := l.Limits()
	if f == nil || spec == (Spec{}) {
		if old := l.shared.Swap(nil); old != nil {
			old.endAllBlocks()
		}
		return
	}
	if cur := l.shared.Load(); cur != nil && cur.f == f {
		return
	}
	if old := l.shared.Swap(newSharedLimit(f, thing)); old != nil {
		old.endAllBlocks()
	}
}

// Configure pushes new limits in, at now.
func (l *Limiter) Configure(spec Spec, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s := l.shared.Load(); s != nil && spec != l.spec {
		s.endAllBlocks() // blocks sized for the old limits go back
	}
	l.maxConc.Store(spec.Concurrency)
	if spec.Rate != l.spec.Rate {
		if spec.Rate.N == 0 {
			l.requests = nil
		} else if l.requests == nil {
			l.requests = rate.NewLimiter(rate.Limit(spec.Rate.PerSecond()), int(math.Ceil(spec.Rate.N)))
		} else {
			l.requests.SetLimitAt(now, rate.Limit(spec.Rate.PerSecond()))
			l.requests.SetBurstAt(now, int(math.Ceil(spec.Rate.N)))
		}
	}
	if spec.Tokens != l.spec.Tokens {
		if spec.Tokens.N == 0 {
			l.tokens = nil
		} else if l.tokens == nil {
			l.tokens = newTokenBucket(spec.Tokens, now)
		} else {
			l.tokens.configure(spec.Tokens, now)
		}
	}
	l.spec = spec
}

// Scope names the limit that refused a request, for the
// relay_rate_limited_total metric and the error message.
type Scope string

// Scopes of the limits.
const (
	ScopeNone        Scope = ""            // none refused
	ScopeRate        Scope = "rate"        // the request rate
	ScopeTokens      Scope = "tokens"      // the token limit
	ScopeConcurrency Scope = "concurrency" // the requests in flight
	ScopeQueue       Scope = "queue"       // the wait in a group's queue ran out
)

// Grant is what a limiter admitted, to give back with Done: where it was
// taken, so that it goes back there.
type Grant struct {
	store *sharedLimit // the fleet's limits that admitted it; nil: this relay's
	lease string       // the store's concurrency slot; "" for none
	// slotGen, when not 0, says its concurrency slot is one of this node's
	// block of the store's slots, of that generation (fleet_slots.go)
	slotGen uint64
	Tokens  bool // it is held to the token limit
	// fromBlock says its tokens were charged to this node's block of the
	// store's token limit: its corrections go to the block held then,
	// whichever it is, as long as one is (fleet_leases.go)
	fromBlock bool
	// Pending says the request passed the gate of limits the fleet keeps
	// (Enter) and is admitted with its first channel; Charged is then the
	// estimate to charge, when Tokens is set
	Pending bool
	Charged int64 // tokens charged so far, corrected by Done
	// Left is what the fleet's store said the limits had left when it
	// admitted (or refused) the request; this relay's own limits are read
	// when asked instead
	Left Headroom
}

// ScopeFleetDown refuses a request because the fleet's store did not answer
// and the storage says on_error deny.
const ScopeFleetDown Scope = "storage"

// Take admits one request and charges it estimate tokens, or says which
// limit refused it and when it may pass (zero when only a release can
// tell, as for concurrency). The token limit refuses while its bucket is
// in debt, whatever the estimate: an estimate of 0 (the body is not read
// yet) only looks, and Charge adds the estimate later. estimate < 0 keeps
// the request out of the token limit. An admitted request must be given
// back with Done.
func (l *Limiter) Take(now time.Time, estimate int64) (Grant, Scope, time.Duration) {
	if s := l.shared.Load(); s != nil {
		g, scope, wait, err := s.admit(now, l.Limits(), estimate)
		if g, scope, wait, ok := l.settle(now, s, g, scope, wait, err); ok {
			return g, scope, wait
		}
		// Redis is down: this relay keeps its own limits meanwhile
	}
	return l.takeLocal(now, estimate)
}

// TakeRate counts one request against the request rate alone, or says
// when the rate allows one more, as Take does. It takes no concurrency
// slot and no tokens, and gives nothing to give back: for a call the relay
// answers at once from its own state (GET /v1/relay/usage), which is to
// cost its caller's rate and no more. In a fleet the rate is the fleet's,
// asked of Redis like a request's (or taken from this relay's block of it).
func (l *Limiter) TakeRate(now time.Time) (Grant, Scope, time.Duration) {
	spec := l.Limits()
	if spec.Rate.N == 0 {
		return Grant{}, ScopeNone, 0
	}
	if s := l.shared.Load(); s != nil {
		g, scope, wait, err := s.admit(now, Spec{Rate: spec.Rate}, -1)
		switch {
		case err == nil && scope == ScopeNone:
			return g, ScopeNone, 0
		case err == nil:
			l.refusedUntil.Store(now.Add(max(wait, sharedBusyHint)).UnixNano())
			l.refusedBy.Store(int32(slices.Index(scriptScopes[:], scope)))
			return Grant{Left: g.Left}, scope, wait
		case s.f.Deny:
			return Grant{}, ScopeFleetDown, 0
		}
		// Redis is down: this relay keeps its own rate meanwhile
	}
	l.mu.Lock()
	requests := l.requests
	l.mu.Unlock()
	if requests == nil {
		return Grant{}, ScopeNone, 0
	}
	res := requests.ReserveN(now, 1)
	if wait := res.DelayFrom(now); !res.OK() || wait > 0 {
		res.CancelAt(now)
		return Grant{}, ScopeRate, max(wait, time.Millisecond)
	}
	return Grant{}, ScopeNone, 0
}

// Enter lets a request in before its body is read: as Take, but limits
// the fleet keeps are only gated here, on what this relay knows without
// asking Redis, and admitted along with the request's first channel in its
// one round trip (the grant is pending until Resolve). The gate refuses
// when this relay alone holds the concurrency limit's worth of the
// limiter's requests (admitted, or past the gate), and while Redis last
// said the rate or the token limit refuses, until when it said they lift.
// A pending grant is given back with Done too.
func (l *Limiter) Enter(now time.Time, estimate int64) (Grant, Scope, time.Duration) {
	s := l.shared.Load()
	if s == nil {
		return l.Take(now, estimate)
	}
	if until := l.refusedUntil.Load(); until > now.UnixNano() {
		if by := scriptScopes[l.refusedBy.Load()]; by == ScopeRate || by == ScopeTokens {
			return Grant{Left: s.lastLeft()}, by, time.Duration(until - now.UnixNano())
		}
	}
	if max := l.maxConc.Load(); max > 0 {
		for {
			cur := l.waiting.Load()
			if cur+l.inflight.Load() >= max {
				return Grant{Left: s.lastLeft()}, ScopeConcurrency, 0
			}
			if l.waiting.CompareAndSwap(cur, cur+1) {
				break
			}
		}
	} else {
		l.waiting.Add(1)
	}
	return Grant{Pending: true, Tokens: estimate >= 0, Charged: max(estimate, 0)}, ScopeNone, 0
}

// Resolve puts g, what the limiter admitted a request that passed its
// gate with, in place of its pending grant.
func (l *Limiter) Resolve(pending *Grant, g Grant) {
	if pending.Pending {
		l.waiting.Add(-1)
	}
	*pending = g
}

// settle takes in what the fleet's store said of an admission; false when
// it did not answer and the relay is to use its own limits meanwhile.
func (l *Limiter) settle(now time.Time, s *sharedLimit, g Grant, scope Scope, wait time.Duration, err error) (Grant, Scope, time.Duration, bool) {
	switch {
	case err == nil && scope == ScopeNone:
		l.inflight.Add(1)
		return g, ScopeNone, 0, true
	case err == nil:
		l.refusedUntil.Store(now.Add(max(wait, sharedBusyHint)).UnixNano())
		for i, sc := range scriptScopes {
			if sc == scope {
				l.refusedBy.Store(int32(i))
			}
		}
		return Grant{Left: g.Left}, scope, wait, true
	case s.f.Deny:
		return Grant{}, ScopeFleetDown, 0, true
	}
	return Grant{}, ScopeNone, 0, false
}

// takeLocal admits one request against this relay's own limits.
func (l *Limiter) takeLocal(now time.Time, estimate int64) (Grant, Scope, time.Duration) {
	if scope, wait := l.takeSlot(now); scope != ScopeNone {
		return Grant{}, scope, wait
	}
	g := Grant{}
	if estimate >= 0 {
		l.mu.Lock()
		tokens := l.tokens
		l.mu.Unlock()
		if tokens != nil {
			if wait := tokens.wait(now); wait > 0 {
				l.inflight.Add(-1)
				return Grant{}, ScopeTokens, wait
			}
			tokens.charge(now, estimate)
			g.Tokens, g.Charged = true, estimate
		}
	}
	return g, ScopeNone, 0
}

// sharedBusyHint is how long a limit the fleet's store refused is taken
// as busy when the store gave no time: the selector looks elsewhere
// meanwhile rather than asking again at once.
const sharedBusyHint = 50 * time.Millisecond

// takeSlot admits one request against this relay's own concurrency and
// request rate limits.
func (l *Limiter) takeSlot(now time.Time) (Scope, time.Duration) {
	if max := l.maxConc.Load(); max > 0 {
		for {
			cur := l.inflight.Load()
			if cur >= max {
				return ScopeConcurrency, 0
			}
			if l.inflight.CompareAndSwap(cur, cur+1) {
				break
			}
		}
	} else {
		l.inflight.Add(1)
	}
	l.mu.Lock()
	requests := l.requests
	l.mu.Unlock()
	if requests != nil {
		res := requests.ReserveN(now, 1)
		if wait := res.DelayFrom(now); !res.OK() || wait > 0 {
			res.CancelAt(now)
			l.inflight.Add(-1)
			return ScopeRate, max(wait, time.Millisecond)
		}
	}
	return ScopeNone, 0
}

// Charge adds n tokens to what an admitted request is charged, as its
// estimate grows once its body is read; it never refuses (Take looked at
// the bucket).
func (l *Limiter) Charge(now time.Time, g *Grant, n int64) {
	if !g.Tokens || n == 0 {
		return
	}
	g.Charged += n
	if g.Pending { // charged when admitted
		return
	}
	if g.store != nil {
		spec := l.Limits()
		g.store.correct(spec, g, n)
		g.Left.charge(spec.Tokens, n)
		return
	}
	l.mu.Lock()
	tokens := l.tokens
	l.mu.Unlock()
	if tokens != nil {
		tokens.charge(now, n)
	}
}

// Settled reports whether the limiter is as a new one would be: nothing in
// flight, its buckets full. Forgetting a settled limiter forgives nothing.
// (In a fleet, the store keeps the rest, and lets it expire.)
func (l *Limiter) Settled(now time.Time) bool {
	if l.inflight.Load() != 0 {
		return false
	}
	l.mu.Lock()
	requests, tokens := l.requests, l.tokens
	l.mu.Unlock()
	if requests != nil && requests.TokensAt(now) < float64(requests.Burst()) {
		return false
	}
	return tokens == nil || tokens.full(now)
}

// Limits is the limiter's spec.
func (l *Limiter) Limits() Spec {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.spec
}

// Busy reports whether Take would refuse now, without taking anything, and
// when the limit should lift (zero when unknown). For a limit the fleet
// keeps, it knows only what the store last refused.
func (l *Limiter) Busy(now time.Time) (bool, time.Time) {
	if l.shared.Load() != nil {
		if u := l.refusedUntil.Load(); u > now.UnixNano() {
			return true, time.Unix(0, u)
		}
		return false, time.Time{}
	}
	if max := l.maxConc.Load(); max > 0 && l.inflight.Load() >= max {
		return true, time.Time{}
	}
	l.mu.Lock()
	requests, tokens := l.requests, l.tokens
	l.mu.Unlock()
	if tokens != nil {
		if wait := tokens.wait(now); wait > 0 {
			return true, now.Add(wait)
		}
	}
	if requests != nil && requests.TokensAt(now) < 1 {
		return true, now.Add(time.Duration((1 - requests.TokensAt(now)) / float64(requests.Limit()) * float64(time.Second)))
	}
	return false, time.Time{}
}

// Remaining is what is left now of the request rate and the token limit,
// for the admin API: nil for a limit that is not set, or that the fleet
// keeps (only the store knows). A token limit in debt has less than
// nothing left.
func (l *Limiter) Remaining(now time.Time) (requests, tokens *int64) {
	if l.shared.Load() != nil {
		return nil, nil
	}
	l.mu.Lock()
	rl, tb := l.requests, l.tokens
	l.mu.Unlock()
	if rl != nil {
		n := int64(math.Floor(rl.TokensAt(now)))
		requests = &n
	}
	if tb != nil {
		n := int64(math.Floor(tb.levelAt(now)))
		tokens = &n
	}
	return requests, tokens
}

// Done gives back a request's concurrency slot and corrects its token
// charge to what it really used (actual), where it was taken.
func (l *Limiter) Done(now time.Time, g Grant, actual int64) {
	if g.Pending { // it passed the gate, and was never admitted
		l.waiting.Add(-1)
		return
	}
	l.inflight.Add(-1)
	correction := int64(0)
	if g.Tokens {
		correction = actual - g.Charged
	}
	if g.store != nil {
		g.store.giveBack(l.Limits(), g, correction)
		return
	}
	l.mu.Lock()
	tokens := l.tokens
	l.mu.Unlock()
	if tokens != nil && correction != 0 {
		tokens.charge(now, correction)
	}
}

// Inflight is the requests this relay has in flight under the limiter's
// limits, whoever admitted them.
func (l *Limiter) Inflight() int64 { return l.inflight.Load() }

// MaxConcurrency is the limiter's concurrency limit (0: none).
func (l *Limiter) MaxConcurrency() int64 { return l.maxConc.Load() }

// InFleet reports whether the fleet keeps the limiter's limits (Share).
func (l *Limiter) InFleet() bool { return l.shared.Load() != nil }

// Destruct implements caddy.Destructor.
func (*Limiter) Destruct() error { return nil }
