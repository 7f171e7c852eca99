package relay

import (
	"errors"
	"math"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/sony/gobreaker/v2"
)

// channelStates holds the health of every channel by name, process-wide, so
// that a config reload which keeps a channel keeps its cooldown, breaker and
// counters: the new config takes a reference before the old one releases
// its own.
var channelStates = caddy.NewUsagePool()

// Channel states, as the admin API reports them.
const (
	stateHealthy  = "healthy"
	stateCooldown = "cooldown"
	stateOpen     = "open"
	stateHalfOpen = "half_open"
	stateDisabled = "disabled"
)

// cooldownPolicy is what a channel's config says about cooling it down.
type cooldownPolicy struct {
	base time.Duration // after a transient failure; doubles while they repeat
	max  time.Duration // cap for every cooldown but auth
	auth time.Duration // after the credential or account was refused
	// how long a model the upstream refused stays set aside on the channel
	capability time.Duration
}

// defaultRateLimitWait is the cooldown after a 429 that gave no hint.
const defaultRateLimitWait = 5 * time.Second

// breakerSettings are a channel's resolved breaker options.
type breakerSettings struct {
	window      time.Duration
	ratio       float64
	minRequests uint32
	openFor     time.Duration
	probes      uint32
}

// Breaker defaults.
var defaultBreaker = breakerSettings{window: 10 * time.Second, ratio: 0.6, minRequests: 5, openFor: 30 * time.Second, probes: 1}

// channelHealth is the state machine of one channel: healthy, cooling down
// after a failure, breaker open or half-open, or disabled by hand. It
// outlives config reloads (see channelStates) and is shared by every group
// that lists the channel.
type channelHealth struct {
	// Read without the lock on every selection, in Unix nanoseconds.
	until      atomic.Int64 // end of the current cooldown
	openUntil  atomic.Int64 // when the open breaker turns half-open
	quotaUntil atomic.Int64 // the upstream said a quota is spent until then
	// the end of the last cooldown a 429 started: while the cooldown ends
	// no later, only the upstream's reset keeps the channel out
	limitedUntil atomic.Int64
	disabled     atomic.Bool
	// spend is the account of the channel's spend caps in the last config
	// that loaded it (spend_scopes.go); nil: none
	spend atomic.Pointer[spendAccount]
	// forcing is set while a breaker is opened because another node's
	// opened: it trips at once, and the change is not published back
	forcing atomic.Bool
	// steered counts the changes that can lower or flip the channel's state
	// (a reset, a breaker closed, disable, enable): a fleet sync that began
	// before one does not apply the fleet's older state over it
	steered atomic.Uint64

	name  string                // the channel's name
	fleet atomic.Pointer[fleet] // the fleet the health is shared with; nil: none

	// models the upstream refused (403): model -> until, Unix nanoseconds.
	// Copied on write, read without the lock on every selection.
	refused atomic.Pointer[map[string]int64]
	// features the upstream said it does not support (a 400 in its
	// refusal's words): feature -> until, Unix nanoseconds, as refused
	lacks atomic.Pointer[map[string]int64]

	limits   limiter       // the channel's rate, tokens and concurrency; counts in-flight attempts
	requests atomic.Uint64 // finished attempts, client traffic only
	failures atomic.Uint64 // of which ended in a retryable outcome

	breaker atomic.Pointer[gobreaker.TwoStepCircuitBreaker[struct{}]]

	// first-byte latency in ms, exponentially weighted (float64 bits):
	// read by the adaptive policy without the lock
	ewmaMs atomic.Uint64
	ewmaAt atomic.Int64 // when its last sample came, Unix nanoseconds

	// the queues of the groups that hold the channel, woken when an
	// attempt frees a slot; derived from owners
	queues atomic.Pointer[[]*waitQueue]

	mu          sync.Mutex
	settings    breakerSettings
	consecutive int // transient failures in a row, for the exponential cooldown
	lastError   outcome
	lastReason  string
	lastErrorAt time.Time
	owners      []channelOwner
}

// latency is the channel's first-byte latency EWMA in ms; 0 before any.
func (h *channelHealth) latency() float64 { return math.Float64frombits(h.ewmaMs.Load()) }

