// Package health keeps the health of the relay's channels: each channel's
// state machine (healthy, cooling down, breaker open or half-open,
// disabled), its cooldowns and those of its model classes, the models and
// features its upstream refused, its circuit breaker and the admission of
// half-open probes, and its first-byte latency. A Channel is the same with
// and without a fleet: shared (Share) with a fleet's Shared, the changes it
// makes travel to the other relays through Redis, and theirs apply to it.
//
// The package knows nothing of the relay: which class a model is, what a
// channel's limits and spend are, and which configs hold it are the
// relay's; it hands the package names, classes and policies.
package health

import (
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/sony/gobreaker/v2"
)

// Channel states, as the admin API reports them.
const (
	StateHealthy  = "healthy"
	StateCooldown = "cooldown"
	StateOpen     = "open"
	StateHalfOpen = "half_open"
	StateDisabled = "disabled"
)

// Channel is the state machine of one channel: healthy, cooling down after
// a failure, breaker open or half-open, or disabled by hand. The relay
// keeps it across config reloads, by the channel's name, and every group
// that lists the channel shares it. Its zero value is a healthy channel
// without a name; Configure gives it its breaker.
type Channel struct {
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
	// forcing is set while a breaker is opened because another node's
	// opened: it trips at once, and the change is not published back
	forcing atomic.Bool
	// steered counts the changes that can lower or flip the channel's state
	// (a reset, a breaker closed, disable, enable): a fleet sync that began
	// before one does not apply the fleet's older state over it
	steered atomic.Uint64

	name   string                 // the channel's name
	shared atomic.Pointer[Shared] // the fleet the health is shared with; nil: none

	// models the upstream refused (403): model -> until, Unix nanoseconds.
	// Copied on write, read without the lock on every selection.
	refused atomic.Pointer[map[string]int64]
	// features the upstream said it does not support (a 400 in its
	// refusal's words): feature -> until, Unix nanoseconds, as refused
	lacks atomic.Pointer[map[string]int64]
	// the model classes cooling on the channel (classes.go): a 429, a 529
	// or a spent quota cools the class that answered, not the channel.
	// Copied on write, read without the lock on every selection.
	classes atomic.Pointer[classCooldowns]

	requests atomic.Uint64 // finished attempts, client traffic only
	failures atomic.Uint64 // of which ended in a retryable outcome

	breaker atomic.Pointer[gobreaker.TwoStepCircuitBreaker[struct{}]]

	// first-byte latency in ms, exponentially weighted (float64 bits):
	// read by the adaptive policy without the lock
	ewmaMs atomic.Uint64
	ewmaAt atomic.Int64 // when its last sample came, Unix nanoseconds

	mu          sync.Mutex
	settings    BreakerSettings
	consecutive int // transient failures in a row, for the exponential cooldown
	lastError   Outcome
	lastReason  string
	lastErrorAt time.Time
	resetAt     time.Time // the last reset: what came before it is history
}

// NewChannel is the health of the channel called name: healthy, its
// breaker not configured yet.
func NewChannel(name string) *Channel { return &Channel{name: name} }

// Name is the channel's name.
func (h *Channel) Name() string { return h.name }

// Latency is the channel's first-byte latency EWMA in ms; 0 before any.
func (h *Channel) Latency() float64 { return math.Float64frombits(h.ewmaMs.Load()) }

// LatencyAt is when the latency EWMA took its last sample.
func (h *Channel) LatencyAt() time.Time { return time.Unix(0, h.ewmaAt.Load()) }

// Requests counts the attempts that finished on the channel, client
// traffic only (a canceled one is none).
func (h *Channel) Requests() uint64 { return h.requests.Load() }

// Failures counts the finished attempts that ended in a retryable outcome
// other than a refused model or a lacking feature.
func (h *Channel) Failures() uint64 { return h.failures.Load() }

// Disabled reports whether a person disabled the channel.
func (h *Channel) Disabled() bool { return h.disabled.Load() }

// LastError is the channel's last error, why and when (a zero time when
// it had none).
func (h *Channel) LastError() (outcome Outcome, reason string, at time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.lastError, h.lastReason, h.lastErrorAt
}

// ResetAt is when the channel was last reset (zero: never): its last error
// and its recent error rate may be from before it.
func (h *Channel) ResetAt() time.Time {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.resetAt
}

// Available reports whether the channel may be selected at now, and if
// not, when it may be again (zero when only a person can bring it back).
func (h *Channel) Available(now time.Time) (bool, time.Time) {
	if h.disabled.Load() {
		return false, time.Time{}
	}
	u := max(h.until.Load(), h.openUntil.Load())
	if u <= now.UnixNano() {
		return true, time.Time{}
	}
	return false, time.Unix(0, u)
}

// State is the channel's state for the admin API and metrics: its own
// (ChannelState), and cooldown while any of its model classes cools, so
// that a channel that is out for some requests never reads healthy.
func (h *Channel) State(now time.Time) string {
	st := h.ChannelState(now)
	if st == StateHealthy && h.ClassCooling(now) {
		return StateCooldown
	}
	return st
}

// ChannelState is the state of the channel itself, its model classes
// aside: what probes look at, since a probe's success ends the channel's
// cooldown, not a class's limit.
func (h *Channel) ChannelState(now time.Time) string {
	if h.disabled.Load() {
		return StateDisabled
	}
	switch h.breaker.Load().State() {
	case gobreaker.StateOpen:
		return StateOpen
	case gobreaker.StateHalfOpen:
		return StateHalfOpen
	}
	if h.until.Load() > now.UnixNano() {
		return StateCooldown
	}
	return StateHealthy
}

// Share makes the channel's health the fleet's (nil: this relay's own):
// the changes this relay makes are published to s, those the others
// publish apply here, and the channel's state is synced with the fleet's
// soon.
func (h *Channel) Share(s *Shared) {
	if old := h.shared.Swap(s); old != nil && old != s {
		old.forget(h)
	}
	if s != nil {
		s.add(h)
		s.ResyncSoon()
	}
}

// Drop says that no config holds the channel any more: the other nodes'
// changes stop applying to it and the fleet's syncs leave it out, so that
// a channel of its name made later takes its place. What its attempts
// still in flight change is published as before.
func (h *Channel) Drop() {
	if s := h.shared.Load(); s != nil {
		s.forget(h)
	}
}
