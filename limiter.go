package relay

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

// rateSpec is a parsed `N/period` limit.
type rateSpec struct {
	n      float64
	period time.Duration
}

func (s rateSpec) perSecond() float64 { return s.n / s.period.Seconds() }

// parseRateSpec reads `N/period`, period being s, m, h, d or a duration
// such as 10s. An empty string is no limit.
func parseRateSpec(s string) (rateSpec, error) {
	if s == "" {
		return rateSpec{}, nil
	}
	num, per, ok := strings.Cut(s, "/")
	n, err := strconv.ParseFloat(num, 64)
	if !ok || err != nil || n <= 0 || math.IsInf(n, 0) {
		return rateSpec{}, fmt.Errorf("%q is not a limit such as 600/m", s)
	}
	units := map[string]time.Duration{"s": time.Second, "m": time.Minute, "h": time.Hour, "d": 24 * time.Hour}
	d, known := units[per]
	if !known {
		if d, err = caddy.ParseDuration(per); err != nil || d <= 0 {
			return rateSpec{}, fmt.Errorf("%q: the period must be s, m, h, d or a duration", s)
		}
	}
	return rateSpec{n: n, period: d}, nil
}

// limits are the resolved `rate`, `tokens` and `concurrency` of a key or a
// channel; zero values mean no limit.
type limits struct {
	rate        rateSpec
	tokens      rateSpec
	concurrency int64
}

func parseLimits(rateStr, tokensStr string, concurrency int) (limits, error) {
	var l limits
	var err error
	if l.rate, err = parseRateSpec(rateStr); err != nil {
		return l, fmt.Errorf("rate: %w", err)
	}
	if l.tokens, err = parseRateSpec(tokensStr); err != nil {
		return l, fmt.Errorf("tokens: %w", err)
	}
	if concurrency < 0 {
		return l, fmt.Errorf("concurrency must not be negative")
	}
	l.concurrency = int64(concurrency)
	return l, nil
}

// limiter enforces limits. It outlives config reloads (keys and channels
// keep theirs by name), and new limits are pushed into it without losing
// what was already spent.
type limiter struct {
	mu       sync.Mutex
	spec     limits
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
	// the fleet keeps (enter) and wait to be admitted with their first
	// channel
	waiting atomic.Int64
}

