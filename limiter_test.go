package relay

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

func TestParseRateSpec(t *testing.T) {
	for in, want := range map[string]rateSpec{
		"600/m": {600, time.Minute}, "10/s": {10, time.Second}, "2000000/h": {2000000, time.Hour},
		"5/d": {5, 24 * time.Hour}, "3/10s": {3, 10 * time.Second}, "": {},
	} {
		got, err := parseRateSpec(in)
		if err != nil || got != want {
			t.Errorf("%q = %+v, %v; want %+v", in, got, err, want)
		}
	}
	for _, bad := range []string{"600", "x/m", "0/m", "-1/m", "10/fortnight", "10/-5s"} {
		if _, err := parseRateSpec(bad); err == nil {
			t.Errorf("%q should not parse", bad)
		}
	}
}

// limitRelay is a relay with one key (limited as given) on a mock channel,
// driven by a fake clock.
func limitRelay(t *testing.T, name string, key Key, upstreamURL string) (*Relay, *fakeClock) {
	t.Helper()
	key.Secret, key.Group, key.Name = "sk-"+name, name, name
	ch := &Channel{Name: name + "-ch", UpstreamRaw: upstream("mock")}
	if upstreamURL != "" {
		ch = &Channel{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", upstreamURL, "api_key", channelKey)}
	}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{{Name: name, Channels: []string{ch.Name}}}}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Unix(1_900_000_000, 0)}
	r.now = clock.now
	return r, clock
}

func TestKeyRateLimitHoldsOverTheWindow(t *testing.T) {
	r, clock := limitRelay(t, "krate", Key{KeyOptions: KeyOptions{Rate: "3/m"}}, "")
	send := func() *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-krate"))
		return w
	}
	for i := 0; i < 3; i++ {
		if w := send(); w.Code != 200 {
			t.Fatalf("request %d: %d", i, w.Code)
		}
	}
	w := send()
	if w.Code != 429 || !strings.Contains(w.Body.String(), `"code":"key_rate_limited"`) || !strings.Contains(w.Body.String(), "rate") {
		t.Fatalf("4th request in the minute: %d %s", w.Code, w.Body.String())
	}
	if ra := w.Header().Get("Retry-After"); ra != "20" {
		t.Errorf("retry-after = %q, want 20 (one request every 20s)", ra)
	}
	clock.advance(19 * time.Second)
	if w := send(); w.Code != 429 {
		t.Errorf("after 19s: %d, want still limited", w.Code)
	}
	clock.advance(time.Second)
	if w := send(); w.Code != 200 {
		t.Errorf("after 20s: %d, want one more request", w.Code)
	}
	if w := send(); w.Code != 429 {
		t.Errorf("and only one: %d", w.Code)
	}
}

func TestKeyTokenLimitChargesRealUsage(t *testing.T) {
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m", "x", fakeupstream.Usage{InputTokens: 10, CacheReadInputTokens: 5000, OutputTokens: 600}))
	}))
	r, clock := limitRelay(t, "ktok", Key{KeyOptions: KeyOptions{Tokens: "1000/m"}}, up.URL)
	send := func() *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-ktok"))
		return w
	}

	// 1000 -> 390 -> -220: the second request passes with 390 left and puts
	// the key 220 tokens in debt (cache reads do not count)
	for i := 0; i < 2; i++ {
		if w := send(); w.Code != 200 {
			t.Fatalf("request %d: %d %s", i, w.Code, w.Body.String())
		}
	}
	w := send()
	if w.Code != 429 || !strings.Contains(w.Body.String(), "tokens") {
		t.Fatalf("a key in debt must be refused: %d %s", w.Code, w.Body.String())
	}
	// 221 tokens at 1000/60s take 13.26s
	if ra := w.Header().Get("Retry-After"); ra != "14" {
		t.Errorf("retry-after = %q, want 14", ra)
	}
	clock.advance(13 * time.Second)
	if w := send(); w.Code != 429 {
		t.Errorf("after 13s the key is still in debt: %d", w.Code)
	}
	clock.advance(time.Second)
	if w := send(); w.Code != 200 {
		t.Errorf("after 14s: %d", w.Code)
	}
	if up.Hits() != 3 {
		t.Errorf("refused requests must not reach the upstream: %d hits", up.Hits())
	}
}

