package relay

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func TestBadInputGetsAnthropicErrors(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("never"))
	startRelay(t, "\t\tmax_body_size 1KiB\n"+channelBlock("bad-input-a", up.URL)+keyAndGroup("bad-input", "bad-input-a"))

	t.Run("no key", func(t *testing.T) {
		r := send(t, http.MethodPost, "/v1/messages", "", simpleBody)
		wantRelayError(t, r, 401, "authentication_error", "")
		if !bytes.Contains(r.body, []byte("x-api-key")) {
			t.Errorf("message should say how to send the key: %s", r.body)
		}
	})
	t.Run("wrong key", func(t *testing.T) {
		wantRelayError(t, send(t, http.MethodPost, "/v1/messages", "sk-wrong", simpleBody), 401, "authentication_error", "")
	})
	t.Run("wrong bearer", func(t *testing.T) {
		r := send(t, http.MethodPost, "/v1/messages", "", simpleBody, "Authorization", "Bearer sk-wrong")
		wantRelayError(t, r, 401, "authentication_error", "")
	})
	t.Run("not JSON", func(t *testing.T) {
		wantRelayError(t, message(t, `{"model":`), 400, "invalid_request_error", "")
	})
	t.Run("no model", func(t *testing.T) {
		r := message(t, `{"max_tokens":1,"messages":[]}`)
		wantRelayError(t, r, 400, "invalid_request_error", "")
		if !bytes.Contains(r.body, []byte("model")) {
			t.Errorf("message should name the field: %s", r.body)
		}
	})
	t.Run("model not a string", func(t *testing.T) {
		wantRelayError(t, message(t, `{"model":7}`), 400, "invalid_request_error", "")
	})
	t.Run("oversized body", func(t *testing.T) {
		big := `{"model":"claude-sonnet-4-5","pad":"` + strings.Repeat("x", 2048) + `"}`
		r := message(t, big)
		wantRelayError(t, r, 413, "request_too_large", "")
		if !bytes.Contains(r.body, []byte("the relay's max_body_size of 1 KiB (1024 bytes)")) {
			t.Errorf("the 413 should name max_body_size and its limit: %s", r.body)
		}
	})
	t.Run("wrong method", func(t *testing.T) {
		r := send(t, http.MethodGet, "/v1/messages", clientKey, "")
		wantRelayError(t, r, 405, "invalid_request_error", "")
		if r.header.Get("Allow") != "POST" {
			t.Errorf("Allow = %q, want POST", r.header.Get("Allow"))
		}
	})
	t.Run("unknown path", func(t *testing.T) {
		wantRelayError(t, send(t, http.MethodPost, "/v1/complete", clientKey, simpleBody), 404, "not_found_error", "")
	})
	t.Run("unknown model", func(t *testing.T) {
		// the channel serves every model, so this one is relayed; a group
		// whose channels list models is tested in TestModelFilterAndMapping
		if r := message(t, `{"model":"x","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 {
			t.Errorf("status = %d", r.status)
		}
	})
	if n := up.Hits(); n != 1 {
		t.Errorf("upstream hits = %d, want 1: only the valid request may reach it", n)
	}
}

func TestRetriesExhaustedReturnLastResponse(t *testing.T) {
	ups := make([]*fakeupstream.Upstream, 3)
	var cfg strings.Builder
	for i := range ups {
		ups[i] = fakeupstream.New(t, fakeupstream.Error(503, "api_error", fmt.Sprintf("down %d", i)))
		cfg.WriteString(channelBlock(fmt.Sprintf("exhaust-%d", i), ups[i].URL, fmt.Sprintf("priority %d", i+1)))
	}
	cfg.WriteString(keyAndGroup("exhaust", "exhaust-0 exhaust-1 exhaust-2", "retries 1"))
	startRelay(t, cfg.String())

	r := message(t, simpleBody)
	if r.status != 503 {
		t.Fatalf("status = %d, want the last upstream's 503", r.status)
	}
	if !bytes.Equal(r.body, fakeupstream.ErrorBody("api_error", "down 1")) {
		t.Errorf("body = %s, want the second channel's body unchanged", r.body)
	}
	// the upstream said nothing of retrying, and neither does the relay:
	// a client such as Claude Code decides from the upstream's own answer
	if r.header.Get("X-Relay-Attempts") != "2" || r.header.Values("X-Should-Retry") != nil {
		t.Errorf("x-relay-attempts = %q, x-should-retry = %q; want 2 and none",
			r.header.Get("X-Relay-Attempts"), r.header.Values("X-Should-Retry"))
	}
	if got := []int{ups[0].Hits(), ups[1].Hits(), ups[2].Hits()}; got[0] != 1 || got[1] != 1 || got[2] != 0 {
		t.Errorf("hits = %v, want [1 1 0]: retries 1 allows two attempts", got)
	}

	// every channel serving the model is cooling now, and the first two
	// are cooling for 5s: the request is refused with the wait
	r = message(t, simpleBody)
	if r.status != 503 {
		// the third channel was never tried, so it still serves
		if ups[2].Hits() != 1 {
			t.Fatalf("status %d, third channel hits %d", r.status, ups[2].Hits())
		}
	}
	r = message(t, simpleBody)
	wantRelayError(t, r, 503, "relay_error", "no_healthy_channel")
	ra := r.header.Get("Retry-After")
	if ra == "" || ra == "0" || len(ra) > 1 {
		t.Errorf("retry-after = %q, want the seconds (1-9) to the first recovery", ra)
	}
}

func TestCountTokensRelayed(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Raw(200, []byte(`{"input_tokens":42}`)))
	startRelay(t, channelBlock("count-a", up.URL, "models claude-sonnet-4-5=claude-sonnet-4-5-20250929")+keyAndGroup("count", "count-a"))
	r := send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || string(r.body) != `{"input_tokens":42}` {
		t.Fatalf("count_tokens: %d %s", r.status, r.body)
	}
	if got := up.Last(t); got.Path != "/v1/messages/count_tokens" || string(got.Body) != `{"model":"claude-sonnet-4-5-20250929","messages":[{"role":"user","content":"Hi"}]}` {
		t.Errorf("upstream got %s %s", got.Path, got.Body)
	}
}

func TestClientLeavingBeforeTheFirstByteEndsTheRequest(t *testing.T) {
	arrived := make(chan struct{}, 3)
	hold := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		arrived <- struct{}{}
		<-r.Context().Done()
	})
	ups := []*fakeupstream.Upstream{fakeupstream.New(t, hold), fakeupstream.New(t, hold), fakeupstream.New(t, hold)}
	startRelay(t, channelBlock("hostile-gone-a", ups[0].URL)+channelBlock("hostile-gone-b", ups[1].URL)+
		channelBlock("hostile-gone-c", ups[2].URL)+keyAndGroup("hostile-gone", "hostile-gone-a hostile-gone-b hostile-gone-c"))
	mf, _ := scrape(t)
	left := func(mf map[string]*dto.MetricFamily) float64 {
		return max(value(mf, "relay_requests_total", "group=hostile-gone", "code=499"), 0)
	}
	leftBefore := left(mf)

	ctx, cancel := context.WithCancel(context.Background())
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, relayURL+"/v1/messages", strings.NewReader(simpleBody))
	req.Header.Set("X-Api-Key", clientKey)
	done := make(chan error, 1)
	go func() {
		resp, err := client.Do(req)
		if err == nil {
			resp.Body.Close()
		}
		done <- err
	}()
	<-arrived
	cancel()
	<-done
	waitFor(t, "the request accounted as 499", 5*time.Second, func() bool { mf, _ := scrape(t); return left(mf) == leftBefore+1 })

	mf, _ = scrape(t)
	if v := value(mf, "relay_failovers_total", "group=hostile-gone"); v > 0 {
		t.Errorf("relay_failovers_total = %v after the client left: the relay failed over for nobody", v)
	}
	attempts := 0.0
	for _, ch := range []string{"hostile-gone-a", "hostile-gone-b", "hostile-gone-c"} {
		attempts += max(value(mf, "relay_attempts_total", "channel="+ch, "outcome=canceled"), 0)
	}
	if attempts != 1 {
		t.Errorf("%v attempts after the client left, want the one that was running", attempts)
	}
	for _, ch := range []string{"hostile-gone-a", "hostile-gone-b", "hostile-gone-c"} {
		if st := channels(t)[ch]; st.State != stateHealthy {
			t.Errorf("%s was cooled by a client leaving: %+v", ch, st)
		}
	}
	groupStates.Range(func(k, v any) bool {
		if k == "hostile-gone" {
			if n := retries(v.(*groupState)); n != 0 {
				t.Errorf("the client's departure spent %d of the group's retry budget", n)
			}
		}
		return true
	})
}

// retries counts the retries a group's budget holds over its window.
func retries(g *groupState) int {
	return g.budget.Retries()
}

func TestUpstreamAccountHeadersStayUpstream(t *testing.T) {
	account := []string{"Anthropic-Organization-Id", "org-0123", "Set-Cookie", "__cf_bm=secret; Path=/", "Request-Id", "req_up"}
	ok := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("m", "a", fakeupstream.Usage{}), account...))
	bad := fakeupstream.New(t, fakeupstream.Raw(400, fakeupstream.ErrorBody("invalid_request_error", "no"), account...))
	startRelay(t, channelBlock("hostile-hdr-ok", ok.URL)+channelBlock("hostile-hdr-bad", bad.URL)+
		keyAndGroup("hostile-hdr", "hostile-hdr-ok")+
		"\t\tkey sk-header-errors-0123456789 hostile-hdr-bad\n\t\tgroup hostile-hdr-bad {\n\t\t\tchannels hostile-hdr-bad\n\t\t}\n")
	for _, r := range []reply{message(t, simpleBody), send(t, http.MethodPost, "/v1/messages", "sk-header-errors-0123456789", simpleBody)} {
		if r.header.Get("Anthropic-Organization-Id") != "" || r.header.Get("Set-Cookie") != "" {
			t.Errorf("%d: the upstream's account reached the tenant: %v", r.status, r.header)
		}
		if r.header.Get("Request-Id") != "req_up" {
			t.Errorf("%d: request-id should pass: %v", r.status, r.header)
		}
	}
}

// benchBody is a realistic 10 KB Messages request.
var benchBody = `{"model":"claude-sonnet-4-5","max_tokens":64,"metadata":{"user_id":"u-1"},"messages":[{"role":"user","content":"` +
	strings.Repeat("The quick brown fox jumps over the lazy dog. ", 225) + `"}]}`

// discardWriter is a ResponseWriter that flushes and forgets all but the
// status.
type discardWriter struct {
	h      http.Header
	status int
}

func (d *discardWriter) Header() http.Header         { return d.h }
func (d *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (d *discardWriter) WriteHeader(code int)        { d.status = code }
func (d *discardWriter) Flush()                      {}

// benchServe runs ServeHTTP b.N times against a fast in-process upstream.
func benchServe(b *testing.B, body string) { benchServeWith(b, body, "", nil) }

// benchServeWith is benchServe for a group with the given cache, requests
// with the given headers, and names with suffix.
func benchServeWith(b *testing.B, body, suffix string, cache *ResponseCache, header ...string) {
	up := fakeupstream.Start(fakeupstream.Fast(), false)
	defer up.Close()
	name := "bench-serve" + suffix
	if strings.Contains(body, `"stream":true`) {
		name += "-stream"
	}
	r := benchServeRelay(name, up.URL, cache)
	benchLoop(b, r, len(body), func(int) *http.Request { return benchServeRequest(name, body, header...) })
}

// benchLoop provisions r and serves it b.N requests of size bytes, the
// i-th made by request, each of which must be answered 200.
func benchLoop(b *testing.B, r *Relay, size int, request func(i int) *http.Request) {
	provisionHandler(b, r)
	srv := &caddyhttp.Server{}
	b.ReportAllocs()
	b.SetBytes(int64(size))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		req := request(i)
		w := &discardWriter{h: http.Header{}}
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, srv)
		if err := r.ServeHTTP(w, req, nil); err != nil {
			b.Fatal(err)
		}
		// a benchmark of the relay's refusals would measure nothing of the
		// path it is for
		if w.status != http.StatusOK {
			b.Fatalf("request %d: status %d, not 200", i, w.status)
		}
	}
}

// benchServeRelay is the config of benchServeWith: a key named name (its
// secret "sk-" + name) and its group, with the given cache, of one
// anthropic channel at url. It configures nothing else: no limits, budget,
// identity, end users or fleet (TestBenchServeConfiguresNoFeature).
func benchServeRelay(name, url string, cache *ResponseCache) *Relay {
	return &Relay{
		Keys:     []*Key{{Secret: "sk-" + name, Group: name, KeyOptions: KeyOptions{Name: name}}},
		Channels: []*Channel{{Name: name, UpstreamRaw: upstream("anthropic", "url", url, "api_key", channelKey), Models: []string{"claude-sonnet-4-5"}}},
		Groups:   []*Group{{Name: name, Channels: []string{name}, Cache: cache}},
	}
}

// benchServeRequest is a request of benchServeWith: body for the key of
// benchServeRelay(name, ...), with the given headers (name, value pairs)
// beside its key and anthropic-version.
func benchServeRequest(name, body string, header ...string) *http.Request {
	req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", "sk-"+name)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	return req
}

// BenchmarkServeHTTPFeatures is BenchmarkServeHTTP with what a relay
// serving people turns on: each request is served as the identity a header
// carries, one of 1,000 under user *, each with a daily budget, in a group
// with one (a hold against both, then the charge), and each is marked as an
// SDK's first attempt, so dedup records it for retries that never come.
func BenchmarkServeHTTPFeatures(b *testing.B) {
	up := fakeupstream.Start(fakeupstream.Fast(), false)
	defer up.Close()
	name := "bench-features"
	r := &Relay{
		Identity: "{http.request.header.X-Bench-User}",
		Users:    []*User{{ID: "*", Group: name, KeyOptions: KeyOptions{Budgets: []string{"1000000usd/day"}}}},
		Channels: []*Channel{{Name: name, UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey), Models: []string{"claude-sonnet-4-5"}}},
		Groups:   []*Group{{Name: name, Channels: []string{name}, Budgets: []string{"1000000usd/day"}}},
	}
	benchLoop(b, r, len(benchBody), func(i int) *http.Request {
		req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(benchBody))
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("X-Bench-User", "user-"+strconv.Itoa(i%1000)+"@bench.example")
		req.Header.Set("X-Stainless-Retry-Count", "0")
		return req
	})
}

// BenchmarkServeHTTP is one non-streaming request end to end: route, key,
// body, inspect, admit, select, attempt over loopback HTTP, account.
func BenchmarkServeHTTP(b *testing.B) { benchServe(b, benchBody) }

// BenchmarkServeHTTPStream is the same for a 20-event stream.
func BenchmarkServeHTTPStream(b *testing.B) {
	benchServe(b, strings.Replace(benchBody, `"max_tokens":64`, `"max_tokens":64,"stream":true`, 1))
}

// BenchmarkServeHTTPCacheHit is BenchmarkServeHTTP answered from the
// group's response cache (every request after the first).
func BenchmarkServeHTTPCacheHit(b *testing.B) {
	benchServeWith(b, benchBody, "-cache", &ResponseCache{})
}

// BenchmarkServeHTTPStreamCacheHit is the same for the stream.
func BenchmarkServeHTTPStreamCacheHit(b *testing.B) {
	benchServeWith(b, strings.Replace(benchBody, `"max_tokens":64`, `"max_tokens":64,"stream":true`, 1), "-cache", &ResponseCache{})
}

// BenchmarkServeHTTPStreamMarked is BenchmarkServeHTTPStream for an SDK's
// first attempt (x-stainless-retry-count: 0), whose answer is kept for its
// retries: the dedup table and the tee into its flight.
func BenchmarkServeHTTPStreamMarked(b *testing.B) {
	forgetDedupsB(b)
	benchServeWith(b, strings.Replace(benchBody, `"max_tokens":64`, `"max_tokens":64,"stream":true`, 1), "-marked", nil, "X-Stainless-Retry-Count", "0")
}

// BenchmarkInspect is the one-pass scan of a 10 KB body.
func BenchmarkInspect(b *testing.B) {
	body := []byte(benchBody)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for i := 0; i < b.N; i++ {
		in := inbound{ask: asked{body: body}}
		if err := in.inspect(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkInspectFeatures is the same scan of a 10 KB request that needs
// features: a server tool among its tools, a feature field and two betas.
func BenchmarkInspectFeatures(b *testing.B) {
	body := []byte(strings.Replace(benchBody, `"metadata"`, `"context_management":{"edits":[]},"tools":[{"name":"get_weather","description":"Get the weather","input_schema":{"type":"object","properties":{"city":{"type":"string"}}}},{"type":"web_search_20250305","name":"web_search","max_uses":3}],"metadata"`, 1))
	h := http.Header{"Anthropic-Beta": {"context-management-2025-06-27,interleaved-thinking-2025-05-14"}}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for i := 0; i < b.N; i++ {
		in := inbound{ask: asked{body: body, header: h}}
		if err := in.inspect(); err != nil || in.ask.needs.Set == 0 || len(in.ask.needs.Betas) != 2 {
			b.Fatal(err)
		}
	}
}

// BenchmarkStreamCopy is the SSE path of one attempt: hold until content,
// commit, forward and flush each of 20 events, read the usage.
func BenchmarkStreamCopy(b *testing.B) {
	deltas := make([]string, 13)
	for i := range deltas {
		deltas[i] = "tok "
	}
	stream := []byte(strings.Join(fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 9, OutputTokens: 13}, deltas...), ""))
	r := &Relay{}
	r.logger = discardLogger()
	ch := &channel{name: "bench-copy", firstContent: time.Minute, streamIdle: time.Minute}
	g := &group{}
	b.ReportAllocs()
	b.SetBytes(int64(len(stream)))
	for i := 0; i < b.N; i++ {
		in := &inbound{who: requester{key: &key{group: g}}}
		ctx, cancel := context.WithCancelCause(context.Background())
		resp := &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: io.NopCloser(bytes.NewReader(stream))}
		dl := &deadline{cancel: cancel, headers: time.Now()}
		dl.start(stageFirstContent, time.Minute)
		s := &streamAttempt{r: r, w: &discardWriter{h: http.Header{}}, in: in, ch: ch, n: 1, ctx: ctx, clientCtx: context.Background(),
			deadline: dl, resp: resp}
		if res := s.run(); res.verdict.outcome != outcomeSuccess || in.end.usage.output != 13 {
			b.Fatalf("%+v %+v", res.verdict, in.end.usage)
		}
		dl.stop()
		cancel(nil)
	}
}
