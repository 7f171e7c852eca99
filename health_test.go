package relay

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
	"github.com/sony/gobreaker/v2"
)

func TestChannelHealthCooldowns(t *testing.T) {
	policy := cooldownPolicy{base: 5 * time.Second, max: time.Minute, auth: 30 * time.Minute}
	var (
		transient  = verdict{outcome: outcomeTransient}
		success    = verdict{outcome: outcomeSuccess}
		clientErr  = verdict{outcome: outcomeClientError}
		canceled   = verdict{outcome: outcomeCanceled}
		overloaded = verdict{outcome: outcomeOverloaded}
		auth       = verdict{outcome: outcomeAuth}
		limited    = func(wait time.Duration) verdict { return verdict{outcome: outcomeRateLimited, wait: wait} }
	)
	type step struct {
		at   time.Duration // after testNow
		v    verdict
		want time.Duration // the cooldown record returns
	}
	// Unless a case says otherwise, each step comes after the previous
	// cooldown ended, as it would in the relay (a cooling channel gets no
	// requests).
	tests := []struct {
		name      string
		steps     []step
		wantUntil time.Duration // end of the cooldown after the last step, after testNow; 0: available
	}{
		{
			name: "transient failures double the cooldown up to max",
			steps: []step{
				{0, transient, 5 * time.Second},
				{10 * time.Second, transient, 10 * time.Second},
				{30 * time.Second, transient, 20 * time.Second},
				{time.Minute, transient, 40 * time.Second},
				{2 * time.Minute, transient, time.Minute},
				{4 * time.Minute, transient, time.Minute},
			},
			wantUntil: 5 * time.Minute,
		},
		{
			name: "a success resets the doubling",
			steps: []step{
				{0, transient, 5 * time.Second},
				{10 * time.Second, transient, 10 * time.Second},
				{30 * time.Second, success, 0},
				{31 * time.Second, transient, 5 * time.Second},
			},
			wantUntil: 36 * time.Second,
		},
		{
			name: "a client error is a healthy answer: no cooldown, doubling reset",
			steps: []step{
				{0, transient, 5 * time.Second},
				{10 * time.Second, clientErr, 0},
				{11 * time.Second, transient, 5 * time.Second},
			},
			wantUntil: 16 * time.Second,
		},
		{
			name: "a cancel changes nothing, not even the doubling",
			steps: []step{
				{0, transient, 5 * time.Second},
				{10 * time.Second, canceled, 0},
				{11 * time.Second, transient, 10 * time.Second},
			},
			wantUntil: 21 * time.Second,
		},
		{
			name:      "a cancel does not end a running cooldown",
			steps:     []step{{0, transient, 5 * time.Second}, {time.Second, canceled, 0}},
			wantUntil: 5 * time.Second,
		},
		{
			name:      "a client error does not end a running cooldown",
			steps:     []step{{0, transient, 5 * time.Second}, {time.Second, clientErr, 0}},
			wantUntil: 5 * time.Second,
		},
		{
			name:      "a 429 uses the upstream's hint",
			steps:     []step{{0, limited(12 * time.Second), 12 * time.Second}},
			wantUntil: 12 * time.Second,
		},
		{
			name:      "a 429 without a hint rests 5s",
			steps:     []step{{0, limited(0), 5 * time.Second}},
			wantUntil: 5 * time.Second,
		},
		{
			name:      "a 429 hint is capped by max",
			steps:     []step{{0, limited(10 * time.Minute), time.Minute}},
			wantUntil: time.Minute,
		},
		{
			name: "repeated 429s do not double",
			steps: []step{
				{0, limited(0), 5 * time.Second},
				{10 * time.Second, limited(0), 5 * time.Second},
				{20 * time.Second, limited(0), 5 * time.Second},
			},
			wantUntil: 25 * time.Second,
		},
		{
			name: "529 uses the base cooldown without doubling",
			steps: []step{
				{0, overloaded, 5 * time.Second},
				{10 * time.Second, overloaded, 5 * time.Second},
				{20 * time.Second, overloaded, 5 * time.Second},
			},
			wantUntil: 25 * time.Second,
		},
		{
			name:      "auth uses the auth cooldown, not capped by max",
			steps:     []step{{0, auth, 30 * time.Minute}},
			wantUntil: 30 * time.Minute,
		},
		{
			name: "a shorter cooldown never shortens a running one",
			steps: []step{
				{0, auth, 30 * time.Minute},
				{time.Second, transient, 5 * time.Second},
				{2 * time.Second, overloaded, 5 * time.Second},
				{3 * time.Second, limited(time.Second), time.Second},
			},
			wantUntil: 30 * time.Minute,
		},
		{
			name:      "a longer cooldown extends a running one",
			steps:     []step{{0, transient, 5 * time.Second}, {time.Second, limited(50 * time.Second), 50 * time.Second}},
			wantUntil: 51 * time.Second,
		},
		{
			name:      "a success does not end a running cooldown",
			steps:     []step{{0, overloaded, 5 * time.Second}, {time.Second, success, 0}},
			wantUntil: 5 * time.Second,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := new(channelHealth)
			for i, s := range tt.steps {
				if got := h.record(s.v, policy, testNow.Add(s.at), 0); got != s.want {
					t.Errorf("step %d (%v at +%v): cooldown = %v, want %v", i+1, s.v.outcome, s.at, got, s.want)
				}
			}
			last := testNow.Add(tt.steps[len(tt.steps)-1].at)
			ok, until := h.available(last)
			if tt.wantUntil == 0 || testNow.Add(tt.wantUntil).Compare(last) <= 0 {
				if !ok {
					t.Errorf("not available after the last step; cooling until +%v", until.Sub(testNow))
				}
				return
			}
			if ok {
				t.Fatalf("available after the last step, want cooling until +%v", tt.wantUntil)
			}
			if want := testNow.Add(tt.wantUntil); !until.Equal(want) {
				t.Errorf("cooling until +%v, want +%v", until.Sub(testNow), tt.wantUntil)
			}
		})
	}
}

