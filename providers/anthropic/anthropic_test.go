package anthropic

import (
	"bytes"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/provider"
)

// clientKey is the relay key a client sends, which no upstream may see.
const clientKey = "sk-client-secret-0123456789"

// channel provisions an anthropic channel of url whose key is the fake
// upstream's, with the auth given ("" for the default).
func channel(t *testing.T, name, url, auth string) *Provider {
	t.Setenv("RELAY_TEST_CHANNEL_KEY", fakeupstream.Key)
	p := &Provider{URL: url, APIKey: "{env.RELAY_TEST_CHANNEL_KEY}", Auth: auth}
	providertest.Provision(t, p, name)
	return p
}

func TestClientKeyNeverReachesUpstreamAndHeadersForwarded(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	p := channel(t, "fwd-a", up.URL, "")
	header := http.Header{
		"Authorization":     {"Bearer " + clientKey},
		"X-Api-Key":         {clientKey},
		"Anthropic-Version": {"2023-06-01"},
		"Anthropic-Beta":    {"prompt-caching-2024-07-31"},
		"Content-Type":      {"application/json"},
		"User-Agent":        {"test-agent/1.0"},
		"X-Custom-Secret":   {"private"},
		"Cookie":            {"session=1"},
		"Connection":        {"keep-alive"},
	}
	a := providertest.Send(t, p, providertest.Request{RawQuery: "beta=true", Header: header, Body: providertest.SimpleBody}.Call())
	if a.Status != 200 {
		t.Fatalf("status %d: %s", a.Status, a.Body)
	}
	got := up.Last(t)
	if got.Header.Get("X-Api-Key") != fakeupstream.Key {
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
	if a.Header.Get("Request-Id") != "req_fake" {
		t.Errorf("the upstream's headers were lost: %v", a.Header)
	}

	// a bearer channel sends Authorization: Bearer <channel key>
	bearer := fakeupstream.New(t, fakeupstream.Message("ok"))
	p = channel(t, "fwd-b", bearer.URL, "bearer")
	if a := providertest.Send(t, p, providertest.Request{Header: header, Body: providertest.SimpleBody}.Call()); a.Status != 200 {
		t.Fatalf("bearer channel: %d %s", a.Status, a.Body)
	}
	if got := bearer.Last(t).Header; got.Get("Authorization") != "Bearer "+fakeupstream.Key || got.Get("X-Api-Key") != "" {
		t.Errorf("bearer channel credentials: %v", got)
	}
}

// A channel's key written as a placeholder is resolved when the provider
// is provisioned: the upstream gets the secret.
func TestSecretPlaceholderIsResolved(t *testing.T) {
	secret := "sk-ant-from-env-" + fmt.Sprint(time.Now().UnixNano())
	t.Setenv("RELAY_TEST_CHANNEL_KEY", secret)
	up := fakeupstream.New(t, fakeupstream.Message("ok"), fakeupstream.AcceptKeys(secret))
	p := &Provider{URL: up.URL, APIKey: "{env.RELAY_TEST_CHANNEL_KEY}"}
	providertest.Provision(t, p, "env-a")
	if a := providertest.Send(t, p, providertest.Request{Body: providertest.SimpleBody}.Call()); a.Status != 200 {
		t.Fatalf("status %d %s", a.Status, a.Body)
	}
	if got := up.Last(t).Header.Get("X-Api-Key"); got != secret {
		t.Errorf("upstream key = %q, want the resolved placeholder", got)
	}
}

// Every request the provider builds carries anthropic-version: the
// client's, as sent, or 2023-06-01 when it sent none (an OpenAI client
// knows of no such header). The fake upstream, as strict as the real API,
// refuses a request without it.
func TestEveryRequestCarriesAnAPIVersion(t *testing.T) {
	store := fakeupstream.NewStore("v")
	up := fakeupstream.New(t, store)
	p := channel(t, "version-a", up.URL, "")
	header := func(version, contentType string) http.Header {
		h := http.Header{"X-Api-Key": {clientKey}}
		if contentType != "" {
			h.Set("Content-Type", contentType)
		}
		if version != "" {
			h.Set("Anthropic-Version", version)
		}
		return h
	}
	var upload bytes.Buffer
	mw := multipart.NewWriter(&upload)
	fw, _ := mw.CreateFormFile("file", "a.txt")
	_, _ = io.WriteString(fw, "hello")
	_ = mw.Close()
	batch := `{"requests":[{"custom_id":"one","params":` + providertest.SimpleBody + `}]}`
	cases := []struct {
		name, method, path, version, contentType, body string
	}{
		{"a message", "POST", provider.PathMessages, "", "application/json", providertest.SimpleBody},
		{"a message naming its version", "POST", provider.PathMessages, "2026-10-21", "application/json", providertest.SimpleBody},
		{"a stream", "POST", provider.PathMessages, "", "application/json", providertest.StreamBody},
		{"count_tokens", "POST", provider.PathCountTokens, "", "application/json", `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`},
		{"a batch", "POST", "/v1/messages/batches", "", "application/json", batch},
		{"the batches' list", "GET", "/v1/messages/batches", "", "", ""},
		{"an upload", "POST", "/v1/files", "", mw.FormDataContentType(), upload.String()},
		{"the files' list", "GET", "/v1/files", "", "", ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := up.Hits()
			var status int
			var body []byte
			if c.path == provider.PathMessages || c.path == provider.PathCountTokens {
				a := providertest.Send(t, p, providertest.Request{Path: c.path, Header: header(c.version, c.contentType), Body: c.body}.Call())
				status, body = a.Status, a.Body
			} else {
				rc := &provider.ResourceCall{Channel: "version-a", Method: c.method, Path: c.path, Header: header(c.version, c.contentType), ContentLength: int64(len(c.body))}
				if c.body != "" {
					rc.Body = strings.NewReader(c.body)
				}
				req, err := p.NewResourceRequest(t.Context(), rc)
				if err != nil {
					t.Fatal(err)
				}
				resp, err := http.DefaultClient.Do(req)
				if err != nil {
					t.Fatal(err)
				}
				body, _ = io.ReadAll(resp.Body)
				resp.Body.Close()
				status = resp.StatusCode
			}
			if status != 200 {
				t.Fatalf("%d %s", status, body)
			}
			if up.Hits() == before {
				t.Fatal("the upstream was not asked")
			}
			want := c.version
			if want == "" {
				want = "2023-06-01"
			}
			if got := up.Last(t).Header.Values("Anthropic-Version"); len(got) != 1 || got[0] != want {
				t.Errorf("anthropic-version upstream %q, want %q", got, want)
			}
		})
	}
	if store.Files() != 1 || store.Batches() != 1 {
		t.Errorf("the store holds %d files and %d batches, want 1 and 1", store.Files(), store.Batches())
	}
}
