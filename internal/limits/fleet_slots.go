package limits

import (
	"context"
	"strconv"
	"time"

	"github.com/redis/go-redis/v9"
)

// Leased blocks of concurrency slots. A concurrency limit large enough
// that a node's share of it is many slots is not asked of Redis at every
// request: a node takes a block of slots in the admission script of the
// request that needs one, each slot a member of the limit's sorted set of
// leases (<lease id>/1, <lease id>/2, ...), renewed like every lease, so
// that the other relays count them as occupied. The node admits with no
// round trip while its requests in flight are fewer than the slots it
// holds, and takes another block (in the one call of the request that
// would exceed them) when they are not.
//
//   - Size: as a rate's block, a tenth of a node's even share,
//     n / (10 x nodes), leased only when that is at least minSlotBlock
//     slots, and at most maxSlotBlock (each slot is a member to add and
//     renew). Smaller limits take a slot per request, as before.
//   - Exact upper bound: a slot counts in Redis from the moment it is
//     taken until it is given back or expires, whether a request uses it
//     or not, and Redis grants at most what the limit has left: the fleet
//     never has more than n requests in flight.
//   - Under-admission: a node's unused slots count against the others.
//     Every slotLease the node shrinks what it holds to what the peak of
//     its requests in flight over that time needed, in whole blocks, and
//     gives the rest back off the request's path: with a steady load each
//     node holds less than one block unused, so a request may be refused
//     while up to relays x block <= n/10 slots are unused on other relays.
//   - A node that dies stops renewing: its slots expire within the
//     storage's lease. A changed limit, a reload that drops it and a node
//     that stops give the unused slots back at once, and each used one as
//     its request ends. Slots the node could not renew (Redis away, or
//     emptied) are not admitted from once the last renewal that found them
//     is three quarters of a lease old: they may have expired.

// Slot block sizing.
const (
	minSlotBlock = 10   // slots: a smaller block is not worth it
	maxSlotBlock = 1000 // slots: members one admission adds at most
)

// defaultSlotEvery is how long a node keeps the slots the peak of its
// requests in flight needed before it gives back what the next peak does
// not need (at most the storage's lease).
const defaultSlotEvery = time.Second

// slotLease is how long a node keeps the slots its peak needed before it
// shrinks what it holds to what the next peak needs.
func (f *Shared) slotLease() time.Duration { return time.Duration(f.slotEvery.Load()) }

// slotBlock is what this node holds of a concurrency limit: members of the
// limit's lease set. Guarded by its sharedLimit's mu.
type slotBlock struct {
	// gen changes when the slots are given back all at once: the requests
	// that used them then give back one of draining each as they end
	gen  uint64
	ids  []string // the members held, in the order taken
	used int64    // this node's requests in flight on them
	peak int64    // the most used since the last shrink
	// size is the block taken last, nodes the relays up it was sized for
	size, nodes int64
	until       time.Time // when what is held shrinks to what peak needed
	// confirmed is when Redis last said it holds the slots (they were
	// taken, or a renewal found them)
	confirmed time.Time
	refill    *refill  // a request is taking the next block
	draining  []string // slots given back while requests used them
}

// held reports whether slots are held.
func (b *slotBlock) held() bool { return len(b.ids) > 0 }

// fresh reports whether the slots may admit at now: Redis confirmed
// them within three quarters of a lease, so they have not expired there.
func (b *slotBlock) fresh(now time.Time, lease time.Duration) bool {
	return now.Before(b.confirmed.Add(lease * 3 / 4))
}

// free reports whether a slot is held and free, and may admit at now.
func (b *slotBlock) free(now time.Time, lease time.Duration) bool {
	return b.used < int64(len(b.ids)) && b.fresh(now, lease)
}

// use admits one request on a slot held and free, at now; its gen, or 0.
func (b *slotBlock) use(now time.Time, lease time.Duration) uint64 {
	if !b.free(now, lease) {
		return 0
	}
	b.used++
	b.peak = max(b.peak, b.used)
	return b.gen
}

