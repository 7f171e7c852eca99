package limits

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/memtest"
	"github.com/caddy-relay/relay/internal/redistest"
)

// slotsHeld is the number of members of a lease set in Redis.
func slotsHeld(t *testing.T, rdb *redis.Client, set string) int64 {
	t.Helper()
	n, err := rdb.ZCard(context.Background(), set).Result()
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// takeN admits n requests on l, one after the other, and returns their
// grants, to give back with done.
func takeN(t *testing.T, l *Limiter, n int) []Grant {
	t.Helper()
	gs := make([]Grant, n)
	for i := range gs {
		g, scope, _ := l.Take(time.Now(), -1)
		if scope != ScopeNone {
			t.Fatalf("request %d of %d: refused by %q", i+1, n, scope)
		}
		gs[i] = g
	}
	return gs
}

// slotState is what s holds of slots: held, used.
func slotState(s *sharedLimit) (held, used int64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return int64(len(s.cb.ids)), s.cb.used
}

// TestSlotsAreLeasedInBlocks: a concurrency of 1000 on one node is leased
// in blocks of 100 slots. The first request takes a block in its one
// call, the next 99 in flight ask Redis nothing, the 101st takes the next
// block; the slots count in Redis whether used or not, and GET
// /relay/fleet lists them. When the lease of the peak passes, the node
// shrinks to what its peak needed, and then, idle, gives back all.
func TestSlotsAreLeasedInBlocks(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	f := testNodes(t, srv.Addr, "slotblk:", 1)[0]
	f.slotEvery.Store(int64(time.Hour)) // the worker shrinks nothing: the test does
	l := sharedLimiter(t, f, "k:blk", Spec{Concurrency: 1000})
	s := l.shared.Load()
	const set = "slotblk:{k:blk}:leases"
	before := admitOps(t)
	gs := takeN(t, l, 100)
	if ops := admitOps(t) - before; ops != 1 {
		t.Fatalf("100 requests in flight asked Redis %v times, want 1: a block of 100", ops)
	}
	if n := slotsHeld(t, rdb, set); n != 100 {
		t.Fatalf("Redis holds %d slots, want the block's 100", n)
	}
	gs = append(gs, takeN(t, l, 1)...)
	if ops := admitOps(t) - before; ops != 2 {
		t.Fatalf("the 101st request in flight: %v round trips in all, want 2: the next block", ops)
	}
	if n := slotsHeld(t, rdb, set); n != 200 {
		t.Fatalf("Redis holds %d slots, want two blocks' 200", n)
	}
	infos := f.blockInfos(time.Now())
	if len(infos) != 1 {
		t.Fatalf("blocks listed: %+v", infos)
	}
	if b := infos[0]; b.Limit != "k:blk" || b.Kind != "concurrency" || b.Block != 100 || b.Held != 200 || b.Left != 99 ||
		b.Nodes != 1 || b.MaxFleetError != 100 || b.Until.IsZero() {
		t.Fatalf("block info %+v", b)
	}
	for _, g := range gs[:90] {
		l.Done(time.Now(), g, 0)
	}
	if held, used := slotState(s); held != 200 || used != 11 {
		t.Fatalf("after 90 ended: %d held, %d used, want 200 and 11", held, used)
	}
	// the lease of the peak (101) passes: it keeps two blocks
	leaseEnds := func() {
		s.mu.Lock()
		s.cb.until = time.Now()
		s.mu.Unlock()
		f.endBlocks(time.Now(), false)
	}
	leaseEnds()
	if held, _ := slotState(s); held != 200 {
		t.Fatalf("after the peak's lease: %d held, want 200 (the peak of 101 needed two blocks)", held)
	}
	// another lease at 11 in flight: one block is enough
	leaseEnds()
	if held, _ := slotState(s); held != 100 {
		t.Fatalf("after a lease at 11 in flight: %d held, want one block of 100", held)
	}
	waitFor(t, "the second block's slots given back", 2*time.Second, func() bool { return slotsHeld(t, rdb, set) == 100 })
	for _, g := range gs[90:] {
		l.Done(time.Now(), g, 0)
	}
	// idle for a lease: everything goes back
	leaseEnds()
	leaseEnds()
	if held, used := slotState(s); held != 0 || used != 0 {
		t.Fatalf("idle: %d held, %d used, want none", held, used)
	}
	waitFor(t, "every slot given back", 2*time.Second, func() bool { return slotsHeld(t, rdb, set) == 0 })
	if infos := f.blockInfos(time.Now()); len(infos) != 0 {
		t.Fatalf("blocks listed with none held: %+v", infos)
	}
}

// TestASmallConcurrencyStaysExact: a concurrency whose block would be
// under 10 slots (99 on one node, 299 on three) takes a slot per request
// in Redis, as before: one round trip each, and no block.
func TestASmallConcurrencyStaysExact(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	for _, c := range []struct {
		nodes int
		n     int64
	}{{1, 99}, {3, 299}} {
		f := testNodes(t, srv.Addr, "slotsmall:", c.nodes)[0]
		l := sharedLimiter(t, f, "k:small", Spec{Concurrency: c.n})
		before := admitOps(t)
		gs := takeN(t, l, 5)
		if ops := admitOps(t) - before; ops != 5 {
			t.Fatalf("%d on %d nodes: 5 requests asked Redis %v times, want 5", c.n, c.nodes, ops)
		}
		if n := slotsHeld(t, rdb, "slotsmall:{k:small}:leases"); n != 5 {
			t.Fatalf("%d on %d nodes: Redis holds %d slots, want the 5 requests'", c.n, c.nodes, n)
		}
		if s := l.shared.Load(); s.gens != 0 || len(s.cb.ids) != 0 {
			t.Fatalf("%d on %d nodes: a block of slots was taken", c.n, c.nodes)
		}
		for _, g := range gs {
			l.Done(time.Now(), g, 0)
		}
		waitFor(t, "the slots given back", 2*time.Second, func() bool { return slotsHeld(t, rdb, "slotsmall:{k:small}:leases") == 0 })
	}
}

// TestLeasedSlotsHoldTheLimitAcrossNodes: three nodes share a concurrency
// of 300, in blocks of 10. Workers on every node take slots and hold them
// until the limit refuses them: never more than 300 are held at once
// fleet-wide, at least 300 less a block per node are, and then every node
// is refused. Once they end, the whole limit can be taken again.
func TestLeasedSlotsHoldTheLimitAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	const limit, nodes, workers = 300, 3, 40
	spec := Spec{Concurrency: limit}
	var ls []*Limiter
	fleets := testNodes(t, srv.Addr, "slotfleet:", nodes)
	for _, f := range fleets {
		ls = append(ls, sharedLimiter(t, f, "k:fleet", spec))
	}
	var inFlight, most atomic.Int64
	var mu sync.Mutex
	held := map[*Limiter][]Grant{}
	var wg sync.WaitGroup
	for _, l := range ls {
		for range workers {
			wg.Go(func() {
				for {
					g, scope, _ := l.Take(time.Now(), -1)
					if scope != ScopeNone {
						if scope != ScopeConcurrency {
							t.Errorf("refused by %q, want concurrency", scope)
						}
						return
					}
					n := inFlight.Add(1)
					for m := most.Load(); n > m && !most.CompareAndSwap(m, n); m = most.Load() {
					}
					mu.Lock()
					held[l] = append(held[l], g)
					mu.Unlock()
				}
			})
		}
	}
	wg.Wait()
	if m := most.Load(); m > limit {
		t.Fatalf("%d requests in flight at once, the limit is %d", m, limit)
	}
	if n := inFlight.Load(); n < limit-nodes*10 {
		t.Fatalf("%d requests in flight when every node was refused, want at least %d: the limit less a block per node", n, limit-nodes*10)
	}
	if n := slotsHeld(t, rdb, "slotfleet:{k:fleet}:leases"); n != limit {
		t.Fatalf("Redis holds %d slots, want all %d: the blocks count, used or not", n, limit)
	}
	for i, l := range ls {
		if _, scope, _ := l.Take(time.Now(), -1); scope != ScopeConcurrency {
			t.Fatalf("node %d with the limit taken: %q, want concurrency", i, scope)
		}
	}
	for l, gs := range held {
		for _, g := range gs {
			l.Done(time.Now(), g, 0)
		}
	}
	for _, f := range fleets { // the slots taken alone go back now, not 2ms later
		f.flushSlots()
	}
	// a node's worker may be giving slots back as flushSlots finds none
	// left: Redis then holds, for a moment, more than the nodes do
	waitFor(t, "Redis to hold only the nodes' blocks", 2*time.Second, func() bool {
		var held int64
		for _, l := range ls {
			h, _ := slotState(l.shared.Load())
			held += h
		}
		return slotsHeld(t, rdb, "slotfleet:{k:fleet}:leases") == held
	})
	// one node alone can now take what the others do not hold unused
	var unused int64
	for _, l := range ls[1:] {
		h, u := slotState(l.shared.Load())
		unused += h - u
	}
	gs := takeN(t, ls[0], int(limit-unused))
	for _, g := range gs {
		ls[0].Done(time.Now(), g, 0)
	}
}

