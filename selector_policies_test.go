package relay

import (
	"fmt"
	"math"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/limits"
)

func sessions(n int) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = fmt.Sprintf("session-%04d", i)
	}
	return out
}

func pickFor(t *testing.T, g *group, session string) string {
	t.Helper()
	ch, rerr := pickErr(g, &selection{model: "m", session: session, now: testNow, rand: rand.IntN})
	if ch == nil {
		t.Fatalf("no pick for %s: %v", session, rerr)
	}
	return ch.name
}

func TestStickySpreadsAndKeepsSessions(t *testing.T) {
	g := &group{name: "sticky", policy: policySticky}
	for _, n := range []string{"a", "b", "c", "d"} {
		g.channels = append(g.channels, testChannel(n))
	}
	first := map[string]string{}
	count := map[string]int{}
	for _, s := range sessions(1000) {
		first[s] = pickFor(t, g, s)
		count[first[s]]++
		if again := pickFor(t, g, s); again != first[s] {
			t.Fatalf("session %s moved from %s to %s", s, first[s], again)
		}
	}
	// binomial(1000, 1/4): sd 13.7; allow 4 sd
	for name, n := range count {
		if n < 195 || n > 305 {
			t.Errorf("channel %s got %d of 1000 sessions, want 250±55", name, n)
		}
	}

	// cooling c moves c's sessions only, and they come back
	c := g.channels[2]
	coolUntil(c.health, testNow.Add(time.Minute))
	for s, was := range first {
		now := pickFor(t, g, s)
		if was != "c" && now != was {
			t.Fatalf("session %s moved from %s to %s when only c cooled", s, was, now)
		}
		if was == "c" && now == "c" {
			t.Fatalf("session %s stayed on the cooling channel", s)
		}
	}
	c.health.Reset()
	for s, was := range first {
		if now := pickFor(t, g, s); now != was {
			t.Fatalf("session %s did not come back to %s after the recovery (on %s)", s, was, now)
		}
	}

	// weights shape the shares: 2 of weight 1, one of weight 2
	w := &group{name: "sticky-w", policy: policySticky, channels: []*channel{testChannel("x"), testChannel("y"), testChannel("z", withWeight(2))}}
	z := 0
	for _, s := range sessions(2000) {
		if pickFor(t, w, s) == "z" {
			z++
		}
	}
	if z < 920 || z > 1080 { // binomial(2000, 1/2): sd 22
		t.Errorf("weight 2 of 4 got %d of 2000 sessions, want 1000±80", z)
	}
}

func TestASessionIDNeverLeavesTheBestLiveTier(t *testing.T) {
	// whatever session id a client makes up, sticky hashing only picks
	// within the best live tier: a heavy fallback is never chosen while a
	// preferred channel lives
	a, b := testChannel("a"), testChannel("b")
	fallback := testChannel("fallback", withPriority(2), withWeight(1_000_000))
	g := &group{name: "tiers", policy: policySticky, channels: []*channel{a, b, fallback}}
	ids := sessions(5000)
	ids = append(ids, "", "fallback", "key:x", strings.Repeat("z", 4096), "\x00", "session_fallback")
	for _, s := range ids {
		if got := pickFor(t, g, s); got == "fallback" {
			t.Fatalf("session %q picked the tier-2 channel while tier 1 is live", s)
		}
	}
	coolUntil(a.health, testNow.Add(time.Minute))
	for _, s := range ids {
		if got := pickFor(t, g, s); got != "b" {
			t.Fatalf("session %q picked %s while b is the only live tier-1 channel", s, got)
		}
	}
	// a canary split is the documented exception: its share of sessions
	// reaches it whatever its priority, and no other session does
	a.health.Reset()
	split := &group{name: "tiers-split", policy: policySticky, channels: []*channel{a, b, fallback},
		splits: []groupSplit{{ch: fallback, share: 0.01}}}
	in := 0
	for _, s := range ids {
		if pickFor(t, split, s) == "fallback" {
			if unitHash("split", "fallback", s) >= 0.01 {
				t.Fatalf("session %q reached the canary outside its share", s)
			}
			in++
		}
	}
	if in == 0 || in > 100 {
		t.Errorf("%d of %d sessions reached a 1%% canary", in, len(ids))
	}
}

