package relay

// Helpers shared by the package's tests. The end-to-end tests run a real
// Caddy in-process (caddytest, on ports 9080 and 2999) with the relay in a
// site block, against fake upstreams that speak real HTTP on 127.0.0.1.
// Channel names are unique per test because channel health survives config
// reloads by design.

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/limits"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/certmagic"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// upstream renders a channel's provider config: its name and key, value
// pairs of its options (strings).
func upstream(provider string, kv ...string) json.RawMessage {
	m := map[string]string{"provider": provider}
	for i := 0; i+1 < len(kv); i += 2 {
		m[kv[i]] = kv[i+1]
	}
	b, _ := json.Marshal(m)
	return b
}

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
	channelKey = fakeupstream.Key
)

// startRelay loads a Caddyfile whose site block holds `relay { <block> }`.
func startRelay(t *testing.T, block string) *caddytest.Tester {
	t.Helper()
	return startRelayWith(t, "", block)
}

// startRelayWith is startRelay with the site's other directives first.
func startRelayWith(t *testing.T, site, block string) *caddytest.Tester {
	t.Helper()
	tester := caddytest.NewTester(t)
	tester.InitServer(testGlobal+"http://localhost:9080 {\n"+site+"\trelay {\n"+block+"\n\t}\n}\n", "caddyfile")
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
	// a nil value is not sent, but lets the transport send the request
	// again when the kept-alive connection it picked was closed by the
	// server of the previous test's config as it stopped (an EOF before
	// any answer), as an SDK's retry would
	req.Header["X-Idempotency-Key"] = nil
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := client.Do(req)
	for retry := 0; err != nil && retry < 2; retry++ {
		// a connection the server closed before any answer: the server
		// of the previous config accepted it as it stopped. The SDKs send
		// such a request again after a moment, and so does this client.
		time.Sleep(100 * time.Millisecond)
		again := req.Clone(context.Background())
		again.Body, _ = req.GetBody()
		resp, err = client.Do(again)
	}
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

// streamReader reads a relay stream event by event.
type streamReader struct {
	resp *http.Response
	br   *bufio.Reader
}

func openStream(t *testing.T, ctx context.Context, body string) *streamReader {
	t.Helper()
	return openStreamAs(t, ctx, clientKey, body)
}

// openStreamAs is openStream with another key.
func openStreamAs(t *testing.T, ctx context.Context, key, body string) *streamReader {
	t.Helper()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, relayURL+"/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", key)
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

const adminURL = "http://localhost:2999"

// channels returns GET /relay/channels by channel name.
func channels(t *testing.T) map[string]channelStatus {
	t.Helper()
	resp, err := client.Get(adminURL + "/relay/channels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []channelStatus
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil || resp.StatusCode != 200 {
		t.Fatalf("GET /relay/channels: %d %v", resp.StatusCode, err)
	}
	out := map[string]channelStatus{}
	for _, r := range rows {
		out[r.Name] = r
	}
	return out
}

// adminPost calls POST /relay/channels/<name>/<action>.
func adminPost(t *testing.T, name, action string) (int, []byte) {
	t.Helper()
	resp, err := client.Post(adminURL+"/relay/channels/"+name+"/"+action, "application/json", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, b
}

// waitFor polls cond until it holds or the bound passes; for states that
// change on their own clock (probes, breakers), not for request results.
func waitFor(t *testing.T, what string, bound time.Duration, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(bound)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v", what, bound)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// scrape reads Caddy's /metrics from the admin endpoint.
func scrape(t *testing.T) (map[string]*dto.MetricFamily, string) {
	t.Helper()
	resp, err := client.Get(adminURL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	p := expfmt.NewTextParser(model.UTF8Validation)
	mf, err := p.TextToMetricFamilies(strings.NewReader(string(raw)))
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	return mf, string(raw)
}

// value returns the value of the series of family name whose labels include
// labels ("k=v" pairs); a histogram gives its sample count. Missing: -1.
func value(mf map[string]*dto.MetricFamily, name string, labels ...string) float64 {
	f := mf[name]
	if f == nil {
		return -1
	}
next:
	for _, m := range f.Metric {
		have := map[string]string{}
		for _, l := range m.Label {
			have[l.GetName()] = l.GetValue()
		}
		for _, kv := range labels {
			k, v, _ := strings.Cut(kv, "=")
			if have[k] != v {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		case m.Histogram != nil:
			return float64(m.Histogram.GetSampleCount())
		}
	}
	return -1
}

func mustRead(r *http.Request) string {
	b, _ := io.ReadAll(r.Body)
	return string(b)
}

// provisionHandler provisions r outside a server, with its log lines going
// to an observer.
func provisionHandler(t testing.TB, r *Relay) *observer.ObservedLogs {
	t.Helper()
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	t.Cleanup(cancel)
	if err := r.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = r.Cleanup() })
	core, logs := observer.New(zapcore.DebugLevel)
	r.logger = zap.New(core)
	return logs
}

// serveHandler runs one request through r as Caddy's server would and
// returns the response and the request's replacer.
func serveHandler(t *testing.T, r *Relay, req *http.Request) (*httptest.ResponseRecorder, *caddy.Replacer) {
	t.Helper()
	w := httptest.NewRecorder()
	repl := caddy.NewReplacer()
	req = caddyhttp.PrepareRequest(req, repl, w, &caddyhttp.Server{})
	if err := r.ServeHTTP(w, req, nil); err != nil {
		t.Fatal(err)
	}
	return w, repl
}

func newRequest(body, key string) *http.Request {
	req := httptest.NewRequest(http.MethodPost, "/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", key)
	req.Header.Set("Content-Type", "application/json")
	return req
}

func discardLogger() *zap.Logger { return zap.NewNop() }

// testNow is the fixed clock of the pure tests.
var testNow = time.Date(2025, time.March, 14, 15, 9, 26, 0, time.UTC)

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

// needTool returns the path of a program a test runs. When it is missing
// the test fails under CI=true (CI installs it) and is skipped elsewhere,
// saying how to install it.
func needTool(t *testing.T, name, install string) string {
	t.Helper()
	path, err := exec.LookPath(name)
	if err == nil {
		return path
	}
	if os.Getenv("CI") == "true" {
		t.Fatalf("%s is not installed (CI must have it): %s", name, install)
	}
	t.Skipf("%s is not installed; to run this test: %s", name, install)
	return ""
}

// TestMain runs the tests, then checks an invariant no single test can see:
// every key's, identity's, end user's and channel's in-flight count, kept
// by name across all the configs the tests loaded, is never below zero (a
// slot given back twice).
func TestMain(m *testing.M) {
	// Caddy's storage, where the keys' spend is kept, in a directory of the
	// tests' own rather than the user's
	data, err := os.MkdirTemp("", "caddy-relay-data")
	if err != nil {
		panic(err)
	}
	_ = os.Setenv("XDG_DATA_HOME", data)
	caddy.DefaultStorage = &certmagic.FileStorage{Path: data} // read from the environment before TestMain
	code := m.Run()
	_ = os.RemoveAll(data)
	negative := func(pool *caddy.UsagePool, of func(any) int64) {
		pool.Range(func(k, v any) bool {
			if n := of(v); n < 0 {
				fmt.Fprintf(os.Stderr, "%v: in flight %d after the tests\n", k, n)
				code = 1
			}
			return true
		})
	}
	negative(keyStates, func(v any) int64 {
		st := v.(*keyState)
		least := st.limits.Inflight()
		if c := st.idents.Load(); c != nil { // user *: each identity's own
			c.Each(func(_ string, id *keyState) { least = min(least, id.limits.Inflight()) })
		}
		if c := st.endUsers.Load(); c != nil {
			c.Each(func(_ string, l *limits.Limiter) { least = min(least, l.Inflight()) })
		}
		return least
	})
	negative(channelStates, func(v any) int64 { return v.(*channelHealth).limits.Inflight() })
	os.Exit(code)
}
