package limits

import (
	"context"
	"github.com/caddy-relay/relay/internal/fleet"
	"math"
	"time"

	"github.com/caddy-relay/relay/internal/loop"
	"github.com/redis/go-redis/v9"
)

// correct charges n more tokens (negative: gives them back) to a request
// that holds g: to this node's token block when it was charged to one and
// one is held (the block it was charged to, or the one after it: the
// block that ended gave back its rest without this), else to Redis, off
// the request's path (the worker that gives back leases sends it).
func (s *sharedLimit) correct(spec Spec, g *Grant, n int64) {
	if g.fromBlock && s.chargeBlock(n) {
		return
	}
	s.queue(release{limit: s, tokens: n, perMs: spec.tokensPerMs(), burst: spec.Tokens.N})
}

// chargeBlock charges n tokens to this node's token block, when it holds
// one.
func (s *sharedLimit) chargeBlock(n int64) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.tb.held() {
		return false
	}
	s.tb.left -= float64(n)
	return true
}

// giveBack gives back what a request admitted by the fleet holds: its
// lease, and the correction of its tokens to what it used. Outside a
// Redis Cluster, the lease goes with the next admission this relay sends,
// or with the worker that gives back when none comes soon (pendSlots).
func (s *sharedLimit) giveBack(spec Spec, g Grant, correction int64) {
	if g.slotGen != 0 {
		s.freeSlot(g.slotGen)
	}
	r := release{limit: s, lease: g.lease}
	if correction != 0 && spec.Tokens.N > 0 && !(g.fromBlock && s.chargeBlock(correction)) {
		r.tokens, r.perMs, r.burst = correction, spec.tokensPerMs(), spec.Tokens.N
	}
	if r.lease != "" {
		l := leaseRef{s.lease, r.lease}
		s.f.drop(l, false)
		if !s.f.Cluster {
			s.f.pendSlots(l)
			r.lease = ""
		}
	}
	if r.lease != "" || r.tokens != 0 {
		s.queue(r)
	}
}

// Slots given back with the next admission. At one request at a time, a
// slot freed by one request goes with the next one's admission instead of
// a round trip of its own; the worker gives back what no admission took
// within the fleet's slotDelay (defaultSlotDelay). A slot so given back
// counts a moment longer (at most slotDelay) against its limit on the
// other relays: the safe side.
const (
	defaultSlotDelay = 2 * time.Millisecond
	maxCarried       = 64 // slots one admission carries at most
)

// pendSlots queues slots freed on this relay, to be given back with the
// next admission or by the worker.
func (f *Shared) pendSlots(ls ...leaseRef) {
	if len(ls) == 0 {
		return
	}
	f.slotsMu.Lock()
	f.slots = append(f.slots, ls...)
	f.slotsMu.Unlock()
	select {
	case f.slotsNew <- struct{}{}:
	default:
	}
}

// takeSlots takes at most n of the slots freed and not yet given back.
func (f *Shared) takeSlots(n int) []leaseRef {
	f.slotsMu.Lock()
	defer f.slotsMu.Unlock()
	if len(f.slots) == 0 {
		return nil
	}
	k := min(n, len(f.slots))
	out := append([]leaseRef(nil), f.slots[len(f.slots)-k:]...)
	f.slots = f.slots[:len(f.slots)-k]
	return out
}

// giveBackSlots gives back, slotDelay after they were freed, the slots no
// admission carried, until ctx ends.
func (f *Shared) giveBackSlots(ctx context.Context) {
	t := time.NewTimer(time.Duration(f.slotDelay.Load()))
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-f.slotsNew:
		}
		t.Reset(time.Duration(f.slotDelay.Load()))
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		f.flushSlots()
	}
}

// flushSlots gives back every slot freed and not given back yet, in one
// round trip.
func (f *Shared) flushSlots() {
	slots := f.takeSlots(math.MaxInt)
	if len(slots) == 0 {
		return
	}
	_ = f.Background("release", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, l := range slots {
				pipe.ZRem(ctx, l.set, l.id)
			}
			return nil
		})
		return err
	})
}

// queue hands r to the worker that gives back to Redis. It never waits for
// Redis: when the worker is behind by a full queue, r is sent on the
// caller's time, within the timeout.
func (s *sharedLimit) queue(r release) { s.f.queueRelease(r) }

// queueRelease hands r to the worker that gives back to Redis, or sends
// it on the caller's time when the worker is behind by a full queue.
func (f *Shared) queueRelease(r release) {
	select {
	case f.releases <- r:
	default:
		f.flush([]release{r})
	}
}

// release is what one request, or one ended block, gives back.
type release struct {
	limit  *sharedLimit
	lease  string
	tokens int64 // correction, charged (negative: given back)
	perMs  float64
	burst  float64
	// requests are a rate block's, not used, given back at its emission
	// interval (ms)
	requests, emission float64
	// member is a hold that cost nothing, in the account's holds
	// (holdSet) and its total (holdTotal)
	member, holdSet, holdTotal string
}

