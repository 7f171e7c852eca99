package relay

import (
	"bytes"
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddy-relay/relay/providers/anthropic"
)

// testChannel builds a runtime channel for the selector: one tier, weight 1,
// serving every model, healthy, on its own host.
func testChannel(name string, opts ...func(*channel)) *channel {
	ch := &channel{name: name, priority: 1, weight: 1, host: name + ".example", health: newChannelHealth(name)}
	ch.features = features.NewChannel(&anthropic.Provider{}, nil, nil, nil)
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
func withPriority(p int) func(*channel) { return func(ch *channel) { ch.priority = p } }
func withWeight(w int) func(*channel)   { return func(ch *channel) { ch.weight = w } }
func withHost(h string) func(*channel)  { return func(ch *channel) { ch.host = h } }
func withFeatures(supports, lacks, strip []string) func(*channel) {
	return func(ch *channel) {
		ch.features = features.NewChannel(&anthropic.Provider{}, supports, lacks, strip)
	}
}
func withSupports(names ...string) func(*channel) { return withFeatures(names, nil, nil) }
func withLacks(names ...string) func(*channel)    { return withFeatures(nil, names, nil) }
func withStrip(names ...string) func(*channel)    { return withFeatures(nil, nil, names) }
func withLearnedLack(name string, d time.Duration) func(*channel) {
	return func(ch *channel) {
		ch.health.Record(health.Verdict{Outcome: outcomeLacksFeature, Features: []string{name}}, health.CooldownPolicy{Capability: d}, testNow, 0)
	}
}

// needing is the needs of a request that carries the named features.
func needing(names ...string) features.Needs {
	var n features.Needs
	for _, name := range names {
		if b := features.Bit(name); b != 0 {
			n.Set |= b
		} else {
			n.Betas = append(n.Betas, name)
		}
	}
	return n
}
func withCooldown(d time.Duration) func(*channel) {
	return func(ch *channel) { coolUntil(ch.health, testNow.Add(d)) }
}

// coolUntil cools the channel until t, as a credential refused at testNow
// would (a cooldown no max_cooldown caps); a cooldown that ends earlier
// does not shorten one.
func coolUntil(h *channelHealth, t time.Time) {
	h.Record(health.Verdict{Outcome: outcomeAuth}, health.CooldownPolicy{Auth: t.Sub(testNow)}, testNow, 0)
}

// setLatency makes ms the channel's first-byte latency average, its last
// sample taken at at, as a first answer would.
func setLatency(h *channelHealth, ms float64, at time.Time) {
	h.Record(health.Verdict{Outcome: outcomeSuccess}, health.CooldownPolicy{}, at, time.Duration(ms*float64(time.Millisecond)))
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
		needs     features.Needs
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
			name:     "capability filter keeps the channels that support it",
			channels: []*channel{testChannel("a"), testChannel("b", withSupports("service_tier", "speed"))},
			needs:    needing("service_tier"),
			want:     want{channel: "b"},
		},
		{
			name:     "every needed feature must be supported by one channel",
			channels: []*channel{testChannel("a", withSupports("service_tier")), testChannel("b", withSupports("speed"))},
			needs:    needing("service_tier", "speed"),
			want:     want{code: "capability_not_available"},
		},
		{
			name:     "a feature supported only by a cooling channel: it is the channel's health that fails",
			channels: []*channel{testChannel("a"), testChannel("b", withSupports("inference_geo"), withCooldown(time.Minute))},
			needs:    needing("inference_geo"),
			want:     want{code: "no_healthy_channel", retryAfter: time.Minute},
		},
		{
			name:     "a feature supported only by a tried channel: nothing left",
			channels: []*channel{testChannel("a"), testChannel("b", withSupports("inference_geo"))},
			needs:    needing("inference_geo"),
			tried:    []string{"b"},
			want:     want{},
		},
		{
			name:     "a channel that lacks a field is passed over",
			channels: []*channel{testChannel("a", withLacks("mcp_servers")), testChannel("b", withWeight(0))},
			needs:    needing("mcp_servers"),
			want:     want{channel: "b"},
		},
		{
			name:     "a channel that lacks a beta is passed over, for that beta only",
			channels: []*channel{testChannel("a", withLacks("files-api-2025-04-14")), testChannel("b", withPriority(2))},
			needs:    needing("files-api-2025-04-14", "web_search"),
			want:     want{channel: "b"},
		},
		{
			name:     "a learned lack sets the channel aside for that feature",
			channels: []*channel{testChannel("a", withLearnedLack("context_management", time.Minute)), testChannel("b", withPriority(2))},
			needs:    needing("context_management"),
			want:     want{channel: "b"},
		},
		{
			name:     "a learned lack that ended sets nothing aside",
			channels: []*channel{testChannel("a", withLearnedLack("context_management", -time.Second)), testChannel("b", withPriority(2))},
			needs:    needing("context_management"),
			want:     want{channel: "a"},
		},
		{
			name:     "a learned lack of a beta does not touch requests without it",
			channels: []*channel{testChannel("a", withLearnedLack("x-beta-2030-01-01", time.Minute)), testChannel("b", withPriority(2))},
			needs:    needing("mcp_servers"),
			want:     want{channel: "a"},
		},
		{
			name:     "a channel that serves the request whole beats one that would strip, whatever the tier",
			channels: []*channel{testChannel("a", withStrip("mcp_servers")), testChannel("b", withPriority(2))},
			needs:    needing("mcp_servers"),
			want:     want{channel: "b"},
		},
		{
			name:     "a channel that strips serves when no other can",
			channels: []*channel{testChannel("a", withStrip("mcp_servers", "claude-code-20250219")), testChannel("b", withLacks("mcp_servers"))},
			needs:    needing("mcp_servers", "claude-code-20250219"),
			want:     want{channel: "a"},
		},
		{
			name:     "strip unsupported_betas takes the betas the channel lacks",
			channels: []*channel{testChannel("a", withFeatures(nil, []string{"x-beta-2030-01-01"}, []string{"unsupported_betas"}))},
			needs:    needing("x-beta-2030-01-01"),
			want:     want{channel: "a"},
		},
		{
			name:     "opt-in fields and lacked tools name what is missing",
			channels: []*channel{testChannel("a", withLacks("web_fetch"))},
			needs:    needing("web_fetch", "speed"),
			want:     want{code: "capability_not_available"},
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
			s := &selection{model: tt.model, needs: tt.needs, avoidHost: tt.avoidHost, now: testNow, rand: tt.rand}
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

func TestPriorityTiersAndWeights(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Message("a"))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	c := fakeupstream.New(t, fakeupstream.Message("c"))
	startRelay(t, channelBlock("tier-a", a.URL, "weight 3")+channelBlock("tier-b", b.URL, "weight 1")+
		channelBlock("tier-c", c.URL, "priority 2", "weight 100")+keyAndGroup("tier", "tier-a tier-b tier-c"))

	const n = 400
	for i := 0; i < n; i++ {
		if r := message(t, simpleBody); r.status != 200 {
			t.Fatalf("request %d: status %d", i, r.status)
		}
	}
	if c.Hits() != 0 {
		t.Errorf("the priority-2 channel got %d requests while tier 1 was healthy", c.Hits())
	}
	// binomial(400, 0.75): mean 300, sd 8.7; allow 4 sd
	if got := a.Hits(); got < 265 || got > 335 || got+b.Hits() != n {
		t.Errorf("weights 3:1 gave a=%d b=%d, want a within 300±35", got, b.Hits())
	}
}

func TestCapabilityFilter(t *testing.T) {
	plain := fakeupstream.New(t, fakeupstream.Message("plain"))
	tier := fakeupstream.New(t, fakeupstream.Message("tier"))
	startRelay(t, channelBlock("cap-plain", plain.URL, "weight 100")+channelBlock("cap-tier", tier.URL, "allow service_tier")+
		keyAndGroup("cap", "cap-plain cap-tier"))

	for i := 0; i < 5; i++ {
		if r := message(t, `{"model":"m","max_tokens":1,"service_tier":"auto","messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 {
			t.Fatalf("status %d", r.status)
		}
	}
	if tier.Hits() != 5 || plain.Hits() != 0 {
		t.Errorf("service_tier requests: tier %d plain %d, want all 5 on the channel that allows it", tier.Hits(), plain.Hits())
	}
	// a null value is no request for the capability
	message(t, `{"model":"m","service_tier":null,"max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`)
	r := message(t, `{"model":"m","max_tokens":1,"speed":"fast","messages":[{"role":"user","content":"Hi"}]}`)
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	if !bytes.Contains(r.body, []byte("speed")) || r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("capability error should name the field and say x-should-retry: false: %s", r.body)
	}
}

func TestOverloadPrefersAnotherHost(t *testing.T) {
	shared := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.HasPrefix(r.URL.Path, "/a/") {
			fakeupstream.Error(529, "overloaded_error", "Overloaded")(w, r)
			return
		}
		fakeupstream.Message("same host")(w, r)
	}))
	other := fakeupstream.New(t, fakeupstream.Message("other host"))
	startRelay(t, channelBlock("host-a", shared.URL+"/a", "priority 1")+channelBlock("host-b", shared.URL+"/b", "priority 2")+
		channelBlock("host-c", other.URL, "priority 3")+keyAndGroup("host", "host-a host-b host-c"))
	r := message(t, simpleBody)
	if r.status != 200 || !bytes.Contains(r.body, []byte("other host")) {
		t.Errorf("after a 529 the next attempt should go to another upstream host: %d %s", r.status, r.body)
	}
	if got := shared.Last(t).Path; got != "/a/v1/messages" {
		t.Errorf("the shared host should only have seen channel a: %s", got)
	}
}

