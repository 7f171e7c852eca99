package limits

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/redis/go-redis/v9"

	"github.com/caddy-relay/relay/internal/redistest"
)

// sharedLimiter is a limiter kept in fleet f under thing.
func sharedLimiter(t *testing.T, f *Shared, thing string, spec Spec) *Limiter {
	t.Helper()
	l := new(Limiter)
	l.Configure(spec, time.Now())
	l.Share(f, thing)
	if !l.InFleet() {
		t.Fatal("the limiter is not shared")
	}
	return l
}

func TestSharedConcurrencyAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	spec := Spec{Concurrency: 3}
	nodes := []*Limiter{
		sharedLimiter(t, testFleet(t, srv.Addr, "conc:", 0), "k:a", spec),
		sharedLimiter(t, testFleet(t, srv.Addr, "conc:", 0), "k:a", spec),
	}
	// 16 workers on two nodes take and give back slots as fast as they
	// can: never more than 3 are held at once, fleet-wide
	var held, most, admitted atomic.Int64
	var wg sync.WaitGroup
	for w := range 16 {
		wg.Go(func() {
			l := nodes[w%2]
			for range 40 {
				g, scope, _ := l.Take(time.Now(), -1)
				if scope != ScopeNone {
					if scope != ScopeConcurrency {
						t.Errorf("refused by %q, want concurrency", scope)
					}
					time.Sleep(time.Millisecond)
					continue
				}
				admitted.Add(1)
				n := held.Add(1)
				for cur := most.Load(); n > cur && !most.CompareAndSwap(cur, n); cur = most.Load() {
				}
				time.Sleep(500 * time.Microsecond)
				held.Add(-1)
				l.Done(time.Now(), g, 0)
			}
		})
	}
	wg.Wait()
	if most.Load() > 3 {
		t.Fatalf("%d slots held at once across the nodes, the limit is 3", most.Load())
	}
	if admitted.Load() == 0 || most.Load() < 2 {
		t.Fatalf("admitted %d, at most %d at once: the test did not exercise the limit", admitted.Load(), most.Load())
	}
	// every slot is given back (off the request path, so allow a moment)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	waitFor(t, "every lease given back", 2*time.Second, func() bool {
		n, err := rdb.ZCard(context.Background(), "conc:{k:a}:leases").Result()
		return err == nil && n == 0
	})
}

func TestSharedRateIsExactAcrossNodes(t *testing.T) {
	srv := redistest.Start(t)
	spec := Spec{Rate: Rate{N: 10, Period: time.Minute}}
	a := sharedLimiter(t, testFleet(t, srv.Addr, "rate:", 0), "k:r", spec)
	b := sharedLimiter(t, testFleet(t, srv.Addr, "rate:", 0), "k:r", spec)
	ok := 0
	var lastWait time.Duration
	for i := range 30 {
		l := a
		if i%2 == 1 {
			l = b
		}
		g, scope, wait := l.Take(time.Now(), -1)
		switch scope {
		case ScopeNone:
			ok++
			l.Done(time.Now(), g, 0)
		case ScopeRate:
			lastWait = wait
		default:
			t.Fatalf("refused by %q", scope)
		}
	}
	if ok != 10 {
		t.Fatalf("admitted %d of 30 with a shared rate of 10/m, want 10", ok)
	}
	// the next request is due one emission interval (6s) after the burst
	if lastWait < 5*time.Second || lastWait > 6*time.Second {
		t.Fatalf("the refusal said to wait %v, want about 6s", lastWait)
	}
}

// TestSharedRateKeepsSubMillisecondIntervals runs the admission script
// back to back with a burst of one request every 20µs (50,000/s): the
// stored arrival time must keep its fraction of a millisecond, or every
// request passes.
func TestSharedRateKeepsSubMillisecondIntervals(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	ctx := context.Background()
	var cmds []*redis.Cmd
	start := time.Now()
	_, err := rdb.Pipelined(ctx, func(pipe redis.Pipeliner) error {
		for range 50 {
			// one thing, no holds, no slots carried; lease, concurrency, lease ms, emission ms, burst,
			// requests to take, requests given back, tokens/ms, token burst, charge, tokens to take and given back
			cmds = append(cmds, fleet.AdmitScript.Eval(ctx, pipe, []string{"fine:l", "fine:r", "fine:t"}, 1, 0, "x", 0, 1000, 0.02, 1, 1, 0, 0, 0, -1, 0, 0))
		}
		return nil
	})
	took := time.Since(start)
	if err != nil {
		t.Fatal(err)
	}
	admitted := 0
	for _, c := range cmds {
		if v, _ := c.Int64Slice(); len(v) == fleet.AdmitAnswer && v[0] == 0 {
			admitted++
		}
	}
	// one per millisecond the 50 calls spanned, and the first
	if bound := 2 + int(took/time.Millisecond); admitted > bound {
		t.Fatalf("%d of 50 calls admitted within %v at one per 20µs with a burst of 1; want at most %d", admitted, took, bound)
	}
}