// inflightGauge reads relay_inflight{channel} through the collector.
func inflightGauge(t *testing.T, channel string) float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(metricStates)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "relay_inflight" {
			continue
		}
		for _, m := range mf.Metric {
			if m.Label[0].GetValue() == channel {
				return m.Gauge.GetValue()
			}
		}
	}
	return -1
}

// panicTransport fails an attempt the hard way.
type panicTransport struct{}

func (panicTransport) RoundTrip(*http.Request) (*http.Response, error) { panic("transport bug") }

func TestConcurrencySlotsReturnOnEveryPath(t *testing.T) {
	evs := fakeupstream.StreamEvents("m", fakeupstream.Usage{}, "x")
	var mu sync.Mutex
	mode := "ok"
	started := make(chan struct{}, 1)
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		m := mode
		mu.Unlock()
		switch m {
		case "error":
			fakeupstream.Error(500, "api_error", "boom")(w, r)
		case "reset":
			fakeupstream.Hangup()(w, r)
		case "hang":
			fakeupstream.StartStream(w)
			for _, ev := range evs[:4] {
				fakeupstream.WriteEvent(w, ev)
			}
			started <- struct{}{}
			<-r.Context().Done()
		default:
			fakeupstream.Message("ok")(w, r)
		}
	}))
	name := "slots"
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-slots", Group: name, KeyOptions: KeyOptions{Name: name, Concurrency: 3}}},
		Channels: []*Channel{{Name: "slots-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey), Concurrency: 2, Tuning: Tuning{Cooldown: caddy.Duration(time.Nanosecond), MaxCooldown: caddy.Duration(time.Nanosecond), Breaker: &Breaker{MinRequests: 1000}}}},
		Groups:   []*Group{{Name: name, Channels: []string{"slots-ch"}}},
	}
	provisionHandler(t, r)
	k := r.keys[keyDigestMust(t, "sk-slots")]
	r.activate(k) // as its first request does
	ch := r.groups[name].channels[0]
	check := func(path string) {
		t.Helper()
		if n := k.limits.inflight.Load(); n != 0 {
			t.Errorf("%s: key slots in use = %d, want 0", path, n)
		}
		if n := ch.health.limits.inflight.Load(); n != 0 {
			t.Errorf("%s: channel slots in use = %d, want 0", path, n)
		}
		if g := inflightGauge(t, "slots-ch"); g != 0 {
			t.Errorf("%s: relay_inflight = %v, want 0", path, g)
		}
	}
	setMode := func(m string) { mu.Lock(); mode = m; mu.Unlock() }

	serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-slots"))
	check("success")
	setMode("error")
	serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-slots"))
	check("upstream error")
	setMode("reset")
	serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-slots"))
	check("upstream reset")

	setMode("hang")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`, "sk-slots").WithContext(ctx))
	}()
	<-started
	if n := ch.health.limits.inflight.Load(); n != 1 {
		t.Errorf("while streaming: channel slots = %d, want 1", n)
	}
	cancel()
	<-done
	check("client cancel")

	ch.rt = panicTransport{}
	func() {
		defer func() {
			if p := recover(); p == nil {
				t.Error("the transport's panic should reach the server")
			}
		}()
		serveHandler(t, r, newRequest(`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, "sk-slots"))
	}()
	check("panic")
}