// failureRatio is the share of failed attempts in the breaker's window.
func (h *channelHealth) failureRatio() float64 {
	c := h.breaker.Load().Counts()
	if judged := c.TotalSuccesses + c.TotalFailures; judged > 0 {
		return float64(c.TotalFailures) / float64(judged)
	}
	return 0
}

// channelOwner is what one relay handler that declares the channel says
// about it: the provider for the admin API (the most recent handler wins),
// and its groups, whose queues a freed slot wakes.
type channelOwner struct {
	relay    *Relay
	provider string
	groups   []string
	queues   []*waitQueue // of its groups: woken when an attempt frees a slot
}

// Destruct implements caddy.Destructor.
func (*channelHealth) Destruct() error { return nil }

// configure pushes a config's breaker settings into the (possibly
// surviving) state and records what the config says about the channel.
// gobreaker cannot change its settings, so new settings start a new breaker;
// unchanged settings keep the breaker and its counts.
func (h *channelHealth) configure(s breakerSettings, l limits, owner channelOwner, now time.Time) {
	h.limits.configure(l, now)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.breaker.Load() == nil || s != h.settings {
		h.settings = s
		h.resetBreaker()
	}
	h.owners = append(h.owners, owner)
	h.ownersChanged()
}

// release forgets what the config r said about the channel.
func (h *channelHealth) release(r *Relay) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.owners = slices.DeleteFunc(h.owners, func(o channelOwner) bool { return o.relay == r })
	h.ownersChanged()
}

// owner is what the most recent config that holds the channel says about
// it (zero when none does).
func (h *channelHealth) owner() channelOwner {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.ownerLocked()
}

// ownerLocked is owner with h.mu held.
func (h *channelHealth) ownerLocked() channelOwner {
	if n := len(h.owners); n > 0 {
		return h.owners[n-1]
	}
	return channelOwner{}
}

// groups lists the groups that hold the channel, in every handler that
// declares it.
func (h *channelHealth) groups() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.groupsLocked()
}

// groupsLocked is groups with h.mu held.
func (h *channelHealth) groupsLocked() []string {
	var out []string
	for _, o := range h.owners {
		for _, g := range o.groups {
			if !slices.Contains(out, g) {
				out = append(out, g)
			}
		}
	}
	return out
}

// resetBreaker starts a closed breaker with the current settings. h.mu is
// held.
func (h *channelHealth) resetBreaker() {
	s := h.settings
	h.openUntil.Store(0)
	h.breaker.Store(gobreaker.NewTwoStepCircuitBreaker[struct{}](gobreaker.Settings{
		MaxRequests:  s.probes,
		Interval:     s.window,
		BucketPeriod: s.window / 10,
		Timeout:      s.openFor,
		ReadyToTrip: func(c gobreaker.Counts) bool {
			if h.forcing.Load() {
				return true
			}
			judged := c.TotalSuccesses + c.TotalFailures
			return judged >= s.minRequests && float64(c.TotalFailures)/float64(judged) >= s.ratio-1e-9
		},
		IsExcluded: func(err error) bool { return err == errBreakerExcluded },
		// gobreaker keeps its own time (time.Now): the end of an open
		// state is reckoned on the same clock as its own switch to
		// half-open. (Tests run it in a testing/synctest bubble.)
		OnStateChange: func(_ string, from, to gobreaker.State) {
			if to == gobreaker.StateOpen {
				h.openUntil.Store(time.Now().Add(s.openFor).UnixNano())
			}
			if h.forcing.Load() {
				return
			}
			switch {
			case to == gobreaker.StateOpen:
				h.announce(healthChange{Kind: changeOpen, Open: s.openFor.Milliseconds()})
			case to == gobreaker.StateClosed && from == gobreaker.StateHalfOpen:
				h.announce(healthChange{Kind: changeClosed})
			}
		},
	}))
}

// forceOpen opens the breaker because another node's opened: it fails
// one attempt on a breaker made to trip at once. A breaker already open or
// half-open stays as it is.
func (h *channelHealth) forceOpen() {
	h.mu.Lock()
	defer h.mu.Unlock()
	b := h.breaker.Load()
	if b.State() != gobreaker.StateClosed {
		return
	}
	h.forcing.Store(true)
	defer h.forcing.Store(false)
	if done, err := b.Allow(); err == nil {
		done(errBreakerFailure)
	}
}