func TestSharedTokensGoIntoDebtAndAreCorrected(t *testing.T) {
	srv := redistest.Start(t)
	spec := Spec{Tokens: Rate{N: 1000, Period: time.Hour}}
	l := sharedLimiter(t, testFleet(t, srv.Addr, "tok:", 0), "k:t", spec)

	// a request larger than what is left passes, and puts the bucket in debt
	g, scope, _ := l.Take(time.Now(), 1500)
	if scope != ScopeNone {
		t.Fatalf("first request refused by %q", scope)
	}
	if _, scope, wait := l.Take(time.Now(), 10); scope != ScopeTokens || wait < 30*time.Minute {
		t.Fatalf("in debt: refused by %q with wait %v, want tokens and over 30m", scope, wait)
	}
	// it used 100: the correction gives 1400 back, off the request path
	l.Done(time.Now(), g, 100)
	waitFor(t, "the correction reaches Redis", 2*time.Second, func() bool {
		g, scope, _ := l.Take(time.Now(), 0)
		if scope == ScopeNone {
			l.Done(time.Now(), g, 0)
		}
		return scope == ScopeNone
	})
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	level, err := rdb.HGet(context.Background(), "tok:{k:t}:tokens", "level").Float64()
	if err != nil || level < 899 || level > 901 {
		t.Fatalf("bucket level %v (%v), want 900: 1000 - 100 used", level, err)
	}

	// an estimate charged after admission (the body was read later) counts
	g, scope, _ = l.Take(time.Now(), 0)
	if scope != ScopeNone {
		t.Fatal(scope)
	}
	l.Charge(time.Now(), &g, 2000)
	l.Done(time.Now(), g, 2000)
	waitFor(t, "the charge reaches Redis", 2*time.Second, func() bool {
		_, scope, _ := l.Take(time.Now(), 0)
		return scope == ScopeTokens
	})
}

func TestLeasesOfADeadNodeExpire(t *testing.T) {
	srv := redistest.Start(t)
	const lease = 600 * time.Millisecond
	spec := Spec{Concurrency: 2}
	dying := testFleet(t, srv.Addr, "lease:", lease)
	a := sharedLimiter(t, dying, "k:l", spec)
	b := sharedLimiter(t, testFleet(t, srv.Addr, "lease:", lease), "k:l", spec)
	for range 2 {
		if _, scope, _ := a.Take(time.Now(), -1); scope != ScopeNone {
			t.Fatal(scope)
		}
	}
	// a living node renews its leases: they outlast the lease time
	time.Sleep(2 * lease)
	if _, scope, _ := b.Take(time.Now(), -1); scope != ScopeConcurrency {
		t.Fatalf("the other node's renewed slots: refused by %q, want concurrency", scope)
	}
	// the node dies without giving its slots back
	slotsFreedByDeath(t, dying, b, lease, 3*lease)
}

// slotsFreedByDeath stops dying without giving its slots back and waits,
// up to wait, for b to take one of them: they must free within a lease
// (and a third of one, the renewals' spacing) of the death, with room
// for a loaded machine (under two leases).
func slotsFreedByDeath(t *testing.T, dying *Shared, b *Limiter, lease, wait time.Duration) {
	t.Helper()
	dying.Stop()
	died := time.Now()
	waitFor(t, "the dead node's slots free", wait, func() bool {
		g, scope, _ := b.Take(time.Now(), -1)
		if scope == ScopeNone {
			b.Done(time.Now(), g, 0)
		}
		return scope == ScopeNone
	})
	if took := time.Since(died); took > lease+lease/2+300*time.Millisecond {
		t.Fatalf("slots freed %v after the node died, lease is %v", took, lease)
	}
}