// blockRelease is the release that gives back what ended blocks of s
// left: requests of its rate's (at emission), tokens of its token
// limit's (at perMs, burst; negative: a debt to charge).
func blockRelease(s *sharedLimit, requests, emission, tokens, perMs, burst float64) release {
	return release{limit: s, requests: max(0, math.Floor(requests)), emission: emission,
		tokens: -int64(math.Round(tokens)), perMs: perMs, burst: burst}
}

// hold records a lease this node renews until it is given back: a
// concurrency slot, or a request's hold of a budget (held).
func (f *Shared) hold(l leaseRef, held bool) {
	f.leaseMu.Lock()
	if held {
		f.holdLeases[l] = struct{}{}
	} else {
		f.leases[l] = struct{}{}
	}
	f.leaseMu.Unlock()
}

// HoldLease records that this node renews the hold member of an
// account's holds (set) until DropHoldLease: a hold whose cost has not
// reached the fleet's spend yet.
func (f *Shared) HoldLease(set, member string) { f.hold(leaseRef{set, member}, true) }

// DropHoldLease stops renewing a hold (HoldLease).
func (f *Shared) DropHoldLease(set, member string) { f.drop(leaseRef{set, member}, true) }

// ReleaseHold gives back, off the request's path, a hold member of an
// account's holds (set) and their total that cost nothing.
func (f *Shared) ReleaseHold(set, total, member string) {
	f.queueRelease(release{holdSet: set, holdTotal: total, member: member})
}

// drop stops renewing a lease.
func (f *Shared) drop(l leaseRef, held bool) {
	f.leaseMu.Lock()
	if held {
		delete(f.holdLeases, l)
	} else {
		delete(f.leases, l)
	}
	f.leaseMu.Unlock()
}

// giveBack pipelines the queued releases to Redis, as many at once as have
// queued, until ctx ends.
func (f *Shared) giveBack(ctx context.Context) {
	batch := make([]release, 0, 256)
	for {
		select {
		case <-ctx.Done():
			return
		case r := <-f.releases:
			batch = append(batch[:0], r)
		}
	more:
		for len(batch) < cap(batch) {
			select {
			case r := <-f.releases:
				batch = append(batch, r)
			default:
				break more
			}
		}
		f.flush(batch)
	}
}

// flush gives back a batch in one round trip. What Redis does not take
// expires: a lease within its lease time, a token correction never (the
// bucket is as if the estimate had been right).
func (f *Shared) flush(batch []release) {
	_ = f.Background("release", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for _, r := range batch {
				if r.lease != "" {
					pipe.ZRem(ctx, r.limit.lease, r.lease)
				}
				if r.tokens != 0 && r.perMs > 0 {
					chargeScript.Eval(ctx, pipe, []string{r.limit.bkt}, r.perMs, r.burst, r.tokens)
				}
				if r.requests > 0 && r.emission > 0 {
					giveBackRateScript.Eval(ctx, pipe, []string{r.limit.rate}, r.emission, r.requests)
				}
				if r.member != "" {
					fleet.ReleaseHoldScript.Eval(ctx, pipe, []string{r.holdSet, r.holdTotal}, r.member)
				}
			}
			return nil
		})
		return err
	})
}

// renewLeases moves the expiry of every lease this node holds, every third
// of the lease time, until ctx ends.
func (f *Shared) renewLeases(ctx context.Context) {
	loop.Every(ctx, f.Lease/3, nil, f.renew)
}

// renew moves the expiry of every lease this node holds: its concurrency
// slots (its blocks' too) and its requests' holds; and confirms that
// Redis still holds its blocks of slots.
func (f *Shared) renew() {
	bySet := map[string][]any{}
	f.leaseMu.Lock()
	for l := range f.leases {
		bySet[l.set] = append(bySet[l.set], l.id)
	}
	for l := range f.holdLeases {
		bySet[l.set] = append(bySet[l.set], l.id)
	}
	f.leaseMu.Unlock()
	if len(bySet) == 0 {
		return
	}
	checks := f.slotChecks() // after the leases: a block taken since is confirmed by its taking
	start := f.now()
	var found []*redis.Cmd
	err := f.Background("renew", func(ctx context.Context) error {
		_, err := f.Redis.Pipelined(ctx, func(pipe redis.Pipeliner) error {
			for set, ids := range bySet {
				renewScript.Eval(ctx, pipe, []string{set}, append([]any{f.Lease.Milliseconds()}, ids...)...)
			}
			found = checkSlots(ctx, pipe, f.Lease.Milliseconds(), checks)
			return nil
		})
		return err
	})
	if err == nil {
		confirmSlots(start, checks, found)
	}
}
