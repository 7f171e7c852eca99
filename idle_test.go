package relay

import (
	"fmt"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
)

// fakeState is a state whose settledness a test sets.
type fakeState struct{ busy bool }

func (s *fakeState) Settled(time.Time) bool { return !s.busy }

func TestIdleCacheNeverHoldsMoreThanItsCap(t *testing.T) {
	c := newIdleCache[*fakeState](100, time.Hour)
	for i := range 1000 {
		c.get(fmt.Sprint(i), testNow, func() *fakeState { return &fakeState{busy: true} })
		if c.len() > 100 {
			t.Fatalf("%d states kept, the cap is 100", c.len())
		}
	}
	// the least recently used went first: the last hundred are kept
	made := false
	c.get("999", testNow, func() *fakeState { made = true; return new(fakeState) })
	c.get("900", testNow, func() *fakeState { made = true; return new(fakeState) })
	if made {
		t.Error("a recent state was dropped")
	}
	c.get("0", testNow, func() *fakeState { made = true; return new(fakeState) })
	if !made {
		t.Error("the oldest state was kept")
	}
}

func TestIdleCacheDropsOnlySettledStates(t *testing.T) {
	c := newIdleCache[*fakeState](100, 10*time.Minute)
	busy := &fakeState{busy: true}
	c.get("busy", testNow, func() *fakeState { return busy })
	c.get("idle", testNow, func() *fakeState { return new(fakeState) })
	c.get("recent", testNow.Add(5*time.Minute), func() *fakeState { return new(fakeState) })

	later := testNow.Add(10 * time.Minute)
	c.get("new", later, func() *fakeState { return new(fakeState) })
	kept := map[string]bool{}
	c.each(func(id string, _ *fakeState) { kept[id] = true })
	if kept["idle"] || !kept["busy"] || !kept["recent"] || !kept["new"] {
		t.Fatalf("kept %v: want the idle settled state dropped, the busy one kept", kept)
	}
	// the busy one was kept as if used then: once settled, it goes when
	// idle again, counted from then
	busy.busy = false
	c.get("new", later.Add(9*time.Minute), func() *fakeState { return new(fakeState) })
	kept = map[string]bool{}
	c.each(func(id string, _ *fakeState) { kept[id] = true })
	if !kept["busy"] || kept["recent"] || !kept["new"] {
		t.Fatalf("kept %v, want busy (idle 9m) and new", kept)
	}
	c.get("new", later.Add(10*time.Minute), func() *fakeState { return new(fakeState) })
	if _, ok := c.lru.Peek("busy"); ok || c.len() != 1 {
		t.Fatalf("%d kept, busy among them: want only new", c.len())
	}
}

func TestALimiterIsSettledOnceItWouldBeNew(t *testing.T) {
	l := new(limits.Limiter)
	l.Configure(limits.Spec{Rate: limits.Rate{N: 2, Period: time.Minute}, Tokens: limits.Rate{N: 1000, Period: time.Minute}}, testNow)
	if !l.Settled(testNow) {
		t.Fatal("a new limiter is settled")
	}
	g, scope, _ := l.Take(testNow, 100)
	if scope != limits.ScopeNone {
		t.Fatal(scope)
	}
	if l.Settled(testNow) {
		t.Error("a limiter with a request in flight is not settled")
	}
	l.Done(testNow, g, 1600) // 600 tokens in debt
	if l.Settled(testNow.Add(time.Minute)) {
		t.Error("a limiter whose token bucket is still refilling is not settled")
	}
	if !l.Settled(testNow.Add(97 * time.Second)) {
		t.Error("1600 tokens at 1000/m are back after 96s")
	}
}
