package relay

import (
	"bytes"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
)

// TestClassificationTable drives every row of the outcome table:
// for each, a channel answering that way is tried first (priority 1), with a
// healthy fallback (priority 2). Retryable outcomes fail over and cool the
// channel (a second request skips it); the others reach the client unchanged
// and leave the channel healthy.
func TestClassificationTable(t *testing.T) {
	spend := []byte(`{"type":"error","error":{"type":"rate_limit_error","message":"spend limit","details":{"error_code":"enforced_spend_limit_reached"}}}`)
	cases := []struct {
		name     string
		bad      http.HandlerFunc // nil: a port that refuses connections
		failover bool
		status   int // what the client gets when the answer passes through
	}{
		{"400 passes through", fakeupstream.Error(400, "invalid_request_error", "messages: field required"), false, 400},
		{"404 passes through", fakeupstream.Error(404, "not_found_error", "model: unknown"), false, 404},
		{"413 passes through", fakeupstream.Error(413, "request_too_large", "too large"), false, 413},
		{"422 passes through", fakeupstream.Error(422, "invalid_request_error", "unprocessable"), false, 422},
		{"401 fails over", fakeupstream.Error(401, "authentication_error", "invalid x-api-key"), true, 0},
		{"402 fails over", fakeupstream.Error(402, "billing_error", "billing"), true, 0},
		{"403 fails over", fakeupstream.Error(403, "permission_error", "forbidden"), true, 0},
		{"400 credit balance fails over", fakeupstream.Error(400, "invalid_request_error", "Your credit balance is too low to access the Anthropic API."), true, 0},
		{"429 spend limit fails over", fakeupstream.Raw(429, spend), true, 0},
		{"429 fails over", fakeupstream.Error(429, "rate_limit_error", "slow down", "Retry-After", "30"), true, 0},
		{"529 fails over", fakeupstream.Error(529, "overloaded_error", "Overloaded"), true, 0},
		{"500 fails over", fakeupstream.Error(500, "api_error", "internal"), true, 0},
		{"502 fails over", fakeupstream.Raw(502, []byte("bad gateway")), true, 0},
		{"503 fails over", fakeupstream.Raw(503, []byte("unavailable")), true, 0},
		{"504 fails over", fakeupstream.Raw(504, []byte("timeout")), true, 0},
		{"refused connection fails over", nil, true, 0},
		{"connection reset fails over", fakeupstream.Hangup(), true, 0},
		{"body cut mid-way fails over", fakeupstream.CutAfter(200, []byte(`{"id":"msg_`), 500), true, 0},
	}

	// one config: a key, a group and two channels per row
	var cfg strings.Builder
	bads := make([]*fakeupstream.Upstream, len(cases))
	goods := make([]*fakeupstream.Upstream, len(cases))
	for i, c := range cases {
		badURL := fakeupstream.DeadURL(t)
		if c.bad != nil {
			bads[i] = fakeupstream.New(t, c.bad)
			badURL = bads[i].URL
		}
		goods[i] = fakeupstream.New(t, fakeupstream.Message("from the fallback"))
		fmt.Fprintf(&cfg, "\t\tkey sk-row-%d row%d\n\t\tgroup row%d {\n\t\t\tchannels row%d-bad row%d-good\n\t\t\texpose_channel\n\t\t}\n", i, i, i, i, i)
		cfg.WriteString(channelBlock(fmt.Sprintf("row%d-bad", i), badURL, "priority 1"))
		cfg.WriteString(channelBlock(fmt.Sprintf("row%d-good", i), goods[i].URL, "priority 2"))
	}
	startRelay(t, cfg.String())

	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			key := fmt.Sprintf("sk-row-%d", i)
			hits := func() int {
				if bads[i] == nil {
					return -1
				}
				return bads[i].Hits()
			}
			r := send(t, http.MethodPost, "/v1/messages", key, simpleBody)
			if c.failover {
				if r.status != 200 || !bytes.Contains(r.body, []byte("from the fallback")) {
					t.Fatalf("got %d %s, want the fallback's 200", r.status, r.body)
				}
				if got := r.header.Get("X-Relay-Attempts"); got != "2" {
					t.Errorf("x-relay-attempts = %q, want 2", got)
				}
				if got := r.header.Get("X-Relay-Channel"); got != fmt.Sprintf("row%d-good", i) {
					t.Errorf("x-relay-channel = %q", got)
				}
				if bads[i] != nil && hits() != 1 {
					t.Errorf("bad channel hits = %d, want 1", hits())
				}
				// cooled: the next request goes straight to the fallback
				r2 := send(t, http.MethodPost, "/v1/messages", key, simpleBody)
				if r2.status != 200 || r2.header.Get("X-Relay-Attempts") != "" {
					t.Errorf("second request: %d, attempts %q; want 200 in one attempt", r2.status, r2.header.Get("X-Relay-Attempts"))
				}
				if bads[i] != nil && hits() != 1 {
					t.Errorf("the cooling channel was called again: hits = %d", hits())
				}
				if n := goods[i].Hits(); n != 2 {
					t.Errorf("fallback hits = %d, want 2", n)
				}
				return
			}
			if r.status != c.status {
				t.Fatalf("status = %d, want %d unchanged; body %s", r.status, c.status, r.body)
			}
			var want bytes.Buffer
			c.bad(recorder{&want}, httptestRequest())
			if !bytes.Equal(r.body, want.Bytes()) {
				t.Errorf("body = %s, want the upstream's unchanged %s", r.body, want.Bytes())
			}
			if goods[i].Hits() != 0 {
				t.Errorf("a client error must not fail over: fallback hits = %d", goods[i].Hits())
			}
			send(t, http.MethodPost, "/v1/messages", key, simpleBody)
			if hits() != 2 {
				t.Errorf("the channel must stay healthy after a client error: hits = %d, want 2", hits())
			}
		})
	}
}

