package relay

// Vertex channels against a fake Google token endpoint and a fake Vertex
// AI on 127.0.0.1: a test service account signs its token requests with a
// fresh RSA key, the token endpoint verifies the signature, and the fake
// Vertex accepts only the tokens it issued.

import (
	"crypto"
	"crypto/rand"
	"crypto/rsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/providers/vertex"
	"github.com/tidwall/gjson"
)

const vertexTestEmail = "relay-test@p.iam.gserviceaccount.com"

// fakeGoogle is Google's OAuth2 token endpoint for one test service account.
type fakeGoogle struct {
	*httptest.Server
	key       *rsa.PrivateKey
	keyPEM    string
	expiresIn atomic.Int64 // seconds, for the tokens to come
	refuse    atomic.Bool  // answer 400 invalid_grant
	hits      atomic.Int64
	hit       chan int64 // the number of each hit, as it is answered

	mu     sync.Mutex
	issued map[string]bool
	errs   []string
}

func newFakeGoogle(t *testing.T, expiresIn int64) *fakeGoogle {
	t.Helper()
	key, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	g := &fakeGoogle{key: key, hit: make(chan int64, 64), issued: map[string]bool{},
		keyPEM: string(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}))}
	g.expiresIn.Store(expiresIn)
	g.Server = httptest.NewServer(http.HandlerFunc(g.serve))
	t.Cleanup(g.Close)
	t.Cleanup(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		for _, e := range g.errs {
			t.Errorf("token endpoint: %s", e)
		}
	})
	return g
}

func (g *fakeGoogle) tokenURL() string { return g.URL + "/token" }

// serve answers a JWT-bearer token request whose assertion the service
// account's key signed.
func (g *fakeGoogle) serve(w http.ResponseWriter, r *http.Request) {
	n := g.hits.Add(1)
	if err := g.verify(r); err != nil {
		g.mu.Lock()
		g.errs = append(g.errs, err.Error())
		g.mu.Unlock()
		http.Error(w, `{"error":"invalid_request"}`, http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	if g.refuse.Load() {
		w.WriteHeader(http.StatusBadRequest)
		_, _ = io.WriteString(w, `{"error":"invalid_grant","error_description":"Invalid JWT Signature."}`)
		g.signal(n)
		return
	}
	tok := fmt.Sprintf("ya29.test-%d", n)
	g.mu.Lock()
	g.issued[tok] = true
	g.mu.Unlock()
	_, _ = fmt.Fprintf(w, `{"access_token":%q,"expires_in":%d,"token_type":"Bearer"}`, tok, g.expiresIn.Load())
	g.signal(n)
}

// signal reports hit n, never blocking: a refresher may go on fetching
// after its test stopped listening.
func (g *fakeGoogle) signal(n int64) {
	select {
	case g.hit <- n:
	default:
	}
}

func (g *fakeGoogle) verify(r *http.Request) error {
	if r.Method != http.MethodPost || r.URL.Path != "/token" {
		return fmt.Errorf("%s %s, want POST /token", r.Method, r.URL.Path)
	}
	if err := r.ParseForm(); err != nil {
		return err
	}
	if gt := r.PostForm.Get("grant_type"); gt != "urn:ietf:params:oauth:grant-type:jwt-bearer" {
		return fmt.Errorf("grant_type %q", gt)
	}
	parts := strings.Split(r.PostForm.Get("assertion"), ".")
	if len(parts) != 3 {
		return fmt.Errorf("assertion is not a JWT")
	}
	var header struct{ Alg, Typ string }
	var claims struct {
		Iss, Scope, Aud string
		Iat, Exp        int64
	}
	for i, dst := range []any{&header, &claims} {
		raw, err := base64.RawURLEncoding.DecodeString(parts[i])
		if err != nil {
			return fmt.Errorf("JWT part %d: %v", i, err)
		}
		if err := json.Unmarshal(raw, dst); err != nil {
			return fmt.Errorf("JWT part %d: %v", i, err)
		}
	}
	sig, err := base64.RawURLEncoding.DecodeString(parts[2])
	if err != nil {
		return fmt.Errorf("JWT signature: %v", err)
	}
	digest := sha256.Sum256([]byte(parts[0] + "." + parts[1]))
	if header.Alg != "RS256" || rsa.VerifyPKCS1v15(&g.key.PublicKey, crypto.SHA256, digest[:], sig) != nil {
		return fmt.Errorf("JWT signature does not verify with the service account's key (alg %q)", header.Alg)
	}
	if claims.Iss != vertexTestEmail || claims.Aud != g.tokenURL() || claims.Scope != "https://www.googleapis.com/auth/cloud-platform" {
		return fmt.Errorf("JWT claims %+v", claims)
	}
	if now := time.Now().Unix(); claims.Exp <= now || claims.Iat > now+5 {
		return fmt.Errorf("JWT times iat %d exp %d, now %d", claims.Iat, claims.Exp, now)
	}
	return nil
}

// valid reports whether the token endpoint issued token.
func (g *fakeGoogle) valid(token string) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.issued[token]
}

// awaitHit waits for the token endpoint's hit number n.
func (g *fakeGoogle) awaitHit(t *testing.T, n int64) {
	t.Helper()
	timeout := time.After(20 * time.Second)
	for {
		select {
		case got := <-g.hit:
			if got >= n {
				return
			}
		case <-timeout:
			t.Fatalf("the token endpoint got no request #%d (hits: %d)", n, g.hits.Load())
		}
	}
}

// serviceAccountFile writes the test service account's key file, its
// token_uri pointing at g.
func (g *fakeGoogle) serviceAccountFile(t *testing.T) string {
	t.Helper()
	b, _ := json.Marshal(map[string]string{
		"type": "service_account", "project_id": "p", "private_key_id": "key-1", "private_key": g.keyPEM,
		"client_email": vertexTestEmail, "client_id": "1", "token_uri": g.tokenURL(),
	})
	path := filepath.Join(t.TempDir(), "sa.json")
	if err := os.WriteFile(path, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// fakeVertex answers for h, after checking the bearer token as Vertex
// would: one the token endpoint issued, or a Google-shaped 401.
func fakeVertex(t *testing.T, g *fakeGoogle, h http.HandlerFunc) *fakeupstream.Upstream {
	return fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); !ok || !g.valid(tok) {
			fakeupstream.Raw(401, []byte(`{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}`))(w, r)
			return
		}
		h(w, r)
	}))
}