// end gives back every slot: it returns the unused ones, to give back
// now; the used ones drain as their requests end.
func (b *slotBlock) end(next *uint64) []string {
	if !b.held() {
		return nil
	}
	free := b.ids[b.used:]
	b.draining = append(b.draining, b.ids[:b.used]...)
	*next++
	*b = slotBlock{gen: *next, refill: b.refill, draining: b.draining}
	return free
}

// shrink gives back, at now (its until passed), the slots the peak of the
// last slotLease did not need, in whole blocks of size; it returns them.
func (b *slotBlock) shrink(now time.Time, every time.Duration) []string {
	keep := min(int64(len(b.ids)), (b.peak+b.size-1)/b.size*b.size)
	keep = max(keep, b.used)
	free := b.ids[keep:]
	b.ids = b.ids[:keep:keep] // what is appended next does not write over free
	b.peak, b.until = b.used, now.Add(every)
	if len(b.ids) == 0 {
		b.until = time.Time{}
	}
	return free
}

// slotUse is how an admission uses the node's slots.
type slotUse struct {
	gen   uint64 // > 0: it took a slot held, of gen
	ask   int64  // > 0: it takes a block of up to ask
	nodes int64
}

// prepareSlots decides how the call c takes its concurrency slot under
// spec at now (s.mu held): from the slots held, with a new block, or one
// slot for itself (lease set, asked of Redis). It returns slots to give
// back.
func (s *sharedLimit) prepareSlots(c *admitCall, now time.Time, spec Spec) (free []string) {
	b := &s.cb
	size := min(s.f.blockSize(float64(spec.Concurrency), minSlotBlock), maxSlotBlock)
	if size == 0 { // not leased: slots still held go back
		c.g.lease, c.redis = s.f.LeaseID(), true
		return b.end(&s.gens)
	}
	if gen := b.use(now, s.f.Lease); gen != 0 {
		c.slots.gen, c.g.slotGen = gen, gen
		return nil
	}
	c.g.lease, c.redis = s.f.LeaseID(), true
	if b.refill != nil { // another request is taking the next block: this one asks alone
		return nil
	}
	if b.held() && !b.fresh(now, s.f.Lease) {
		free = b.end(&s.gens)
	}
	if b.gen == 0 {
		s.gens++
		b.gen = s.gens
	}
	s.startRefill(&b.refill)
	c.slots.ask, c.slots.nodes = size, s.f.RelaysUp()
	return free
}

// undoSlots puts back the slot the call took, or ends its taking of a
// block (s.mu held). It returns a slot to give back to Redis: when the
// slots were given back meanwhile, one of those the requests used.
func (c *admitCall) undoSlots() (back string) {
	b := &c.s.cb
	if c.slots.gen != 0 {
		back = b.unuse(c.slots.gen)
	}
	if c.slots.ask > 0 {
		c.s.endRefill(&b.refill, c.down)
	}
	c.slots = slotUse{}
	return back
}

// lostBlock is the ids of the block of slots the call asked Redis for,
// when its answer was lost (a timeout): Redis may have taken them, and
// nothing renews them, so they go back rather than sit out a lease.
func (c *admitCall) lostBlock() []string {
	if c.slots.ask <= 0 || c.g.lease == "" {
		return nil
	}
	ids := make([]string, c.slots.ask)
	for i := range ids {
		ids[i] = c.g.lease + "/" + strconv.Itoa(i+1)
	}
	return ids
}

// unuse ends the use of a slot of gen: it is free again, or, when the
// slots of gen were given back while it was used, one of those used goes
// back to Redis (returned).
func (b *slotBlock) unuse(gen uint64) string {
	if gen == b.gen && b.used > 0 {
		b.used--
		return ""
	}
	n := len(b.draining)
	if n == 0 {
		return ""
	}
	id := b.draining[n-1]
	b.draining = b.draining[:n-1]
	return id
}

// grantSlots takes in the block of got slots the call took, one of them
// the request's, at now (s.mu held). It returns the slots to renew.
func (c *admitCall) grantSlots(now time.Time, g *Grant, got int64) []string {
	if c.slots.ask <= 0 {
		return nil
	}
	s, b := c.s, &c.s.cb
	s.endRefill(&b.refill, false)
	if got <= 0 {
		return nil
	}
	if !b.held() {
		b.until = now.Add(s.f.slotLease())
	}
	ids := make([]string, got)
	for i := range ids {
		ids[i] = g.lease + "/" + strconv.Itoa(i+1)
	}
	b.ids = append(b.ids, ids...)
	b.size, b.nodes, b.confirmed = c.slots.ask, c.slots.nodes, now
	b.used++
	b.peak = max(b.peak, b.used)
	g.lease, g.slotGen = "", b.gen
	return ids
}

