package relay

import "time"

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
// waits before it prepares any of its calls, holding no block of its own
// that others could be waiting for, and at most once.

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

// refillFor is the refill under way that a request under spec, charging
// estimate tokens (-1: none), would otherwise ask Redis beside: a block
// of a limit it needs that is spent, and that another request is taking.
// Nil when there is none; while no block of s is being taken (refills is
// 0), there is none.
func (s *sharedLimit) refillFor(now time.Time, spec limits, estimate int64) *refill {
	s.mu.Lock()
	defer s.mu.Unlock()
	var r *refill
	switch {
	case s.rb.refill != nil && spec.emission() > 0:
		r = s.rb.refill
	case s.tb.refill != nil && spec.tokens.n > 0 && estimate >= 0:
		r = s.tb.refill
	case s.cb.refill != nil && spec.concurrency > 0 && !s.cb.free(now, s.f.lease):
		r = s.cb.refill
	default:
		return nil
	}
	r.waiters++
	return r
}

// awaitRefills waits for the refills rs (nil ones are none) to end, all
// within the storage's timeout, and reports whether Redis failed one of
// them, or the time ran out: then Redis counts as down for the request.
func (f *fleet) awaitRefills(rs ...*refill) (down bool) {
	t := time.NewTimer(f.timeout)
	defer t.Stop()
	for _, r := range rs {
		if r == nil {
			continue
		}
		select {
		case <-r.done:
			if r.down {
				return true
			}
		case <-t.C:
			return true
		}
	}
	return false
}

// awaitRefillsOf waits for the refills under way that the asks of a
// request that go to Redis (in) would otherwise ask Redis beside, as
// awaitRefills, and moves now to when the wait ended: errFleetDown when
// Redis failed one.
func (f *fleet) awaitRefillsOf(now *time.Time, asks []ask, in func(int) bool) error {
	var rs [4]*refill
	found := false
	for i := range asks {
		if !in(i) {
			continue
		}
		a := &asks[i]
		if s := a.l.shared.Load(); s.refills.Load() != 0 {
			rs[i] = s.refillFor(*now, a.l.limits(), a.est)
			found = found || rs[i] != nil
		}
	}
	if !found {
		return nil
	}
	if f.awaitRefills(rs[:len(asks)]...) {
		return errFleetDown
	}
	*now = f.now()
	return nil
}
