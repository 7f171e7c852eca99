package money

import (
	"sync"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/limits"
)

// Shared is the money's part of a relay's membership of a fleet: the
// spend it adds to the fleet's totals and the holds it takes in Redis,
// on the fleet's client. Holds are taken with the request's limits, in
// the limits' admission (internal/limits), which renews them as leases
// until their cost is added here.
type Shared struct {
	// Client is the fleet's Redis client, shared with the other concerns
	*fleet.Client

	// limits admit the holds with a request's limits, renew them and
	// give back those that cost nothing
	limits *limits.Shared

	spendMu  sync.Mutex    // one spend sync at a time
	spendNow chan struct{} // asks for a sync of the spend
}

// New keeps spend and holds in the fleet of c, whose limits (l) admit
// the holds: it runs the spend's sync with c's background work (c.Go);
// when that stops (c.Stop), Flush adds what is left.
func New(c *fleet.Client, l *limits.Shared) *Shared {
	f := &Shared{Client: c, limits: l, spendNow: make(chan struct{}, 1)}
	c.Go(f.syncSpend)
	return f
}

// limitsOf is the limits of the fleet f (nil f: none).
func (f *Shared) limitsOf() *limits.Shared {
	if f == nil {
		return nil
	}
	return f.limits
}

// Flush adds the spend not yet added to the fleet's, and with it gives
// back the holds of the requests that spent it, once the workers have
// stopped. The holds of requests still in flight expire with their
// lease: their cost is not known yet.
func (f *Shared) Flush() { f.flushSpend() }