// recorder captures what a handler writes, to compare with what the client
// received.
type recorder struct{ b *bytes.Buffer }

func (r recorder) Header() http.Header { return http.Header{} }

func (r recorder) Write(p []byte) (int, error) { return r.b.Write(p) }

func (r recorder) WriteHeader(int) {}

func httptestRequest() *http.Request {
	req, _ := http.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(simpleBody))
	return req
}

func TestResponseTimeoutFailsOverNonStreaming(t *testing.T) {
	slow := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	ok := fakeupstream.New(t, fakeupstream.Message("in time"))
	startRelay(t, channelBlock("rt-slow", slow.URL, "priority 1", "response_timeout 300ms")+channelBlock("rt-ok", ok.URL, "priority 2")+
		keyAndGroup("rt", "rt-slow rt-ok"))
	start := time.Now()
	r := message(t, simpleBody)
	if r.status != 200 || !bytes.Contains(r.body, []byte("in time")) || r.header.Get("X-Relay-Attempts") != "2" {
		t.Fatalf("got %d %s", r.status, r.body)
	}
	if d := time.Since(start); d < 300*time.Millisecond || d > 10*time.Second {
		t.Errorf("took %v, want at least the channel's 300ms response_timeout", d)
	}

	// with nowhere to fail over, the client gets a 504 timeout_error
	ok.SetHandler(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	startRelay(t, channelBlock("rt-only", slow.URL, "response_timeout 200ms")+keyAndGroup("rt2", "rt-only"))
	wantRelayError(t, message(t, simpleBody), 504, "timeout_error", "")
}

func TestSuccessBodiesAreBounded(t *testing.T) {
	huge := fakeupstream.Raw(200, []byte(`{"type":"message","pad":"`+strings.Repeat("x", 4096)+`"}`))
	big, ok := fakeupstream.New(t, huge), fakeupstream.New(t, fakeupstream.Message("served"))
	startRelay(t, "\t\tmax_response_size 1KiB\n"+channelBlock("hostile-big-a", big.URL, "priority 1")+
		channelBlock("hostile-big-b", ok.URL, "priority 2")+keyAndGroup("hostile-big", "hostile-big-a hostile-big-b"))
	if r := message(t, simpleBody); r.status != 200 || !strings.Contains(string(r.body), "served") {
		t.Fatalf("an answer over max_response_size should fail over: %d %s", r.status, r.body)
	}
	if st := channels(t)["hostile-big-a"]; st.LastError != "transient" || !strings.Contains(st.LastErrorReason, "max_response_size") {
		t.Errorf("the oversized answer's channel: %+v", st)
	}
}
