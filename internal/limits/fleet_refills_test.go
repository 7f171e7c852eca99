package limits

import (
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/sony/gobreaker/v2"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddy-relay/relay/internal/redistest"
)

// refillSetup is a node of a fleet of one on a Redis frozen while a
// request takes the next block of a leased rate (6000/m: blocks of 600),
// and 20 more requests that found that block spent, waiting for it. It
// returns the node, the limiter, and the 21 requests' answers to come.
// The requests are admitted alone (take), or as a request's first attempt
// admits its limits together (TakeAll).
func refillSetup(t *testing.T, srv *redistest.Server, prefix string, timeout time.Duration, onError string, together bool) (*Shared, *Limiter, <-chan Scope) {
	t.Helper()
	f := newShared(t, &fleet.Config{Address: []string{srv.Addr}, Prefix: prefix, Timeout: caddy.Duration(timeout), OnError: onError})
	f.NodesPinned.Store(1)
	l := sharedLimiter(t, f, "k:refill", Spec{Rate: Rate{N: 6000, Period: time.Minute}})
	s := l.shared.Load()
	g, scope, _ := l.Take(time.Now(), -1)
	if scope != ScopeNone || !s.rb.held() {
		t.Fatalf("the first request: refused by %q, or no block taken", scope)
	}
	l.Done(time.Now(), g, 0)
	s.mu.Lock()
	s.rb.left = 0 // spent: the next request takes the next block
	s.mu.Unlock()

	srv.Stop() // connections stay open, nothing answers
	t.Cleanup(srv.Continue)
	answers := make(chan Scope, 21)
	take := func() {
		if together {
			asks := []Ask{{Limiter: l, Estimate: -1}}
			i, scope, _, _ := TakeAll[struct{}](time.Now(), asks, nil)
			if i < 0 && scope == ScopeNone {
				l.Done(time.Now(), asks[0].Grant, 0)
			}
			answers <- scope
			return
		}
		g, scope, _ := l.Take(time.Now(), -1)
		if scope == ScopeNone {
			l.Done(time.Now(), g, 0)
		}
		answers <- scope
	}
	go take()
	waitFor(t, "a request takes the next block", 5*time.Second, func() bool { return s.refills.Load() == 1 })
	for range 20 {
		go take()
	}
	waitFor(t, "20 requests wait for the block", 5*time.Second, func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.rb.refill != nil && s.rb.refill.waiters == 20
	})
	return f, l, answers
}

// TestARefillIsAskedOnceForItsWaiters: the requests that find a block
// spent while another takes the next one wait for it and admit from it:
// however slow Redis is, a node asks it once per block, not once per
// request.
func TestARefillIsAskedOnceForItsWaiters(t *testing.T) {
	srv := redistest.Start(t)
	before := admitOps(t)
	_, l, answers := refillSetup(t, srv, "refillok:", 10*time.Second, "", false)
	srv.Continue()
	for i := range 21 {
		if scope := <-answers; scope != ScopeNone {
			t.Fatalf("request %d: refused by %q, want admitted from the new block", i+1, scope)
		}
	}
	// the first request's block, and the next one's
	if ops := admitOps(t) - before; ops != 2 {
		t.Fatalf("22 requests asked Redis %v times, want 2: one per block", ops)
	}
	s := l.shared.Load()
	s.mu.Lock()
	defer s.mu.Unlock()
	if left := s.rb.left; left != 600-21 {
		t.Fatalf("the new block has %v left, want %d", left, 600-21)
	}
}

// TestARefillRedisFailedFailsItsWaitersAtOnce: when Redis does not answer
// the call that takes the next block, the requests waiting for it count
// Redis as down too, without asking it again: under on_error deny they
// are refused, none of them waits for Redis a second time, and the one
// failed call does not open the breaker, as 21 would. The requests are
// admitted as a request's first attempt admits its limits together.
func TestARefillRedisFailedFailsItsWaitersAtOnce(t *testing.T) {
	srv := redistest.Start(t)
	before := admitOps(t)
	f, _, answers := refillSetup(t, srv, "refilldown:", 2*time.Second, "deny", true)
	for i := range 21 {
		if scope := <-answers; scope != ScopeFleetDown {
			t.Fatalf("request %d: %q, want refused as the storage is down", i+1, scope)
		}
	}
	if ops := admitOps(t) - before; ops != 2 {
		t.Fatalf("the requests asked Redis %v times, want 2: the first block, and the one that failed", ops)
	}
	if st := f.BreakerState(); st != gobreaker.StateClosed {
		t.Fatalf("the breaker is %v after one failed call, want closed", st)
	}
}
