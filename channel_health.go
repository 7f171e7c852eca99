package relay

import (
	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/internal/money"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddyserver/caddy/v2"
)

// channelStates holds the state of every channel by name, process-wide,
// so that a config reload which keeps a channel keeps its health (cooldown,
// breaker, counters), its limits and its waiting queues: the new config
// takes a reference before the old one releases its own.
var channelStates = caddy.NewUsagePool()

// Channel states, as the admin API reports them: the health's, and
// stateCapped (spend_scopes.go).
const (
	stateHealthy  = health.StateHealthy
	stateCooldown = health.StateCooldown
	stateOpen     = health.StateOpen
	stateHalfOpen = health.StateHalfOpen
	stateDisabled = health.StateDisabled
)

// channelHealth is what outlives a config reload of one channel (see
// channelStates), shared by every group that lists it: its health (the
// state machine of internal/health, embedded), its limits, its spend caps'
// account, and what the configs that hold it say about it.
type channelHealth struct {
	*health.Channel

	// spend is the account of the channel's spend caps in the last config
	// that loaded it (spend_scopes.go); nil: none
	spend atomic.Pointer[money.Account]
	// fleet is the fleet the channel's health and limits are shared with;
	// nil: none
	fleet atomic.Pointer[member]

	limits limits.Limiter // the channel's rate, tokens and concurrency; counts in-flight attempts

	// the queues of the groups that hold the channel, woken when an
	// attempt frees a slot; derived from owners
	queues atomic.Pointer[[]*waitQueue]

	mu     sync.Mutex // guards owners
	owners []channelOwner
}

// newChannelHealth is the state of a channel called name that no config
// held before.
func newChannelHealth(name string) *channelHealth {
	return &channelHealth{Channel: health.NewChannel(name)}
}

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

// Destruct implements caddy.Destructor: no config holds the channel any
// more, so the fleet's changes no longer apply to its health.
func (h *channelHealth) Destruct() error {
	h.Drop()
	return nil
}

// configure pushes a config's breaker settings and limits into the
// (possibly surviving) state and records what the config says about the
// channel.
func (h *channelHealth) configure(s health.BreakerSettings, l limits.Spec, owner channelOwner, now time.Time) {
	h.limits.Configure(l, now)
	h.Configure(s)
	h.mu.Lock()
	defer h.mu.Unlock()
	h.owners = append(h.owners, owner)
	h.ownersChanged()
}

// share makes the channel's health and limits the fleet's (nil: this
// relay's own). Limits are kept in Redis only when the channel has some.
func (h *channelHealth) share(f *member) {
	h.fleet.Store(f)
	var s *health.Shared
	if f != nil {
		s = f.health
	}
	h.Share(s)
	h.limits.Share(f.limitsOf(), fleet.Tag("c:", h.Name()))
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

// classLabels are the class labels of the channel's gauge: the classes
// its configs can name.
func (h *channelHealth) classLabels() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	var out []string
	for _, o := range h.owners {
		for _, c := range o.classes {
			if !slices.Contains(out, c) {
				out = append(out, c)
			}
		}
	}
	return out
}

// ownersChanged rebuilds what is derived from the owners. h.mu is held.
func (h *channelHealth) ownersChanged() {
	var qs []*waitQueue
	for _, o := range h.owners {
		qs = append(qs, o.queues...)
	}
	h.queues.Store(&qs)
}

// busy reports whether the channel is at one of its limits, or its
// upstream said a quota is spent (upstream), and when that should lift
// (zero when only a finishing attempt can tell). A busy channel is skipped,
// not cooled.
func (h *channelHealth) busy(now time.Time) (busy bool, until time.Time, upstream bool) {
	if spent, until := h.Quota(now); spent {
		return true, until, true
	}
	busy, until = h.limits.Busy(now)
	return busy, until, false
}
