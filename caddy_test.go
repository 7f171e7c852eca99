package relay

// End-to-end tests: a real Caddy (caddytest, in-process) with the relay in a
// site block, against fake upstreams that speak real HTTP on 127.0.0.1.
// Channel names are unique per test because channel health survives config
// reloads by design.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddyserver/caddy/v2/caddytest"
)

const (
	testGlobal = `{
	admin localhost:2999
	http_port 9080
	https_port 9443
	skip_install_trust
	grace_period 1ns
}
`
	relayURL  = "http://localhost:9080"
	clientKey = "sk-client-secret-0123456789"
	// the channels' credential, as the fake upstreams must receive it
	channelKey = "sk-ant-channel-key-abcdef"
)

// startRelay loads a Caddyfile whose site block holds `relay { <block> }`.
func startRelay(t *testing.T, block string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t)
	tester.InitServer(testGlobal+"http://localhost:9080 {\n\trelay {\n"+block+"\n\t}\n}\n", "caddyfile")
	if t.Failed() {
		t.FailNow()
	}
	return tester
}

// channelBlock renders a channel block for an anthropic channel at url.
func channelBlock(name, url string, opts ...string) string {
	return fmt.Sprintf("\t\tchannel %s {\n\t\t\turl %s\n\t\t\tapi_key %s\n\t\t\t%s\n\t\t}\n", name, url, channelKey, strings.Join(opts, "\n\t\t\t"))
}

// keyAndGroup renders a key (clientKey unless given) and its group.
func keyAndGroup(group string, channels string, opts ...string) string {
	return fmt.Sprintf("\t\tkey %s %s\n\t\tgroup %s {\n\t\t\tchannels %s\n\t\t\t%s\n\t\t}\n", clientKey, group, group, channels, strings.Join(opts, "\n\t\t\t"))
}

// reply is what the client received.
type reply struct {
	status int
	header http.Header
	body   []byte
}

var client = &http.Client{Timeout: 30 * time.Second}

// send makes one request to the relay; header pairs follow the body.
func send(t *testing.T, method, path, key, body string, header ...string) reply {
	t.Helper()
	r, err := do(method, path, key, body, header...)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// do is send for goroutines: it returns its error instead of failing the
// test.
func do(method, path, key, body string, header ...string) (reply, error) {
	req, err := http.NewRequest(method, relayURL+path, strings.NewReader(body))
	if err != nil {
		return reply{}, err
	}
	if key != "" {
		req.Header.Set("X-Api-Key", key)
	}
	req.Header.Set("Anthropic-Version", "2023-06-01")
	req.Header.Set("Content-Type", "application/json")
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	if err != nil {
		return reply{}, fmt.Errorf("%s %s: %v", method, path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return reply{}, fmt.Errorf("%s %s: reading body: %v", method, path, err)
	}
	return reply{resp.StatusCode, resp.Header, b}, nil
}

func message(t *testing.T, body string, header ...string) reply {
	t.Helper()
	return send(t, http.MethodPost, "/v1/messages", clientKey, body, header...)
}

const simpleBody = `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
const streamBody = `{"model":"claude-sonnet-4-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`

// wantRelayError checks an error the relay wrote itself: status, the
// Anthropic shape, error.type, error.code, and the request id matching the
// x-relay-request-id header.
func wantRelayError(t *testing.T, r reply, status int, typ, code string) {
	t.Helper()
	if r.status != status {
		t.Fatalf("status = %d, want %d; body %s", r.status, status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("content-type = %q, want application/json", ct)
	}
	var e struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
			Code    string `json:"code"`
		} `json:"error"`
		RequestID string `json:"request_id"`
	}
	if err := json.Unmarshal(r.body, &e); err != nil {
		t.Fatalf("error body is not JSON: %v: %s", err, r.body)
	}
	if e.Type != "error" || e.Error.Type != typ || e.Error.Code != code || e.Error.Message == "" {
		t.Errorf("error = %+v, want type %q code %q with a message", e, typ, code)
	}
	if id := r.header.Get("X-Relay-Request-Id"); id == "" || e.RequestID != id {
		t.Errorf("request_id %q does not match x-relay-request-id %q", e.RequestID, id)
	}
}

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
		wantRelayError(t, message(t, big), 413, "request_too_large", "")
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
		if r := message(t, `{"model":"x"}`); r.status != 200 {
			t.Errorf("status = %d", r.status)
		}
	})
	if n := up.Hits(); n != 1 {
		t.Errorf("upstream hits = %d, want 1: only the valid request may reach it", n)
	}
}