// TestSlotsGoBackOnAChangeAndAtStop: a changed limit gives back the
// unused slots at once, and each used one as its request ends; a node
// that stops gives back the slots of its blocks.
func TestSlotsGoBackOnAChangeAndAtStop(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	f := testNodes(t, srv.Addr, "slotchg:", 1)[0]
	f.slotDelay.Store(int64(time.Millisecond))
	l := sharedLimiter(t, f, "k:chg", Spec{Concurrency: 1000})
	const set = "slotchg:{k:chg}:leases"
	gs := takeN(t, l, 5)
	if n := slotsHeld(t, rdb, set); n != 100 {
		t.Fatalf("Redis holds %d slots, want a block of 100", n)
	}
	l.Configure(Spec{Concurrency: 2000}, time.Now())
	waitFor(t, "the 95 unused slots given back", 2*time.Second, func() bool { return slotsHeld(t, rdb, set) == 5 })
	for i, g := range gs {
		l.Done(time.Now(), g, 0)
		want := int64(4 - i)
		waitFor(t, "an ended request's slot given back", 2*time.Second, func() bool { return slotsHeld(t, rdb, set) == want })
	}
	// a new block, of the new size (200), then the node stops
	takeN(t, l, 3)
	if n := slotsHeld(t, rdb, set); n != 200 {
		t.Fatalf("Redis holds %d slots, want a block of 200", n)
	}
	if err := stop(f); err != nil {
		t.Fatal(err)
	}
	if n := slotsHeld(t, rdb, set); n != 0 {
		t.Fatalf("a node that stopped left %d slots in Redis", n)
	}
}