// googleError answers with a Google platform error, wrapped in an array as
// Vertex sometimes sends it when wrapped is true.
func googleError(code int, status, msg string, wrapped bool) http.HandlerFunc {
	b := fmt.Sprintf(`{"error":{"code":%d,"message":%q,"status":%q}}`, code, msg, status)
	if wrapped {
		b = "[" + b + "]"
	}
	return fakeupstream.Raw(code, []byte(b))
}

// vertexBlock renders a vertex channel block: project p, region us-east5,
// the credentials file (none when empty) and url.
func vertexBlock(name, url, creds string, opts ...string) string {
	lines := []string{"provider vertex", "project p", "region us-east5", "url " + url}
	if creds != "" {
		lines = append(lines, "credentials_file "+creds)
	}
	return fmt.Sprintf("\t\tchannel %s {\n\t\t\t%s\n\t\t}\n", name, strings.Join(append(lines, opts...), "\n\t\t\t"))
}

const vertexModelPath = "/v1/projects/p/locations/us-east5/publishers/anthropic/models/"

func TestVertexRelaysMessagesStreamsAndCountsTokens(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	u := fakeupstream.Usage{InputTokens: 11, OutputTokens: 7, CacheReadInputTokens: 3}
	events := fakeupstream.StreamEvents("claude-sonnet-4-5@20250929", u, "Hel", "lo")
	vertex := fakeVertex(t, g, func(w http.ResponseWriter, r *http.Request) {
		switch {
		case strings.HasSuffix(r.URL.Path, "/count-tokens:rawPredict"):
			fakeupstream.Raw(200, []byte(`{"input_tokens":42}`))(w, r)
		case strings.HasSuffix(r.URL.Path, ":streamRawPredict"):
			fakeupstream.Stream(events...)(w, r)
		default:
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(fakeupstream.MessageBody("claude-sonnet-4-5@20250929", "hi", fakeupstream.Usage{InputTokens: 10, OutputTokens: 5}))
		}
	})
	startRelay(t, vertexBlock("vx-main", vertex.URL, g.serviceAccountFile(t),
		"models claude-sonnet-4-5=claude-sonnet-4-5@20250929", "strip service_tier")+keyAndGroup("vx", "vx-main"))
	if n := g.hits.Load(); n != 0 {
		t.Fatalf("provisioning fetched %d tokens; it must fetch none (caddy validate runs offline)", n)
	}
	tokens := func(kind string) float64 {
		mf, _ := scrape(t)
		return max(value(mf, "relay_tokens_total", "group=vx", "channel=vx-main", "model=claude-sonnet-4-5", "kind="+kind), 0)
	}
	before := map[string]float64{"input": tokens("input"), "output": tokens("output"), "cache_read": tokens("cache_read")}

	// non-streaming: the model moves into the URL, service_tier leaves (the
	// channel strips it), anthropic_version joins, every other byte stays
	body := `{"model":"claude-sonnet-4-5","max_tokens":16,"service_tier":"auto","messages":[{"role":"user","content":[{"type":"text","text":"Hi é","cache_control":{"type":"ephemeral"}}]}],"tools":[{"name":"t","input_schema":{"type":"object","n":[1,2.50, 3e0]}}]}`
	r := send(t, http.MethodPost, "/v1/messages?beta=true", clientKey, body, "Anthropic-Beta", "a-2025-01-01, b-2025-02-02")
	if r.status != 200 || !strings.Contains(string(r.body), `"text":"hi"`) {
		t.Fatalf("non-streaming: %d %s", r.status, r.body)
	}
	got := vertex.Last(t)
	if want := vertexModelPath + "claude-sonnet-4-5@20250929:rawPredict"; got.Path != want || got.RawQuery != "" {
		t.Errorf("path %s?%s, want %s without a query", got.Path, got.RawQuery, want)
	}
	if want := `{"max_tokens":16,"messages":[{"role":"user","content":[{"type":"text","text":"Hi é","cache_control":{"type":"ephemeral"}}]}],"tools":[{"name":"t","input_schema":{"type":"object","n":[1,2.50, 3e0]}}],"anthropic_version":"vertex-2023-10-16"}`; string(got.Body) != want {
		t.Errorf("upstream body\n got %s\nwant %s", got.Body, want)
	}
	if got.Header.Get("Authorization") != "Bearer ya29.test-1" || got.Header.Get("X-Api-Key") != "" {
		t.Errorf("credentials upstream: Authorization %q, X-Api-Key %q", got.Header.Get("Authorization"), got.Header.Get("X-Api-Key"))
	}
	if got.Header.Get("Anthropic-Beta") != "a-2025-01-01,b-2025-02-02" || got.Header.Get("Anthropic-Version") != "2023-06-01" {
		t.Errorf("anthropic headers upstream: %v", got.Header)
	}
	for k, vs := range got.Header {
		if strings.Contains(strings.Join(vs, " "), clientKey) {
			t.Errorf("the client's key reached Vertex in %s", k)
		}
	}

	// streaming: stream stays in the body, the SSE reaches the client as sent
	r = message(t, `{"model":"claude-sonnet-4-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`)
	if want := strings.Join(events, ""); r.status != 200 || string(r.body) != want {
		t.Fatalf("stream: %d\n got %q\nwant %q", r.status, r.body, want)
	}
	got = vertex.Last(t)
	if want := vertexModelPath + "claude-sonnet-4-5@20250929:streamRawPredict"; got.Path != want {
		t.Errorf("stream path %s, want %s", got.Path, want)
	}
	if want := `{"max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2023-10-16"}`; string(got.Body) != want {
		t.Errorf("stream body\n got %s\nwant %s", got.Body, want)
	}

	// count tokens: count-tokens:rawPredict, the (mapped) model in the body
	r = send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || string(r.body) != `{"input_tokens":42}` {
		t.Fatalf("count_tokens: %d %s", r.status, r.body)
	}
	got = vertex.Last(t)
	if got.Path != vertexModelPath+"count-tokens:rawPredict" ||
		string(got.Body) != `{"model":"claude-sonnet-4-5@20250929","messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2023-10-16"}` {
		t.Errorf("count tokens upstream: %s %s", got.Path, got.Body)
	}

	// one token served all three requests
	if n := g.hits.Load(); n != 1 {
		t.Errorf("token endpoint hits = %d, want 1", n)
	}
	for kind, want := range map[string]float64{"input": 10 + 11, "output": 5 + 7, "cache_read": 3} {
		if v := tokens(kind) - before[kind]; v != want {
			t.Errorf("relay_tokens_total{kind=%s} grew by %v, want %v", kind, v, want)
		}
	}
}