// TestClassificationTable drives every row of DESIGN.md's outcome table:
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

func (r recorder) Header() http.Header         { return http.Header{} }
func (r recorder) Write(p []byte) (int, error) { return r.b.Write(p) }
func (r recorder) WriteHeader(int)             {}

func httptestRequest() *http.Request {
	req, _ := http.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(simpleBody))
	return req
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
	if r.header.Get("X-Relay-Attempts") != "2" || r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("x-relay-attempts = %q, x-should-retry = %q; want 2 and false",
			r.header.Get("X-Relay-Attempts"), r.header.Get("X-Should-Retry"))
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

func TestModelFilterAndMapping(t *testing.T) {
	a := fakeupstream.New(t, fakeupstream.Message("a"))
	b := fakeupstream.New(t, fakeupstream.Message("b"))
	startRelay(t, channelBlock("models-a", a.URL, "models claude-opus-4-1=claude-opus-4-1-20250805 claude-haiku-4-5")+
		channelBlock("models-b", b.URL, "models claude-sonnet-4-5")+keyAndGroup("models", "models-a models-b"))

	body := `{"model"  :  "claude-opus-4-1", "max_tokens":16, "metadata":{"user_id":"u1"},"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"unknown_field":{"kept":true}}`
	r := message(t, body)
	if r.status != 200 || b.Hits() != 0 {
		t.Fatalf("status %d, b hits %d: opus is served by a only", r.status, b.Hits())
	}
	want := strings.Replace(body, `"claude-opus-4-1"`, `"claude-opus-4-1-20250805"`, 1)
	if got := string(a.Last(t).Body); got != want {
		t.Errorf("upstream body:\n got %s\nwant %s", got, want)
	}

	message(t, `{"model":"claude-haiku-4-5","max_tokens":1}`)
	if got := string(a.Last(t).Body); got != `{"model":"claude-haiku-4-5","max_tokens":1}` {
		t.Errorf("an unmapped model must pass unchanged: %s", got)
	}
	message(t, `{"model":"claude-sonnet-4-5"}`)
	if b.Hits() != 1 {
		t.Errorf("sonnet should go to b: hits %d", b.Hits())
	}

	r = message(t, `{"model":"claude-3-opus"}`)
	wantRelayError(t, r, 503, "relay_error", "model_not_found")
	if r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("model_not_found must say x-should-retry: false")
	}

	// GET /v1/models lists what the group's channels declare
	r = send(t, http.MethodGet, "/v1/models", clientKey, "")
	var list struct {
		Data []struct {
			ID   string `json:"id"`
			Type string `json:"type"`
		} `json:"data"`
		HasMore bool   `json:"has_more"`
		FirstID string `json:"first_id"`
		LastID  string `json:"last_id"`
	}
	if err := json.Unmarshal(r.body, &list); err != nil || r.status != 200 {
		t.Fatalf("models: %d %s", r.status, r.body)
	}
	var ids []string
	for _, m := range list.Data {
		ids = append(ids, m.ID)
	}
	if strings.Join(ids, ",") != "claude-opus-4-1,claude-haiku-4-5,claude-sonnet-4-5" || list.FirstID != "claude-opus-4-1" || list.LastID != "claude-sonnet-4-5" {
		t.Errorf("models = %v (first %q last %q)", ids, list.FirstID, list.LastID)
	}
	if r = send(t, http.MethodGet, "/v1/models?limit=1", clientKey, ""); !bytes.Contains(r.body, []byte(`"has_more":true`)) {
		t.Errorf("limit=1 should page: %s", r.body)
	}
	if r = send(t, http.MethodGet, "/v1/models/claude-haiku-4-5", clientKey, ""); r.status != 200 || !bytes.Contains(r.body, []byte(`"id":"claude-haiku-4-5"`)) {
		t.Errorf("GET /v1/models/{id}: %d %s", r.status, r.body)
	}
	wantRelayError(t, send(t, http.MethodGet, "/v1/models/gpt-4", clientKey, ""), 404, "not_found_error", "")
	wantRelayError(t, send(t, http.MethodGet, "/v1/models", "sk-wrong", ""), 401, "authentication_error", "")
	if a.Hits()+b.Hits() != 3 {
		t.Errorf("GET /v1/models must be answered locally: upstream hits %d", a.Hits()+b.Hits())
	}
}