// TestSlotsOfADeadNodeExpire: a node that dies stops renewing its block's
// slots, and they expire within the storage's lease; a living node's are
// renewed.
func TestSlotsOfADeadNodeExpire(t *testing.T) {
	srv := redistest.Start(t)
	const lease = 600 * time.Millisecond
	spec := Spec{Concurrency: 200} // two nodes: blocks of 10
	dying := testFleet(t, srv.Addr, "slotdead:", lease)
	other := testFleet(t, srv.Addr, "slotdead:", lease)
	for _, f := range []*Shared{dying, other} {
		f.NodesPinned.Store(2)
	}
	a := sharedLimiter(t, dying, "k:d", spec)
	b := sharedLimiter(t, other, "k:d", spec)
	takeN(t, a, 195) // 20 blocks: 200 slots, 5 unused
	time.Sleep(2 * lease)
	// renewed while the node lives: the other gets nothing
	if _, scope, _ := b.Take(time.Now(), -1); scope != ScopeConcurrency {
		t.Fatalf("with the other node's renewed blocks: %q, want concurrency", scope)
	}
	slotsFreedByDeath(t, dying, b, lease, 3*lease)
}

// TestSlotsRedisLostAreNotUsed: slots a renewal does not find (Redis was
// emptied, or they expired while it was away) admit nothing more: the
// next request takes a new block.
func TestSlotsRedisLostAreNotUsed(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	f := testNodes(t, srv.Addr, "slotlost:", 1)[0]
	l := sharedLimiter(t, f, "k:lost", Spec{Concurrency: 1000})
	takeN(t, l, 1)
	f.renew()
	before := admitOps(t)
	takeN(t, l, 1)
	if ops := admitOps(t) - before; ops != 0 {
		t.Fatalf("a request on slots a renewal found asked Redis %v times", ops)
	}
	if err := rdb.FlushAll(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	f.renew()
	takeN(t, l, 1)
	if ops := admitOps(t) - before; ops != 1 {
		t.Fatalf("after Redis lost the slots, a request asked Redis %v times, want 1: a new block", ops)
	}
	if n := slotsHeld(t, rdb, "slotlost:{k:lost}:leases"); n != 100 {
		t.Fatalf("Redis holds %d slots, want the new block's 100", n)
	}
}

// TestLeasedSlotsAllocateNothing: a request that takes one of the node's
// slots allocates no more than one whose key has no concurrency limit.
func TestLeasedSlotsAllocateNothing(t *testing.T) {
	if memtest.Race {
		t.Skip("the race detector changes what code allocates; .ci/run runs this test without -race")
	}
	srv := redistest.Start(t)
	f := testNodes(t, srv.Addr, "slotalloc:", 1)[0]
	large := Spec{Rate: Rate{N: 1e9, Period: time.Second}, Tokens: Rate{N: 1e13, Period: time.Second}}
	withConc := large
	withConc.Concurrency = 100_000
	allocs := func(spec Spec, thing string) float64 {
		l := sharedLimiter(t, f, thing, spec)
		run := func() {
			g, scope, _ := l.Take(time.Now(), 2500)
			if scope != ScopeNone {
				t.Fatal(scope)
			}
			l.Done(time.Now(), g, 2600)
		}
		run() // takes the blocks
		return testing.AllocsPerRun(200, run)
	}
	without, with := allocs(large, "k:noconc"), allocs(withConc, "k:conc")
	if with > without {
		t.Fatalf("a request on a leased slot allocates %.1f, one without a concurrency limit %.1f", with, without)
	}
}

// TestASlotGoesBackWhenAnotherLimitRefuses: a request that took one of
// the node's slots and that its rate (too small to lease, so asked of
// Redis) refuses puts the slot back.
func TestASlotGoesBackWhenAnotherLimitRefuses(t *testing.T) {
	srv := redistest.Start(t)
	f := testNodes(t, srv.Addr, "slotundo:", 1)[0]
	l := sharedLimiter(t, f, "k:undo", Spec{Concurrency: 1000, Rate: Rate{N: 2, Period: time.Hour}})
	s := l.shared.Load()
	takeN(t, l, 2)
	if _, scope, _ := l.Take(time.Now(), -1); scope != ScopeRate {
		t.Fatalf("the third request of a rate of 2/h: %q, want rate", scope)
	}
	if held, used := slotState(s); held != 100 || used != 2 {
		t.Fatalf("%d slots held, %d used, want 100 and the 2 admitted", held, used)
	}
}

// TestSlotsInUseDrainOnePerRequest: slots given back all at once while
// requests use them go back one as each of those requests ends, whether
// it ends normally or is taken back.
func TestSlotsInUseDrainOnePerRequest(t *testing.T) {
	var gens uint64 = 1
	b := slotBlock{gen: 1, ids: []string{"a/1", "a/2", "a/3", "a/4"}, used: 2}
	if free := b.end(&gens); len(free) != 2 || free[0] != "a/3" || free[1] != "a/4" {
		t.Fatalf("given back at once: %v, want the two unused", free)
	}
	if b.held() || b.gen != 2 || len(b.draining) != 2 {
		t.Fatalf("after the end: %+v", b)
	}
	b.ids, b.used = []string{"b/1"}, 1 // a new block, of gen 2
	if id := b.unuse(1); id == "" || len(b.draining) != 1 || b.used != 1 {
		t.Fatalf("a request of the ended slots ends: %q given back, %d draining, %d used", id, len(b.draining), b.used)
	}
	if id := b.unuse(2); id != "" || b.used != 0 {
		t.Fatalf("a request of the new block ends: %q given back, %d used", id, b.used)
	}
	if id := b.unuse(1); id == "" || len(b.draining) != 0 {
		t.Fatalf("the last request of the ended slots: %q given back, %d draining", id, len(b.draining))
	}
}