// share keeps the limits in the fleet f, as thing ("k:" and a key's name,
// "c:" and a channel's), when there are limits to keep (nil f: in this
// relay alone).
func (l *limiter) share(f *limitsShared, thing string) {
	spec := l.limits()
	if f == nil || spec == (limits{}) {
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

// configure pushes new limits in, at now.
func (l *limiter) configure(spec limits, now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if s := l.shared.Load(); s != nil && spec != l.spec {
		s.endAllBlocks() // blocks sized for the old limits go back
	}
	l.maxConc.Store(spec.concurrency)
	if spec.rate != l.spec.rate {
		if spec.rate.n == 0 {
			l.requests = nil
		} else if l.requests == nil {
			l.requests = rate.NewLimiter(rate.Limit(spec.rate.perSecond()), int(math.Ceil(spec.rate.n)))
		} else {
			l.requests.SetLimitAt(now, rate.Limit(spec.rate.perSecond()))
			l.requests.SetBurstAt(now, int(math.Ceil(spec.rate.n)))
		}
	}
	if spec.tokens != l.spec.tokens {
		if spec.tokens.n == 0 {
			l.tokens = nil
		} else if l.tokens == nil {
			l.tokens = newTokenBucket(spec.tokens, now)
		} else {
			l.tokens.configure(spec.tokens, now)
		}
	}
	l.spec = spec
}

// limitScope names the limit that refused a request, for the
// relay_rate_limited_total metric and the error message.
type limitScope string

const (
	scopeNone        limitScope = ""
	scopeRate        limitScope = "rate"
	scopeTokens      limitScope = "tokens"
	scopeConcurrency limitScope = "concurrency"
	scopeQueue       limitScope = "queue"
)

// grant is what a limiter admitted, to give back with done: where it was
// taken, so that it goes back there.
type grant struct {
	store *sharedLimit // the fleet's limits that admitted it; nil: this relay's
	lease string       // the store's concurrency slot; "" for none
	// slotGen, when not 0, says its concurrency slot is one of this node's
	// block of the store's slots, of that generation (fleet_slots.go)
	slotGen uint64
	tokens  bool // it is held to the token limit
	// fromBlock says its tokens were charged to this node's block of the
	// store's token limit: its corrections go to the block held then,
	// whichever it is, as long as one is (fleet_leases.go)
	fromBlock bool
	// pending says the request passed the gate of limits the fleet keeps
	// (enter) and is admitted with its first channel; charged is then the
	// estimate to charge, when tokens is set
	pending bool
	charged int64 // tokens charged so far, corrected by done
	// left is what the fleet's store said the limits had left when it
	// admitted (or refused) the request; this relay's own limits are read
	// when asked instead
	left headroom
}

// scopeFleetDown refuses a request because the fleet's store did not answer
// and the storage says on_error deny.
const scopeFleetDown limitScope = "storage"

// take admits one request and charges it estimate tokens, or says which
// limit refused it and when it may pass (zero when only a release can
// tell, as for concurrency). The token limit refuses while its bucket is
// in debt, whatever the estimate: an estimate of 0 (the body is not read
// yet) only looks, and charge adds the estimate later. estimate < 0 keeps
// the request out of the token limit. An admitted request must be given
// back with done.
func (l *limiter) take(now time.Time, estimate int64) (grant, limitScope, time.Duration) {
	if s := l.shared.Load(); s != nil {
		g, scope, wait, err := s.admit(now, l.limits(), estimate)
		if g, scope, wait, ok := l.settle(now, s, g, scope, wait, err); ok {
			return g, scope, wait
		}
		// Redis is down: this relay keeps its own limits meanwhile
	}
	return l.takeLocal(now, estimate)
}

// takeRate counts one request against the request rate alone, or says
// when the rate allows one more, as take does. It takes no concurrency
// slot and no tokens, and gives nothing to give back: for a call the relay
// answers at once from its own state (GET /v1/relay/usage), which is to
// cost its caller's rate and no more. In a fleet the rate is the fleet's,
// asked of Redis like a request's (or taken from this relay's block of it).
func (l *limiter) takeRate(now time.Time) (grant, limitScope, time.Duration) {
	spec := l.limits()
	if spec.rate.n == 0 {
		return grant{}, scopeNone, 0
	}
	if s := l.shared.Load(); s != nil {
		g, scope, wait, err := s.admit(now, limits{rate: spec.rate}, -1)
		switch {
		case err == nil && scope == scopeNone:
			return g, scopeNone, 0
		case err == nil:
			l.refusedUntil.Store(now.Add(max(wait, sharedBusyHint)).UnixNano())
			l.refusedBy.Store(int32(slices.Index(scriptScopes[:], scope)))
			return grant{left: g.left}, scope, wait
		case s.f.Deny:
			return grant{}, scopeFleetDown, 0
		}
		// Redis is down: this relay keeps its own rate meanwhile
	}
	l.mu.Lock()
	requests := l.requests
	l.mu.Unlock()
	if requests == nil {
		return grant{}, scopeNone, 0
	}
	res := requests.ReserveN(now, 1)
	if wait := res.DelayFrom(now); !res.OK() || wait > 0 {
		res.CancelAt(now)
		return grant{}, scopeRate, max(wait, time.Millisecond)
	}
	return grant{}, scopeNone, 0
}

// enter lets a request in before its body is read: as take, but limits
// the fleet keeps are only gated here, on what this relay knows without
// asking Redis, and admitted along with the request's first channel in its
// one round trip (the grant is pending until resolve). The gate refuses
// when this relay alone holds the concurrency limit's worth of the
// limiter's requests (admitted, or past the gate), and while Redis last
// said the rate or the token limit refuses, until when it said they lift.
// A pending grant is given back with done too.
func (l *limiter) enter(now time.Time, estimate int64) (grant, limitScope, time.Duration) {
	s := l.shared.Load()
	if s == nil {
		return l.take(now, estimate)
	}
	if until := l.refusedUntil.Load(); until > now.UnixNano() {
		if by := scriptScopes[l.refusedBy.Load()]; by == scopeRate || by == scopeTokens {
			return grant{left: s.lastLeft()}, by, time.Duration(until - now.UnixNano())
		}
	}
	if max := l.maxConc.Load(); max > 0 {
		for {
			cur := l.waiting.Load()
			if cur+l.inflight.Load() >= max {
				return grant{left: s.lastLeft()}, scopeConcurrency, 0
			}
			if l.waiting.CompareAndSwap(cur, cur+1) {
				break
			}
		}
	} else {
		l.waiting.Add(1)
	}
	return grant{pending: true, tokens: estimate >= 0, charged: max(estimate, 0)}, scopeNone, 0
}

// resolve puts g, what the limiter admitted a request that passed its
// gate with, in place of its pending grant.
func (l *limiter) resolve(pending *grant, g grant) {
	if pending.pending {
		l.waiting.Add(-1)
	}
	*pending = g
}

// settle takes in what the fleet's store said of an admission; false when
// it did not answer and the relay is to use its own limits meanwhile.
func (l *limiter) settle(now time.Time, s *sharedLimit, g grant, scope limitScope, wait time.Duration, err error) (grant, limitScope, time.Duration, bool) {
	switch {
	case err == nil && scope == scopeNone:
		l.inflight.Add(1)
		return g, scopeNone, 0, true
	case err == nil:
		l.refusedUntil.Store(now.Add(max(wait, sharedBusyHint)).UnixNano())
		for i, sc := range scriptScopes {
			if sc == scope {
				l.refusedBy.Store(int32(i))
			}
		}
		return grant{left: g.left}, scope, wait, true
	case s.f.Deny:
		return grant{}, scopeFleetDown, 0, true
	}
	return grant{}, scopeNone, 0, false
}

// takeLocal admits one request against this relay's own limits.
func (l *limiter) takeLocal(now time.Time, estimate int64) (grant, limitScope, time.Duration) {
	if scope, wait := l.takeSlot(now); scope != scopeNone {
		return grant{}, scope, wait
	}
	g := grant{}
	if estimate >= 0 {
		l.mu.Lock()
		tokens := l.tokens
		l.mu.Unlock()
		if tokens != nil {
			if wait := tokens.wait(now); wait > 0 {
				l.inflight.Add(-1)
				return grant{}, scopeTokens, wait
			}
			tokens.charge(now, estimate)
			g.tokens, g.charged = true, estimate
		}
	}
	return g, scopeNone, 0
}

// sharedBusyHint is how long a limit the fleet's store refused is taken
// as busy when the store gave no time: the selector looks elsewhere
// meanwhile rather than asking again at once.
const sharedBusyHint = 50 * time.Millisecond

// takeSlot admits one request against this relay's own concurrency and
// request rate limits.
func (l *limiter) takeSlot(now time.Time) (limitScope, time.Duration) {
	if max := l.maxConc.Load(); max > 0 {
		for {
			cur := l.inflight.Load()
			if cur >= max {
				return scopeConcurrency, 0
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
			return scopeRate, max(wait, time.Millisecond)
		}
	}
	return scopeNone, 0
}

// charge adds n tokens to what an admitted request is charged, as its
// estimate grows once its body is read; it never refuses (take looked at
// the bucket).
func (l *limiter) charge(now time.Time, g *grant, n int64) {
	if !g.tokens || n == 0 {
		return
	}
	g.charged += n
	if g.pending { // charged when admitted
		return
	}
	if g.store != nil {
		spec := l.limits()
		g.store.correct(spec, g, n)
		g.left.charge(spec.tokens, n)
		return
	}
	l.mu.Lock()
	tokens := l.tokens
	l.mu.Unlock()
	if tokens != nil {
		tokens.charge(now, n)
	}
}

// settled reports whether the limiter is as a new one would be: nothing in
// flight, its buckets full. Forgetting a settled limiter forgives nothing.
// (In a fleet, the store keeps the rest, and lets it expire.)
func (l *limiter) settled(now time.Time) bool {
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

// limits is the limiter's spec.
func (l *limiter) limits() limits {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.spec
}

// busy reports whether take would refuse now, without taking anything, and
// when the limit should lift (zero when unknown). For a limit the fleet
// keeps, it knows only what the store last refused.
func (l *limiter) busy(now time.Time) (bool, time.Time) {
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

// remaining is what is left now of the request rate and the token limit,
// for the admin API: nil for a limit that is not set, or that the fleet
// keeps (only the store knows). A token limit in debt has less than
// nothing left.
func (l *limiter) remaining(now time.Time) (requests, tokens *int64) {
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

// done gives back a request's concurrency slot and corrects its token
// charge to what it really used (actual), where it was taken.
func (l *limiter) done(now time.Time, g grant, actual int64) {
	if g.pending { // it passed the gate, and was never admitted
		l.waiting.Add(-1)
		return
	}
	l.inflight.Add(-1)
	correction := int64(0)
	if g.tokens {
		correction = actual - g.charged
	}
	if g.store != nil {
		g.store.giveBack(l.limits(), g, correction)
		return
	}
	l.mu.Lock()
	tokens := l.tokens
	l.mu.Unlock()
	if tokens != nil && correction != 0 {
		tokens.charge(now, correction)
	}
}

// Destruct implements caddy.Destructor.
func (*limiter) Destruct() error { return nil }

// estimateTokens guesses the input tokens of a request from its body
// before the upstream says: about 4 bytes a token. The guess is corrected
// with the real usage when the answer ends.
func estimateTokens(body []byte) int64 { return int64(len(body)/4) + 1 }

// billedTokens is what a request costs against a token limit: input, cache
// writes and output, as Anthropic counts its own rate limits (cache reads do
// not count).
func billedTokens(u usage) int64 { return u.input + u.cacheWrite + u.output }
