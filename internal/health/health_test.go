package health

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/sony/gobreaker/v2"
)

// testNow is the fixed "now" of the tests that step their own clock.
var testNow = time.Date(2025, time.March, 14, 15, 9, 26, 0, time.UTC)

func TestChannelHealthCooldowns(t *testing.T) {
	policy := CooldownPolicy{Base: 5 * time.Second, Max: time.Minute, Auth: 30 * time.Minute}
	var (
		transient  = Verdict{Outcome: Transient}
		success    = Verdict{Outcome: Success}
		clientErr  = Verdict{Outcome: ClientError}
		canceled   = Verdict{Outcome: Canceled}
		overloaded = Verdict{Outcome: Overloaded}
		auth       = Verdict{Outcome: Auth}
		limited    = func(wait time.Duration) Verdict { return Verdict{Outcome: RateLimited, Wait: wait} }
	)
	type step struct {
		at   time.Duration // after testNow
		v    Verdict
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
			h := new(Channel)
			for i, s := range tt.steps {
				if got := h.Record(s.v, policy, testNow.Add(s.at), 0); got != s.want {
					t.Errorf("step %d (%v at +%v): cooldown = %v, want %v", i+1, s.v.Outcome, s.at, got, s.want)
				}
			}
			last := testNow.Add(tt.steps[len(tt.steps)-1].at)
			ok, until := h.Available(last)
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
	h := new(Channel)
	if ok, until := h.Available(testNow); !ok || !until.IsZero() {
		t.Fatalf("a new channel: available = %v until %v, want true and zero time", ok, until)
	}
	h.Record(Verdict{Outcome: Transient}, CooldownPolicy{Base: 5 * time.Second, Max: time.Minute, Auth: time.Hour}, testNow, 0)
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
			ok, until := h.Available(tt.at)
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

// newTestHealth returns a channel's health with a breaker configured by s.
func newTestHealth(s BreakerSettings) *Channel {
	h := NewChannel("c")
	h.Configure(s)
	return h
}

var testPolicy = CooldownPolicy{Base: time.Millisecond, Max: time.Millisecond, Auth: time.Millisecond}

// run lets through and finishes one attempt per outcome, as the relay does.
func run(t *testing.T, h *Channel, outcomes ...Outcome) {
	t.Helper()
	for _, o := range outcomes {
		a, ok := h.Allow()
		if !ok {
			t.Fatalf("attempt refused; breaker %v", h.breaker.Load().State())
		}
		h.Finish(a, Verdict{Outcome: o}, testPolicy, time.Now(), time.Millisecond)
	}
}

func TestBreakerTripsAtTheConfiguredRatio(t *testing.T) {
	s := BreakerSettings{Window: 10 * time.Second, Ratio: 0.6, MinRequests: 5, OpenFor: time.Hour, Probes: 1}
	f, ok := Transient, Success
	tests := []struct {
		name     string
		outcomes []Outcome
		open     bool
	}{
		{"3 of 5 failed (0.6) trips", []Outcome{ok, f, ok, f, f}, true},
		{"2 of 5 failed (0.4) does not", []Outcome{f, ok, f, ok, ok}, false},
		{"4 of 4 failed is below min_requests", []Outcome{f, f, f, f}, false},
		{"5 of 9 failed (0.56) does not", []Outcome{ok, ok, ok, ok, f, f, f, f, f}, false},
		{"6 of 10 failed trips on the tenth", []Outcome{ok, ok, ok, ok, f, f, f, f, f, f}, true},
		{"429, 529 and auth are not breaker failures", []Outcome{RateLimited, Overloaded, Auth, RateLimited, Overloaded, ok}, false},
		{"client errors count as successes", []Outcome{ClientError, ClientError, f, f, f}, true},
		{"canceled attempts do not count", []Outcome{Canceled, Canceled, f, f, ok, ok}, false},
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
				if st := h.State(time.Now()); st != StateOpen {
					t.Errorf("state = %q, want open", st)
				}
				if ok, until := h.Available(time.Now()); ok || time.Until(until) < 59*time.Minute {
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
func turnHalfOpen(t *testing.T, h *Channel) {
	t.Helper()
	time.Sleep(h.settings.OpenFor + time.Nanosecond)
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
	s := BreakerSettings{Window: 10 * time.Second, Ratio: 0.5, MinRequests: 2, OpenFor: 50 * time.Millisecond, Probes: probes}
	h := newTestHealth(s)
	run(t, h, Transient, Transient)
	if st := h.State(time.Now()); st != StateOpen {
		t.Errorf("state = %q, want open", st)
	}
	turnHalfOpen(t, h)
	if st := h.State(time.Now()); st != StateHalfOpen {
		t.Errorf("state = %q, want half_open", st)
	}

	var admitted []Attempt
	for {
		a, ok := h.Allow()
		if !ok {
			break
		}
		admitted = append(admitted, a)
		if len(admitted) > 10 {
			break
		}
	}
	if uint32(len(admitted)) != probes {
		t.Fatalf("half-open admitted %d attempts, want exactly %d", len(admitted), probes)
	}
	for _, a := range admitted {
		h.Finish(a, Verdict{Outcome: Success}, testPolicy, time.Now(), time.Millisecond)
	}
	if got := h.breaker.Load().State(); got != gobreaker.StateClosed {
		t.Errorf("after %d successful probes the breaker is %v, want closed", probes, got)
	}
}

func TestBreakerHalfOpenFailureReopens(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		h := newTestHealth(BreakerSettings{Window: 10 * time.Second, Ratio: 0.5, MinRequests: 2, OpenFor: 50 * time.Millisecond, Probes: 1})
		run(t, h, Transient, Transient)
		turnHalfOpen(t, h)
		run(t, h, Transient)
		if got := h.breaker.Load().State(); got != gobreaker.StateOpen {
			t.Fatalf("a failed probe should reopen the breaker, got %v", got)
		}
		if ok, until := h.Available(time.Now()); ok || until.Sub(time.Now()) != 50*time.Millisecond {
			t.Errorf("reopened: available=%v until %v from now, want open_for", ok, until.Sub(time.Now()))
		}
	})
}

func TestAttemptReleasedWithoutVerdict(t *testing.T) {
	synctest.Test(t, attemptReleasedWithoutVerdict)
}

func attemptReleasedWithoutVerdict(t *testing.T) {
	h := newTestHealth(BreakerSettings{Window: 10 * time.Second, Ratio: 0.5, MinRequests: 1, OpenFor: 50 * time.Millisecond, Probes: 1})
	run(t, h, Transient)
	turnHalfOpen(t, h)
	func() {
		defer func() { _ = recover() }()
		a, ok := h.Allow()
		if !ok {
			t.Fatal("the half-open slot should be free")
		}
		defer h.Abort(a)
		panic("attempt panicked")
	}()
	if _, ok := h.Allow(); !ok {
		t.Errorf("the half-open slot was lost with the panicking attempt")
	}
}

func TestChannelCounters(t *testing.T) {
	h := newTestHealth(DefaultBreaker)
	run(t, h, Success, Transient, ClientError, RateLimited, Canceled)
	if h.Requests() != 4 || h.Failures() != 2 {
		t.Errorf("requests %d failures %d, want 4, 2 (a cancel is not traffic)", h.Requests(), h.Failures())
	}
	if last, _, _ := h.LastError(); last != RateLimited || h.Latency() != 1 {
		t.Errorf("last error %v, latency %v", last, h.Latency())
	}
	h.Disable()
	if h.State(time.Now()) != StateDisabled {
		t.Errorf("a disabled channel reports %q", h.State(time.Now()))
	}
	if ok, until := h.Available(time.Now()); ok || !until.IsZero() {
		t.Errorf("a disabled channel is available=%v until %v; want unavailable with no recovery time", ok, until)
	}
}

func TestConfigureKeepsOrReplacesTheBreaker(t *testing.T) {
	s := BreakerSettings{Window: 10 * time.Second, Ratio: 0.5, MinRequests: 2, OpenFor: time.Hour, Probes: 1}
	h := newTestHealth(s)
	run(t, h, Transient, Transient)
	h.Configure(s) // a reload with the same settings
	if h.breaker.Load().State() != gobreaker.StateOpen {
		t.Errorf("a reload with unchanged settings must keep the open breaker")
	}
	s.OpenFor = 2 * time.Hour
	h.Configure(s)
	if h.breaker.Load().State() != gobreaker.StateClosed {
		t.Errorf("new settings start a new breaker")
	}
}