func TestVertexBetaAllowListAndModelAliases(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	vertex := fakeVertex(t, g, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/count-tokens:rawPredict") {
			fakeupstream.Raw(200, []byte(`{"input_tokens":7}`))(w, r)
			return
		}
		fakeupstream.Message("ok")(w, r)
	})
	startRelay(t, vertexBlock("vx-beta", vertex.URL, g.serviceAccountFile(t),
		"models claude-sonnet-4-6=claude-sonnet-4-6@default", "betas context-1m-2025-08-07 interleaved-thinking-2025-05-14",
		"anthropic_version vertex-2099-01-01", "strip_fields metadata")+keyAndGroup("vx-beta", "vx-beta"))

	body := `{"model":"claude-sonnet-4-6","max_tokens":16,"metadata":{"user_id":"u"},"messages":[{"role":"user","content":"Hi"}]}`
	// a flag the channel's betas do not list is not dropped: the request
	// cannot be served as sent
	r := message(t, body, "Anthropic-Beta", "interleaved-thinking-2025-05-14,unknown-2030-01-01,context-1m-2025-08-07")
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	if !strings.Contains(gjson.GetBytes(r.body, "error.message").String(), "unknown-2030-01-01") || vertex.Hits() != 0 {
		t.Fatalf("the error should name the flag, and nothing reach Vertex: %s (%d hits)", r.body, vertex.Hits())
	}
	if r := message(t, body, "Anthropic-Beta", "interleaved-thinking-2025-05-14,context-1m-2025-08-07"); r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	got := vertex.Last(t)
	if got.Header.Get("Anthropic-Beta") != "interleaved-thinking-2025-05-14,context-1m-2025-08-07" {
		t.Errorf("anthropic-beta upstream = %q, want the client's flags", got.Header.Get("Anthropic-Beta"))
	}
	if got.Path != vertexModelPath+"claude-sonnet-4-6@default:rawPredict" ||
		string(got.Body) != `{"max_tokens":16,"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2099-01-01"}` {
		t.Errorf("upstream got %s %s", got.Path, got.Body)
	}

	// no flag: no header at all
	if r := message(t, body); r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	if h := vertex.Last(t).Header; h.Values("Anthropic-Beta") != nil {
		t.Errorf("anthropic-beta upstream = %q, want none", h.Values("Anthropic-Beta"))
	}

	// count-tokens refuses the @default alias: the dated model name without it
	r = send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-6","messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || string(r.body) != `{"input_tokens":7}` {
		t.Fatalf("count_tokens: %d %s", r.status, r.body)
	}
	if got := vertex.Last(t); string(got.Body) != `{"model":"claude-sonnet-4-6","messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2099-01-01"}` {
		t.Errorf("count tokens body %s", got.Body)
	}
}

