package limits

import (
	"context"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddyserver/caddy/v2"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/redistest"
)

// testNodes starts n nodes of one fleet on the Redis at addr, each
// sizing its blocks for n relays up (one process is one node to the
// heartbeats: TestHeartbeatsCountTheRelaysUp checks that count).
func testNodes(t *testing.T, addr, prefix string, n int) []*Shared {
	t.Helper()
	nodes := make([]*Shared, n)
	for i := range nodes {
		nodes[i] = testFleet(t, addr, prefix, 0)
		nodes[i].NodesPinned.Store(int64(n))
	}
	return nodes
}

// TestHeartbeatsCountTheRelaysUp: a heartbeat counts the relays seen
// within the last few heartbeats, which sizes the blocks; before the
// first, nothing is leased.
func TestHeartbeatsCountTheRelaysUp(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	f := &Shared{Client: &fleet.Client{Prefix: "beat:", Lease: fleet.DefaultLease}}
	if f.blockSize(6000, minRateBlock) != 0 {
		t.Fatal("a block was sized before the relays up were known")
	}
	f = testFleet(t, srv.Addr, "beat:", 0)
	now, _ := rdb.Time(ctx).Result()
	for i, seen := range []time.Duration{-time.Second, -3 * time.Second, -time.Minute} {
		rdb.ZAdd(ctx, "beat:{nodes}:seen", redis.Z{Score: float64(now.Add(seen).UnixMilli()), Member: "peer-" + strconv.Itoa(i)})
	}
	f.Beat()
	if up := f.NodesUp.Load(); up != 3 {
		t.Fatalf("%d relays up, want 3: this one and the two seen in the last %v", up, fleet.NodeGoneAfter)
	}
	if b := f.blockSize(6000, minRateBlock); b != 200 {
		t.Fatalf("a block of 6000/m for 3 relays: %d, want 200", b)
	}
	if b := f.blockSize(299, minRateBlock); b != 0 {
		t.Fatalf("a limit of 299 for 3 relays (blocks of 9) is leased in blocks of %d, want none", b)
	}
	if b := f.blockSize(299_999, minTokenBlock); b != 0 {
		t.Fatalf("tokens of 299,999 for 3 relays are leased in blocks of %d, want none", b)
	}
}

// redisRate reads the requests a rate of n a period has left in Redis,
// as GCRA counts them from its stored arrival time, and Redis's time.
func redisRate(t *testing.T, rdb *redis.Client, key string, spec Rate) (left float64) {
	t.Helper()
	ctx := context.Background()
	now, err := rdb.Time(ctx).Result()
	if err != nil {
		t.Fatal(err)
	}
	tat, err := rdb.Get(ctx, key).Float64()
	if err == redis.Nil {
		return spec.N
	}
	if err != nil {
		t.Fatal(err)
	}
	emission := float64(spec.Period.Milliseconds()) / spec.N
	nowMs := float64(now.UnixNano()) / 1e6
	return spec.N - math.Max(0, tat-nowMs)/emission
}

// hammer takes from the limiters of nodes with workers goroutines each,
// every worker until the limit refuses it, and returns how many were
// admitted.
func hammer(t *testing.T, nodes []*Limiter, workers int) int64 {
	t.Helper()
	var admitted atomic.Int64
	var wg sync.WaitGroup
	for _, l := range nodes {
		for range workers {
			wg.Go(func() {
				for {
					g, scope, _ := l.Take(time.Now(), -1)
					if scope != ScopeNone {
						if scope != ScopeRate {
							t.Errorf("refused by %q, want rate", scope)
						}
						return
					}
					admitted.Add(1)
					l.Done(time.Now(), g, 0)
				}
			})
		}
	}
	wg.Wait()
	return admitted.Load()
}

// TestASmallLimitStaysExactAcrossNodes: 30 a minute on three nodes is too
// small to lease (a block would be one request), so every request asks
// Redis and the fleet admits 30 (one more should the rate refill one
// while the test runs).
func TestASmallLimitStaysExactAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	spec := Spec{Rate: Rate{N: 30, Period: time.Minute}}
	var nodes []*Limiter
	for _, f := range testNodes(t, srv.Addr, "small:", 3) {
		nodes = append(nodes, sharedLimiter(t, f, "k:small", spec))
	}
	if n := hammer(t, nodes, 4); n < 30 || n > 31 {
		t.Fatalf("three nodes admitted %d of a rate of 30/m, want 30 (+1)", n)
	}
	for _, l := range nodes {
		if s := l.shared.Load(); s.rb.held() || s.gens != 0 {
			t.Fatal("a node leased a block of a limit of 30/m across 3 nodes")
		}
	}
}

