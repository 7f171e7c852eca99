package relay

import (
	"context"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

func TestLogLineAndPlaceholders(t *testing.T) {
	const secret, upstreamKey = "sk-log-test-client", "sk-ant-log-test-upstream"
	bad := fakeupstream.New(t, fakeupstream.Raw(503, []byte("down")), fakeupstream.AcceptKeys(upstreamKey))
	ok := fakeupstream.New(t, fakeupstream.Stream(strings.SplitAfter(usageStream, "\n\n")...), fakeupstream.AcceptKeys(upstreamKey))
	r := &Relay{
		Keys: []*Key{{Secret: secret, Group: "log-g", KeyOptions: KeyOptions{Name: "support-bot"}}},
		Channels: []*Channel{
			{Name: "log-bad", UpstreamRaw: upstream("anthropic", "url", bad.URL, "api_key", upstreamKey), Priority: 1, Models: []string{"claude-sonnet-4-5"}},
			{Name: "log-ok", UpstreamRaw: upstream("anthropic", "url", ok.URL, "api_key", upstreamKey), Priority: 2, Models: []string{"claude-sonnet-4-5"}},
		},
		Groups: []*Group{{Name: "log-g", Channels: []string{"log-bad", "log-ok"}}},
	}
	logs := provisionHandler(t, r)

	w, repl := serveHandler(t, r, newRequest(`{"model":"claude-sonnet-4-5","stream":true,"max_tokens":5,"messages":[{"role":"user","content":"Hi"}]}`, secret))
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

// A stream whose client left after part of its content, with settle_grace
// 0 (nothing read after the client left), is billed the input its
// message_start reported and the output estimated from what the client was
// sent, marked estimated.
func TestAStreamTheClientLeftIsAccountedAsFarAsItWent(t *testing.T) {
	u := fakeupstream.Usage{InputTokens: 100, CacheReadInputTokens: 10, OutputTokens: 40}
	events := fakeupstream.StreamEvents("claude-sonnet-5-5", u, "one", "two", "three", "four", "five")
	canceled := make(chan struct{})
	up := fakeupstream.New(t, fakeupstream.Held(events, 6, nil, canceled)) // message_start, content_block_start, ping, 3 deltas
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-left-midway-0123456789", Group: "left", KeyOptions: KeyOptions{Name: "left-key"}}},
		Channels: []*Channel{{Name: "left-ch", UpstreamRaw: upstream("anthropic", "url", up.URL, "api_key", channelKey)}},
		Groups:   []*Group{{Name: "left", Channels: []string{"left-ch"}}},
	}
	r.SettleGrace = new(caddy.Duration)
	logs := provisionHandler(t, r)
	// the channel lists no models, so the label of the model is "other"
	tokens := func(kind string) float64 {
		return testutil.ToFloat64(metricTokens.WithLabelValues("left", "left-ch", labelOther, kind))
	}
	inputBefore, outputBefore, readBefore := tokens("input"), tokens("output"), tokens("cache_read")
	incompleteBefore := testutil.ToFloat64(metricIncomplete.WithLabelValues("left", labelOther))
	estimatedBefore := testutil.ToFloat64(metricEstimated.WithLabelValues("left"))
	costBefore := testutil.ToFloat64(metricCost.WithLabelValues("left", "left-ch", labelOther))

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	w := &cancelAfter{h: http.Header{}, n: 3, cancel: cancel}
	req := newRequest(`{"model":"claude-sonnet-5-5","stream":true,"max_tokens":64,"messages":[{"role":"user","content":"Hi"}]}`, "sk-left-midway-0123456789").WithContext(ctx)
	req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, &caddyhttp.Server{})
	if err := r.ServeHTTP(w, req, nil); err != nil {
		t.Fatal(err)
	}
	<-canceled // the upstream saw the client leave

	if w.seen != 3 {
		t.Fatalf("the client read %d deltas, want 3:\n%s", w.seen, w.body.String())
	}
	// message_start said 100 input and 10 cache-read tokens; the client
	// was sent three words, 4 tokens by the estimate (3.15, rounded up)
	if d := tokens("input") - inputBefore; d != 100 {
		t.Errorf("input tokens accounted %v, want 100", d)
	}
	if d := tokens("cache_read") - readBefore; d != 10 {
		t.Errorf("cache read tokens accounted %v, want 10", d)
	}
	if d := tokens("output") - outputBefore; d != 4 {
		t.Errorf("output tokens accounted %v, want the 4 estimated", d)
	}
	if d := testutil.ToFloat64(metricEstimated.WithLabelValues("left")) - estimatedBefore; d != 1 {
		t.Errorf("relay_estimated_usage_total grew by %v, want 1", d)
	}
	if d := testutil.ToFloat64(metricIncomplete.WithLabelValues("left", labelOther)) - incompleteBefore; d != 1 {
		t.Errorf("relay_incomplete_total grew by %v, want 1", d)
	}
	wantCost := (100*2 + 10*0.1 + 4*10) / 1e6
	if d := testutil.ToFloat64(metricCost.WithLabelValues("left", "left-ch", labelOther)) - costBefore; math.Abs(d-wantCost) > 1e-12 {
		t.Errorf("cost accounted %v, want %v", d, wantCost)
	}
	lines := logs.FilterMessage("relayed request").All()
	if len(lines) != 1 {
		t.Fatalf("%d log lines", len(lines))
	}
	f := lines[0].ContextMap()
	for k, want := range map[string]any{"status": int64(200), "incomplete": true, "input_tokens": int64(100), "output_tokens": int64(4), "cache_read_tokens": int64(10), "estimated": true} {
		if f[k] != want {
			t.Errorf("log field %s = %#v, want %#v", k, f[k], want)
		}
	}
	if c, _ := f["cost_usd"].(float64); math.Abs(c-wantCost) > 1e-12 {
		t.Errorf("log cost_usd = %v, want %v", f["cost_usd"], wantCost)
	}
}

