package limits

import (
	"testing"
	"time"
)

func TestParseRateSpec(t *testing.T) {
	for in, want := range map[string]Rate{
		"600/m": {600, time.Minute}, "10/s": {10, time.Second}, "2000000/h": {2000000, time.Hour},
		"5/d": {5, 24 * time.Hour}, "3/10s": {3, 10 * time.Second}, "": {},
	} {
		got, err := ParseRate(in)
		if err != nil || got != want {
			t.Errorf("%q = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"600", "x/m", "0/m", "-1/m", "10/fortnight", "10/-5s"} {
		if _, err := ParseRate(bad); err == nil {
			t.Errorf("%q should not parse", bad)
		}
	}
}

func TestTokenBucketDebt(t *testing.T) {
	now := time.Unix(1_900_000_000, 0)
	b := newTokenBucket(Rate{N: 100, Period: 10 * time.Second}, now)
	b.charge(now, 150)
	if w := b.wait(now); w != 5100*time.Millisecond {
		t.Errorf("wait with 50 in debt at 10/s = %v, want 5.1s (until one token is back)", w)
	}
	b.charge(now, -100) // the estimate was too high
	if w := b.wait(now); w != 0 {
		t.Errorf("after the refund: wait %v", w)
	}
	b.configure(Rate{N: 20, Period: 10 * time.Second}, now)
	if b.level != 20 {
		t.Errorf("a smaller burst caps the level: %v", b.level)
	}
}

// takeRate counts a request against the request rate alone: a key whose
// concurrency is all in flight, or whose token limit is in debt, still
// gets it, and it holds nothing to give back; past the rate it refuses
// with the time the rate takes to allow one more.
func TestTakeRateCountsTheRateAlone(t *testing.T) {
	now := time.Unix(1_900_000_000, 0)
	var l Limiter
	l.Configure(Spec{Rate: Rate{N: 3, Period: time.Minute}, Tokens: Rate{N: 10, Period: time.Minute}, Concurrency: 1}, now)
	g, scope, _ := l.Take(now, 100) // the one slot in flight, 90 tokens in debt
	if scope != ScopeNone {
		t.Fatalf("the first request: %s", scope)
	}
	if busy, _ := l.Busy(now); !busy {
		t.Fatal("a key with its one slot in flight and its tokens in debt is not busy")
	}
	for i := range 2 {
		if _, scope, _ := l.TakeRate(now); scope != ScopeNone {
			t.Errorf("takeRate %d beside a full concurrency and a token debt: %s", i+1, scope)
		}
	}
	if n := l.Inflight(); n != 1 {
		t.Errorf("in flight after takeRate: %d, want the first request's 1", n)
	}
	if left, _ := l.Remaining(now); left == nil || *left != 0 {
		t.Errorf("the rate left: %v, want none (one request, two takeRate)", left)
	}
	_, scope, wait := l.TakeRate(now)
	if scope != ScopeRate || wait < 19*time.Second || wait > 20*time.Second {
		t.Errorf("takeRate past the rate: %s, wait %v; want rate, 20s", scope, wait)
	}
	if _, scope, _ := l.TakeRate(now.Add(20 * time.Second)); scope != ScopeNone {
		t.Errorf("takeRate once the rate allows one more: %s", scope)
	}
	l.Done(now, g, 100)
	var free Limiter
	free.Configure(Spec{Concurrency: 1}, now)
	if _, scope, _ := free.TakeRate(now); scope != ScopeNone || free.Inflight() != 0 {
		t.Errorf("takeRate without a rate: %s, %d in flight", scope, free.Inflight())
	}
}