func TestCapabilityFilter(t *testing.T) {
	plain := fakeupstream.New(t, fakeupstream.Message("plain"))
	tier := fakeupstream.New(t, fakeupstream.Message("tier"))
	startRelay(t, channelBlock("cap-plain", plain.URL, "weight 100")+channelBlock("cap-tier", tier.URL, "allow service_tier")+
		keyAndGroup("cap", "cap-plain cap-tier"))

	for i := 0; i < 5; i++ {
		if r := message(t, `{"model":"m","service_tier":"auto"}`); r.status != 200 {
			t.Fatalf("status %d", r.status)
		}
	}
	if tier.Hits() != 5 || plain.Hits() != 0 {
		t.Errorf("service_tier requests: tier %d plain %d, want all 5 on the channel that allows it", tier.Hits(), plain.Hits())
	}
	// a null value is no request for the capability
	message(t, `{"model":"m","service_tier":null,"max_tokens":1}`)
	r := message(t, `{"model":"m","speed":"fast"}`)
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	if !bytes.Contains(r.body, []byte("speed")) || r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("capability error should name the field and say x-should-retry: false: %s", r.body)
	}
}

func TestClientKeyNeverReachesUpstreamAndHeadersForwarded(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	bearer := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("fwd-a", up.URL)+channelBlock("fwd-b", bearer.URL, "auth bearer", "priority 2")+keyAndGroup("fwd", "fwd-a fwd-b"))

	r := send(t, http.MethodPost, "/v1/messages?beta=true", "", simpleBody,
		"Authorization", "Bearer "+clientKey,
		"Anthropic-Beta", "prompt-caching-2024-07-31",
		"User-Agent", "test-agent/1.0",
		"X-Custom-Secret", "private",
		"Cookie", "session=1",
		"Connection", "keep-alive")
	if r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	got := up.Last(t)
	if got.Header.Get("X-Api-Key") != channelKey {
		t.Errorf("x-api-key upstream = %q, want the channel's key", got.Header.Get("X-Api-Key"))
	}
	if got.Header.Get("Authorization") != "" {
		t.Errorf("the client's Authorization reached the upstream")
	}
	for k, vs := range got.Header {
		for _, v := range vs {
			if strings.Contains(v, clientKey) {
				t.Errorf("client key leaked upstream in header %s", k)
			}
		}
	}
	for _, h := range []string{"X-Custom-Secret", "Cookie"} {
		if got.Header.Get(h) != "" {
			t.Errorf("header %s must not be forwarded", h)
		}
	}
	if got.Header.Get("Anthropic-Version") != "2023-06-01" || got.Header.Get("Anthropic-Beta") != "prompt-caching-2024-07-31" ||
		got.Header.Get("User-Agent") != "test-agent/1.0" || got.Header.Get("Content-Type") != "application/json" {
		t.Errorf("forwarded headers wrong: %v", got.Header)
	}
	if got.RawQuery != "beta=true" || got.Path != "/v1/messages" {
		t.Errorf("path %q query %q, want /v1/messages?beta=true", got.Path, got.RawQuery)
	}
	if want := strings.TrimPrefix(up.URL, "http://"); got.Host != want {
		t.Errorf("upstream Host = %q, want the channel's %q", got.Host, want)
	}
	if r.header.Get("X-Relay-Request-Id") == "" || r.header.Get("Request-Id") != "req_fake" {
		t.Errorf("response headers: %v", r.header)
	}
	if r.header.Get("X-Relay-Channel") != "" {
		t.Errorf("x-relay-channel without expose_channel")
	}

	// the bearer channel gets Authorization: Bearer <channel key>
	up.SetHandler(fakeupstream.Raw(503, []byte("down")))
	message(t, simpleBody)
	if got := bearer.Last(t).Header; got.Get("Authorization") != "Bearer "+channelKey || got.Get("X-Api-Key") != "" {
		t.Errorf("bearer channel credentials: %v", got)
	}
}