// closeBreaker closes the breaker because another node's closed after its
// probes succeeded.
func (h *channelHealth) closeBreaker() {
	h.steered.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.breaker.Load().State() != gobreaker.StateClosed {
		h.resetBreaker()
	}
}

// What an attempt reports to the breaker: nil is a success.
var (
	errBreakerFailure  = errors.New("transient failure")
	errBreakerExcluded = errors.New("not the channel's health")
)

// available reports whether the channel may be selected at now, and if not,
// when it may be again (zero when only a person can bring it back).
func (h *channelHealth) available(now time.Time) (bool, time.Time) {
	if h.disabled.Load() {
		return false, time.Time{}
	}
	u := max(h.until.Load(), h.openUntil.Load())
	if u <= now.UnixNano() {
		return true, time.Time{}
	}
	return false, time.Unix(0, u)
}

// state is the channel's state for the admin API and metrics.
func (h *channelHealth) state(now time.Time) string {
	if h.disabled.Load() {
		return stateDisabled
	}
	switch h.breaker.Load().State() {
	case gobreaker.StateOpen:
		return stateOpen
	case gobreaker.StateHalfOpen:
		return stateHalfOpen
	}
	if h.until.Load() > now.UnixNano() {
		return stateCooldown
	}
	return stateHealthy
}

// busy reports whether the channel is at one of its limits, or its
// upstream said a quota is spent (upstream), and when that should lift
// (zero when only a finishing attempt can tell). A busy channel is skipped,
// not cooled.
func (h *channelHealth) busy(now time.Time) (busy bool, until time.Time, upstream bool) {
	if q := h.quotaUntil.Load(); q > now.UnixNano() {
		return true, time.Unix(0, q), true
	}
	busy, until = h.limits.busy(now)
	return busy, until, false
}

// outByReset reports whether the channel is out only because its upstream
// answered 429 with a time to come back (its cooldown is that wait, no
// breaker is open, no one disabled it).
func (h *channelHealth) outByReset(now time.Time) bool {
	n := now.UnixNano()
	u := h.until.Load()
	return !h.disabled.Load() && u > n && h.openUntil.Load() <= n && u <= h.limitedUntil.Load()
}

// observeQuota reads the anthropic-ratelimit-* headers of an upstream
// answer: a limit whose remaining count is 0 makes the channel busy until
// its reset, so the relay stops before the upstream's 429. Like a 429's
// wait, it is capped by the channel's max_cooldown (limit).
func (h *channelHealth) observeQuota(hdr http.Header, now time.Time, limit time.Duration) {
	for _, names := range rateLimitHeaders {
		if hdr.Get(names.remaining) != "0" {
			continue
		}
		t, err := time.Parse(time.RFC3339, hdr.Get(names.reset))
		if err != nil || !t.After(now) {
			continue
		}
		if lim := now.Add(limit); t.After(lim) {
			t = lim
		}
		if raiseTo(&h.quotaUntil, t.UnixNano()) {
			h.announce(healthChange{Kind: changeCool, Quota: t.Sub(now).Milliseconds()})
		}
	}
}

// maxSetAside bounds the models remembered as refused, and the features
// as lacking, per channel: clients choose the names.
const maxSetAside = 256

// refuses reports whether the upstream refused model on this channel, and
// until when it stays set aside.
func (h *channelHealth) refuses(model string, now time.Time) (bool, time.Time) {
	m := h.refused.Load()
	if m == nil {
		return false, time.Time{}
	}
	if until, ok := (*m)[model]; ok && until > now.UnixNano() {
		return true, time.Unix(0, until)
	}
	return false, time.Time{}
}

// setAside adds name to the map m (refused models, lacking features)
// until until. Expired entries go; when the map is full, the entry that
// ends first makes room. h.mu is held.
func setAside(m *atomic.Pointer[map[string]int64], name string, now, until time.Time) {
	next := map[string]int64{}
	if cur := m.Load(); cur != nil {
		for k, v := range *cur {
			if v > now.UnixNano() {
				next[k] = v
			}
		}
	}
	if _, ok := next[name]; !ok && len(next) >= maxSetAside {
		first := ""
		for k, v := range next {
			if first == "" || v < next[first] {
				first = k
			}
		}
		delete(next, first)
	}
	next[name] = until.UnixNano()
	m.Store(&next)
}

