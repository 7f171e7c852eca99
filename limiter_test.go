package relay

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/prometheus/client_golang/prometheus"
)

// fakeClock is the relay's injectable clock in tests.
type fakeClock struct {
	mu sync.Mutex
	t  time.Time
}

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

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
		ch = &Channel{Name: name + "-ch", UpstreamRaw: upstream("anthropic", "url", upstreamURL, "api_key", "sk-up")}
	}
	r := &Relay{Keys: []*Key{&key}, Channels: []*Channel{ch}, Groups: []*Group{{Name: name, Channels: []string{ch.Name}}}}
	provisionHandler(t, r)
	clock := &fakeClock{t: time.Unix(1_900_000_000, 0)}
	r.now = clock.now
	return r, clock
}

func TestKeyRateLimitHoldsOverTheWindow(t *testing.T) {
	r, clock := limitRelay(t, "krate", Key{Rate: "3/m"}, "")
	send := func() *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-krate"))
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
	r, clock := limitRelay(t, "ktok", Key{Tokens: "1000/m"}, up.URL)
	send := func() *httptest.ResponseRecorder {
		w, _ := serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-ktok"))
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
		Keys:     []*Key{{Secret: "sk-slots", Group: name, Name: name, Concurrency: 3}},
		Channels: []*Channel{{Name: "slots-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", "sk-up"), Concurrency: 2, Tuning: Tuning{Cooldown: caddy.Duration(time.Nanosecond), MaxCooldown: caddy.Duration(time.Nanosecond), Breaker: &Breaker{MinRequests: 1000}}}},
		Groups:   []*Group{{Name: name, Channels: []string{"slots-ch"}}},
	}
	provisionHandler(t, r)
	k := r.keys[keyDigestMust(t, "sk-slots")]
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

	serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-slots"))
	check("success")
	setMode("error")
	serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-slots"))
	check("upstream error")
	setMode("reset")
	serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-slots"))
	check("upstream reset")

	setMode("hang")
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		serveHandler(t, r, newRequest(`{"model":"m","stream":true}`, "sk-slots").WithContext(ctx))
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
		serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-slots"))
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

func TestQueueOrder(t *testing.T) {
	var q waitQueue
	now := time.Now()
	var batch []*waiter
	for i := 0; i < 3; i++ {
		w, _ := q.enqueue(priorityBatch, 10, now)
		batch = append(batch, w)
	}
	normal, _ := q.enqueue(priorityNormal, 10, now)
	if q.isBest(batch[0]) || !q.isBest(normal) {
		t.Fatal("a normal waiter goes before batch waiters that came first")
	}
	if !q.ahead(priorityBatch) || !q.ahead(priorityNormal) || q.ahead(priorityRealtime) {
		t.Error("ahead() must count waiters of the same class or better only")
	}
	q.leave(normal)
	for i, w := range batch {
		if !q.isBest(w) {
			t.Fatalf("batch waiter %d should be next (FIFO within a class)", i)
		}
		q.leave(w)
	}
	for i := 0; i < 2; i++ {
		q.enqueue(priorityNormal, 2, now)
	}
	if _, ok := q.enqueue(priorityRealtime, 2, now); ok {
		t.Error("max_queue must bound the queue")
	}
}

func TestQueueWaitTimesOutAndWakes(t *testing.T) {
	var q waitQueue
	clock := &fakeClock{t: time.Now()}
	w, _ := q.enqueue(priorityNormal, 10, clock.now())
	// a wake-up makes it try again at once
	q.wakeBest()
	if retry, err := q.wait(context.Background(), w, time.Time{}, clock.now().Add(time.Hour), clock.now); !retry || err != nil {
		t.Fatalf("woken: %v %v", retry, err)
	}
	// past the deadline: the queue timeout
	if _, err := q.wait(context.Background(), w, time.Time{}, clock.now(), clock.now); !errors.Is(err, errQueueTimeout) {
		t.Fatalf("past the deadline: %v", err)
	}
	// a client that leaves ends the wait at once
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := q.wait(ctx, w, time.Time{}, clock.now().Add(time.Hour), clock.now); !errors.Is(err, context.Canceled) {
		t.Fatalf("canceled: %v", err)
	}
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
