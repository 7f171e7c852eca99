package relay

import (
	"testing"
	"time"
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