func TestAChannelsPriceFactorScalesItsCost(t *testing.T) {
	u := fakeupstream.Usage{InputTokens: 1000, OutputTokens: 100}
	resold := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5", "hi", u)))
	list := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5", "hi", u)))
	const resoldKey, listKey = "sk-price-factor-resold-0123", "sk-price-factor-list-0123"
	r := &Relay{
		Keys: []*Key{{Secret: resoldKey, Group: "pf-a", KeyOptions: KeyOptions{Name: "pf-a-key"}}, {Secret: listKey, Group: "pf-b", KeyOptions: KeyOptions{Name: "pf-b-key"}}},
		Channels: []*Channel{
			{Name: "pf-resold", UpstreamRaw: upstream("anthropic", "url", resold.URL, "api_key", channelKey), Models: []string{"claude-sonnet-4-5"}, PriceFactor: priceFactor(0.8)},
			{Name: "pf-list", UpstreamRaw: upstream("anthropic", "url", list.URL, "api_key", channelKey), Models: []string{"claude-sonnet-4-5"}},
		},
		Groups: []*Group{{Name: "pf-a", Channels: []string{"pf-resold"}}, {Name: "pf-b", Channels: []string{"pf-list"}}},
	}
	logs := provisionHandler(t, r)
	cost := func(group, channel string) float64 {
		return testutil.ToFloat64(metricCost.WithLabelValues(group, channel, "claude-sonnet-4-5"))
	}
	listCost := (1000*3 + 100*15) / 1e6
	for _, c := range []struct {
		key, group, channel string
		want                float64
	}{
		{resoldKey, "pf-a", "pf-resold", 0.8 * listCost},
		{listKey, "pf-b", "pf-list", listCost}, // no factor: the list price
	} {
		before := cost(c.group, c.channel)
		w, _ := serveHandler(t, r, newRequest(simpleBody, c.key))
		if w.Code != 200 {
			t.Fatalf("%s: %d %s", c.channel, w.Code, w.Body)
		}
		if d := cost(c.group, c.channel) - before; math.Abs(d-c.want) > 1e-12 {
			t.Errorf("%s: relay_cost_usd_total grew by %v, want %v", c.channel, d, c.want)
		}
		lines := logs.FilterMessage("relayed request").All()
		if got, _ := lines[len(lines)-1].ContextMap()["cost_usd"].(float64); math.Abs(got-c.want) > 1e-12 {
			t.Errorf("%s: log cost_usd = %v, want %v", c.channel, got, c.want)
		}
	}

	// the cost a key's budget is charged is the request's own field
	in := &inbound{grant: granted{target: "claude-sonnet-4-5"}, end: ending{answered: &channel{priceFactor: 0.8}, usage: usage{input: 1000, output: 100}}}
	if priced, _ := r.price(in); !priced || math.Abs(in.end.cost-0.8*listCost) > 1e-12 {
		t.Errorf("in.cost = %v, want %v", in.end.cost, 0.8*listCost)
	}
	// no channel answered: nothing to pay for
	in = &inbound{grant: granted{target: "claude-sonnet-4-5"}, end: ending{usage: usage{input: 1000, output: 100}}}
	if priced, _ := r.price(in); !priced || in.end.cost != 0 {
		t.Errorf("in.cost of a request no channel answered = %v, want 0", in.end.cost)
	}

	for _, f := range []float64{0, -1} {
		bad := &Relay{
			Keys:     []*Key{{Secret: "sk-x", Group: "g"}},
			Channels: []*Channel{{Name: "c", UpstreamRaw: upstream("mock"), PriceFactor: priceFactor(f)}},
			Groups:   []*Group{{Name: "g", Channels: []string{"c"}}},
		}
		if err := bad.validateConfig(); err == nil || !strings.Contains(err.Error(), "price_factor must be a number above 0") {
			t.Errorf("price_factor %v: %v", f, err)
		}
	}
}