// TestALargeLimitStaysWithinOneBlockPerNode: 6000 a minute on three nodes
// is leased in blocks of 200 (6000 / (10 x 3)). Under load from three
// nodes at once the fleet admits what the exact limit would, give or take
// one block per node, and asks Redis for a fraction of its requests.
func TestALargeLimitStaysWithinOneBlockPerNode(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	spec := Spec{Rate: Rate{N: 6000, Period: time.Minute}}
	fleets := testNodes(t, srv.Addr, "large:", 3)
	var nodes []*Limiter
	for _, f := range fleets {
		nodes = append(nodes, sharedLimiter(t, f, "k:large", spec))
	}
	ctx := context.Background()
	start, _ := rdb.Time(ctx).Result()
	before := admitOps(t)
	admitted := int64(0)
	for i, l := range nodes { // each node takes its first block
		g, scope, _ := l.Take(time.Now(), -1)
		if scope != ScopeNone {
			t.Fatal(scope)
		}
		admitted++
		l.Done(time.Now(), g, 0)
		// GET /relay/fleet states the bound with each node's blocks
		infos := fleets[i].blockInfos(time.Now())
		if len(infos) != 1 {
			t.Fatalf("a node lists %d blocks, want 1", len(infos))
		}
		if b := infos[0]; b.Limit != "k:large" || b.Kind != "requests" || b.Block != 200 || b.Left != 199 || b.Nodes != 3 || b.MaxFleetError != 600 {
			t.Errorf("block info %+v", b)
		}
	}
	// one request at a time on each node: a round trip per block of 200
	var wg sync.WaitGroup
	for _, l := range nodes {
		wg.Go(func() {
			for range 999 {
				g, scope, _ := l.Take(time.Now(), -1)
				if scope != ScopeNone {
					t.Errorf("refused by %q with the limit far from spent", scope)
					return
				}
				l.Done(time.Now(), g, 0)
			}
		})
	}
	wg.Wait()
	admitted += 3 * 999
	if ops := admitOps(t) - before; ops != 15 {
		t.Errorf("3000 requests, 1000 on each node, asked Redis %v times, want 15: 5 blocks of 200 a node", ops)
	}
	// then eight at a time on each, until the limit refuses them all (a
	// request that comes while its node takes the next block asks Redis
	// alone)
	admitted += hammer(t, nodes, 8)
	end, _ := rdb.Time(ctx).Result()
	// the exact limit: its burst, and what it refilled meanwhile (100/s)
	exact := 6000 + end.Sub(start).Seconds()*100
	const bound = 3 * 200 // one block per node
	if d := float64(admitted) - exact; d > bound || d < -bound {
		t.Fatalf("admitted %d, the exact limit %.0f: off by %.0f, the bound is %d", admitted, exact, d, bound)
	}
}

// TestAStoppedNodeGivesBackItsBlock: a node that stops gives back what is
// left of its block, and the others can then use it.
func TestAStoppedNodeGivesBackItsBlock(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// an hour's period: the rate refills under 2 a second while it runs
	spec := Spec{Rate: Rate{N: 6000, Period: time.Hour}}
	fleets := testNodes(t, srv.Addr, "stop:", 3)
	a := sharedLimiter(t, fleets[0], "k:stop", spec)
	others := []*Limiter{sharedLimiter(t, fleets[1], "k:stop", spec), sharedLimiter(t, fleets[2], "k:stop", spec)}
	g, scope, _ := a.Take(time.Now(), -1)
	if scope != ScopeNone {
		t.Fatal(scope)
	}
	a.Done(time.Now(), g, 0)
	if left := redisRate(t, rdb, "stop:{k:stop}:rate", spec.Rate); left > 5800+1 {
		t.Fatalf("Redis has %.1f left after a block of 200 was taken, want 5800", left)
	}
	// the two others spend the rest: a's block of 199 is not theirs
	first := hammer(t, others, 4)
	if first < 5800-400 || first > 5800+400+2 {
		t.Fatalf("the other nodes admitted %d, want 5800 less their own blocks' rests", first)
	}
	// a stops: its 199 go back to Redis, and the others take them
	if err := stop(fleets[0]); err != nil {
		t.Fatal(err)
	}
	then := hammer(t, others, 4)
	if then < 199 || then > 199+2 {
		t.Fatalf("after a node stopped, the others admitted %d more, want its block's 199 (+2 refilled)", then)
	}
}