func TestVertexErrorsMapOntoAnthropicErrors(t *testing.T) {
	const quota = "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model with base model: anthropic-claude-sonnet-4-5."
	anthropic529 := string(fakeupstream.ErrorBody("overloaded_error", "Overloaded"))
	for _, c := range []struct {
		name    string
		status  int
		body    string
		want    int
		typ     string
		outcome outcome
		msg     string // in the message; empty: the body passes unchanged
	}{
		{"resource exhausted", 429, `{"error":{"code":429,"message":"` + quota + `","status":"RESOURCE_EXHAUSTED"}}`, 429, "rate_limit_error", outcomeRateLimited, "vertex: RESOURCE_EXHAUSTED: " + quota},
		{"resource exhausted in an array", 429, `[{"error":{"code":429,"message":"` + quota + `","status":"RESOURCE_EXHAUSTED"}}]`, 429, "rate_limit_error", outcomeRateLimited, "vertex: RESOURCE_EXHAUSTED: " + quota},
		{"unavailable", 503, `{"error":{"code":503,"message":"The service is currently unavailable.","status":"UNAVAILABLE"}}`, 529, "overloaded_error", outcomeOverloaded, "vertex: UNAVAILABLE: The service is currently unavailable."},
		{"deadline exceeded", 504, `{"error":{"code":504,"message":"Deadline expired","status":"DEADLINE_EXCEEDED"}}`, 504, "timeout_error", outcomeTransient, "vertex: DEADLINE_EXCEEDED: Deadline expired"},
		{"internal", 500, `{"error":{"code":500,"message":"Internal error encountered.","status":"INTERNAL"}}`, 500, "api_error", outcomeTransient, "vertex: INTERNAL: Internal error encountered."},
		{"unknown", 500, `{"error":{"code":500,"message":"?","status":"UNKNOWN"}}`, 500, "api_error", outcomeTransient, "vertex: UNKNOWN: ?"},
		{"invalid argument", 400, `{"error":{"code":400,"message":"Invalid JSON payload","status":"INVALID_ARGUMENT"}}`, 400, "invalid_request_error", outcomeClientError, "vertex: INVALID_ARGUMENT: Invalid JSON payload"},
		{"out of range", 400, `{"error":{"code":400,"message":"max_tokens too large","status":"OUT_OF_RANGE"}}`, 400, "invalid_request_error", outcomeClientError, "vertex: OUT_OF_RANGE: max_tokens too large"},
		{"not found", 404, `{"error":{"code":404,"message":"Publisher Model was not found","status":"NOT_FOUND"}}`, 404, "not_found_error", outcomeClientError, "vertex: NOT_FOUND: Publisher Model was not found"},
		{"unauthenticated", 401, `{"error":{"code":401,"message":"Request had invalid authentication credentials.","status":"UNAUTHENTICATED"}}`, 401, "authentication_error", outcomeAuth, "vertex: UNAUTHENTICATED: Request had invalid authentication credentials."},
		{"permission denied", 403, `{"error":{"code":403,"message":"Permission 'aiplatform.endpoints.predict' denied","status":"PERMISSION_DENIED"}}`, 403, "permission_error", outcomeAuth, "vertex: PERMISSION_DENIED: Permission 'aiplatform.endpoints.predict' denied"},
		{"model not enabled", 400, `{"error":{"code":400,"message":"Project p is not allowed to use Publisher Model claude","status":"FAILED_PRECONDITION"}}`, 403, "permission_error", outcomeAuth, "vertex: FAILED_PRECONDITION: Project p is not allowed to use Publisher Model claude"},
		{"other status by HTTP status", 409, `{"error":{"code":409,"message":"aborted","status":"ABORTED"}}`, 409, "invalid_request_error", outcomeClientError, "vertex: ABORTED: aborted"},
		{"not JSON", 502, "<html>\n<b>Bad   Gateway</b></html>", 502, "api_error", outcomeTransient, "vertex: HTTP 502 Bad Gateway: <html> <b>Bad Gateway</b></html>"},
		{"anthropic 529 as is", 529, anthropic529, 529, "overloaded_error", outcomeOverloaded, ""},
		{"anthropic 400 as is", 400, string(fakeupstream.ErrorBody("invalid_request_error", "messages: required")), 400, "invalid_request_error", outcomeClientError, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			in := &http.Response{StatusCode: c.status, Status: fmt.Sprint(c.status), Header: http.Header{"Retry-After": {"7"}, "Content-Type": {"application/json"}},
				Body: io.NopCloser(strings.NewReader(c.body))}
			resp, err := (&vertex.Provider{}).Response(in, nil)
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != c.want {
				t.Errorf("status %d, want %d", resp.StatusCode, c.want)
			}
			var e struct {
				Type  string `json:"type"`
				Error struct{ Type, Message string }
			}
			if err := json.Unmarshal(body, &e); err != nil || e.Type != "error" || e.Error.Type != c.typ {
				t.Errorf("body %s: want an Anthropic %s (%v)", body, c.typ, err)
			}
			if c.msg == "" && string(body) != c.body {
				t.Errorf("body changed: %s", body)
			}
			if c.msg != "" && e.Error.Message != c.msg {
				t.Errorf("message %q, want %q", e.Error.Message, c.msg)
			}
			if resp.Header.Get("Retry-After") != "7" {
				t.Errorf("upstream headers lost: %v", resp.Header)
			}
			v := classifyStatus(resp.StatusCode, resp.Header, body, time.Now())
			if v.outcome != c.outcome {
				t.Errorf("classified %s, want %s", v.outcome, c.outcome)
			}
		})
	}

	// a success passes untouched, body unread
	ok := &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader("event: ping\n\n"))}
	if resp, err := (&vertex.Provider{}).Response(ok, nil); err != nil || resp != ok {
		t.Errorf("2xx replaced: %v", err)
	}
}