func TestFallbackServesASimilarModel(t *testing.T) {
	opus := fakeupstream.New(t, fakeupstream.Message("opus"))
	sonnet := fakeupstream.New(t, fakeupstream.Message("sonnet"))
	startRelay(t, channelBlock("fb-opus", opus.URL, "models claude-opus-4-1")+
		channelBlock("fb-sonnet", sonnet.URL, "models claude-sonnet-4-5=claude-sonnet-4-5-20250929")+
		keyAndGroup("fb", "fb-opus fb-sonnet", "fallback claude-opus-4-1 claude-sonnet-4-5"))
	opusBody := `{"model":"claude-opus-4-1","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`
	fallbacks := func() float64 {
		mf, _ := scrape(t)
		return max(value(mf, "relay_model_fallbacks_total", "group=fb", "from=claude-opus-4-1", "to=claude-sonnet-4-5"), 0)
	}
	before := fallbacks()            // the counter outlives the config: a second run of the test finds the first's
	adminPost(t, "fb-opus", "reset") // and so does the cooldown that the first left on opus

	for i := 0; i < 5; i++ {
		if r := message(t, opusBody); r.header.Get("X-Relay-Model") != "" || !strings.Contains(string(r.body), "opus") {
			t.Fatalf("with opus live, sonnet must never serve opus: %v %s", r.header, r.body)
		}
	}
	if sonnet.Hits() != 0 {
		t.Fatalf("sonnet served %d opus requests while opus was live", sonnet.Hits())
	}

	// opus fails: the same request fails over to sonnet
	opus.SetHandler(fakeupstream.Raw(503, []byte("down")))
	r := message(t, opusBody)
	if r.status != 200 || r.header.Get("X-Relay-Model") != "claude-sonnet-4-5" || r.header.Get("X-Relay-Attempts") != "2" {
		t.Fatalf("fallback: %d %v %s", r.status, r.header, r.body)
	}
	if got := string(sonnet.Last(t).Body); got != `{"model":"claude-sonnet-4-5-20250929","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}` {
		t.Errorf("sonnet received %s", got)
	}
	// opus is cooling now: straight to sonnet
	if r := message(t, opusBody); r.header.Get("X-Relay-Model") != "claude-sonnet-4-5" || opus.Hits() != 6 {
		t.Errorf("while opus cools: %v (opus hits %d)", r.header, opus.Hits())
	}
	if v := fallbacks() - before; v != 2 {
		t.Errorf("relay_model_fallbacks_total grew by %v, want 2", v)
	}

	// back up: opus serves opus again
	opus.SetHandler(fakeupstream.Message("opus"))
	adminPost(t, "fb-opus", "reset")
	if r := message(t, opusBody); r.header.Get("X-Relay-Model") != "" || !strings.Contains(string(r.body), "opus") {
		t.Errorf("after the recovery: %v %s", r.header, r.body)
	}
	// a model without a fallback is never served by another
	opus.SetHandler(fakeupstream.Raw(503, []byte("down")))
	adminPost(t, "fb-sonnet", "disable")
	r = message(t, opusBody)
	adminPost(t, "fb-sonnet", "enable")
	if r.status != 503 {
		t.Errorf("with every channel down: %d %s", r.status, r.body)
	}
}

