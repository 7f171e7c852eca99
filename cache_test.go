package relay

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/dedup"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
)

// groupCache returns the response cache a group's state holds.
func groupCache(t *testing.T, name string) *responseCache {
	t.Helper()
	st, loaded, err := groupStates.LoadOrNew(name, nil)
	if err != nil || !loaded {
		t.Fatalf("group %s has no state: %v", name, err)
	}
	defer func() { _, _ = groupStates.Delete(name) }()
	return st.(*groupState).cache
}

const cacheBlock = "cache {\n\t\t\t\tttl 10m\n\t\t\t\tstale 1h\n\t\t\t\tmax_size 1MiB\n\t\t\t}"

// A group's cache answers a repeated request, JSON or stream, byte for
// byte and without an upstream; cache-control: no-cache bypasses it.
func TestCacheHitAndBypass(t *testing.T) {
	var n atomic.Int64
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := n.Add(1)
		if strings.Contains(mustRead(r), `"stream":true`) {
			fakeupstream.Stream(fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 100, OutputTokens: 3}, "answer ", fmt.Sprint(i))...)(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("claude-sonnet-4-5", fmt.Sprint("answer ", i), fakeupstream.Usage{InputTokens: 100, OutputTokens: 5}))
	}))
	const other = "sk-other-client-secret-0123"
	startRelay(t, channelBlock("ca-hit", up.URL, "models claude-sonnet-4-5")+keyAndGroup("ca-hit", "ca-hit", cacheBlock)+
		"\t\tkey "+other+" ca-hit\n")

	first := message(t, simpleBody)
	second := send(t, http.MethodPost, "/v1/messages", other, simpleBody) // any key of the group
	if first.status != 200 || second.status != 200 || string(second.body) != string(first.body) {
		t.Fatalf("first %d %s; second %d %s", first.status, first.body, second.status, second.body)
	}
	if got := second.header.Get("X-Relay-Cache"); got != "hit" {
		t.Errorf("x-relay-cache = %q, want hit", got)
	}
	if second.header.Get("Content-Type") != first.header.Get("Content-Type") {
		t.Errorf("content-type %q, want %q", second.header.Get("Content-Type"), first.header.Get("Content-Type"))
	}
	if n.Load() != 1 {
		t.Fatalf("upstream calls = %d, want 1", n.Load())
	}
	// another beta is another request
	if r := message(t, simpleBody, "Anthropic-Beta", "context-1m-2025-08-07"); r.status != 200 || n.Load() != 2 {
		t.Errorf("another anthropic-beta: status %d, %d calls, want 2", r.status, n.Load())
	}
	bypass := message(t, simpleBody, "Cache-Control", "no-cache")
	if bypass.status != 200 || n.Load() != 3 || string(bypass.body) == string(first.body) {
		t.Errorf("no-cache: status %d, %d calls, body %s", bypass.status, n.Load(), bypass.body)
	}

	// a stream is replayed byte for byte
	s1 := message(t, streamBody)
	s2 := message(t, streamBody)
	if s1.status != 200 || !isEventStream(s2.header) || string(s1.body) != string(s2.body) || !strings.Contains(string(s1.body), "message_stop") {
		t.Fatalf("stream: %d %q; replay %d %q", s1.status, s1.body, s2.status, s2.body)
	}
	if n.Load() != 4 {
		t.Errorf("upstream calls = %d, want 4", n.Load())
	}
	mf, _ := scrape(t)
	for result, want := range map[string]float64{"hit": 2, "miss": 3, "bypass": 1} {
		if v := value(mf, "relay_cache_total", "group=ca-hit", "result="+result); v != want {
			t.Errorf("relay_cache_total{result=%s} = %v, want %v", result, v, want)
		}
	}
	if v := value(mf, "relay_saved_tokens_total", "group=ca-hit"); v != 208 {
		t.Errorf("relay_saved_tokens_total = %v, want 208", v)
	}
}

// Ten identical requests that miss together make one upstream call, and
// all get its bytes.
func TestCacheCoalescesMisses(t *testing.T) {
	release, arrived := make(chan struct{}), make(chan struct{}, 16)
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 10, OutputTokens: 2}, "a", "b")
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		fakeupstream.Held(evs, 4, release, nil)(w, r)
	}))
	var once sync.Once
	free := func() { once.Do(func() { close(release) }) }
	t.Cleanup(free)
	startRelay(t, channelBlock("ca-co", up.URL, "models claude-sonnet-4-5")+keyAndGroup("ca-co", "ca-co", cacheBlock))
	c := groupCache(t, "ca-co")

	const clients = 10
	bodies := make([]string, clients)
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	for i := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, relayURL+"/v1/messages", strings.NewReader(streamBody))
			req.Header.Set("X-Api-Key", clientKey)
			req.Header.Set("Content-Type", "application/json")
			resp, err := (&http.Client{}).Do(req)
			if err != nil {
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(bufio.NewReader(resp.Body))
			bodies[i] = string(b)
		}()
	}
	<-arrived
	waitFor(t, "nine requests follow the first", 5*time.Second, func() bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		for _, f := range c.flights {
			return f.Followed() && f.Followers() == clients-1
		}
		return false
	})
	free()
	wg.Wait()
	want := strings.Join(evs, "")
	for i, b := range bodies {
		if b != want {
			t.Errorf("client %d got %q", i, b)
		}
	}
	if n := up.Hits(); n != 1 {
		t.Errorf("upstream calls = %d, want 1", n)
	}
}