func TestVertexErrorsFailOverAndCool(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	creds := g.serviceAccountFile(t)
	quota := fakeVertex(t, g, googleError(429, "RESOURCE_EXHAUSTED", "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model", true))
	denied := fakeVertex(t, g, googleError(403, "PERMISSION_DENIED", "Permission 'aiplatform.endpoints.predict' denied on resource", false))
	invalid := fakeVertex(t, g, googleError(400, "INVALID_ARGUMENT", "messages.0.content: required", false))
	good := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, vertexBlock("vx-err-a", quota.URL, creds, "priority 1")+channelBlock("vx-err-b", good.URL, "priority 2")+
		vertexBlock("vx-err-c", denied.URL, creds, "priority 1")+channelBlock("vx-err-d", good.URL, "priority 2")+
		vertexBlock("vx-err-e", invalid.URL, creds)+
		keyAndGroup("vx-err", "vx-err-a vx-err-b")+
		"\t\tkey sk-vx-denied-0123456789 vx-denied\n\t\tgroup vx-denied {\n\t\t\tchannels vx-err-c vx-err-d\n\t\t}\n"+
		"\t\tkey sk-vx-invalid-0123456789 vx-invalid\n\t\tgroup vx-invalid {\n\t\t\tchannels vx-err-e\n\t\t}\n")

	// RESOURCE_EXHAUSTED: a rate limit; fail over and cool the channel
	r := message(t, simpleBody)
	if r.status != 200 || !strings.Contains(string(r.body), "from anthropic") {
		t.Fatalf("failover: %d %s", r.status, r.body)
	}
	if quota.Hits() != 1 {
		t.Errorf("vertex hits %d, want 1", quota.Hits())
	}
	if st := channels(t)["vx-err-a"]; st.State != stateCooldown || st.LastError != "rate_limited" || st.CooldownUntil == nil {
		t.Errorf("vx-err-a after RESOURCE_EXHAUSTED: %+v", st)
	}

	// PERMISSION_DENIED: the model's refusal (the URL names it); fail over,
	// set the model aside for capability_ttl, never cool the channel
	r = send(t, http.MethodPost, "/v1/messages", "sk-vx-denied-0123456789", simpleBody)
	if r.status != 200 || !strings.Contains(string(r.body), "from anthropic") {
		t.Fatalf("failover: %d %s", r.status, r.body)
	}
	if st := channels(t)["vx-err-c"]; st.State != stateHealthy || st.LastError != "model_refused" || st.CooldownUntil != nil ||
		time.Until(st.RefusedModels["claude-sonnet-4-5"]) < 59*time.Minute {
		t.Errorf("vx-err-c after PERMISSION_DENIED: %+v", st)
	}

	// INVALID_ARGUMENT: the request's fault; the client gets an Anthropic 400
	r = send(t, http.MethodPost, "/v1/messages", "sk-vx-invalid-0123456789", simpleBody)
	var e struct {
		Type  string
		Error struct{ Type, Message string }
	}
	if err := json.Unmarshal(r.body, &e); err != nil || r.status != 400 || e.Type != "error" || e.Error.Type != "invalid_request_error" ||
		e.Error.Message != "vertex: INVALID_ARGUMENT: messages.0.content: required" {
		t.Errorf("invalid argument reached the client as %d %s", r.status, r.body)
	}
	if st := channels(t)["vx-err-e"]; st.State != stateHealthy {
		t.Errorf("vx-err-e after a client error: %+v", st)
	}
}

