package idle

import (
	"fmt"
	"testing"
	"time"
)

// testNow is the tests' clock.
var testNow = time.Date(2025, time.March, 14, 15, 9, 26, 0, time.UTC)

// fakeState is a state whose settledness a test sets.
type fakeState struct{ busy bool }

func (s *fakeState) Settled(time.Time) bool { return !s.busy }

func TestCacheNeverHoldsMoreThanItsCap(t *testing.T) {
	c := New[*fakeState](100, time.Hour)
	for i := range 1000 {
		c.Get(fmt.Sprint(i), testNow, func() *fakeState { return &fakeState{busy: true} })
		if c.Len() > 100 {
			t.Fatalf("%d states kept, the cap is 100", c.Len())
		}
	}
	// the least recently used went first: the last hundred are kept
	made := false
	c.Get("999", testNow, func() *fakeState { made = true; return new(fakeState) })
	c.Get("900", testNow, func() *fakeState { made = true; return new(fakeState) })
	if made {
		t.Error("a recent state was dropped")
	}
	c.Get("0", testNow, func() *fakeState { made = true; return new(fakeState) })
	if !made {
		t.Error("the oldest state was kept")
	}
}

func TestCacheDropsOnlySettledStates(t *testing.T) {
	c := New[*fakeState](100, 10*time.Minute)
	busy := &fakeState{busy: true}
	c.Get("busy", testNow, func() *fakeState { return busy })
	c.Get("idle", testNow, func() *fakeState { return new(fakeState) })
	c.Get("recent", testNow.Add(5*time.Minute), func() *fakeState { return new(fakeState) })

	later := testNow.Add(10 * time.Minute)
	c.Get("new", later, func() *fakeState { return new(fakeState) })
	kept := map[string]bool{}
	c.Each(func(id string, _ *fakeState) { kept[id] = true })
	if kept["idle"] || !kept["busy"] || !kept["recent"] || !kept["new"] {
		t.Fatalf("kept %v: want the idle settled state dropped, the busy one kept", kept)
	}
	// the busy one was kept as if used then: once settled, it goes when
	// idle again, counted from then
	busy.busy = false
	c.Get("new", later.Add(9*time.Minute), func() *fakeState { return new(fakeState) })
	kept = map[string]bool{}
	c.Each(func(id string, _ *fakeState) { kept[id] = true })
	if !kept["busy"] || kept["recent"] || !kept["new"] {
		t.Fatalf("kept %v, want busy (idle 9m) and new", kept)
	}
	c.Get("new", later.Add(10*time.Minute), func() *fakeState { return new(fakeState) })
	if _, ok := c.lru.Peek("busy"); ok || c.Len() != 1 {
		t.Fatalf("%d kept, busy among them: want only new", c.Len())
	}
}