// startThenHold is an upstream that starts a stream with events and holds
// it open, without content, until the request is canceled; started is
// closed once the events are out.
func startThenHold(started chan<- struct{}, events ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		fakeupstream.StartStream(w)
		for _, ev := range events {
			fakeupstream.WriteEvent(w, ev)
		}
		if started != nil {
			close(started)
		}
		<-r.Context().Done()
	}
}

// silentAfterReading reads the request and never answers; got is closed
// once it has the request.
func silentAfterReading(got chan<- struct{}) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.ReadAll(r.Body)
		if got != nil {
			close(got)
		}
		<-r.Context().Done()
	}
}

func TestWastedTokensOfAttemptsFailedOver(t *testing.T) {
	const model = "claude-sonnet-4-5"
	started := fakeupstream.StreamEvents(model, fakeupstream.Usage{InputTokens: 300, CacheReadInputTokens: 50, CacheCreationInputTokens: 20}, "x")[0]
	reported := fakeupstream.New(t, startThenHold(nil, started))                                          // message_start, then no content
	unreported := fakeupstream.New(t, startThenHold(nil, fakeupstream.Event("ping", `{"type": "ping"}`))) // no message_start
	silent := fakeupstream.New(t, silentAfterReading(nil))                                                // has the request, never answers
	overloaded := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))          // an error answer
	good := fakeupstream.New(t, fakeupstream.Stream(fakeupstream.StreamEvents(model, fakeupstream.Usage{InputTokens: 7, OutputTokens: 3}, "ok")...))
	goodJSON := fakeupstream.New(t, fakeupstream.Raw(200, fakeupstream.MessageBody(model, "ok", fakeupstream.Usage{InputTokens: 7, OutputTokens: 3})))
	ch := func(name, url string, priority int) *Channel {
		return &Channel{Name: name, UpstreamRaw: upstream("anthropic", "url", url, "api_key", channelKey), Models: []string{model}, Priority: priority,
			Tokens: "1000000/100d", // refills a token in about 9s
			Tuning: Tuning{FirstContentTimeout: caddy.Duration(200 * time.Millisecond), ResponseTimeout: caddy.Duration(200 * time.Millisecond)}}
	}
	r := &Relay{
		Channels: []*Channel{
			ch("wf-reported", reported.URL, 1), ch("wf-unreported", unreported.URL, 1), ch("wf-silent", silent.URL, 1),
			ch("wf-overloaded", overloaded.URL, 1), ch("wf-dead", fakeupstream.DeadURL(t), 1),
			ch("wf-good", good.URL, 2), ch("wf-good-json", goodJSON.URL, 2),
		},
	}
	cases := []struct {
		name, channel, good, body string
		want                      int64
		spent                     int64 // of the channel's token limit: input, cache writes, output
	}{
		{"a stream that reported its input and timed out before content", "wf-reported", "wf-good", streamBody, 300 + 50 + 20, 300 + 20 + 1},
		{"a stream that reported nothing: the estimate", "wf-unreported", "wf-good", streamBody, estimateTokens([]byte(streamBody)), estimateTokens([]byte(streamBody))},
		{"a request that timed out after it was sent: the estimate", "wf-silent", "wf-good-json", simpleBody, estimateTokens([]byte(simpleBody)), estimateTokens([]byte(simpleBody))},
		{"an error answer wastes nothing", "wf-overloaded", "wf-good", streamBody, 0, 0},
		{"an upstream never connected wastes nothing", "wf-dead", "wf-good", streamBody, 0, 0},
	}
	for i, c := range cases {
		secret := fmt.Sprintf("sk-wasted-failover-%d-0123456789", i)
		r.Keys = append(r.Keys, &Key{Secret: secret, Group: c.channel})
		r.Groups = append(r.Groups, &Group{Name: c.channel, Channels: []string{c.channel, c.good}})
	}
	logs := provisionHandler(t, r)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			wasted := func(reason string) float64 {
				return testutil.ToFloat64(metricWasted.WithLabelValues(c.channel, reason))
			}
			failoverBefore, canceledBefore := wasted(wasteFailover), wasted(wasteCanceled)
			w, _ := serveHandler(t, r, newRequest(c.body, fmt.Sprintf("sk-wasted-failover-%d-0123456789", i)))
			if w.Code != 200 || w.Header().Get("X-Relay-Attempts") != "2" {
				t.Fatalf("%d, attempts %q: %s", w.Code, w.Header().Get("X-Relay-Attempts"), w.Body)
			}
			if d := wasted(wasteFailover) - failoverBefore; d != float64(c.want) {
				t.Errorf("relay_wasted_tokens_total{channel=%q,reason=failover} grew by %v, want %d", c.channel, d, c.want)
			}
			if d := wasted(wasteCanceled) - canceledBefore; d != 0 {
				t.Errorf("reason canceled grew by %v", d)
			}
			// the client is accounted what it got, from the channel that
			// answered, and nothing of the abandoned attempt
			lines := logs.FilterMessage("relayed request").All()
			f := lines[len(lines)-1].ContextMap()
			if f["input_tokens"] != int64(7) || f["cache_read_tokens"] != int64(0) || f["cache_write_tokens"] != int64(0) || f["output_tokens"] != int64(3) {
				t.Errorf("the client's usage: %v", f)
			}
			if cost, want := f["cost_usd"].(float64), (7*3+3*15)/1e6; math.Abs(cost-want) > 1e-12 {
				t.Errorf("cost_usd = %v, want %v, the answer's alone", cost, want)
			}
			if got, _ := f["wasted_tokens"].(int64); got != c.want {
				t.Errorf("log wasted_tokens = %v, want %d", f["wasted_tokens"], c.want)
			}
			// the channel's own quota spent them
			_, left := r.groups[c.channel].channels[0].health.limits.Remaining(time.Now())
			if spent := 1e6 - float64(*left); spent < float64(c.spent)-1 || spent > float64(c.spent) {
				t.Errorf("the channel's token limit was charged %v, want %d", spent, c.spent)
			}
		})
	}
}