func TestCanarySplit(t *testing.T) {
	a, canary := testChannel("a"), testChannel("canary", withPriority(2))
	g := &group{name: "split", policy: policyWeighted, channels: []*channel{a, canary}, splits: []groupSplit{{ch: canary, share: 0.1}}}
	in := 0
	for _, s := range sessions(1000) {
		got := pickFor(t, g, s)
		if got == "canary" {
			in++
		}
		if pickFor(t, g, s) != got {
			t.Fatalf("session %s is not stable across the split", s)
		}
	}
	if in < 62 || in > 138 { // binomial(1000, 0.1): sd 9.5; allow 4 sd
		t.Errorf("%d of 1000 sessions went to the 10%% canary", in)
	}
	// the others only reach the canary when nothing else is live
	coolUntil(a.health, testNow.Add(time.Minute))
	if got := pickFor(t, g, "session-that-is-not-canary-"+fmt.Sprint(in)); got != "canary" {
		t.Errorf("with a cooling, every session must use the canary: %s", got)
	}
}

func TestEffectiveWeights(t *testing.T) {
	mk := func(name string, latencyMs float64, age time.Duration, inflight, conc int64) *channel {
		ch := testChannel(name, withWeight(10))
		ch.health.configure(health.DefaultBreaker, limits.Spec{Concurrency: conc}, channelOwner{}, testNow)
		if latencyMs > 0 {
			setLatency(ch.health, latencyMs, testNow.Add(-age))
		}
		for range inflight { // in flight: taken and not given back
			if _, scope, _ := ch.health.limits.Take(testNow, -1); scope != limits.ScopeNone {
				panic(scope)
			}
		}
		return ch
	}
	w := effectiveWeights([]*channel{
		mk("fast", 100, 0, 0, 0),
		mk("within the dead band", 124, 0, 0, 0), // 25% of the best
		mk("slow", 400, 0, 0, 0),                 // (100+25)/400
		mk("slow, half forgotten", 400, latencyMemory/2, 0, 0),
		mk("slow, forgotten", 400, latencyMemory, 0, 0),
		mk("busy", 100, 0, 3, 4),
		mk("crawling", 100_000, 0, 0, 0),
		mk("new", 0, 0, 0, 0),
	}, testNow, nil)
	want := []float64{10, 10, 3.125, 5, 10, 2.5, 0.5, 10}
	for i := range want {
		if math.Abs(w[i]-want[i]) > 1e-9 {
			t.Errorf("effective weights = %v, want %v", w, want)
			break
		}
	}
	// sub-millisecond differences are noise, not speed
	w = effectiveWeights([]*channel{mk("a", 0.4, 0, 0, 0), mk("b", 0.9, 0, 0, 0)}, testNow, nil)
	if w[0] != w[1] {
		t.Errorf("0.4ms and 0.9ms weigh %v", w)
	}
}

// TestAdaptiveDrainsASlowChannelAndTakesItBack simulates traffic on two
// channels with an injected clock, injected latencies (with noise) and a
// seeded random source: the result is the same on every run.
func TestAdaptiveDrainsASlowChannelAndTakesItBack(t *testing.T) {
	fast, slow := testChannel("fast"), testChannel("slow")
	for _, ch := range []*channel{fast, slow} {
		ch.health.configure(health.DefaultBreaker, limits.Spec{}, channelOwner{}, testNow)
	}
	g := &group{name: "adaptive", policy: policyAdaptive, channels: []*channel{fast, slow}}
	rnd := rand.New(rand.NewPCG(7, 11))
	now := testNow
	latency := map[*channel]time.Duration{fast: 3 * time.Millisecond, slow: 3 * time.Millisecond}
	share := func(n int) float64 {
		hits := 0
		for i := 0; i < n; i++ {
			now = now.Add(50 * time.Millisecond) // 20 requests a second
			p := g.pick(&selection{model: "m", now: now, rand: rnd.IntN})
			tk, _ := p.ch.health.admit(now, 0)
			noise := time.Duration(rnd.IntN(2000)) * time.Microsecond
			tk.finish(verdict{outcome: outcomeSuccess}, testPolicy, now, latency[p.ch]+noise, 0)
			if p.ch == slow {
				hits++
			}
		}
		t.Logf("%d picks: %.3f to the slow one", n, float64(hits)/float64(n))
		return float64(hits) / float64(n)
	}
	if s := share(400); s < 0.45 || s > 0.55 {
		t.Fatalf("while both are equally fast (noise aside) the slow one takes %.3f, want half", s)
	}
	latency[slow] = 200 * time.Millisecond
	share(100) // it slows down ...
	if s := share(400); s > 0.12 || s == 0 {
		t.Errorf("after it slowed down it takes %.3f of the traffic, want a trickle of about 0.1", s)
	}
	latency[slow] = 3 * time.Millisecond
	share(400) // ... recovers: within latencyMemory its old latency fades
	if s := share(400); s < 0.45 || s > 0.55 {
		t.Errorf("after it recovered it takes %.3f of the traffic, want half again", s)
	}
}

