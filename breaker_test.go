package relay

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/sony/gobreaker/v2"
)

// newTestHealth returns a channel state with a breaker configured by s.
func newTestHealth(s breakerSettings) *channelHealth {
	h := new(channelHealth)
	h.configure(s, limits{}, channelOwner{provider: "anthropic"}, time.Now())
	return h
}

var testPolicy = cooldownPolicy{base: time.Millisecond, max: time.Millisecond, auth: time.Millisecond}

// run admits and finishes one attempt per outcome, as the relay does.
func run(t *testing.T, h *channelHealth, outcomes ...outcome) {
	t.Helper()
	for _, o := range outcomes {
		tk, _ := h.admit(time.Now(), 0)
		if tk == nil {
			t.Fatalf("attempt refused; breaker %v", h.breaker.Load().State())
		}
		tk.finish(verdict{outcome: o}, testPolicy, time.Now(), time.Millisecond, 0)
	}
}

func TestBreakerTripsAtTheConfiguredRatio(t *testing.T) {
	s := breakerSettings{window: 10 * time.Second, ratio: 0.6, minRequests: 5, openFor: time.Hour, probes: 1}
	f, ok := outcomeTransient, outcomeSuccess
	tests := []struct {
		name     string
		outcomes []outcome
		open     bool
	}{
		{"3 of 5 failed (0.6) trips", []outcome{ok, f, ok, f, f}, true},
		{"2 of 5 failed (0.4) does not", []outcome{f, ok, f, ok, ok}, false},
		{"4 of 4 failed is below min_requests", []outcome{f, f, f, f}, false},
		{"5 of 9 failed (0.56) does not", []outcome{ok, ok, ok, ok, f, f, f, f, f}, false},
		{"6 of 10 failed trips on the tenth", []outcome{ok, ok, ok, ok, f, f, f, f, f, f}, true},
		{"429, 529 and auth are not breaker failures", []outcome{outcomeRateLimited, outcomeOverloaded, outcomeAuth, outcomeRateLimited, outcomeOverloaded, ok}, false},
		{"client errors count as successes", []outcome{outcomeClientError, outcomeClientError, f, f, f}, true},
		{"canceled attempts do not count", []outcome{outcomeCanceled, outcomeCanceled, f, f, ok, ok}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newTestHealth(s)
			run(t, h, tt.outcomes...)
			open := h.breaker.Load().State() == gobreaker.StateOpen
			if open != tt.open {
				t.Fatalf("breaker open = %v, want %v", open, tt.open)
			}
			if open {
				if st := h.state(time.Now()); st != stateOpen {
					t.Errorf("state = %q, want open", st)
				}
				if ok, until := h.available(time.Now()); ok || time.Until(until) < 59*time.Minute {
					t.Errorf("an open channel must be unavailable until open_for ends: %v %v", ok, until)
				}
			}
		})
	}
}

// The breaker keeps its own time (gobreaker reads time.Now), so the tests
// that wait for it to turn half-open run in a testing/synctest bubble,
// where time.Now is the bubble's clock and a sleep steps it at once.

// turnHalfOpen steps the bubble's clock past the breaker's open_for.
func turnHalfOpen(t *testing.T, h *channelHealth) {
	t.Helper()
	time.Sleep(h.settings.openFor + time.Nanosecond)
	if got := h.breaker.Load().State(); got != gobreaker.StateHalfOpen {
		t.Fatalf("breaker %v after open_for, want half-open", got)
	}
}

func TestBreakerHalfOpenAdmitsExactlyTheProbes(t *testing.T) {
	for _, probes := range []uint32{1, 3} {
		synctest.Test(t, func(t *testing.T) { halfOpenAdmitsTheProbes(t, probes) })
	}
}

func halfOpenAdmitsTheProbes(t *testing.T, probes uint32) {
	s := breakerSettings{window: 10 * time.Second, ratio: 0.5, minRequests: 2, openFor: 50 * time.Millisecond, probes: probes}
	h := newTestHealth(s)
	run(t, h, outcomeTransient, outcomeTransient)
	if st := h.state(time.Now()); st != stateOpen {
		t.Errorf("state = %q, want open", st)
	}
	turnHalfOpen(t, h)
	if st := h.state(time.Now()); st != stateHalfOpen {
		t.Errorf("state = %q, want half_open", st)
	}

	var admitted []*ticket
	for {
		tk, _ := h.admit(time.Now(), 0)
		if tk == nil {
			break
		}
		admitted = append(admitted, tk)
		if len(admitted) > 10 {
			break
		}
	}
	if uint32(len(admitted)) != probes {
		t.Fatalf("half-open admitted %d attempts, want exactly %d", len(admitted), probes)
	}
	if got := h.limits.inflight.Load(); got != int64(probes) {
		t.Errorf("inflight = %d, want %d", got, probes)
	}
	for _, tk := range admitted {
		tk.finish(verdict{outcome: outcomeSuccess}, testPolicy, time.Now(), time.Millisecond, 0)
	}
	if got := h.breaker.Load().State(); got != gobreaker.StateClosed {
		t.Errorf("after %d successful probes the breaker is %v, want closed", probes, got)
	}
	if got := h.limits.inflight.Load(); got != 0 {
		t.Errorf("inflight = %d after the probes finished", got)
	}
}

