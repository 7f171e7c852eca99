package relay

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
)

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

func TestSecretPlaceholderStaysOutOfConfig(t *testing.T) {
	secret := "sk-ant-from-env-" + fmt.Sprint(time.Now().UnixNano())
	t.Setenv("RELAY_TEST_CHANNEL_KEY", secret)
	t.Setenv("RELAY_TEST_CLIENT_KEY", clientKey)
	up := fakeupstream.New(t, fakeupstream.Message("ok"), fakeupstream.AcceptKeys(secret))
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

// Every request the relay builds for an Anthropic-wire upstream carries
// anthropic-version: the client's, as sent, or 2023-06-01 when it sent none
// (an OpenAI client knows of no such header). The fake upstream, as strict
// as the real API, refuses a request without it.
func TestEveryAnthropicRequestCarriesAnAPIVersion(t *testing.T) {
	up, store := storeUpstream(t, "v")
	startRelay(t, channelBlock("version-a", up.URL)+keyAndGroup("version", "version-a"))

	// do sends a request with the client key and the given version, none
	// when empty
	do := func(method, path, version, contentType, body string) reply {
		t.Helper()
		req, _ := http.NewRequest(method, relayURL+path, strings.NewReader(body))
		req.Header.Set("X-Api-Key", clientKey)
		if contentType != "" {
			req.Header.Set("Content-Type", contentType)
		}
		if version != "" {
			req.Header.Set("Anthropic-Version", version)
		}
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return reply{resp.StatusCode, resp.Header, b}
	}
	var upload bytes.Buffer
	mw := multipart.NewWriter(&upload)
	fw, _ := mw.CreateFormFile("file", "a.txt")
	_, _ = io.WriteString(fw, "hello")
	_ = mw.Close()
	batch := `{"requests":[{"custom_id":"one","params":` + simpleBody + `}]}`
	cases := []struct {
		name, method, path, version, contentType, body string
	}{
		{"a message", "POST", "/v1/messages", "", "application/json", simpleBody},
		{"a message naming its version", "POST", "/v1/messages", "2026-10-21", "application/json", simpleBody},
		{"a stream", "POST", "/v1/messages", "", "application/json", streamBody},
		{"count_tokens", "POST", "/v1/messages/count_tokens", "", "application/json", `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`},
		{"a batch", "POST", "/v1/messages/batches", "", "application/json", batch},
		{"the batches' list", "GET", "/v1/messages/batches", "", "", ""},
		{"an upload", "POST", "/v1/files", "", mw.FormDataContentType(), upload.String()},
		{"the files' list", "GET", "/v1/files", "", "", ""},
		{"a chat completion", "POST", "/v1/chat/completions", "", "application/json", `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			before := up.Hits()
			r := do(c.method, c.path, c.version, c.contentType, c.body)
			if r.status != 200 {
				t.Fatalf("%d %s", r.status, r.body)
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