func TestCountTokensRelayed(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Raw(200, []byte(`{"input_tokens":42}`)))
	startRelay(t, channelBlock("count-a", up.URL, "models claude-sonnet-4-5=claude-sonnet-4-5-20250929")+keyAndGroup("count", "count-a"))
	r := send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[]}`)
	if r.status != 200 || string(r.body) != `{"input_tokens":42}` {
		t.Fatalf("count_tokens: %d %s", r.status, r.body)
	}
	if got := up.Last(t); got.Path != "/v1/messages/count_tokens" || string(got.Body) != `{"model":"claude-sonnet-4-5-20250929","messages":[]}` {
		t.Errorf("upstream got %s %s", got.Path, got.Body)
	}
}

func TestSecretPlaceholderStaysOutOfConfig(t *testing.T) {
	secret := "sk-ant-from-env-" + fmt.Sprint(time.Now().UnixNano())
	t.Setenv("RELAY_TEST_CHANNEL_KEY", secret)
	t.Setenv("RELAY_TEST_CLIENT_KEY", clientKey)
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, "\t\tchannel env-a {\n\t\t\turl "+up.URL+"\n\t\t\tapi_key {env.RELAY_TEST_CHANNEL_KEY}\n\t\t}\n"+
		"\t\tkey {env.RELAY_TEST_CLIENT_KEY} env\n\t\tgroup env {\n\t\t\tchannels env-a\n\t\t}\n")

	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("status %d %s", r.status, r.body)
	}
	if got := up.Last(t).Header.Get("X-Api-Key"); got != secret {
		t.Errorf("upstream key = %q, want the resolved placeholder", got)
	}
	resp, err := client.Get("http://localhost:2999/config/")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if bytes.Contains(cfg, []byte(secret)) || bytes.Contains(cfg, []byte(clientKey)) {
		t.Errorf("GET /config/ contains a secret: %s", cfg)
	}
	if !bytes.Contains(cfg, []byte("{env.RELAY_TEST_CHANNEL_KEY}")) {
		t.Errorf("GET /config/ should show the placeholder: %s", cfg)
	}
}

func TestLiteralKeyIsHashedInConfig(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("lit-a", up.URL)+keyAndGroup("lit", "lit-a"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("status %d", r.status)
	}
	resp, err := client.Get("http://localhost:2999/config/")
	if err != nil {
		t.Fatal(err)
	}
	cfg, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if bytes.Contains(cfg, []byte(clientKey)) || !bytes.Contains(cfg, []byte(`"secret":"sha256:`)) {
		t.Errorf("a literal client key must be stored as its sha256: %s", cfg)
	}
}

// streamReader reads a relay stream event by event.
type streamReader struct {
	resp *http.Response
	br   *bufio.Reader
}

func openStream(t *testing.T, ctx context.Context, body string) *streamReader {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, relayURL+"/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", clientKey)
	req.Header.Set("Content-Type", "application/json")
	resp, err := (&http.Client{}).Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return &streamReader{resp, bufio.NewReader(resp.Body)}
}

// next returns the next raw event, or "" at the end of the stream.
func (s *streamReader) next(t *testing.T) string {
	t.Helper()
	var ev strings.Builder
	for {
		line, err := s.br.ReadString('\n')
		ev.WriteString(line)
		if err != nil {
			return ev.String()
		}
		if line == "\n" {
			return ev.String()
		}
	}
}

func (s *streamReader) rest(t *testing.T) string {
	b, _ := io.ReadAll(s.br)
	return string(b)
}

// failoverPair starts a relay whose group tries an upstream answering with
// bad first (priority 1) and one answering with good second.
func failoverPair(t *testing.T, name string, bad, good http.Handler) (first, second *fakeupstream.Upstream) {
	t.Helper()
	first, second = fakeupstream.New(t, bad), fakeupstream.New(t, good)
	startRelay(t, channelBlock(name+"-a", first.URL, "priority 1")+channelBlock(name+"-b", second.URL, "priority 2")+
		keyAndGroup(name, name+"-a "+name+"-b"))
	return first, second
}

