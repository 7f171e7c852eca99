package relay

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
)

// The health of a channel alone is internal/health's (its tests are
// there); these test what the relay keeps with it: its limits, its owners
// and the admin API's row.

var testPolicy = health.CooldownPolicy{Base: time.Millisecond, Max: time.Millisecond, Auth: time.Millisecond}

// newTestHealth returns a channel state with a breaker configured by s.
func newTestHealth(s health.BreakerSettings) *channelHealth {
	h := newChannelHealth("c")
	h.configure(s, limits.Spec{}, channelOwner{provider: "anthropic"}, time.Now())
	return h
}

// run admits and finishes one attempt per outcome, as the relay does.
func run(t *testing.T, h *channelHealth, outcomes ...outcome) {
	t.Helper()
	for _, o := range outcomes {
		tk, _ := h.admit(time.Now(), 0)
		if tk == nil {
			t.Fatalf("attempt refused; channel %s", h.State(time.Now()))
		}
		tk.finish(verdict{outcome: o}, testPolicy, time.Now(), time.Millisecond, 0)
	}
}

func TestChannelCounters(t *testing.T) {
	h := newTestHealth(health.DefaultBreaker)
	run(t, h, outcomeSuccess, outcomeTransient, outcomeClientError, outcomeRateLimited, outcomeCanceled)
	st := h.status("c", time.Now())
	if st.Requests != 4 || st.Failures != 2 || st.Inflight != 0 {
		t.Errorf("requests %d failures %d inflight %d, want 4, 2, 0 (a cancel is not traffic)", st.Requests, st.Failures, st.Inflight)
	}
	if st.LastError != "rate_limited" || st.EWMALatencyMs != 1 || st.Provider != "anthropic" {
		t.Errorf("status = %+v", st)
	}
	h.Disable()
	if st := h.status("c", time.Now()); st.State != stateDisabled || st.CooldownUntil != nil {
		t.Errorf("a disabled channel reports %+v", st)
	}
}

// The breaker keeps its own time (gobreaker reads time.Now), so the tests
// that wait for it to turn half-open run in a testing/synctest bubble,
// where time.Now is the bubble's clock and a sleep steps it at once.

func TestHalfOpenTicketsHoldTheirSlots(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newTestHealth(health.BreakerSettings{Window: 10 * time.Second, Ratio: 0.5, MinRequests: 2, OpenFor: 50 * time.Millisecond, Probes: 2})
		run(t, h, outcomeTransient, outcomeTransient)
		time.Sleep(50*time.Millisecond + time.Nanosecond)
		var admitted []*ticket
		for len(admitted) <= 10 {
			tk, _ := h.admit(time.Now(), 0)
			if tk == nil {
				break
			}
			admitted = append(admitted, tk)
		}
		if len(admitted) != 2 {
			t.Fatalf("half-open admitted %d attempts, want its 2 probes", len(admitted))
		}
		if got := h.limits.Inflight(); got != 2 {
			t.Errorf("inflight = %d, want 2", got)
		}
		for _, tk := range admitted {
			tk.finish(verdict{outcome: outcomeSuccess}, testPolicy, time.Now(), time.Millisecond, 0)
		}
		if got := h.limits.Inflight(); got != 0 || h.State(time.Now()) != stateHealthy {
			t.Errorf("inflight = %d, channel %s after the probes succeeded", got, h.State(time.Now()))
		}
	})
}

func TestTicketReleasedWithoutVerdict(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newTestHealth(health.BreakerSettings{Window: 10 * time.Second, Ratio: 0.5, MinRequests: 1, OpenFor: 50 * time.Millisecond, Probes: 1})
		run(t, h, outcomeTransient)
		time.Sleep(50*time.Millisecond + time.Nanosecond)
		func() {
			defer func() { _ = recover() }()
			tk, _ := h.admit(time.Now(), 0)
			if tk == nil {
				t.Fatal("the half-open slot should be free")
			}
			defer tk.release(time.Now)
			panic("attempt panicked")
		}()
		if h.limits.Inflight() != 0 {
			t.Errorf("inflight = %d after a panic", h.limits.Inflight())
		}
		if tk, _ := h.admit(time.Now(), 0); tk == nil {
			t.Errorf("the half-open slot was lost with the panicking attempt")
		}
	})
}

func TestUpstreamQuotaIsCappedAndReset(t *testing.T) {
	far := time.Now().Add(20 * time.Hour).UTC().Format(time.RFC3339)
	up := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("m", "a", fakeupstream.Usage{}),
		"Anthropic-Ratelimit-Requests-Remaining", "0", "Anthropic-Ratelimit-Requests-Reset", far))
	startRelay(t, "\t\tmax_cooldown 1m\n"+channelBlock("hostile-quota", up.URL)+keyAndGroup("hostile-quota", "hostile-quota"))
	message(t, simpleBody)
	st := channels(t)["hostile-quota"]
	if c, ok := st.Classes["sonnet"]; !ok || time.Until(c.Until) > time.Minute+time.Second || st.State != stateCooldown {
		t.Fatalf("a quota reset 20h away should cool the model's class for max_cooldown at most: %+v", st)
	}
	if code, _ := adminPost(t, "hostile-quota", "reset"); code != 200 {
		t.Fatal("reset failed")
	}
	if st := channels(t)["hostile-quota"]; st.Classes != nil || st.State != stateHealthy {
		t.Errorf("reset should clear the spent quota: %+v", st)
	}
}

func TestResolveBreakerMergesFieldByField(t *testing.T) {
	relay := &Breaker{Window: caddy.Duration(20 * time.Second), FailureRatio: 0.5}
	ch := &Breaker{FailureRatio: 0.8, HalfOpenProbes: 2}
	got := resolveBreaker(ch, relay)
	want := health.BreakerSettings{Window: 20 * time.Second, Ratio: 0.8, MinRequests: 5, OpenFor: 30 * time.Second, Probes: 2}
	if got != want {
		t.Errorf("resolveBreaker = %+v, want %+v", got, want)
	}
	if got := resolveBreaker(nil, nil); got != health.DefaultBreaker {
		t.Errorf("defaults = %+v", got)
	}
}