// A stale answer is served at once while one request in the background
// fetches a new one; the next request gets the new one.
func TestCacheStaleWhileRevalidate(t *testing.T) {
	var n atomic.Int64
	second, arrived := make(chan struct{}), make(chan struct{}, 4)
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		i := n.Add(1)
		if i > 1 {
			arrived <- struct{}{}
			<-second
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("claude-sonnet-4-5", fmt.Sprint("answer ", i), fakeupstream.Usage{InputTokens: 10, OutputTokens: 5}))
	}))
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(second) }) })
	ch := &Channel{Name: "ca-swr", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey), Models: []string{"claude-sonnet-4-5"}}
	r := &Relay{Keys: []*Key{{Secret: clientKey, Group: "ca-swr"}}, Channels: []*Channel{ch},
		Groups: []*Group{{Name: "ca-swr", Channels: []string{ch.Name}, Cache: &ResponseCache{TTL: caddy.Duration(time.Minute), Stale: caddy.Duration(time.Hour)}}}}
	provisionHandler(t, r)
	clock := &fakeClock{t: testNow}
	r.now = clock.now

	get := func() (int, string, string) {
		w, _ := serveHandler(t, r, newRequest(simpleBody, clientKey))
		return w.Code, w.Body.String(), w.Header().Get("X-Relay-Cache")
	}
	code, first, _ := get()
	if code != 200 || !strings.Contains(first, "answer 1") {
		t.Fatalf("first: %d %s", code, first)
	}
	clock.advance(2 * time.Minute) // past the ttl, within stale
	code, body, result := get()
	if code != 200 || body != first || result != "stale" {
		t.Fatalf("stale: %d %q %s", code, result, body)
	}
	<-arrived // the background request is at the upstream
	if _, body, result := get(); body != first || result != "stale" {
		t.Errorf("while revalidating: %q %s", result, body)
	}
	once.Do(func() { close(second) })
	c := r.groups["ca-swr"].cache
	waitFor(t, "the new answer is stored", 5*time.Second, func() bool {
		e, res := c.get(requestDigestOf(t, simpleBody), clock.now())
		return e != nil && res == cacheHit
	})
	if _, body, result := get(); !strings.Contains(body, "answer 2") || result != "hit" {
		t.Errorf("after revalidation: %q %s", result, body)
	}
	if n.Load() != 2 {
		t.Errorf("upstream calls = %d, want 2 (one background request)", n.Load())
	}
	// past ttl and stale, it is a miss
	clock.advance(2 * time.Hour)
	if _, body, result := get(); !strings.Contains(body, "answer 3") || result != "" {
		t.Errorf("expired: %q %s", result, body)
	}
}

// requestDigestOf is the digest of a Messages request with body, as the
// relay computes it.
func requestDigestOf(t *testing.T, body string) dedup.Digest {
	t.Helper()
	req := newRequest(body, clientKey)
	return requestDigest(&inbound{route: routeMessages, ask: asked{header: req.Header, body: []byte(body)}}, true)
}

// The cache's own accounting stays within max_size under 10,000 distinct
// answers.
func TestCacheBounded(t *testing.T) {
	const maxSize = 1 << 20
	c := newResponseCache(ResponseCache{MaxSize: maxSize})
	body := make([]byte, 1<<10)
	for i := range 10_000 {
		f := dedup.NewFlight()
		f.Begin(200, http.Header{"Content-Type": {"application/json"}}, false, nil)
		f.Add(body)
		f.Finish(true, 0, 0, testNow)
		var d dedup.Digest
		d[0], d[1] = byte(i), byte(i>>8)
		c.store(d, f, testNow)
		f.Release()
	}
	c.entries.CleanUp()
	if w := c.entries.WeightedSize(); w > maxSize {
		t.Errorf("cache weight = %d, want at most %d", w, maxSize)
	}
	if n := c.entries.EstimatedSize(); n == 0 || n > maxSize/len(body) {
		t.Errorf("cache entries = %d, want 1..%d", n, maxSize/len(body))
	}
	if b := dedup.SharedBytes(); b != 0 {
		t.Errorf("flights keep %d bytes", b)
	}
}

