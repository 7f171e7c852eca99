package relay

import (
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
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
	// the end of the last cooldown a 529 started: while the cooldown ends
	// no later, only the upstream's overload keeps the channel out
	overloadedUntil atomic.Int64
	disabled        atomic.Bool
	// spend is the account of the channel's spend caps in the last config
	// that loaded it (spend_config.go); nil: none
	spend atomic.Pointer[money.Account]
	// forcing is set while a breaker is opened because another node's
	// opened: it trips at once, and the change is not published back
	forcing atomic.Bool
	// steered counts the changes that can lower or flip the channel's state
	// (a reset, a breaker closed, disable, enable): a fleet sync that began
	// before one does not apply the fleet's older state over it
	steered atomic.Uint64

	name  string                 // the channel's name
	fleet atomic.Pointer[member] // the fleet the health is shared with; nil: none

	// models the upstream refused (403): model -> until, Unix nanoseconds.
	// Copied on write, read without the lock on every selection.
	refused atomic.Pointer[map[string]int64]
	// features the upstream said it does not support (a 400 in its
	// refusal's words): feature -> until, Unix nanoseconds, as refused
	lacks atomic.Pointer[map[string]int64]
	// the model classes cooling on the channel (health_classes.go): a
	// 429, a 529 or a spent quota cools the class that answered, not the
	// channel. Copied on write, read without the lock on every selection.
	classes atomic.Pointer[classCooldowns]

	limits   limits.Limiter // the channel's rate, tokens and concurrency; counts in-flight attempts
	requests atomic.Uint64  // finished attempts, client traffic only
	failures atomic.Uint64  // of which ended in a retryable outcome

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
	resetAt     time.Time // the last reset: what came before it is history
	owners      []channelOwner
}

// latency is the channel's first-byte latency EWMA in ms; 0 before any.
func (h *channelHealth) latency() float64 { return math.Float64frombits(h.ewmaMs.Load()) }

// channelOwner is what one relay handler that declares the channel says
// about it: the provider for the admin API (the most recent handler wins),
// and its groups, whose queues a freed slot wakes.
type channelOwner struct {
	relay    *Relay
	provider string
	groups   []string
	queues   []*waitQueue // of its groups: woken when an attempt frees a slot
	classes  []string     // the names its model classes may have, for the gauge's labels
}

// Destruct implements caddy.Destructor.
func (*channelHealth) Destruct() error { return nil }

// configure pushes a config's breaker settings into the (possibly
// surviving) state and records what the config says about the channel.
// gobreaker cannot change its settings, so new settings start a new breaker;
// unchanged settings keep the breaker and its counts.
func (h *channelHealth) configure(s breakerSettings, l limits.Spec, owner channelOwner, now time.Time) {
	h.limits.Configure(l, now)
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

// state is the channel's state for the admin API and metrics: its own
// (channelState), and cooldown while any of its model classes cools, so
// that a channel that is out for some requests never reads healthy.
func (h *channelHealth) state(now time.Time) string {
	st := h.channelState(now)
	if st == stateHealthy && h.classCooling(now) {
		return stateCooldown
	}
	return st
}

// channelState is the state of the channel itself, its model classes
// aside: what probes look at, since a probe's success ends the channel's
// cooldown, not a class's limit.
func (h *channelHealth) channelState(now time.Time) string {
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

// ownersChanged rebuilds what is derived from the owners. h.mu is held.
func (h *channelHealth) ownersChanged() {
	var qs []*waitQueue
	for _, o := range h.owners {
		qs = append(qs, o.queues...)
	}
	h.queues.Store(&qs)
}