// freeSlot gives back the slot of a request that ends, which a block of
// gen admitted: to the node's slots, or, when they were given back while
// it ran, to Redis.
func (s *sharedLimit) freeSlot(gen uint64) {
	s.mu.Lock()
	id := s.cb.unuse(gen)
	s.mu.Unlock()
	if id != "" {
		s.f.releaseSlots(s, []string{id})
	}
}

// releaseSlots stops renewing slots of s and gives them back, off the
// request's path: with the next admission, or the worker.
func (f *Shared) releaseSlots(s *sharedLimit, ids []string) {
	if len(ids) == 0 {
		return
	}
	refs := make([]leaseRef, len(ids))
	f.leaseMu.Lock()
	for i, id := range ids {
		refs[i] = leaseRef{s.lease, id}
		delete(f.leases, refs[i])
	}
	f.leaseMu.Unlock()
	if !f.Cluster {
		f.pendSlots(refs...)
		return
	}
	for _, id := range ids {
		f.queueRelease(release{limit: s, lease: id})
	}
}

// holdSlots records slots this node renews until it gives them back.
func (f *Shared) holdSlots(s *sharedLimit, ids []string) {
	f.leaseMu.Lock()
	for _, id := range ids {
		f.leases[leaseRef{s.lease, id}] = struct{}{}
	}
	f.leaseMu.Unlock()
}

// endSlots ends (all) or shrinks (its time came, at now) what s holds of
// slots, and gives back what that frees (s.mu not held); it returns
// whether slots are still held and until when.
func (s *sharedLimit) endSlots(now time.Time, all bool) (bool, time.Time) {
	s.mu.Lock()
	b := &s.cb
	var free []string
	switch {
	case !b.held():
	case all || !b.fresh(now, s.f.Lease):
		free = b.end(&s.gens)
	case !now.Before(b.until):
		free = b.shrink(now, s.f.slotLease())
	}
	held, until := b.held(), b.until
	s.mu.Unlock()
	s.f.releaseSlots(s, free)
	return held, until
}

// slotCheck is one sharedLimit's slots a renewal looks for: the first
// held, of gen.
type slotCheck struct {
	s   *sharedLimit
	gen uint64
	id  string
}

// slotChecks lists the slots of blocks held, one per sharedLimit.
func (f *Shared) slotChecks() []slotCheck {
	f.blocksMu.Lock()
	defer f.blocksMu.Unlock()
	var out []slotCheck
	for s := range f.blocks {
		s.mu.Lock()
		if s.cb.held() {
			out = append(out, slotCheck{s, s.cb.gen, s.cb.ids[0]})
		}
		s.mu.Unlock()
	}
	return out
}

// checkSlots asks, in the renewal's pipeline, whether Redis still holds
// the slots of checks; confirm takes in the answers.
func checkSlots(ctx context.Context, pipe redis.Pipeliner, leaseMs int64, checks []slotCheck) []*redis.Cmd {
	cmds := make([]*redis.Cmd, len(checks))
	for i, c := range checks {
		cmds[i] = renewScript.Eval(ctx, pipe, []string{c.s.lease}, leaseMs, c.id)
	}
	return cmds
}

// confirmSlots records that a renewal begun at start found the slots of
// checks (answers, of checkSlots), or that it did not: such slots are not
// admitted from, and are ended by the next request or the worker.
func confirmSlots(start time.Time, checks []slotCheck, answers []*redis.Cmd) {
	for i, c := range checks {
		found, err := answers[i].Int64()
		if err != nil {
			continue
		}
		c.s.mu.Lock()
		if b := &c.s.cb; b.gen == c.gen && b.held() && b.ids[0] == c.id {
			if found > 0 && start.After(b.confirmed) {
				b.confirmed = start
			} else if found == 0 {
				b.confirmed = time.Time{}
			}
		}
		c.s.mu.Unlock()
	}
}