// The Caddyfile's dedup options and a group's cache block, and their
// errors at the offending line.
func TestCaddyfileDedupAndCache(t *testing.T) {
	r, err := parseRelay(t, "relay {\n\tdedup_window 0\n\tdedup_grace 2s\n\tkey {env.K} g\n\tchannel a {\n\t\tprovider mock\n\t}\n\tgroup g {\n\t\tchannels a\n\t\tcache {\n\t\t\tttl 5m\n\t\t\tstale 1h\n\t\t\tmax_size 64MiB\n\t\t}\n\t}\n}")
	if err != nil {
		t.Fatal(err)
	}
	if r.DedupWindow == nil || *r.DedupWindow != 0 || r.DedupGrace != caddy.Duration(2*time.Second) {
		t.Errorf("dedup_window %v, dedup_grace %v", r.DedupWindow, r.DedupGrace)
	}
	want := ResponseCache{TTL: caddy.Duration(5 * time.Minute), Stale: caddy.Duration(time.Hour), MaxSize: 64 << 20}
	if c := r.Groups[0].Cache; c == nil || *c != want {
		t.Errorf("cache = %+v, want %+v", c, want)
	}
	for input, msg := range map[string]string{
		"relay {\n\tdedup_window -1s\n}":                                    "Testfile:2",
		"relay {\n\tgroup g {\n\t\tcache {\n\t\t\tttl soon\n\t\t}\n\t}\n}":  "Testfile:4",
		"relay {\n\tgroup g {\n\t\tcache {\n\t\t\tsize 1MiB\n\t\t}\n\t}\n}": "unrecognized cache option",
		"relay {\n\tgroup g {\n\t\tcache\n\t\tcache\n\t}\n}":                "cache is given twice",
		"relay {\n\tgroup g {\n\t\tcache {\n\t\t\tstale -1m\n\t\t}\n\t}\n}": "negative",
	} {
		if _, err := parseRelay(t, input); err == nil || !strings.Contains(err.Error(), msg) {
			t.Errorf("%q: error %v, want one with %q", input, err, msg)
		}
	}
}

// A cache miss that no SDK will retry ends with its client, as any request
// does, when nothing follows it.
func TestCacheLeaderEndsWithItsClient(t *testing.T) {
	release, canceled := make(chan struct{}), make(chan struct{})
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 10, OutputTokens: 3}, "one", "two")
	up := fakeupstream.New(t, fakeupstream.Held(evs, 4, release, canceled))
	var once sync.Once
	t.Cleanup(func() { once.Do(func() { close(release) }) })
	startRelay(t, channelBlock("ca-leave", up.URL, "models claude-sonnet-4-5")+keyAndGroup("ca-leave", "ca-leave", cacheBlock))

	ctx, leave := context.WithCancel(context.Background())
	first := postStream(t, ctx, clientKey, streamBody)
	readEvents(t, bufio.NewReader(first.Body), 4)
	leave()
	select {
	case <-canceled:
	case <-time.After(defaultDedupGrace / 2):
		t.Fatal("the upstream attempt outlived its client")
	}
	d := requestDigest(&inbound{route: routeMessages, ask: asked{header: http.Header{"Anthropic-Version": {"2023-06-01"}}, body: []byte(streamBody)}}, true)
	if e, _ := groupCache(t, "ca-leave").get(d, time.Now()); e != nil {
		t.Error("a broken answer was cached")
	}
}

// A cached answer costs its key nothing, and its log line says where it
// came from.
func TestCacheAccounting(t *testing.T) {
	up := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("m-cache", "ok", fakeupstream.Usage{InputTokens: 1_000_000}))
	}))
	ch := &Channel{Name: "ca-acct", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}
	r := &Relay{Keys: []*Key{{Secret: clientKey, Group: "ca-acct", KeyOptions: KeyOptions{Name: "ca-acct"}}}, Channels: []*Channel{ch},
		Groups:  []*Group{{Name: "ca-acct", Channels: []string{ch.Name}, Cache: &ResponseCache{}}},
		Pricing: map[string]Price{"m-cache": {Input: 3, Output: 15}}}
	logs := provisionHandler(t, r)
	body := `{"model":"m-cache","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	for range 2 {
		if w, _ := serveHandler(t, r, newRequest(body, clientKey)); w.Code != 200 {
			t.Fatalf("status %d: %s", w.Code, w.Body)
		}
	}
	lines := logs.FilterMessage("relayed request").All()
	if len(lines) != 2 {
		t.Fatalf("%d log lines", len(lines))
	}
	first, second := lines[0].ContextMap(), lines[1].ContextMap()
	if first["cost_usd"] != 3.0 || first["shared"] != nil {
		t.Errorf("first: cost %v, shared %v; want 3 and none", first["cost_usd"], first["shared"])
	}
	if second["cost_usd"] != 0.0 || second["shared"] != "cache" || second["input_tokens"] != int64(0) {
		t.Errorf("second: cost %v, shared %v, input %v; want 0, cache, 0", second["cost_usd"], second["shared"], second["input_tokens"])
	}
	if up.Hits() != 1 {
		t.Errorf("upstream calls = %d", up.Hits())
	}
}