func TestStreamCommitPoint(t *testing.T) {
	good := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 10, OutputTokens: 3}, "Hello", " world")
	overloaded := fakeupstream.Event("error", `{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}`)

	t.Run("error event before content fails over invisibly", func(t *testing.T) {
		bad, ok := failoverPair(t, "commit-err", fakeupstream.Stream(good[0], good[2], overloaded), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || string(r.body) != strings.Join(good, "") {
			t.Fatalf("client got %d:\n%s\nwant exactly the second upstream's stream", r.status, r.body)
		}
		if bad.Hits() != 1 || ok.Hits() != 1 || r.header.Get("X-Relay-Attempts") != "2" {
			t.Errorf("hits bad=%d ok=%d attempts=%q", bad.Hits(), ok.Hits(), r.header.Get("X-Relay-Attempts"))
		}
		if ct := r.header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
			t.Errorf("content-type = %q", ct)
		}
	})

	t.Run("keep-alive comments do not commit the stream", func(t *testing.T) {
		_, ok := failoverPair(t, "commit-comment", fakeupstream.Stream(": keep-alive\n\n", good[0], ": keep-alive\n\n", overloaded), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || string(r.body) != strings.Join(good, "") || ok.Hits() != 1 {
			t.Fatalf("client got %d (second upstream hits %d):\n%s\nwant the second upstream's stream only", r.status, ok.Hits(), r.body)
		}
	})

	t.Run("dead stream before content fails over", func(t *testing.T) {
		bad, ok := failoverPair(t, "commit-cut", fakeupstream.StreamThenCut(good[0]), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || string(r.body) != strings.Join(good, "") || bad.Hits() != 1 || ok.Hits() != 1 {
			t.Fatalf("client got %d (bad hits %d):\n%s", r.status, bad.Hits(), r.body)
		}
	})

	t.Run("cut after content ends with an error event and no failover", func(t *testing.T) {
		_, ok := failoverPair(t, "commit-late", fakeupstream.StreamThenCut(good[:4]...), fakeupstream.Stream(good...))
		r := message(t, streamBody)
		if r.status != 200 || !strings.HasPrefix(string(r.body), strings.Join(good[:4], "")) {
			t.Fatalf("client got %d:\n%s\nwant the events sent before the cut", r.status, r.body)
		}
		tail := strings.TrimPrefix(string(r.body), strings.Join(good[:4], ""))
		if !strings.HasPrefix(tail, "event: error\ndata: ") || !strings.Contains(tail, `"type":"api_error"`) || !strings.HasSuffix(tail, "\n\n") {
			t.Errorf("stream should end with an Anthropic error event, got %q", tail)
		}
		if ok.Hits() != 0 {
			t.Errorf("no second upstream may be called after the commit point: hits %d", ok.Hits())
		}
	})

	t.Run("EOF without message_stop ends with an error event", func(t *testing.T) {
		up := fakeupstream.New(t, fakeupstream.Stream(good[:len(good)-1]...))
		startRelay(t, channelBlock("commit-eof-a", up.URL)+keyAndGroup("commit-eof", "commit-eof-a"))
		r := message(t, streamBody)
		if !strings.HasPrefix(string(r.body), strings.Join(good[:len(good)-1], "")) || !strings.Contains(string(r.body), "event: error\n") {
			t.Errorf("a stream without message_stop must end with event: error:\n%s", r.body)
		}
	})

	t.Run("invalid JSON data is dropped", func(t *testing.T) {
		evs := append([]string{}, good[:4]...)
		evs = append(evs, fakeupstream.Event("content_block_delta", `{"type":"content_block_delta",`))
		evs = append(evs, good[4:]...)
		up := fakeupstream.New(t, fakeupstream.Stream(evs...))
		startRelay(t, channelBlock("commit-json-a", up.URL)+keyAndGroup("commit-json", "commit-json-a"))
		if r := message(t, streamBody); string(r.body) != strings.Join(good, "") {
			t.Errorf("client got:\n%s\nwant the stream without the broken event", r.body)
		}
	})

	t.Run("non-retryable error event passes through", func(t *testing.T) {
		invalid := fakeupstream.Event("error", `{"type":"error","error":{"type":"invalid_request_error","message":"bad"}}`)
		bad, ok := failoverPair(t, "commit-inv", fakeupstream.Stream(good[0], invalid), fakeupstream.Stream(good...))
		if r := message(t, streamBody); string(r.body) != good[0]+invalid || ok.Hits() != 0 || bad.Hits() != 1 {
			t.Errorf("client got:\n%s\n(second upstream hits %d)", r.body, ok.Hits())
		}
	})
}

func TestStreamFlushesEachEvent(t *testing.T) {
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 1, OutputTokens: 2}, "first", "second")
	release := make(chan struct{}) // the client must see "first" while the rest is held back
	up := fakeupstream.New(t, fakeupstream.Held(evs, 4, release, nil))
	startRelay(t, channelBlock("flush-a", up.URL)+keyAndGroup("flush", "flush-a"))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	s := openStream(t, ctx, streamBody)
	var seen strings.Builder
	for !strings.Contains(seen.String(), `"text":"first"`) {
		ev := s.next(t)
		if ev == "" {
			t.Fatalf("stream ended before the first delta; got %q", seen.String())
		}
		seen.WriteString(ev)
	}
	if seen.String() != strings.Join(evs[:4], "") {
		t.Errorf("events before the release:\n%s", seen.String())
	}
	close(release)
	seen.WriteString(s.rest(t))
	if seen.String() != strings.Join(evs, "") {
		t.Errorf("whole stream:\n%s", seen.String())
	}
}