// pipedStream is a transport whose answer is a 200 event stream that the
// test writes: each write returns once the relay has read it. The stream
// ends when the attempt is canceled.
type pipedStream struct{ body *io.PipeReader }

func (p pipedStream) RoundTrip(req *http.Request) (*http.Response, error) {
	go func() {
		<-req.Context().Done()
		p.body.CloseWithError(req.Context().Err())
	}()
	return &http.Response{StatusCode: 200, Header: http.Header{"Content-Type": {"text/event-stream"}}, Body: p.body, Request: req}, nil
}

func TestWastedTokensOfAClientThatLeft(t *testing.T) {
	const model = "claude-sonnet-4-5"
	got := make(chan struct{})
	silent := fakeupstream.New(t, silentAfterReading(got))
	r := &Relay{
		Keys: []*Key{{Secret: "sk-wasted-left-stream-0123456789", Group: "wl-stream"}, {Secret: "sk-wasted-left-silent-0123456789", Group: "wl-silent"}},
		Channels: []*Channel{
			{Name: "wl-stream", UpstreamRaw: upstream("anthropic", "url", "http://127.0.0.1:1", "api_key", channelKey), Models: []string{model}},
			{Name: "wl-silent", UpstreamRaw: upstream("anthropic", "url", silent.URL, "api_key", channelKey), Models: []string{model}},
		},
		Groups: []*Group{{Name: "wl-stream", Channels: []string{"wl-stream"}}, {Name: "wl-silent", Channels: []string{"wl-silent"}}},
	}
	logs := provisionHandler(t, r)
	pr, pw := io.Pipe()
	r.groups["wl-stream"].channels[0].rt = pipedStream{pr}
	streamed := make(chan struct{})
	go func() {
		defer close(streamed)
		start := fakeupstream.StreamEvents(model, fakeupstream.Usage{InputTokens: 500, CacheReadInputTokens: 40}, "x")[0]
		_, _ = io.WriteString(pw, start)
		// the relay reads this only once it has taken message_start in
		_, _ = io.WriteString(pw, ": still thinking\n\n")
	}()

	est := estimateTokens([]byte(simpleBody))
	for _, c := range []struct {
		name, channel, secret, body string
		upstreamHasIt               <-chan struct{}
		want                        int64
		// what the request is charged: the input the upstream took, as it
		// counted it or as estimated ($3/M input, $0.30/M cache reads)
		input, cacheRead int64
		cost             float64
		estimated        bool
	}{
		{"while the stream had not proved itself", "wl-stream", "sk-wasted-left-stream-0123456789", streamBody, streamed, 540, 500, 40, 0.001512, false},
		{"while the upstream had not answered: the estimate", "wl-silent", "sk-wasted-left-silent-0123456789", simpleBody, got, est, est, 0, float64(est) * 3e-6, true},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := testutil.ToFloat64(metricWasted.WithLabelValues(c.channel, wasteCanceled))
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			go func() {
				<-c.upstreamHasIt
				cancel() // the client leaves
			}()
			w := httptest.NewRecorder()
			req := caddyhttp.PrepareRequest(newRequest(c.body, c.secret).WithContext(ctx), caddy.NewReplacer(), w, &caddyhttp.Server{})
			if err := r.ServeHTTP(w, req, nil); err != nil {
				t.Fatal(err)
			}
			if d := testutil.ToFloat64(metricWasted.WithLabelValues(c.channel, wasteCanceled)) - before; d != float64(c.want) {
				t.Errorf("relay_wasted_tokens_total{reason=canceled} grew by %v, want %d", d, c.want)
			}
			if d := testutil.ToFloat64(metricWasted.WithLabelValues(c.channel, wasteFailover)); d != 0 {
				t.Errorf("reason failover: %v", d)
			}
			lines := logs.FilterMessage("relayed request").All()
			f := lines[len(lines)-1].ContextMap()
			cost, _ := f["cost_usd"].(float64)
			if f["status"] != int64(statusClientClosed) || f["input_tokens"] != c.input || f["cache_read_tokens"] != c.cacheRead ||
				cost < c.cost-1e-12 || cost > c.cost+1e-12 || (f["estimated"] == true) != c.estimated || f["output_tokens"] != int64(0) {
				t.Errorf("a client that left before any answer is charged the input its upstream took: %v", f)
			}
		})
	}
}
