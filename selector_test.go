package relay

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"testing"
	"time"
)

// testChannel builds a runtime channel for the selector: one tier, weight 1,
// serving every model, healthy, on its own host.
func testChannel(name string, opts ...func(*channel)) *channel {
	ch := &channel{name: name, priority: 1, weight: 1, host: name + ".example", health: new(channelHealth)}
	for _, o := range opts {
		o(ch)
	}
	return ch
}

func withModels(m ...string) func(*channel) {
	return func(ch *channel) {
		ch.models = map[string]string{}
		for _, n := range m {
			ch.models[n] = n
		}
	}
}
func withPriority(p int) func(*channel)     { return func(ch *channel) { ch.priority = p } }
func withWeight(w int) func(*channel)       { return func(ch *channel) { ch.weight = w } }
func withHost(h string) func(*channel)      { return func(ch *channel) { ch.host = h } }
func withAllow(c capability) func(*channel) { return func(ch *channel) { ch.allow = c } }
func withCooldown(d time.Duration) func(*channel) {
	return func(ch *channel) { ch.health.extend(testNow.Add(d)) }
}

// Deterministic randomness: the first or the last channel of the weighted
// list.
var (
	randFirst randIntN = func(int) int { return 0 }
	randLast  randIntN = func(n int) int { return n - 1 }
)