// benchPick measures one pick among 4 live channels of one tier under a
// policy (with a 10% canary split when split is set).
func benchPick(b *testing.B, policy string, split bool) {
	g := &group{name: "bench-pick", policy: policy}
	for i := 0; i < 4; i++ {
		ch := testChannel(fmt.Sprintf("bench-pick-%d", i), withWeight(1+i))
		ch.health.configure(health.DefaultBreaker, limits.Spec{}, channelOwner{}, time.Now())
		setLatency(ch.health, float64(100+50*i), time.Unix(0, 0))
		g.channels = append(g.channels, ch)
	}
	if split {
		g.splits = []groupSplit{{ch: g.channels[3], share: 0.1}}
	}
	var triedBuf [4]*channel
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		sel := selection{model: "m", session: "session-1234", tried: triedBuf[:0], rand: rand.IntN, now: testNow}
		if ch, _ := pickErr(g, &sel); ch == nil {
			b.Fatal("no pick")
		}
	}
}

func BenchmarkPickWeighted(b *testing.B)        { benchPick(b, policyWeighted, false) }
func BenchmarkPickAdaptive(b *testing.B)        { benchPick(b, policyAdaptive, false) }
func BenchmarkPickSticky(b *testing.B)          { benchPick(b, policySticky, false) }
func BenchmarkPickStickyWithSplit(b *testing.B) { benchPick(b, policySticky, true) }