func TestSharedLimitKeysAreTagged(t *testing.T) {
	f := &Shared{Client: &fleet.Client{Prefix: "p:"}}
	s := newSharedLimit(f, fleet.Tag("k:", "support"))
	if s.lease != "p:{k:support}:leases" || s.rate != "p:{k:support}:rate" || s.bkt != "p:{k:support}:tokens" {
		t.Fatalf("keys %q %q %q", s.lease, s.rate, s.bkt)
	}
	// a brace in a name would end the cluster hash tag early
	if got := fleet.Tag("c:", "a}b"); got == "c:a}b" || len(got) != len("c:")+16 {
		t.Fatalf("tag of a name with a brace: %q", got)
	}
}

// TestAFreedSlotGoesWithTheNextAdmission: a slot a request frees is given
// back with the next admission the relay sends, not in a round trip of
// its own; the worker gives back what no admission took, and so does a
// relay that stops.
func TestAFreedSlotGoesWithTheNextAdmission(t *testing.T) {
	srv := redistest.Start(t)
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr})
	defer rdb.Close()
	f := testFleet(t, srv.Addr, "carry:", 0)
	// no worker: only admissions carry them. Each freed slot must wait
	// for the next admission in this relay's queue, and go with it: one
	// slot held in Redis at each request. (The metric of releases is the
	// process's, which other tests' relays stopping late may add to, so
	// it is not what is counted here.)
	f.slotDelay.Store(int64(time.Hour))
	l := sharedLimiter(t, f, "k:carry", Spec{Concurrency: 1})
	slots := func() int64 {
		n, err := rdb.ZCard(context.Background(), "carry:{k:carry}:leases").Result()
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	for i := range 5 {
		g, scope, _ := l.Take(time.Now(), -1)
		if scope != ScopeNone {
			t.Fatalf("request %d: refused by %q: the slot freed before it was not given back with it", i+1, scope)
		}
		if n := slots(); n != 1 {
			t.Fatalf("request %d: %d slots held in Redis, want 1", i+1, n)
		}
		l.Done(time.Now(), g, 0)
		f.slotsMu.Lock()
		pending := len(f.slots)
		f.slotsMu.Unlock()
		if pending != 1 {
			t.Fatalf("request %d: %d freed slots wait for the next admission, want 1: its own", i+1, pending)
		}
	}
	// the last one: nobody carries it, the relay stops and gives it back
	if err := stop(f); err != nil {
		t.Fatal(err)
	}
	if n := slots(); n != 0 {
		t.Fatalf("%d slots held after the relay stopped, want none", n)
	}
}

// TestTakeRateIsTheFleetsRate: in a fleet, takeRate counts against the
// rate Redis keeps for every node, and nothing else: beside a request in
// flight that holds the key's one concurrency slot, two nodes take what
// is left of a rate of 4/m between them, the next is refused with the
// wait until one more is due, and the node that was refused gates its
// requests (enter) until then without asking Redis.
func TestTakeRateIsTheFleetsRate(t *testing.T) {
	srv := redistest.Start(t)
	spec := Spec{Rate: Rate{N: 4, Period: time.Minute}, Concurrency: 1}
	a := sharedLimiter(t, testFleet(t, srv.Addr, "takerate:", 0), "k:tr", spec)
	b := sharedLimiter(t, testFleet(t, srv.Addr, "takerate:", 0), "k:tr", spec)
	held, scope, _ := a.Take(time.Now(), -1)
	if scope != ScopeNone {
		t.Fatalf("the request in flight: %s", scope)
	}
	defer a.Done(time.Now(), held, 0)
	for i, l := range []*Limiter{b, a, b} {
		if _, scope, _ := l.TakeRate(time.Now()); scope != ScopeNone {
			t.Fatalf("takeRate %d beside the slot in flight: %s", i+1, scope)
		}
	}
	_, scope, wait := a.TakeRate(time.Now())
	if scope != ScopeRate || wait < 14*time.Second || wait > 15*time.Second {
		t.Fatalf("takeRate past the fleet's rate: %s, wait %v; want rate, about 15s", scope, wait)
	}
	if _, scope, _ := a.Enter(time.Now(), -1); scope != ScopeRate {
		t.Errorf("a request at the refused node's gate: %q, want rate", scope)
	}
	if n := a.Inflight() + b.Inflight(); n != 1 {
		t.Errorf("%d in flight on the nodes, want the one request's", n)
	}
}