func TestGroupPick(t *testing.T) {
	type want struct {
		channel    string        // "" with code "": (nil, nil)
		code       string        // error.code of the relayError
		retryAfter time.Duration // of a no_healthy_channel error
	}
	tests := []struct {
		name      string
		channels  []*channel
		model     string
		caps      capability
		tried     []string
		avoidHost string
		rand      randIntN
		want      want
	}{
		{
			name:     "channel listing the model is picked",
			channels: []*channel{testChannel("a", withModels("opus")), testChannel("b", withModels("sonnet"))},
			model:    "sonnet",
			want:     want{channel: "b"},
		},
		{
			name:     "channel with no models list serves every model",
			channels: []*channel{testChannel("a", withModels("opus")), testChannel("any")},
			model:    "claude-made-up",
			want:     want{channel: "any"},
		},
		{
			name:     "no channel serves the model",
			channels: []*channel{testChannel("a", withModels("opus")), testChannel("b", withModels("sonnet"))},
			model:    "haiku",
			want:     want{code: "model_not_found"},
		},
		{
			name:     "model_not_found even when every channel was tried",
			channels: []*channel{testChannel("a", withModels("opus"))},
			model:    "haiku",
			tried:    []string{"a"},
			want:     want{code: "model_not_found"},
		},
		{
			name:     "tried channels are excluded",
			channels: []*channel{testChannel("a"), testChannel("b"), testChannel("c")},
			tried:    []string{"a", "c"},
			want:     want{channel: "b"},
		},
		{
			name:     "nothing left when every channel was tried",
			channels: []*channel{testChannel("a"), testChannel("b")},
			tried:    []string{"b", "a"},
			want:     want{},
		},
		{
			name:     "cooling channels are skipped",
			channels: []*channel{testChannel("a", withCooldown(time.Minute)), testChannel("b"), testChannel("c", withCooldown(time.Second))},
			want:     want{channel: "b"},
		},
		{
			name:     "a cooldown that ended is no longer skipped",
			channels: []*channel{testChannel("a", withCooldown(-time.Second))},
			want:     want{channel: "a"},
		},
		{
			name:     "every channel cooling: retry after the earliest recovery",
			channels: []*channel{testChannel("a", withCooldown(40*time.Second)), testChannel("b", withCooldown(7*time.Second)), testChannel("c", withCooldown(time.Minute))},
			want:     want{code: "no_healthy_channel", retryAfter: 7 * time.Second},
		},
		{
			name:     "every untried channel cooling after an attempt: nothing left",
			channels: []*channel{testChannel("a"), testChannel("b", withCooldown(7*time.Second))},
			tried:    []string{"a"},
			want:     want{},
		},
		{
			name:     "cooling channels of another model do not count",
			channels: []*channel{testChannel("a", withModels("opus"), withCooldown(time.Second)), testChannel("b", withModels("sonnet"), withCooldown(time.Hour))},
			model:    "sonnet",
			want:     want{code: "no_healthy_channel", retryAfter: time.Hour},
		},
		{
			name:     "capability filter keeps the channels that allow it",
			channels: []*channel{testChannel("a"), testChannel("b", withAllow(capServiceTier|capSpeed))},
			caps:     capServiceTier,
			want:     want{channel: "b"},
		},
		{
			name:     "every requested capability must be allowed",
			channels: []*channel{testChannel("a", withAllow(capServiceTier)), testChannel("b", withAllow(capSpeed))},
			caps:     capServiceTier | capSpeed,
			want:     want{code: "capability_not_available"},
		},
		{
			name:     "capability allowed only by a cooling channel",
			channels: []*channel{testChannel("a"), testChannel("b", withAllow(capInferenceGeo), withCooldown(time.Minute))},
			caps:     capInferenceGeo,
			want:     want{code: "capability_not_available"},
		},
		{
			name:     "capability allowed only by a tried channel: nothing left",
			channels: []*channel{testChannel("a"), testChannel("b", withAllow(capInferenceGeo))},
			caps:     capInferenceGeo,
			tried:    []string{"b"},
			want:     want{},
		},
		{
			name:     "the best tier wins even if a lower tier has more weight",
			channels: []*channel{testChannel("fallback", withPriority(2), withWeight(1000)), testChannel("main", withPriority(1), withWeight(1))},
			rand:     randLast,
			want:     want{channel: "main"},
		},
		{
			name:     "tier 2 is used once every tier 1 channel is cooling",
			channels: []*channel{testChannel("a", withCooldown(time.Minute)), testChannel("b", withCooldown(time.Minute)), testChannel("c", withPriority(2)), testChannel("d", withPriority(3))},
			want:     want{channel: "c"},
		},
		{
			name:     "tier 2 is used once every tier 1 channel was tried",
			channels: []*channel{testChannel("a"), testChannel("c", withPriority(2))},
			tried:    []string{"a"},
			want:     want{channel: "c"},
		},
		{
			name:     "weighted pick: low draw gets the first channel",
			channels: []*channel{testChannel("a", withWeight(3)), testChannel("b", withWeight(1))},
			rand:     func(n int) int { return 2 },
			want:     want{channel: "a"},
		},
		{
			name:     "weighted pick: high draw gets the second channel",
			channels: []*channel{testChannel("a", withWeight(3)), testChannel("b", withWeight(1))},
			rand:     func(n int) int { return 3 },
			want:     want{channel: "b"},
		},
		{
			name:      "after a 529 another host is preferred",
			channels:  []*channel{testChannel("a", withHost("api.anthropic.com")), testChannel("b", withHost("api.anthropic.com")), testChannel("c", withHost("proxy.example"))},
			avoidHost: "api.anthropic.com",
			rand:      randFirst,
			want:      want{channel: "c"},
		},
		{
			name:      "after a 529 the same host is used if it is the only one",
			channels:  []*channel{testChannel("a", withHost("api.anthropic.com")), testChannel("b", withHost("api.anthropic.com"))},
			avoidHost: "api.anthropic.com",
			tried:     []string{"a"},
			want:      want{channel: "b"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g := &group{name: "g", channels: tt.channels}
			byName := map[string]*channel{}
			for _, ch := range tt.channels {
				byName[ch.name] = ch
			}
			s := &selection{model: tt.model, caps: tt.caps, avoidHost: tt.avoidHost, now: testNow, rand: tt.rand}
			if s.model == "" {
				s.model = "claude-sonnet-4-5"
			}
			for _, n := range tt.tried {
				s.tried = append(s.tried, byName[n])
			}
			if s.rand == nil {
				s.rand = func(n int) int {
					if n < 1 {
						t.Fatalf("rand called with n = %d", n)
					}
					return 0
				}
			}

			ch, rerr := pickErr(g, s)
			switch {
			case tt.want.code != "":
				if ch != nil || rerr == nil {
					t.Fatalf("got channel %v, error %v; want error code %q", chName(ch), rerr, tt.want.code)
				}
				if rerr.code != tt.want.code || rerr.status != http.StatusServiceUnavailable || rerr.typ != "relay_error" {
					t.Errorf("error = %d %s %q, want 503 relay_error %q", rerr.status, rerr.typ, rerr.code, tt.want.code)
				}
				if rerr.retryAfter != tt.want.retryAfter {
					t.Errorf("retryAfter = %v, want %v", rerr.retryAfter, tt.want.retryAfter)
				}
				if rerr.noRetry != (tt.want.code != "no_healthy_channel") {
					t.Errorf("noRetry = %v for %s", rerr.noRetry, tt.want.code)
				}
			case tt.want.channel == "":
				if ch != nil || rerr != nil {
					t.Fatalf("got channel %v, error %v; want nothing left (nil, nil)", chName(ch), rerr)
				}
			default:
				if rerr != nil {
					t.Fatalf("got error %s %q: %s", rerr.code, rerr.typ, rerr.msg)
				}
				if ch == nil || ch.name != tt.want.channel {
					t.Fatalf("picked %v, want %s", chName(ch), tt.want.channel)
				}
			}
		})
	}
}