// TestABlockIsNotUsedPastItsLease: a block admits locally until its lease
// ends, on the clock of the requests; the first request after that ends
// it, gives back what is left and takes a new one, in one call.
func TestABlockIsNotUsedPastItsLease(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	spec := Spec{Rate: Rate{N: 6000, Period: time.Hour}} // alone: blocks of 600
	f := testNodes(t, srv.Addr, "expiry:", 1)[0]
	l := sharedLimiter(t, f, "k:exp", spec)
	s := l.shared.Load()
	lease := f.blockLease(spec.Rate.Period)
	if lease != fleet.DefaultLease {
		t.Fatalf("a block of a limit per hour is leased for %v, want the storage lease %v", lease, fleet.DefaultLease)
	}
	t0 := time.Now()
	take := func(at time.Time) {
		t.Helper()
		g, scope, _ := l.Take(at, -1)
		if scope != ScopeNone {
			t.Fatal(scope)
		}
		l.Done(at, g, 0)
	}
	left := func() float64 { return redisRate(t, rdb, "expiry:{k:exp}:rate", spec.Rate) }
	take(t0)
	if got := left(); got > 5400+1 || s.gens != 1 {
		t.Fatalf("after the first request: %.1f left in Redis and %d blocks, want 5400 and 1", got, s.gens)
	}
	before := admitOps(t)
	for i := range 9 {
		take(t0.Add(lease - time.Duration(9-i)*time.Millisecond))
	}
	if ops := admitOps(t) - before; ops != 0 || s.gens != 1 {
		t.Fatalf("9 requests within the lease asked Redis %v times and took %d blocks, want none", ops, s.gens-1)
	}
	// the lease is over: 590 are left of the block; they go back and a
	// new block of 600 comes, in the request's one call
	take(t0.Add(lease))
	if ops := admitOps(t) - before; ops != 1 || s.gens != 3 {
		t.Fatalf("the request after the lease asked Redis %v times (%d lives), want once, one block ended and one begun", ops, s.gens)
	}
	if got := left(); got > 5400+590-600+1 || got < 5400+590-600 {
		t.Fatalf("Redis has %.1f left, want 5390: 590 given back, 600 taken", got)
	}
	// the worker ends a block whose lease ran out with nobody asking
	f.endBlocks(t0.Add(2*lease), false)
	waitFor(t, "the block's rest reaches Redis", 2*time.Second, func() bool { return left() >= 5390+599 })
	if s.rb.held() {
		t.Fatal("the block is held after its lease")
	}
}