func TestClientDisconnectCancelsUpstream(t *testing.T) {
	evs := fakeupstream.StreamEvents("m", fakeupstream.Usage{}, "first")
	canceled, never := make(chan struct{}), make(chan struct{})
	up := fakeupstream.New(t, fakeupstream.Held(evs, 4, never, canceled))
	startRelay(t, channelBlock("cancel-a", up.URL)+keyAndGroup("cancel", "cancel-a"))

	ctx, cancel := context.WithCancel(context.Background())
	s := openStream(t, ctx, streamBody)
	for ev := s.next(t); !strings.Contains(ev, "content_block_delta"); ev = s.next(t) {
		if ev == "" {
			t.Fatal("stream ended early")
		}
	}
	cancel()
	select {
	case <-canceled:
	case <-time.After(5 * time.Second):
		t.Fatal("the upstream request was not canceled within 5s of the client leaving")
	}
	// a client leaving is not the channel's fault: it still serves
	up.SetHandler(fakeupstream.Message("still here"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("channel should stay healthy after a client disconnect: %d", r.status)
	}
}

func TestStreamTimeouts(t *testing.T) {
	good := fakeupstream.StreamEvents("m", fakeupstream.Usage{}, "x")
	hang := func(evs ...string) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			fakeupstream.StartStream(w)
			for _, ev := range evs {
				fakeupstream.WriteEvent(w, ev)
			}
			<-r.Context().Done()
		}
	}
	silent := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }))
	noContent := fakeupstream.New(t, hang(good[0], good[2]))
	stalls := fakeupstream.New(t, hang(good[:4]...))
	openEnded := fakeupstream.New(t, hang(good...))
	ok := fakeupstream.New(t, fakeupstream.Stream(good...))
	startRelay(t, "\t\tfirst_byte_timeout 300ms\n\t\tfirst_content_timeout 300ms\n\t\tstream_idle_timeout 300ms\n"+
		channelBlock("to-silent", silent.URL, "priority 1")+channelBlock("to-nocontent", noContent.URL, "priority 1")+
		channelBlock("to-stalls", stalls.URL)+channelBlock("to-open", openEnded.URL)+channelBlock("to-ok", ok.URL, "priority 2")+
		"\t\tkey sk-to-1 to1\n\t\tgroup to1 {\n\t\t\tchannels to-silent to-ok\n\t\t}\n"+
		"\t\tkey sk-to-2 to2\n\t\tgroup to2 {\n\t\t\tchannels to-nocontent to-ok\n\t\t}\n"+
		"\t\tkey sk-to-3 to3\n\t\tgroup to3 {\n\t\t\tchannels to-stalls\n\t\t}\n"+
		"\t\tkey sk-to-4 to4\n\t\tgroup to4 {\n\t\t\tchannels to-open\n\t\t}\n")

	for _, c := range []struct{ name, key string }{{"first byte timeout fails over", "sk-to-1"}, {"first content timeout fails over", "sk-to-2"}} {
		t.Run(c.name, func(t *testing.T) {
			start := time.Now()
			r := send(t, http.MethodPost, "/v1/messages", c.key, streamBody)
			if r.status != 200 || string(r.body) != strings.Join(good, "") || r.header.Get("X-Relay-Attempts") != "2" {
				t.Fatalf("got %d attempts %q:\n%s", r.status, r.header.Get("X-Relay-Attempts"), r.body)
			}
			if d := time.Since(start); d < 300*time.Millisecond || d > 10*time.Second {
				t.Errorf("took %v, want at least the 300ms timeout and well under 10s", d)
			}
		})
	}
	t.Run("idle stream ends with an error event", func(t *testing.T) {
		r := send(t, http.MethodPost, "/v1/messages", "sk-to-3", streamBody)
		body := string(r.body)
		if !strings.HasPrefix(body, strings.Join(good[:4], "")) || !strings.Contains(body, "event: error\n") || !strings.Contains(body, "idle") {
			t.Errorf("got:\n%s", body)
		}
	})
	t.Run("message_stop ends the response even if the upstream stays open", func(t *testing.T) {
		start := time.Now()
		r := send(t, http.MethodPost, "/v1/messages", "sk-to-4", streamBody)
		if string(r.body) != strings.Join(good, "") {
			t.Errorf("got:\n%s", r.body)
		}
		if d := time.Since(start); d > 5*time.Second {
			t.Errorf("the response ended %v after the request; message_stop should end it at once", d)
		}
	})
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

