package relay

import (
	"context"
	"math"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestLogLineAndPlaceholders(t *testing.T) {
	bad := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")))
	ok := fakeupstream.New(t, fakeupstream.Stream(strings.SplitAfter(usageStream, "\n\n")...))
	const secret, upstreamKey = "sk-log-test-client", "sk-ant-log-test-upstream"
	r := &Relay{
		Keys: []*Key{{Secret: secret, Group: "log-g", KeyOptions: KeyOptions{Name: "support-bot"}}},
		Channels: []*Channel{
			{Name: "log-bad", UpstreamRaw: upstream("anthropic", "url", bad.URL, "api_key", upstreamKey), Priority: 1, Models: []string{"claude-sonnet-4-5"}},
			{Name: "log-ok", UpstreamRaw: upstream("anthropic", "url", ok.URL, "api_key", upstreamKey), Priority: 2, Models: []string{"claude-sonnet-4-5"}},
		},
		Groups: []*Group{{Name: "log-g", Channels: []string{"log-bad", "log-ok"}}},
	}
	logs := provisionHandler(t, r)

	w, repl := serveHandler(t, r, newRequest(`{"model":"claude-sonnet-4-5","stream":true,"max_tokens":5}`, secret))
	if w.Code != 200 || w.Body.String() != usageStream {
		t.Fatalf("response %d:\n%s", w.Code, w.Body.String())
	}

	lines := logs.FilterMessage("relayed request").All()
	if len(lines) != 1 {
		t.Fatalf("want one log line per request, got %d", len(lines))
	}
	f := lines[0].ContextMap()
	wantCost := (12*3 + 97*15 + 4000*0.3 + 200*3.75 + 100*6) / 1e6
	for k, want := range map[string]any{
		"request_id": w.Header().Get("X-Relay-Request-Id"), "key": "support-bot", "group": "log-g",
		"model": "claude-sonnet-4-5", "stream": true, "status": int64(200), "input_tokens": int64(12),
		"output_tokens": int64(97), "cache_read_tokens": int64(4000), "cache_write_tokens": int64(300), "incomplete": false,
	} {
		if f[k] != want {
			t.Errorf("log field %s = %#v, want %#v", k, f[k], want)
		}
	}
	if c, _ := f["cost_usd"].(float64); c < wantCost-1e-12 || c > wantCost+1e-12 {
		t.Errorf("cost_usd = %v, want %v", f["cost_usd"], wantCost)
	}
	chain, _ := f["attempts"].([]any)
	if len(chain) != 2 || !strings.HasPrefix(chain[0].(string), "log-bad:transient:") || !strings.HasPrefix(chain[1].(string), "log-ok:success:") {
		t.Errorf("attempts = %v, want log-bad:transient:<d>, log-ok:success:<d>", f["attempts"])
	}
	fb, _ := f["first_byte"].(time.Duration)
	d, _ := f["duration"].(time.Duration)
	if fb <= 0 || d < fb {
		t.Errorf("first_byte %v, duration %v", fb, d)
	}

	for name, want := range map[string]any{"channel": "log-ok", "group": "log-g", "key": "support-bot",
		"model": "claude-sonnet-4-5", "attempts": 2, "input_tokens": int64(12), "output_tokens": int64(97)} {
		if got, _ := repl.Get("http.relay." + name); got != want {
			t.Errorf("{http.relay.%s} = %#v, want %#v", name, got, want)
		}
	}

	// no log line, of any level, carries a secret
	for _, e := range logs.All() {
		s := e.Message
		for k, v := range e.ContextMap() {
			s += k + "=" + strings.TrimSpace(strings.ReplaceAll(strings.ReplaceAll(toString(v), "\n", " "), "\t", " "))
		}
		if strings.Contains(s, secret) || strings.Contains(s, upstreamKey) {
			t.Errorf("a log line carries a secret: %s", s)
		}
	}
}

func TestLogLineOfARefusedRequest(t *testing.T) {
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-refused-test", Group: "ref-g"}},
		Channels: []*Channel{{Name: "ref-mock", UpstreamRaw: upstream("mock")}},
		Groups:   []*Group{{Name: "ref-g", Channels: []string{"ref-mock"}}},
	}
	logs := provisionHandler(t, r)
	w, _ := serveHandler(t, r, newRequest(`{"model":"m"}`, "sk-wrong-guess"))
	if w.Code != 401 {
		t.Fatalf("status %d", w.Code)
	}
	lines := logs.FilterMessage("relayed request").All()
	if len(lines) != 1 {
		t.Fatalf("%d log lines", len(lines))
	}
	f := lines[0].ContextMap()
	if f["status"] != int64(401) || f["key"] != labelNone || f["group"] != labelNone || len(f["attempts"].([]any)) != 0 {
		t.Errorf("fields = %v", f)
	}
	if _, priced := f["cost_usd"]; priced {
		t.Errorf("an unpriced request logs no cost: %v", f)
	}
}