func keyDigestMust(t *testing.T, secret string) [32]byte {
	d, _, err := keyDigest(secret)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestTokenBucketDebt(t *testing.T) {
	now := time.Unix(1_900_000_000, 0)
	b := newTokenBucket(rateSpec{n: 100, period: 10 * time.Second}, now)
	b.charge(now, 150)
	if w := b.wait(now); w != 5100*time.Millisecond {
		t.Errorf("wait with 50 in debt at 10/s = %v, want 5.1s (until one token is back)", w)
	}
	b.charge(now, -100) // the estimate was too high
	if w := b.wait(now); w != 0 {
		t.Errorf("after the refund: wait %v", w)
	}
	b.configure(rateSpec{n: 20, period: 10 * time.Second}, now)
	if b.level != 20 {
		t.Errorf("a smaller burst caps the level: %v", b.level)
	}
}

// benchRelay has 3 groups over 10 channels (some shared), limits on every
// key and channel, and no contention.
func benchRelay(b *testing.B) *Relay {
	r := &Relay{}
	for i := 0; i < 10; i++ {
		r.Channels = append(r.Channels, &Channel{Name: fmt.Sprintf("bench-ch%d", i), UpstreamRaw: upstream("mock"),
			Models: []string{"claude-sonnet-4-5", "claude-haiku-4-5"}, Priority: 1 + i%2, Weight: 1 + i,
			Rate: "100000000/s", Tokens: "1000000000/s", Concurrency: 1 << 20})
	}
	for g := 0; g < 3; g++ {
		grp := &Group{Name: fmt.Sprintf("bench-g%d", g)}
		for i := g * 3; i < g*3+4; i++ {
			grp.Channels = append(grp.Channels, fmt.Sprintf("bench-ch%d", i))
		}
		r.Groups = append(r.Groups, grp)
		r.Keys = append(r.Keys, &Key{Secret: fmt.Sprintf("sk-bench-%d", g), Group: grp.Name, KeyOptions: KeyOptions{Name: fmt.Sprintf("bench-k%d", g),
			Rate: "100000000/s", Tokens: "1000000000/s", Concurrency: 1 << 20}})
	}
	provisionHandler(b, r)
	return r
}

// BenchmarkAdmitAndSelect measures the uncontended path of one request
// from key admission to a channel's admitted attempt, and back: key limits,
// selection among the group's channels, channel limits and breaker.
func BenchmarkAdmitAndSelect(b *testing.B) {
	r := benchRelay(b)
	keys := make([]*key, 0, 3)
	for _, k := range r.keys {
		r.activate(k) // a key takes its state at its first request
		keys = append(keys, k)
	}
	policy := health.CooldownPolicy{Base: time.Second, Max: time.Minute, Auth: time.Hour}
	var triedBuf [4]*channel
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		k := keys[i%len(keys)]
		now := time.Now()
		g, scope, _ := k.limits.take(now, 100)
		if scope != scopeNone {
			b.Fatal("key refused")
		}
		sel := selection{model: "claude-sonnet-4-5", tried: triedBuf[:0], rand: defaultRand, now: now}
		ch, rerr := pickErr(k.group, &sel)
		if ch == nil {
			b.Fatal(rerr)
		}
		t, _ := ch.health.admit(now, 100)
		if t == nil {
			b.Fatal("channel refused")
		}
		t.finish(verdict{outcome: outcomeSuccess}, policy, now, 0, 150)
		k.limits.done(now, g, 150)
	}
}

// takeRate counts a request against the request rate alone: a key whose
// concurrency is all in flight, or whose token limit is in debt, still
// gets it, and it holds nothing to give back; past the rate it refuses
// with the time the rate takes to allow one more.
func TestTakeRateCountsTheRateAlone(t *testing.T) {
	now := time.Unix(1_900_000_000, 0)
	var l limiter
	l.configure(limits{rate: rateSpec{n: 3, period: time.Minute}, tokens: rateSpec{n: 10, period: time.Minute}, concurrency: 1}, now)
	g, scope, _ := l.take(now, 100) // the one slot in flight, 90 tokens in debt
	if scope != scopeNone {
		t.Fatalf("the first request: %s", scope)
	}
	if busy, _ := l.busy(now); !busy {
		t.Fatal("a key with its one slot in flight and its tokens in debt is not busy")
	}
	for i := range 2 {
		if _, scope, _ := l.takeRate(now); scope != scopeNone {
			t.Errorf("takeRate %d beside a full concurrency and a token debt: %s", i+1, scope)
		}
	}
	if n := l.inflight.Load(); n != 1 {
		t.Errorf("in flight after takeRate: %d, want the first request's 1", n)
	}
	if left, _ := l.remaining(now); left == nil || *left != 0 {
		t.Errorf("the rate left: %v, want none (one request, two takeRate)", left)
	}
	_, scope, wait := l.takeRate(now)
	if scope != scopeRate || wait < 19*time.Second || wait > 20*time.Second {
		t.Errorf("takeRate past the rate: %s, wait %v; want rate, 20s", scope, wait)
	}
	if _, scope, _ := l.takeRate(now.Add(20 * time.Second)); scope != scopeNone {
		t.Errorf("takeRate once the rate allows one more: %s", scope)
	}
	l.done(now, g, 100)
	var free limiter
	free.configure(limits{concurrency: 1}, now)
	if _, scope, _ := free.takeRate(now); scope != scopeNone || free.inflight.Load() != 0 {
		t.Errorf("takeRate without a rate: %s, %d in flight", scope, free.inflight.Load())
	}
}