func TestARefusedModelIsSetAsideAloneOnVertex(t *testing.T) {
	g := newFakeGoogle(t, 3600)
	vx := fakeVertex(t, g, byModel("claude-opus", googleError(400, "FAILED_PRECONDITION",
		"Publisher Model `projects/p/locations/us-east5/publishers/anthropic/models/claude-opus-4-1` is not enabled for this project.", false)))
	fallback := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, vertexBlock("hostile-vx", vx.URL, g.serviceAccountFile(t), "priority 1")+channelBlock("hostile-vx-fallback", fallback.URL, "priority 2")+
		keyAndGroup("hostile-vx", "hostile-vx hostile-vx-fallback", "expose_channel"))
	r := message(t, `{"model":"claude-opus-4-1","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-vx-fallback" {
		t.Fatalf("a model not enabled for the project should fail over: %d %s", r.status, r.body)
	}
	st := channels(t)["hostile-vx"]
	if _, ok := st.RefusedModels["claude-opus-4-1"]; st.State != stateHealthy || st.CooldownUntil != nil || !ok {
		t.Errorf("FAILED_PRECONDITION must set the model aside, not cool the channel: %+v", st)
	}
	if r := message(t, simpleBody); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-vx" {
		t.Errorf("another model should still be served by the channel: %d via %q", r.status, r.header.Get("X-Relay-Channel"))
	}
}