// ticket is one admitted attempt on a channel. It must be finished, or
// released when the attempt ends without a verdict (a panic).
type ticket struct {
	h        *channelHealth
	done     func(error)
	grant    grant // what the channel's limits admitted
	finished bool
}

// admit takes a slot of the channel's limits and asks the breaker for an
// attempt. A half-open breaker admits only as many attempts as it has
// probes; the others skip the channel. A nil ticket comes with the limit
// that refused it (another request took the last slot first), or none when
// the breaker did.
func (h *channelHealth) admit(now time.Time, estimate int64) (*ticket, limitScope) {
	g, scope, _ := h.limits.take(now, estimate)
	if scope != scopeNone {
		return nil, scope
	}
	done, err := h.breaker.Load().Allow()
	if err != nil {
		h.limits.done(now, g, 0)
		return nil, scopeNone
	}
	return &ticket{h: h, done: done, grant: g}, scopeNone
}

// admitAlong admits an attempt as admit does, and with it the request's
// end user's limits (user, charged userEstimate tokens), both or neither,
// in one round trip when the fleet keeps both. byUser says that the end
// user's limits refused; else a refusal is the channel's, as admit's.
func (h *channelHealth) admitAlong(now time.Time, estimate int64, user *limiter, userEstimate int64) (t *ticket, userGrant grant, scope limitScope, wait time.Duration, byUser bool) {
	ug, g, scope, wait, byUser := takeBoth(now, user, userEstimate, &h.limits, estimate)
	if scope != scopeNone {
		return nil, grant{}, scope, wait, byUser
	}
	done, err := h.breaker.Load().Allow()
	if err != nil { // its half-open breaker is busy with other probes
		h.limits.done(now, g, 0)
		user.done(now, ug, 0)
		return nil, grant{}, scopeNone, 0, false
	}
	return &ticket{h: h, done: done, grant: g}, ug, scopeNone, 0, false
}

// admitHeld admits an attempt as admitAlong does (user nil: no end user's
// limits), and with it the request's holds of its budgets (hs), all or
// nothing: in the same round trip when the fleet keeps them. ans says why
// the holds were not taken, when they were not.
func (h *channelHealth) admitHeld(now time.Time, estimate int64, user *limiter, userEstimate int64, hs *holds) (t *ticket, userGrant grant, scope limitScope, wait time.Duration, byUser bool, ans holdAnswer) {
	ug, g, scope, wait, byUser, ans := takeHeld(now, user, userEstimate, &h.limits, estimate, hs)
	if scope != scopeNone || ans.verdict != holdTaken {
		return nil, grant{}, scope, wait, byUser, ans
	}
	done, err := h.breaker.Load().Allow()
	if err != nil { // its half-open breaker is busy with other probes
		h.limits.done(now, g, 0)
		if user != nil {
			user.done(now, ug, 0)
		}
		hs.unreserve()
		return nil, grant{}, scopeNone, 0, false, holdAnswer{}
	}
	return &ticket{h: h, done: done, grant: g}, ug, scopeNone, 0, false, holdAnswer{}
}

// finish records the verdict of the attempt: limits, counters, breaker,
// cooldown and latency; tokens is what the attempt used against the
// channel's token limit. It returns the cooldown it started (zero when
// none).
func (t *ticket) finish(v verdict, p cooldownPolicy, now time.Time, firstByte time.Duration, tokens int64) time.Duration {
	if t.finished {
		return 0
	}
	t.finished = true
	h := t.h
	h.limits.done(now, t.grant, tokens)
	h.wakeQueues()
	switch {
	case v.outcome == outcomeCanceled:
		t.done(errBreakerExcluded)
	case v.outcome == outcomeTransient:
		t.done(errBreakerFailure)
	case v.outcome.retryable(): // 429, 529, auth, a refused model: the breaker is about failures
		t.done(errBreakerExcluded)
	default:
		t.done(nil)
	}
	if v.outcome != outcomeCanceled {
		h.requests.Add(1)
	}
	if v.outcome.retryable() && v.outcome != outcomeModelRefused && v.outcome != outcomeLacksFeature {
		h.failures.Add(1)
	}
	return h.record(v, p, now, firstByte)
}

