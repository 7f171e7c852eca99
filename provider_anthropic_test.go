package relay

import (
	"bytes"
	"fmt"
	"io"
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
