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
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

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
		if n := k.limits.Inflight(); n != 0 {
			t.Errorf("%s: key slots in use = %d, want 0", path, n)
		}
		if n := ch.health.limits.Inflight(); n != 0 {
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
	if n := ch.health.limits.Inflight(); n != 1 {
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
		g, scope, _ := k.limits.Take(now, 100)
		if scope != limits.ScopeNone {
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
		k.limits.Done(now, g, 150)
	}
}