func toString(v any) string {
	switch x := v.(type) {
	case string:
		return x
	case []any:
		var b strings.Builder
		for _, e := range x {
			b.WriteString(toString(e) + " ")
		}
		return b.String()
	}
	return ""
}

// cancelAfter is a client that reads a stream and leaves after n text
// deltas.
type cancelAfter struct {
	h      http.Header
	n      int
	seen   int
	cancel context.CancelFunc
	body   strings.Builder
}

func (c *cancelAfter) Header() http.Header { return c.h }
func (c *cancelAfter) WriteHeader(int)     {}
func (c *cancelAfter) Flush()              {}
func (c *cancelAfter) Write(p []byte) (int, error) {
	c.body.Write(p)
	if c.seen += strings.Count(string(p), "event: content_block_delta"); c.seen >= c.n {
		c.cancel()
	}
	return len(p), nil
}

func TestAStreamTheClientLeftIsAccountedAsFarAsItWent(t *testing.T) {
	u := fakeupstream.Usage{InputTokens: 100, CacheReadInputTokens: 10, OutputTokens: 40}
	events := fakeupstream.StreamEvents("claude-sonnet-5-5", u, "one", "two", "three", "four", "five")
	canceled := make(chan struct{})
	up := fakeupstream.New(t, fakeupstream.Held(events, 6, nil, canceled)) // message_start, content_block_start, ping, 3 deltas
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-left-midway-0123456789", Group: "left", KeyOptions: KeyOptions{Name: "left-key"}}},
		Channels: []*Channel{{Name: "left-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", "sk-up")}},
		Groups:   []*Group{{Name: "left", Channels: []string{"left-ch"}}},
	}
	logs := provisionHandler(t, r)
	// the channel lists no models, so the label of the model is "other"
	tokens := func(kind string) float64 {
		return testutil.ToFloat64(metricTokens.WithLabelValues("left", "left-ch", labelOther, kind))
	}
	inputBefore, outputBefore, readBefore := tokens("input"), tokens("output"), tokens("cache_read")
	incompleteBefore := testutil.ToFloat64(metricIncomplete.WithLabelValues("left", labelOther))
	costBefore := testutil.ToFloat64(metricCost.WithLabelValues("left", "left-key", labelOther))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &cancelAfter{h: http.Header{}, n: 3, cancel: cancel}
	req := newRequest(`{"model":"claude-sonnet-5-5","stream":true,"max_tokens":64}`, "sk-left-midway-0123456789").WithContext(ctx)
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, &caddyhttp.Server{})
	if err := r.ServeHTTP(w, req, nil); err != nil {
		t.Fatal(err)
	}
	<-canceled // the upstream saw the client leave

	if w.seen != 3 {
		t.Fatalf("the client read %d deltas, want 3:\n%s", w.seen, w.body.String())
	}
	// message_start said 100 input and 10 cache-read tokens and 1 output
	// token; nothing later said more before the client left
	if d := tokens("input") - inputBefore; d != 100 {
		t.Errorf("input tokens accounted %v, want 100", d)
	}
	if d := tokens("cache_read") - readBefore; d != 10 {
		t.Errorf("cache read tokens accounted %v, want 10", d)
	}
	if d := tokens("output") - outputBefore; d != 1 {
		t.Errorf("output tokens accounted %v, want the 1 message_start reported", d)
	}
	if d := testutil.ToFloat64(metricIncomplete.WithLabelValues("left", labelOther)) - incompleteBefore; d != 1 {
		t.Errorf("relay_incomplete_total grew by %v, want 1", d)
	}
	wantCost := (100*2 + 10*0.1 + 1*10) / 1e6
	if d := testutil.ToFloat64(metricCost.WithLabelValues("left", "left-key", labelOther)) - costBefore; math.Abs(d-wantCost) > 1e-12 {
		t.Errorf("cost accounted %v, want %v", d, wantCost)
	}
	lines := logs.FilterMessage("relayed request").All()
	if len(lines) != 1 {
		t.Fatalf("%d log lines", len(lines))
	}
	f := lines[0].ContextMap()
	for k, want := range map[string]any{"status": int64(200), "incomplete": true, "input_tokens": int64(100), "output_tokens": int64(1), "cache_read_tokens": int64(10)} {
		if f[k] != want {
			t.Errorf("log field %s = %#v, want %#v", k, f[k], want)
		}
	}
	if c, _ := f["cost_usd"].(float64); math.Abs(c-wantCost) > 1e-12 {
		t.Errorf("log cost_usd = %v, want %v", f["cost_usd"], wantCost)
	}
}