func TestSessionID(t *testing.T) {
	for _, c := range []struct {
		header, userID, want string
	}{
		{"cc-session-1", "user_ab_account__session_x", "cc-session-1"},
		{"", "user_7f3a9c_account_1b2c_session_5e2d1c3a-0f1e-4b8a-9c7d-2e4f6a8b0c1d", "5e2d1c3a-0f1e-4b8a-9c7d-2e4f6a8b0c1d"},
		{"", `{"device_id":"d1","account_uuid":"a1","session_id":"s-json"}`, "s-json"},
		{"", "end-user-42", "end-user-42"},
		{"", "", "key:support"},
	} {
		in := &inbound{who: requester{key: &key{name: "support"}, stateID: "support"}, ask: asked{header: http.Header{}, userID: c.userID}}
		if c.header != "" {
			in.ask.header.Set("X-Claude-Code-Session-Id", c.header)
		}
		if got := in.sessionID(); got != c.want {
			t.Errorf("sessionID(%q, %q) = %q, want %q", c.header, c.userID, got, c.want)
		}
	}
	// under user *, each identity is a session of its own
	in := &inbound{who: requester{key: &key{name: "user:*"}, stateID: "user:bob"}, ask: asked{header: http.Header{}}}
	if got := in.sessionID(); got != "key:user:bob" {
		t.Errorf("an identity of user *: sessionID = %q, want key:user:bob", got)
	}
}

func TestInspectReadsMetadataUserID(t *testing.T) {
	in := &inbound{ask: asked{body: []byte(`{"model":"m","metadata":{"user_id":"user_1_account__session_abc"},"messages":[]}`)}}
	if err := in.inspect(); err != nil || in.ask.userID != "user_1_account__session_abc" {
		t.Errorf("userID = %q (%v)", in.ask.userID, err)
	}
}

// TestAdaptiveDrainsASlowChannel: a channel that slows down loses its
// share within a bounded number of requests, and wins it back after it
// recovers.
func TestStickySessionsEndToEnd(t *testing.T) {
	var ups []*fakeupstream.Upstream
	var cfg strings.Builder
	for i := 0; i < 3; i++ {
		ups = append(ups, fakeupstream.New(t, fakeupstream.Message(fmt.Sprint(i))))
		cfg.WriteString(channelBlock(fmt.Sprintf("stick-%d", i), ups[i].URL))
	}
	cfg.WriteString(keyAndGroup("stick", "stick-0 stick-1 stick-2", "policy sticky", "expose_channel"))
	startRelay(t, cfg.String())
	used := map[string]bool{}
	for s := 0; s < 30; s++ {
		session := fmt.Sprintf("claude-code-%d", s)
		var first string
		for i := 0; i < 3; i++ {
			r := message(t, simpleBody, "X-Claude-Code-Session-Id", session)
			ch := r.header.Get("X-Relay-Channel")
			if i == 0 {
				first = ch
			} else if ch != first {
				t.Fatalf("session %s went to %s, then %s", session, first, ch)
			}
		}
		used[first] = true
	}
	if len(used) != 3 {
		t.Errorf("30 sessions used %d of 3 channels", len(used))
	}
	// metadata.user_id's session part pins too
	a := message(t, `{"model":"m","max_tokens":1,"metadata":{"user_id":"user_1_account__session_s1"},"messages":[{"role":"user","content":"Hi"}]}`).header.Get("X-Relay-Channel")
	for i := 0; i < 3; i++ {
		if b := message(t, `{"model":"m","max_tokens":1,"metadata":{"user_id":"user_2_account__session_s1"},"messages":[{"role":"user","content":"Hi"}]}`).header.Get("X-Relay-Channel"); b != a {
			t.Errorf("the same session in another user_id went elsewhere: %s vs %s", a, b)
		}
	}
}