// TestATokenBlockTakesCorrectionsAndGivesBackItsRest: a token limit's
// block is charged the estimates and corrections of the requests it
// admitted, and gives back the rest when it ends; a request larger than
// what is left puts it in debt, charged to Redis when the next block is
// taken.
func TestATokenBlockTakesCorrectionsAndGivesBackItsRest(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	// 10M tokens over 1000 hours: alone, blocks of 1M; 3 tokens a second
	// refill while it runs
	spec := Spec{Tokens: Rate{N: 10_000_000, Period: 1000 * time.Hour}}
	f := testNodes(t, srv.Addr, "tokblock:", 1)[0]
	l := sharedLimiter(t, f, "k:tok", spec)
	level := func() float64 {
		t.Helper()
		v, err := rdb.HGet(context.Background(), "tokblock:{k:tok}:tokens", "level").Float64()
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	now := time.Now()
	g, scope, _ := l.Take(now, 1000)
	if scope != ScopeNone {
		t.Fatal(scope)
	}
	if got := level(); got != 9_000_000 {
		t.Fatalf("Redis holds %.0f after a block of 1M was taken, want 9M", got)
	}
	l.Charge(now, &g, 500) // the body said more
	l.Done(now, g, 2500)   // it used 2500
	g2, scope, _ := l.Take(now, 996_000)
	if scope != ScopeNone {
		t.Fatal(scope)
	}
	l.Done(now, g2, 1_000_000) // 4000 more than its estimate: the block is 2500 in debt
	if got := level(); got > 9_000_000+10 {
		t.Fatalf("Redis holds %.0f: the block's charges went to Redis", got)
	}
	// the block is in debt: the next request takes a new block, and the
	// debt is charged with it
	g3, scope, _ := l.Take(now, 10)
	if scope != ScopeNone {
		t.Fatal(scope)
	}
	l.Done(now, g3, 10)
	if got := level(); got < 9_000_000-2500-1_000_000 || got > 9_000_000-2500-1_000_000+100 {
		t.Fatalf("Redis holds %.0f, want 7,997,500: 2500 of debt and a new block charged", got)
	}
	// the block ends: its rest (1M - 10) goes back
	l.shared.Load().endAllBlocks()
	waitFor(t, "the rest of the block reaches Redis", 2*time.Second, func() bool { return level() >= 8_997_490 })
	if got := level(); got > 8_997_490+100 {
		t.Fatalf("Redis holds %.0f, want 8,997,490", got)
	}
}

// TestBlocksOutliveRedisForTheirLease: while Redis is down, a node admits
// from the block it holds; once the block is spent, on_error decides:
// refused (deny), or this relay's own limits (local).
func TestBlocksOutliveRedisForTheirLease(t *testing.T) {
	srv := redistest.Start(t)
	spec := Spec{Rate: Rate{N: 1000, Period: time.Hour}} // two nodes: blocks of 50
	deny := newShared(t, &fleet.Config{Address: []string{srv.Addr}, Prefix: "down:", OnError: "deny", Timeout: caddy.Duration(time.Second)})
	local := testFleet(t, srv.Addr, "down:", 0)
	now := time.Now()
	var nodes []*Limiter
	for _, f := range []*Shared{deny, local} {
		f.NodesPinned.Store(2)
		l := sharedLimiter(t, f, "k:down", spec)
		g, scope, _ := l.Take(now, -1)
		if scope != ScopeNone {
			t.Fatal(scope)
		}
		l.Done(now, g, 0)
		nodes = append(nodes, l)
	}
	srv.Kill()
	for i, then := range []Scope{ScopeFleetDown, ScopeNone} {
		l := nodes[i]
		admitted := 0
		for range 100 {
			g, scope, _ := l.Take(now, -1)
			if scope != ScopeNone {
				if scope != then {
					t.Fatalf("refused by %q, want %q", scope, then)
				}
				break
			}
			s := l.shared.Load()
			s.mu.Lock()
			held := s.rb.held()
			s.mu.Unlock()
			if !held {
				t.Fatal("admitted on this relay's own limits with the block not spent")
			}
			admitted++
			l.Done(now, g, 0)
			if admitted == 49 && then == ScopeNone {
				break
			}
		}
		if admitted != 49 {
			t.Fatalf("admitted %d from a block of 50 (one used) with Redis down, want 49", admitted)
		}
	}
	// on_error local: this relay's own limits once the block is spent
	if _, scope, _ := nodes[1].Take(now, -1); scope != ScopeNone {
		t.Fatalf("on_error local with the block spent: refused by %q", scope)
	}
}

// BenchmarkFleetAdmit admits and gives back one request against a key's
// limits kept in a real redis-server on loopback, as one relay of a fleet
// of one: a rate and a token limit large enough to lease (and, as the
// benchmark harness's target (g), a concurrency limit large enough to
// lease in blocks of slots; and a concurrency limit alone), with blocks
// and with every admission asked of Redis. It reports the admissions
// asked of Redis per request.
func BenchmarkFleetAdmit(b *testing.B) {
	srv := redistest.Start(b)
	// far above what the loop spends (a request a microsecond, 2,600
	// tokens each), so that nothing is refused
	large := Spec{Rate: Rate{N: 1e9, Period: time.Second}, Tokens: Rate{N: 1e13, Period: time.Second}}
	withConc := large
	withConc.Concurrency = 100_000
	concOnly := Spec{Concurrency: 100_000}
	for _, c := range []struct {
		name   string
		spec   Spec
		leases bool
	}{
		{"rate+tokens/leased", large, true},
		{"rate+tokens/each-in-redis", large, false},
		{"rate+tokens+concurrency/leased", withConc, true},
		{"rate+tokens+concurrency/each-in-redis", withConc, false},
		{"concurrency/leased", concOnly, true},
		{"concurrency/each-in-redis", concOnly, false},
	} {
		b.Run(c.name, func(b *testing.B) {
			f := testFleet(b, srv.Addr, "bench-"+c.name+":", 0)
			f.NodesPinned.Store(1)
			f.noLeases.Store(!c.leases)
			l := new(Limiter)
			l.Configure(c.spec, time.Now())
			l.Share(f, "k:bench")
			before := admitOps(b)
			b.ReportAllocs()
			b.ResetTimer()
			for b.Loop() {
				now := time.Now()
				g, scope, _ := l.Take(now, 2500)
				if scope != ScopeNone {
					b.Fatal(scope)
				}
				l.Done(now, g, 2600)
			}
			b.StopTimer()
			b.ReportMetric((admitOps(b)-before)/float64(b.N), "admits/op")
		})
	}
}