func chName(ch *channel) string {
	if ch == nil {
		return "<nil>"
	}
	return ch.name
}

func TestGroupPickWeightedShare(t *testing.T) {
	heavy, light := testChannel("heavy", withWeight(3)), testChannel("light", withWeight(1))
	g := &group{name: "g", channels: []*channel{light, heavy}}
	rnd := rand.New(rand.NewPCG(1, 2))
	const picks = 4000
	n := 0
	for range picks {
		ch, rerr := pickErr(g, &selection{model: "m", now: testNow, rand: rnd.IntN})
		if rerr != nil || ch == nil {
			t.Fatalf("pick: %v %v", chName(ch), rerr)
		}
		if ch == heavy {
			n++
		}
	}
	// 0.03 is more than four standard deviations of the share (0.0068).
	if share := float64(n) / picks; math.Abs(share-0.75) > 0.03 {
		t.Errorf("weight 3 of 4 got %.3f of the picks, want 0.75±0.03", share)
	}
}

func TestGroupPickWeightedDrawsOverTheTier(t *testing.T) {
	// Only the live best tier counts towards the total weight.
	g := &group{name: "g", channels: []*channel{
		testChannel("a", withWeight(3)),
		testChannel("b", withWeight(5), withCooldown(time.Minute)),
		testChannel("c", withWeight(7)),
		testChannel("d", withWeight(100), withPriority(2)),
	}}
	var gotN int
	ch, _ := pickErr(g, &selection{model: "m", now: testNow, rand: func(n int) int { gotN = n; return n - 1 }})
	if gotN != 10 {
		t.Errorf("rand drew over %d, want 10 (weights 3 and 7)", gotN)
	}
	if chName(ch) != "c" {
		t.Errorf("picked %s, want c", chName(ch))
	}
}

func TestGroupPickManyChannels(t *testing.T) {
	// More channels than the selector's stack buffer.
	var chs []*channel
	for i := range 40 {
		chs = append(chs, testChannel(fmt.Sprintf("ch%02d", i), withCooldown(time.Duration(i%2)*time.Minute)))
	}
	g := &group{name: "g", channels: chs}
	s := &selection{model: "m", now: testNow, rand: randLast}
	seen := map[string]bool{}
	for {
		ch, rerr := pickErr(g, s)
		if rerr != nil {
			t.Fatalf("pick: %v", rerr.msg)
		}
		if ch == nil {
			break
		}
		if seen[ch.name] || ch.name[len(ch.name)-1]%2 != 0 {
			t.Fatalf("picked %s (seen before: %v), want each healthy channel once", ch.name, seen[ch.name])
		}
		seen[ch.name] = true
		s.tried = append(s.tried, ch)
	}
	if len(seen) != 20 {
		t.Errorf("picked %d channels, want the 20 healthy ones", len(seen))
	}
	if g.channels[0].name != "ch00" || g.channels[39].name != "ch39" {
		t.Errorf("pick reordered the group's channels")
	}
}

func TestCapabilityNames(t *testing.T) {
	tests := []struct {
		name string
		bit  capability
	}{
		{"service_tier", capServiceTier},
		{"inference_geo", capInferenceGeo},
		{"speed", capSpeed},
		{"temperature", 0},
		{"", 0},
	}
	for _, tt := range tests {
		if got := capabilityByName(tt.name); got != tt.bit {
			t.Errorf("capabilityByName(%q) = %d, want %d", tt.name, got, tt.bit)
		}
	}
	if s := (capServiceTier | capSpeed).String(); s != "service_tier, speed" {
		t.Errorf("String() = %q", s)
	}
}

// pickErr is a pick as the loop reads it: the channel, or for a request's
// first pick the relay's answer; (nil, nil) when every channel is tried.
func pickErr(g *group, s *selection) (*channel, *relayError) {
	p := g.pick(s)
	switch p.reason {
	case picked:
		return p.ch, nil
	case exhausted:
		return nil, nil
	}
	return nil, p.err(s, g)
}