func TestChannelHealthAvailable(t *testing.T) {
	h := new(channelHealth)
	if ok, until := h.available(testNow); !ok || !until.IsZero() {
		t.Fatalf("a new channel: available = %v until %v, want true and zero time", ok, until)
	}
	h.record(verdict{outcome: outcomeTransient}, cooldownPolicy{base: 5 * time.Second, max: time.Minute, auth: time.Hour}, testNow, 0)
	end := testNow.Add(5 * time.Second)
	tests := []struct {
		name string
		at   time.Time
		want bool
	}{
		{"cooling right after the failure", testNow, false},
		{"cooling one nanosecond before the end", end.Add(-time.Nanosecond), false},
		{"available exactly at the end", end, true},
		{"available after the end", end.Add(time.Hour), true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ok, until := h.available(tt.at)
			if ok != tt.want {
				t.Fatalf("available = %v, want %v", ok, tt.want)
			}
			if !ok && !until.Equal(end) {
				t.Errorf("until = %v, want %v", until, end)
			}
		})
	}
}

func TestBackoff(t *testing.T) {
	tests := []struct {
		consecutive int
		want        time.Duration
	}{
		{1, 5 * time.Second},
		{2, 10 * time.Second},
		{3, 20 * time.Second},
		{4, 40 * time.Second},
	}
	for _, tt := range tests {
		if got := backoff(5*time.Second, tt.consecutive); got != tt.want {
			t.Errorf("backoff(5s, %d) = %v, want %v", tt.consecutive, got, tt.want)
		}
	}
	// A long outage must not overflow into a negative cooldown.
	for _, n := range []int{40, 64, 1000, 1 << 30} {
		if got := backoff(5*time.Second, n); got < 24*time.Hour || got > 48*time.Hour {
			t.Errorf("backoff(5s, %d) = %v, want a large positive bound", n, got)
		}
	}
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

// newTestHealth returns a channel state with a breaker configured by s.
func newTestHealth(s breakerSettings) *channelHealth {
	h := new(channelHealth)
	h.configure(s, limits.Spec{}, channelOwner{provider: "anthropic"}, time.Now())
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
	if got := h.limits.Inflight(); got != int64(probes) {
		t.Errorf("inflight = %d, want %d", got, probes)
	}
	for _, tk := range admitted {
		tk.finish(verdict{outcome: outcomeSuccess}, testPolicy, time.Now(), time.Millisecond, 0)
	}
	if got := h.breaker.Load().State(); got != gobreaker.StateClosed {
		t.Errorf("after %d successful probes the breaker is %v, want closed", probes, got)
	}
	if got := h.limits.Inflight(); got != 0 {
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
	if h.limits.Inflight() != 0 {
		t.Errorf("inflight = %d after a panic", h.limits.Inflight())
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
	h.configure(s, limits.Spec{}, channelOwner{provider: "anthropic"}, time.Now()) // a reload with the same settings
	if h.breaker.Load().State() != gobreaker.StateOpen {
		t.Errorf("a reload with unchanged settings must keep the open breaker")
	}
	s.openFor = 2 * time.Hour
	h.configure(s, limits.Spec{}, channelOwner{provider: "anthropic"}, time.Now())
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
