package limits

import (
	"context"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
)

// Shared is the limits' part of a relay's membership of a fleet: the
// leases it renews, the blocks of large limits it holds, the slots it
// gives back, and the workers that keep them, on the fleet's client.
type Shared struct {
	// Client is the fleet's Redis client, shared with the other concerns
	*fleet.Client

	leaseMu sync.Mutex
	leases  map[leaseRef]struct{} // slots this node holds, renewed until given back
	// holdLeases are its requests' holds of budgets, renewed until their
	// cost is added to the fleet's spend (guarded by leaseMu)
	holdLeases map[leaseRef]struct{}

	// blocks are the sharedLimits of which this node holds a block of a
	// large limit (fleet_leases.go); blocksNew wakes the worker that ends
	// them when their lease runs out
	blocksMu  sync.Mutex
	blocks    map[*sharedLimit]struct{}
	blocksNew chan struct{}
	// noLeases takes no blocks: every limit is asked of Redis at every
	// request (for tests and benchmarks that compare)
	noLeases atomic.Bool
	now      func() time.Time // the clock blocks' leases end by

	// slots are concurrency slots freed on this relay and not given back
	// yet: the next admission carries them, or giveBackSlots after
	// slotDelay; slotsNew wakes it
	slotsMu   sync.Mutex
	slots     []leaseRef
	slotsNew  chan struct{}
	slotDelay atomic.Int64 // ns
	// slotEvery is how long a node keeps the slots its requests' peak
	// needed before it gives back the rest (fleet_slots.go), in ns
	slotEvery atomic.Int64

	releases chan release // given back off the request path
}

// New keeps limits in the fleet of c: it reports its blocks in c's
// heartbeats and runs its workers with c's background work (c.Go); when
// that stops (c.Stop), Flush gives back what the node still holds.
func New(c *fleet.Client) *Shared {
	f := &Shared{
		Client:     c,
		leases:     map[leaseRef]struct{}{},
		holdLeases: map[leaseRef]struct{}{},
		blocks:     map[*sharedLimit]struct{}{},
		blocksNew:  make(chan struct{}, 1),
		slotsNew:   make(chan struct{}, 1),
		now:        time.Now,
		releases:   make(chan release, 4096),
	}
	f.slotDelay.Store(int64(defaultSlotDelay))
	f.slotEvery.Store(int64(min(defaultSlotEvery, f.Lease)))
	c.ReportBlocks(func() []fleet.Block { return f.blockInfos(f.now()) })
	for _, run := range []func(context.Context){f.renewLeases, f.giveBack, f.expireBlocks, f.giveBackSlots} {
		c.Go(run)
	}
	return f
}

// NoLeases, on, takes no blocks: every limit is asked of Redis at every
// request (for tests and benchmarks that compare).
func (f *Shared) NoLeases(on bool) { f.noLeases.Store(on) }

// Flush gives back, once the workers have stopped, what this node
// still holds: the unused part of its blocks of large limits, what the
// worker had not given back yet, the slots freed and not given back, and
// the slots still held. The holds of requests still in flight expire with
// their lease: their cost is not known yet.
func (f *Shared) Flush() {
	f.endBlocks(f.now(), true)
	var rest []release
	for len(f.releases) > 0 {
		rest = append(rest, <-f.releases)
	}
	if len(rest) > 0 {
		f.flush(rest)
	}
	f.flushSlots()
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	f.leaseMu.Lock()
	pipe := f.Redis.Pipeline()
	for l := range f.leases {
		pipe.ZRem(ctx, l.set, l.id)
	}
	f.leaseMu.Unlock()
	_, _ = pipe.Exec(ctx)
}
