package vertex

// Provider vertex against a fake Google token endpoint and a fake Vertex
// AI on 127.0.0.1: a test service account signs its token requests with a
// fresh RSA key, the token endpoint verifies the signature, and the fake
// Vertex accepts only the tokens it issued.

import (
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/provider"
)

// clientKey is the relay key a client sends, which no upstream may see.
const clientKey = "sk-client-secret-0123456789"

// modelPath is where the channels' models are: project p, region us-east5.
const modelPath = "/v1/projects/p/locations/us-east5/publishers/anthropic/models/"

// channel provisions a vertex channel of project p in us-east5 at url,
// with the credentials file creds (none when empty).
func channel(t *testing.T, name, url, creds string, opts ...func(*Provider)) *Provider {
	p := &Provider{Project: "p", Region: "us-east5", URL: url, CredentialsFile: creds}
	for _, o := range opts {
		o(p)
	}
	providertest.Provision(t, p, name)
	return p
}

func TestVertexRelaysMessagesStreamsAndCountsTokens(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	u := fakeupstream.Usage{InputTokens: 11, OutputTokens: 7, CacheReadInputTokens: 3}
	events := fakeupstream.StreamEvents("claude-sonnet-4-5@20250929", u, "Hel", "lo")
	vertex := providertest.NewFakeVertex(t, g, func(w http.ResponseWriter, r *http.Request) {
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
	p := channel(t, "vx-main", vertex.URL, g.ServiceAccountFile(t), func(p *Provider) { p.StripFields = []string{"service_tier"} })
	if n := g.Hits.Load(); n != 0 {
		t.Fatalf("provisioning fetched %d tokens; it must fetch none (caddy validate runs offline)", n)
	}
	const model = "claude-sonnet-4-5@20250929"

	// non-streaming: the model moves into the URL, service_tier leaves (the
	// channel strips it), anthropic_version joins, every other byte stays
	body := `{"model":"claude-sonnet-4-5","max_tokens":16,"service_tier":"auto","messages":[{"role":"user","content":[{"type":"text","text":"Hi é","cache_control":{"type":"ephemeral"}}]}],"tools":[{"name":"t","input_schema":{"type":"object","n":[1,2.50, 3e0]}}]}`
	header := http.Header{"Anthropic-Version": {"2023-06-01"}, "Anthropic-Beta": {"a-2025-01-01, b-2025-02-02"}, "X-Api-Key": {clientKey}}
	a := providertest.Send(t, p, providertest.Request{RawQuery: "beta=true", Header: header, Model: model, Body: body}.Call())
	if a.Status != 200 || !strings.Contains(string(a.Body), `"text":"hi"`) {
		t.Fatalf("non-streaming: %d %s", a.Status, a.Body)
	}
	got := vertex.Last(t)
	if want := modelPath + model + ":rawPredict"; got.Path != want || got.RawQuery != "" {
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

	// streaming: stream stays in the body, the SSE comes back as sent
	a = providertest.Send(t, p, providertest.Request{Model: model,
		Body: `{"model":"claude-sonnet-4-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`}.Call())
	if want := strings.Join(events, ""); a.Status != 200 || string(a.Body) != want {
		t.Fatalf("stream: %d\n got %q\nwant %q", a.Status, a.Body, want)
	}
	got = vertex.Last(t)
	if want := modelPath + model + ":streamRawPredict"; got.Path != want {
		t.Errorf("stream path %s, want %s", got.Path, want)
	}
	if want := `{"max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2023-10-16"}`; string(got.Body) != want {
		t.Errorf("stream body\n got %s\nwant %s", got.Body, want)
	}

	// count tokens: count-tokens:rawPredict, the (mapped) model in the body
	a = providertest.Send(t, p, providertest.Request{Path: provider.PathCountTokens, Model: model,
		Body: `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`}.Call())
	if a.Status != 200 || string(a.Body) != `{"input_tokens":42}` {
		t.Fatalf("count_tokens: %d %s", a.Status, a.Body)
	}
	got = vertex.Last(t)
	if got.Path != modelPath+"count-tokens:rawPredict" ||
		string(got.Body) != `{"model":"claude-sonnet-4-5@20250929","messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2023-10-16"}` {
		t.Errorf("count tokens upstream: %s %s", got.Path, got.Body)
	}

	// one token served all three requests
	if n := g.Hits.Load(); n != 1 {
		t.Errorf("token endpoint hits = %d, want 1", n)
	}
}

func TestVertexBetaAllowListAndModelAliases(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	vertex := providertest.NewFakeVertex(t, g, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, "/count-tokens:rawPredict") {
			fakeupstream.Raw(200, []byte(`{"input_tokens":7}`))(w, r)
			return
		}
		fakeupstream.Message("ok")(w, r)
	})
	p := channel(t, "vx-beta", vertex.URL, g.ServiceAccountFile(t), func(p *Provider) {
		p.Betas = []string{"context-1m-2025-08-07", "interleaved-thinking-2025-05-14"}
		p.AnthropicVersion = "vertex-2099-01-01"
		p.StripFields = []string{"metadata"}
	})
	const model = "claude-sonnet-4-6@default"

	// a flag the channel's betas do not list is not dropped: no request
	// carrying it is sent to the channel
	for name, want := range map[string]provider.Support{
		"unknown-2030-01-01":              provider.Unsupported,
		"interleaved-thinking-2025-05-14": provider.Supported,
		"context-1m-2025-08-07":           provider.Supported,
	} {
		if got := p.Supports(name); got != want {
			t.Errorf("Supports(%q) = %v, want %v", name, got, want)
		}
	}
	body := `{"model":"claude-sonnet-4-6","max_tokens":16,"metadata":{"user_id":"u"},"messages":[{"role":"user","content":"Hi"}]}`
	header := http.Header{"Anthropic-Version": {"2023-06-01"}, "Anthropic-Beta": {"interleaved-thinking-2025-05-14,context-1m-2025-08-07"}}
	if a := providertest.Send(t, p, providertest.Request{Header: header, Model: model, Body: body}.Call()); a.Status != 200 {
		t.Fatalf("status %d: %s", a.Status, a.Body)
	}
	got := vertex.Last(t)
	if got.Header.Get("Anthropic-Beta") != "interleaved-thinking-2025-05-14,context-1m-2025-08-07" {
		t.Errorf("anthropic-beta upstream = %q, want the client's flags", got.Header.Get("Anthropic-Beta"))
	}
	if got.Path != modelPath+"claude-sonnet-4-6@default:rawPredict" ||
		string(got.Body) != `{"max_tokens":16,"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2099-01-01"}` {
		t.Errorf("upstream got %s %s", got.Path, got.Body)
	}

	// no flag: no header at all
	if a := providertest.Send(t, p, providertest.Request{Model: model, Body: body}.Call()); a.Status != 200 {
		t.Fatalf("status %d: %s", a.Status, a.Body)
	}
	if h := vertex.Last(t).Header; h.Values("Anthropic-Beta") != nil {
		t.Errorf("anthropic-beta upstream = %q, want none", h.Values("Anthropic-Beta"))
	}

	// count-tokens refuses the @default alias: the dated model name without it
	a := providertest.Send(t, p, providertest.Request{Path: provider.PathCountTokens, Model: model,
		Body: `{"model":"claude-sonnet-4-6","messages":[{"role":"user","content":"Hi"}]}`}.Call())
	if a.Status != 200 || string(a.Body) != `{"input_tokens":7}` {
		t.Fatalf("count_tokens: %d %s", a.Status, a.Body)
	}
	if got := vertex.Last(t); string(got.Body) != `{"model":"claude-sonnet-4-6","messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2099-01-01"}` {
		t.Errorf("count tokens body %s", got.Body)
	}
}

func TestVertexErrorsMapOntoAnthropicErrors(t *testing.T) {
	for _, c := range providertest.VertexErrors {
		t.Run(c.Name, func(t *testing.T) {
			out, err := (&Provider{}).Response(c.Response(), &provider.Call{Path: provider.PathMessages})
			if err != nil {
				t.Fatal(err)
			}
			c.Check(t, out)
		})
	}

	// a success passes untouched, body unread
	ok := &http.Response{StatusCode: 200, Body: io.NopCloser(strings.NewReader("event: ping\n\n"))}
	if resp, err := (&Provider{}).Response(ok, nil); err != nil || resp != ok {
		t.Errorf("2xx replaced: %v", err)
	}
}

func TestVertexTokenIsFetchedOnceAndRefreshedBeforeExpiry(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	vertex := providertest.NewFakeVertex(t, g, fakeupstream.Message("ok"))
	creds := g.ServiceAccountFile(t)
	once := channel(t, "vx-once", vertex.URL, creds)
	refresh := channel(t, "vx-refresh", vertex.URL, creds)
	send := func(p *Provider) error {
		a, err := providertest.Do(t, p, providertest.Request{Model: "claude-sonnet-4-5", Body: providertest.SimpleBody}.Call())
		if err == nil && a.Status != 200 {
			err = fmt.Errorf("status %d: %s", a.Status, a.Body)
		}
		return err
	}

	// concurrent first requests share one synchronous fetch; later ones read
	// the cached token
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for range 8 {
		wg.Go(func() {
			if err := send(once); err != nil {
				errs <- err
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if err := send(once); err != nil {
		t.Fatal(err)
	}
	if n := g.Hits.Load(); n != 1 {
		t.Fatalf("token endpoint hits = %d after 9 requests, want 1", n)
	}

	// a short-lived token is replaced in the background, before it expires
	g.ExpiresIn.Store(2)
	if err := send(refresh); err != nil {
		t.Fatal(err)
	}
	first := vertex.Last(t).Header.Get("Authorization")
	if first != "Bearer ya29.test-2" {
		t.Fatalf("first token of vx-refresh: %q", first)
	}
	g.AwaitHit(t, 3) // the refresher's, with no request waiting on it
	// the refreshed token is current once the refresher has read the
	// endpoint's answer: a request sent meanwhile still carries the old
	// one, which is still usable
	var n int
	var got string
	for deadline := time.Now().Add(time.Second); ; time.Sleep(10 * time.Millisecond) {
		if err := send(refresh); err != nil {
			t.Fatal(err)
		}
		// ya29.test-3, or a later one if the refresher went on meanwhile
		got = vertex.Last(t).Header.Get("Authorization")
		if _, err := fmt.Sscanf(got, "Bearer ya29.test-%d", &n); err == nil && n >= 3 || time.Now().After(deadline) {
			break
		}
	}
	if n < 3 {
		t.Errorf("after the refresh the request carried %q, want the refreshed Bearer ya29.test-3", got)
	}
}

// Without a credentials file or application default credentials, the
// config loads (the relay fails such a channel's requests over), and each
// request fails, saying what is missing, before anything reaches Vertex.
func TestVertexWithoutCredentials(t *testing.T) {
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", filepath.Join(t.TempDir(), "missing.json"))
	t.Setenv("HOME", t.TempDir())
	vertex := fakeupstream.New(t, fakeupstream.Message("vertex must not be reached"))
	p := channel(t, "vx-adc", vertex.URL, "")
	_, err := providertest.Do(t, p, providertest.Request{Model: "claude-sonnet-4-5", Body: providertest.SimpleBody}.Call())
	if err == nil || !strings.Contains(err.Error(), "credentials") || !strings.Contains(err.Error(), "application default credentials were not found") {
		t.Errorf("the reason does not say what is missing: %v", err)
	}
	if vertex.Hits() != 0 {
		t.Errorf("a request without a token reached Vertex")
	}
}

func TestVertexTokenRefusalNamesNoKeyMaterial(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	g.Refuse.Store(true)
	vertex := providertest.NewFakeVertex(t, g, fakeupstream.Message("unreachable"))
	p := channel(t, "vx-refused", vertex.URL, g.ServiceAccountFile(t))

	_, err := providertest.Do(t, p, providertest.Request{Model: "claude-sonnet-4-5", Body: providertest.SimpleBody}.Call())
	if err == nil || !strings.Contains(err.Error(), "token endpoint refused the credentials: 400 Bad Request: invalid_grant: Invalid JWT Signature.") {
		t.Fatalf("reason: %v", err)
	}
	keyLines := strings.Split(strings.TrimSpace(g.KeyPEM), "\n")
	for _, secret := range []string{"PRIVATE KEY", keyLines[1], keyLines[len(keyLines)-2], "eyJ"} {
		if strings.Contains(err.Error(), secret) {
			t.Errorf("the error shows key material or the assertion (%q)", secret)
		}
	}
	if vertex.Hits() != 0 {
		t.Errorf("a request without a token reached Vertex")
	}
}