func TestBreakerHalfOpenFailureReopens(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newTestHealth(breakerSettings{window: 10 * time.Second, ratio: 0.5, minRequests: 2, openFor: 50 * time.Millisecond, probes: 1})
		run(t, h, outcomeTransient, outcomeTransient)
		turnHalfOpen(t, h)
		run(t, h, outcomeTransient)
		if got := h.breaker.Load().State(); got != gobreaker.StateOpen {
			t.Fatalf("a failed probe should reopen the breaker, got %v", got)
		}
		if ok, until := h.available(time.Now()); ok || until.Sub(time.Now()) != 50*time.Millisecond {
			t.Errorf("reopened: available=%v until %v from now, want open_for", ok, until.Sub(time.Now()))
		}
	})
}

func TestTicketReleasedWithoutVerdict(t *testing.T) {
	synctest.Test(t, ticketReleasedWithoutVerdict)
}

func ticketReleasedWithoutVerdict(t *testing.T) {
	h := newTestHealth(breakerSettings{window: 10 * time.Second, ratio: 0.5, minRequests: 1, openFor: 50 * time.Millisecond, probes: 1})
	run(t, h, outcomeTransient)
	turnHalfOpen(t, h)
	func() {
		defer func() { _ = recover() }()
		tk, _ := h.admit(time.Now(), 0)
		if tk == nil {
			t.Fatal("the half-open slot should be free")
		}
		defer tk.release(time.Now)
		panic("attempt panicked")
	}()
	if h.limits.inflight.Load() != 0 {
		t.Errorf("inflight = %d after a panic", h.limits.inflight.Load())
	}
	if tk, _ := h.admit(time.Now(), 0); tk == nil {
		t.Errorf("the half-open slot was lost with the panicking attempt")
	}
}

func TestChannelCounters(t *testing.T) {
	h := newTestHealth(defaultBreaker)
	run(t, h, outcomeSuccess, outcomeTransient, outcomeClientError, outcomeRateLimited, outcomeCanceled)
	st := h.status("c", time.Now())
	if st.Requests != 4 || st.Failures != 2 || st.Inflight != 0 {
		t.Errorf("requests %d failures %d inflight %d, want 4, 2, 0 (a cancel is not traffic)", st.Requests, st.Failures, st.Inflight)
	}
	if st.LastError != "rate_limited" || st.EWMALatencyMs != 1 || st.Provider != "anthropic" {
		t.Errorf("status = %+v", st)
	}
	h.disabled.Store(true)
	if h.state(time.Now()) != stateDisabled {
		t.Errorf("a disabled channel reports %q", h.state(time.Now()))
	}
	if ok, until := h.available(time.Now()); ok || !until.IsZero() {
		t.Errorf("a disabled channel is available=%v until %v; want unavailable with no recovery time", ok, until)
	}
}

func TestConfigureKeepsOrReplacesTheBreaker(t *testing.T) {
	s := breakerSettings{window: 10 * time.Second, ratio: 0.5, minRequests: 2, openFor: time.Hour, probes: 1}
	h := newTestHealth(s)
	run(t, h, outcomeTransient, outcomeTransient)
	h.configure(s, limits{}, channelOwner{provider: "anthropic"}, time.Now()) // a reload with the same settings
	if h.breaker.Load().State() != gobreaker.StateOpen {
		t.Errorf("a reload with unchanged settings must keep the open breaker")
	}
	s.openFor = 2 * time.Hour
	h.configure(s, limits{}, channelOwner{provider: "anthropic"}, time.Now())
	if h.breaker.Load().State() != gobreaker.StateClosed {
		t.Errorf("new settings start a new breaker")
	}
}

func TestResolveBreakerMergesFieldByField(t *testing.T) {
	relay := &Breaker{Window: caddy.Duration(20 * time.Second), FailureRatio: 0.5}
	ch := &Breaker{FailureRatio: 0.8, HalfOpenProbes: 2}
	got := resolveBreaker(ch, relay)
	want := breakerSettings{window: 20 * time.Second, ratio: 0.8, minRequests: 5, openFor: 30 * time.Second, probes: 2}
	if got != want {
		t.Errorf("resolveBreaker = %+v, want %+v", got, want)
	}
	if got := resolveBreaker(nil, nil); got != defaultBreaker {
		t.Errorf("defaults = %+v", got)
	}
}

func TestRetryBudget(t *testing.T) {
	t0 := time.Unix(1_800_000_000, 0)
	t.Run("ratio of requests over the window", func(t *testing.T) {
		var b retryBudget
		for i := 0; i < 100; i++ {
			b.request(t0)
		}
		allowed := 0
		for i := 0; i < 100; i++ {
			if b.allowRetry(t0.Add(time.Second), 0.2, 0) {
				allowed++
			}
		}
		if allowed != 20 {
			t.Errorf("allowed %d retries for 100 requests at 20%%, want 20", allowed)
		}
	})
	t.Run("floor per second over the window", func(t *testing.T) {
		var b retryBudget
		allowed := 0
		for i := 0; i < 100; i++ {
			if b.allowRetry(t0, 0.2, 3) {
				allowed++
			}
		}
		if allowed != 30 {
			t.Errorf("allowed %d retries with no requests and a floor of 3/s, want 30 (10s window)", allowed)
		}
	})
	t.Run("old seconds leave the window", func(t *testing.T) {
		var b retryBudget
		for i := 0; i < 10; i++ {
			b.request(t0)
		}
		if !b.allowRetry(t0, 0.1, 0) || b.allowRetry(t0, 0.1, 0) {
			t.Fatal("10 requests at 10% allow exactly one retry")
		}
		later := t0.Add(budgetBuckets * time.Second)
		for i := 0; i < 10; i++ {
			b.request(later)
		}
		if !b.allowRetry(later, 0.1, 0) {
			t.Errorf("after the window slid past the old retry, a new one fits")
		}
	})
}