func TestMockChannelServesWithoutCredentials(t *testing.T) {
	startRelay(t, "\t\tchannel mock-only {\n\t\t\tprovider mock\n\t\t\ttokens 5\n\t\t}\n"+keyAndGroup("mockg", "mock-only", "expose_channel"))
	r := message(t, simpleBody)
	var msg struct {
		Model   string `json:"model"`
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
		Usage struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(r.body, &msg); err != nil || r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if msg.Model != "claude-sonnet-4-5" || !strings.Contains(msg.Content[0].Text, "mock-only") || msg.Usage.OutputTokens != 5 || msg.Usage.InputTokens < 1 {
		t.Errorf("mock reply: %+v", msg)
	}
	if r.header.Get("X-Relay-Channel") != "mock-only" {
		t.Errorf("x-relay-channel = %q", r.header.Get("X-Relay-Channel"))
	}
	r = message(t, streamBody)
	if !strings.HasPrefix(string(r.body), "event: message_start\n") || !strings.HasSuffix(string(r.body), "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n") {
		t.Errorf("mock stream:\n%s", r.body)
	}
}

func TestHTTPSChannelUsesTLS(t *testing.T) {
	var sawTLS atomic.Bool
	tlsUp := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sawTLS.Store(r.TLS != nil)
		fakeupstream.Message("over tls")(w, r)
	}))
	t.Cleanup(tlsUp.Close)
	// the fake's certificate is self-signed: trusted only when told so
	startRelay(t, channelBlock("tls-trusting", tlsUp.URL, "transport http {\n\t\t\t\ttls_insecure_skip_verify\n\t\t\t}")+
		channelBlock("tls-default", tlsUp.URL)+
		keyAndGroup("tls1", "tls-trusting")+
		"\t\tkey sk-tls-2 tls2\n\t\tgroup tls2 {\n\t\t\tchannels tls-default\n\t\t}\n")

	if r := message(t, simpleBody); r.status != 200 || !sawTLS.Load() {
		t.Errorf("https channel with a transport block: %d, TLS %v: %s", r.status, sawTLS.Load(), r.body)
	}
	// without a transport block the default one verifies the certificate,
	// which proves it speaks TLS to an https URL
	r := send(t, http.MethodPost, "/v1/messages", "sk-tls-2", simpleBody)
	wantRelayError(t, r, 502, "api_error", "")
	if !bytes.Contains(r.body, []byte("certificate")) {
		t.Errorf("want a certificate error, got %s", r.body)
	}
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