// release ends an attempt that never got a verdict, so the in-flight count
// and the breaker's half-open slot are not lost.
func (t *ticket) release(now func() time.Time) {
	if !t.finished {
		t.finished = true
		t.h.limits.done(now(), t.grant, 0)
		t.done(errBreakerExcluded)
		t.h.wakeQueues()
	}
}

// wakeQueues tells the queues of the channel's groups that a slot freed.
func (h *channelHealth) wakeQueues() {
	if qs := h.queues.Load(); qs != nil {
		for _, q := range *qs {
			q.wakeBest()
		}
	}
}

// ownersChanged rebuilds what is derived from the owners. h.mu is held.
func (h *channelHealth) ownersChanged() {
	var qs []*waitQueue
	for _, o := range h.owners {
		qs = append(qs, o.queues...)
	}
	h.queues.Store(&qs)
}

// ewmaWeight is the weight of the newest sample in the latency average.
const ewmaWeight = 0.2

// record updates the cooldown and the last error with a verdict and returns
// the cooldown it started (zero when none).
func (h *channelHealth) record(v verdict, p cooldownPolicy, now time.Time, firstByte time.Duration) time.Duration {
	h.mu.Lock()
	defer h.mu.Unlock()
	if firstByte > 0 {
		ms, cur := float64(firstByte)/float64(time.Millisecond), h.latency()
		if cur != 0 {
			ms = cur + ewmaWeight*(ms-cur)
		}
		h.ewmaMs.Store(math.Float64bits(ms))
		h.ewmaAt.Store(now.UnixNano())
	}
	var d time.Duration
	switch v.outcome {
	case outcomeSuccess, outcomeClientError:
		h.consecutive = 0
		return 0
	case outcomeCanceled:
		return 0
	case outcomeModelRefused:
		// the request chose the model: only that model is set aside, and
		// the channel stays as healthy as it was
		setAside(&h.refused, v.model, now, now.Add(p.capability))
		h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason+": "+v.model, now
		return 0
	case outcomeLacksFeature:
		// the request carried the feature: the channel stays as healthy
		// as it was, and requests without it still come
		for _, f := range v.features {
			setAside(&h.lacks, f, now, now.Add(p.capability))
		}
		h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason, now
		return 0
	case outcomeAuth:
		d = p.auth
	case outcomeRateLimited:
		d = v.wait
		if d <= 0 {
			d = defaultRateLimitWait
		}
	case outcomeOverloaded:
		d = p.base
	case outcomeTransient:
		h.consecutive++
		d = backoff(p.base, h.consecutive)
	}
	h.lastError, h.lastReason, h.lastErrorAt = v.outcome, v.reason, now
	if v.outcome != outcomeAuth && d > p.max {
		d = p.max
	}
	h.extend(now.Add(d))
	c := healthChange{Kind: changeCool, Until: d.Milliseconds(), Error: v.outcome.String(), Reason: v.reason}
	if v.outcome == outcomeRateLimited {
		raiseTo(&h.limitedUntil, now.Add(d).UnixNano())
		c.Limited = c.Until
	}
	h.announce(c)
	return d
}

// extend moves the end of the cooldown to t unless it already ends later.
func (h *channelHealth) extend(t time.Time) { raiseTo(&h.until, t.UnixNano()) }

// raiseTo stores n in a unless a already holds as much, and reports
// whether it did.
func raiseTo(a *atomic.Int64, n int64) bool {
	for {
		cur := a.Load()
		if n <= cur {
			return false
		}
		if a.CompareAndSwap(cur, n) {
			return true
		}
	}
}

// reset clears the cooldown, the spent quota, the refused models, the
// failure streak and the breaker: the channel is healthy again (unless
// disabled).
func (h *channelHealth) reset() {
	h.steered.Add(1)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.until.Store(0)
	h.quotaUntil.Store(0)
	h.limitedUntil.Store(0)
	h.refused.Store(nil)
	h.lacks.Store(nil)
	h.consecutive = 0
	h.resetBreaker()
}

// backoff is base doubled for every consecutive failure after the first.
func backoff(base time.Duration, consecutive int) time.Duration {
	d := base
	for i := 1; i < consecutive && d < 24*time.Hour; i++ {
		d *= 2
	}
	return d
}
