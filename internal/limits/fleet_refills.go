package limits

import (
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
)

// Refills. One request at a time takes the next block of a limit
// (fleet_leases.go, fleet_slots.go): the request that finds the block
// spent asks Redis for a new one with its own admission. The requests
// that find the block spent while that call is under way wait for its
// outcome instead of each asking Redis for themselves, so that a node
// under load sends Redis one call per block, not one per request, even
// when Redis is slow:
//
//   - the block came: they admit from it, with no round trip;
//   - Redis refused it, or another limit of the refilling request refused
//     that request: they ask for themselves, as a request that holds no
//     block does;
//   - Redis did not answer it: neither do they ask. Redis failed them once
//     already (they waited for it), and a request never waits on Redis
//     twice: they are served as when Redis is down (on_error).
//
// A waiter waits at most the storage's timeout, what the call it waits
// for can take, and counts Redis as down when that runs out. A request
// finds the refill to wait for under the lock it would take the block
// under, so none starts unseen in between; it waits only while it is
// taking no block itself that others could be waiting for, and at most
// once.

// refill is one request's taking of the next block of a limit. Guarded by
// its sharedLimit's mu; done is closed when it ends, and down is read
// after.
type refill struct {
	done    chan struct{}
	down    bool // Redis did not answer the call that took it
	waiters int  // the requests waiting for it (tests read it)
}

// startRefill marks the next block of one of s's limits as being taken
// (s.mu held): *p is the block's refill.
func (s *sharedLimit) startRefill(p **refill) {
	*p = &refill{done: make(chan struct{})}
	s.refills.Add(1)
}

// endRefill ends the taking of a block (s.mu held), down when Redis did
// not answer it, and wakes those that wait for it.
func (s *sharedLimit) endRefill(p **refill, down bool) {
	r := *p
	if r == nil {
		return
	}
	r.down = down
	close(r.done)
	*p = nil
	s.refills.Add(-1)
}

// takesBlock reports whether the call takes the next block of one of its
// limits: other requests may be waiting for it.
func (c *admitCall) takesBlock() bool {
	return c.rate.ask > 0 || c.tokens.ask > 0 || c.slots.ask > 0
}

// refillLocked is the refill under way that a request under spec,
// charging estimate tokens (-1: none), would otherwise ask Redis beside:
// of a block of a limit it needs that is spent, and that another request
// is taking; nil when there is none (s.mu held).
func (s *sharedLimit) refillLocked(now time.Time, spec Spec, estimate int64) *refill {
	switch {
	case s.rb.refill != nil && spec.emission() > 0:
		return s.rb.refill
	case s.tb.refill != nil && spec.Tokens.N > 0 && estimate >= 0:
		return s.tb.refill
	case s.cb.refill != nil && spec.Concurrency > 0 && !s.cb.free(now, s.f.Lease):
		return s.cb.refill
	}
	return nil
}

// awaitRefill waits for the refill r to end, at most the storage's
// timeout, and reports whether Redis failed it, or the time ran out: then
// Redis counts as down for the request.
func (f *Shared) awaitRefill(r *refill) (down bool) {
	t := time.NewTimer(f.Timeout)
	defer t.Stop()
	select {
	case <-r.done:
		return r.down
	case <-t.C:
		return true
	}
}

// prepareAll prepares the calls of the asks that go to Redis (in), in
// calls and their asks' indexes in which, and returns how many. When one
// of them would ask Redis beside another request taking a block, and none
// prepared before it is taking one, the calls prepared take nothing after
// all, the request waits for that refill, and prepares them again, without
// waiting again (now moves on by the wait): fleet.ErrDown when
// Redis failed the refill.
func (f *Shared) prepareAll(now *time.Time, asks []Ask, in func(int) bool, calls *[4]*admitCall, which *[4]int) (int, error) {
	wait := true
	for {
		n := 0
		var r *refill
		for i := range asks {
			if !in(i) {
				continue
			}
			a := &asks[i]
			c, w := a.Limiter.shared.Load().prepare(*now, a.Limiter.Limits(), a.Estimate, wait)
			if w != nil {
				r = w
				break
			}
			calls[n], which[n] = c, i
			n++
			wait = wait && !c.takesBlock()
		}
		if r == nil {
			return n, nil
		}
		for _, c := range calls[:n] {
			c.undo()
		}
		waited := time.Now()
		if f.awaitRefill(r) {
			return 0, fleet.ErrDown
		}
		*now = now.Add(time.Since(waited)) // on the caller's clock
		wait = false
	}
}
