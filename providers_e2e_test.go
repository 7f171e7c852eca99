package relay

// Providers through the whole relay: what needs a Caddy config, the
// relay's routes, failover between channels, cooldowns, the admin API or
// the metrics. What a provider makes of a request and of its upstream's
// answer is tested with the provider (providers/<name>), against the same
// fakes (internal/providertest).

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"mime/multipart"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/tidwall/gjson"
)

// openaiChannel renders a channel of provider openai at url.
func openaiChannel(name, url string, opts ...string) string {
	return "\t\tchannel " + name + " {\n\t\t\tprovider openai\n\t\t\turl " + url + "/v1\n\t\t\tapi_key " + channelKey + "\n\t\t\t" + strings.Join(opts, "\n\t\t\t") + "\n\t\t}\n"
}

// anthropicSDK is the official Anthropic SDK pointed at the relay, without
// its own retries.
func anthropicSDK() anthropic.Client {
	return anthropic.NewClient(aoption.WithBaseURL(relayURL), aoption.WithAPIKey(clientKey), aoption.WithMaxRetries(0))
}

// extKey is the key of the groups of the provider from another package.
const extKey = "sk-external-provider-0123456789"

// A provider defined outside the relay package, as another repository
// would write one (providertest.TokenProvider: the provider package alone,
// registered as a Caddy module), configured from a Caddyfile's channel
// lines and from JSON.
func TestAProviderFromAnotherPackage(t *testing.T) {
	// the token upstream speaks a wire of its own on Anthropic's paths (its
	// credential in X-Token): Anthropic's rules are not its rules
	ok := fakeupstream.New(t, fakeupstream.Message("from the token upstream"), fakeupstream.Lenient())
	refusing := fakeupstream.New(t, fakeupstream.Raw(418, []byte(`{"refused":"this model is not in your plan","code":403}`)), fakeupstream.Lenient())
	// the provider's lines stand on the channel's own lines, or in a
	// `provider <name> { }` block
	tester := startRelay(t, `		key `+extKey+` ext
		channel ext-refusing {
			provider token
			url `+refusing.URL+`
			token t-one
			priority 1
		}
		channel ext-ok {
			provider token {
				url `+ok.URL+`
				token t-two
			}
			priority 2
		}
		group ext {
			channels ext-refusing ext-ok
		}
`)
	r := send(t, http.MethodPost, "/v1/messages", extKey, `{"model":"claude-opus-4-1","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || !strings.Contains(string(r.body), "from the token upstream") {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if got := refusing.Last(t).Header.Get("X-Token"); got != "t-one" {
		t.Errorf("the first channel sent X-Token %q", got)
	}
	if got := ok.Last(t).Header.Get("X-Token"); got != "t-two" || ok.Last(t).Header.Get("Anthropic-Version") != "2023-06-01" {
		t.Errorf("the second channel sent %v", ok.Last(t).Header)
	}
	// what its wire lacks, no channel of its kind is sent
	r = send(t, http.MethodPost, "/v1/messages", extKey, `{"model":"claude-sonnet-4-5","max_tokens":8,"mcp_servers":[],"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 503 || !strings.Contains(string(r.body), "capability_not_available") || !strings.Contains(string(r.body), "mcp_servers") {
		t.Errorf("a feature the provider lacks: %d %s", r.status, r.body)
	}
	// the translated refusal set the model aside on that channel alone
	st := channels(t)["ext-refusing"]
	if _, refused := st.RefusedModels["claude-opus-4-1"]; st.Provider != "token" || st.State != stateHealthy || !refused {
		t.Errorf("ext-refusing: %+v", st)
	}

	// the same provider from JSON, as POST /load takes it
	tester.InitServer(`{
	"admin": {"listen": "localhost:2999"},
	"apps": {"http": {"http_port": 9080, "servers": {"s": {"listen": [":9080"], "routes": [{"handle": [{
		"handler": "relay",
		"keys": [{"secret": "`+extKey+`", "group": "ext"}],
		"channels": [{"name": "ext-json", "upstream": {"provider": "token", "url": "`+ok.URL+`", "token": "t-json"}}],
		"groups": [{"name": "ext", "channels": ["ext-json"]}]
	}]}]}}}}
}`, "json")
	if r := send(t, http.MethodPost, "/v1/messages", extKey, `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 || ok.Last(t).Header.Get("X-Token") != "t-json" {
		t.Errorf("from JSON: %d %s", r.status, r.body)
	}
}

// The client's key, which it may send as a bearer token, reaches no
// upstream; the relay's own headers are on the answer.
func TestClientKeyNeverReachesUpstream(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	startRelay(t, channelBlock("fwd-a", up.URL)+keyAndGroup("fwd", "fwd-a"))
	r := send(t, http.MethodPost, "/v1/messages?beta=true", "", simpleBody, "Authorization", "Bearer "+clientKey)
	if r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	got := up.Last(t)
	for k, vs := range got.Header {
		for _, v := range vs {
			if strings.Contains(v, clientKey) {
				t.Errorf("client key leaked upstream in header %s", k)
			}
		}
	}
	if got.Header.Get("X-Api-Key") != channelKey || got.RawQuery != "beta=true" {
		t.Errorf("upstream: x-api-key %q, query %q", got.Header.Get("X-Api-Key"), got.RawQuery)
	}
	if r.header.Get("X-Relay-Request-Id") == "" || r.header.Get("Request-Id") != "req_fake" {
		t.Errorf("response headers: %v", r.header)
	}
	if r.header.Get("X-Relay-Channel") != "" {
		t.Errorf("x-relay-channel without expose_channel")
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

// Every request the relay builds for an Anthropic-wire upstream, on every
// route, carries anthropic-version: the client's, as sent, or 2023-06-01
// when it sent none (an OpenAI client knows of no such header). The fake
// upstream, as strict as the real API, refuses a request without it.
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

// A mock channel serves as any channel: its answers, and its refusals of
// what the API refuses, are the channel's (x-relay-channel names it), and
// a refusal, the client's mistake, cools nothing.
func TestMockChannelThroughTheRelay(t *testing.T) {
	startRelay(t, "\t\tchannel mock-only {\n\t\t\tprovider mock\n\t\t\tfail_rate 0\n\t\t}\n"+keyAndGroup("mockg", "mock-only", "expose_channel"))
	if r := message(t, simpleBody); r.status != 200 || r.header.Get("X-Relay-Channel") != "mock-only" {
		t.Fatalf("%d %s, x-relay-channel %q", r.status, r.body, r.header.Get("X-Relay-Channel"))
	}
	for _, body := range []string{
		`{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`,
		`{"model":"claude-sonnet-4-5","max_tokens":16,"max_output":5,"messages":[{"role":"user","content":"Hi"}]}`,
	} {
		r := message(t, body)
		if r.status != 400 || gjson.GetBytes(r.body, "error.type").Str != "invalid_request_error" || !strings.HasPrefix(r.header.Get("Request-Id"), "req_mock_") {
			t.Errorf("status %d, want the mock's 400: %s", r.status, r.body)
		}
		if ch := r.header.Get("X-Relay-Channel"); ch != "mock-only" {
			t.Errorf("x-relay-channel = %q: the refusal is the channel's answer", ch)
		}
	}
	// the client's mistakes cooled nothing: the only channel still serves,
	// and a client without anthropic-version is served as provider
	// anthropic serves it
	for _, h := range [][]string{nil, {"Anthropic-Version", ""}} {
		if r := message(t, simpleBody, h...); r.status != 200 {
			t.Errorf("a valid request after the refusals (header %q): %d %s", h, r.status, r.body)
		}
	}
	if r := send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 {
		t.Errorf("count_tokens: %d %s", r.status, r.body)
	}
	if st := channels(t)["mock-only"]; st.State != stateHealthy {
		t.Errorf("mock-only after the refusals: %+v", st)
	}
}

func TestOpenAIProvider429FailsOver(t *testing.T) {
	limited := fakeupstream.New(t, fakeupstream.Raw(http.StatusTooManyRequests,
		[]byte(`{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}`), "Retry-After", "20"))
	good := fakeupstream.New(t, providertest.ChatAnswer(providertest.ChatReply))
	startRelay(t, openaiChannel("oai-429-a", limited.URL, "priority 1")+openaiChannel("oai-429-b", good.URL, "priority 2")+
		keyAndGroup("oai-429", "oai-429-a oai-429-b"))
	var raw *http.Response
	sdk := anthropicSDK()
	msg, err := sdk.Messages.New(context.Background(), anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))},
	}, aoption.WithResponseInto(&raw))
	if err != nil {
		t.Fatal(err)
	}
	if msg.Content[0].Text != "Hello there" || limited.Hits() != 1 || good.Hits() != 1 || raw.Header.Get("X-Relay-Attempts") != "2" {
		t.Errorf("text %q, hits %d and %d, attempts %q", msg.Content[0].Text, limited.Hits(), good.Hits(), raw.Header.Get("X-Relay-Attempts"))
	}
	ch := channels(t)["oai-429-a"]
	if ch.State == "healthy" {
		t.Errorf("the limited channel is %+v, want it cooling until its retry-after", ch)
	}
}

// TestOpenAIChannelsRefuseWhatTheyCannotCarry: a request the format cannot
// carry is the client's 400, and the channel stays healthy; one carrying a
// feature its wire lacks finds no channel.
func TestOpenAIChannelsRefuseWhatTheyCannotCarry(t *testing.T) {
	up := fakeupstream.New(t, providertest.ChatAnswer(providertest.ChatReply))
	startRelay(t, openaiChannel("oai-carry", up.URL)+keyAndGroup("oai-carry", "oai-carry"))
	r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"text","media_type":"text/plain","data":"x"}}]}]}`)
	wantRelayError(t, r, 400, "invalid_request_error", "")
	if !strings.Contains(gjson.GetBytes(r.body, "error.message").Str, "provider openai") {
		t.Errorf("message: %s", r.body)
	}
	for feature, body := range map[string]string{
		"web_search":         `{"model":"claude-sonnet-4-5","max_tokens":16,"tools":[{"type":"web_search_20250305","name":"web_search"}],"messages":[{"role":"user","content":"Hi"}]}`,
		"container":          `{"model":"claude-sonnet-4-5","max_tokens":16,"container":"c1","messages":[{"role":"user","content":"Hi"}]}`,
		"context_management": `{"model":"claude-sonnet-4-5","max_tokens":16,"context_management":{},"messages":[{"role":"user","content":"Hi"}]}`,
	} {
		r := message(t, body)
		wantRelayError(t, r, 503, "relay_error", "capability_not_available")
		if !strings.Contains(gjson.GetBytes(r.body, "error.message").Str, feature) {
			t.Errorf("message: %s", r.body)
		}
	}
	r = message(t, simpleBody, "Anthropic-Beta", "interleaved-thinking-2025-05-14")
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	r = send(t, http.MethodPost, "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 400 {
		t.Errorf("count_tokens: %d %s", r.status, r.body)
	}
	if up.Hits() != 0 || channels(t)["oai-carry"].State != "healthy" {
		t.Errorf("hits %d, channel %+v", up.Hits(), channels(t)["oai-carry"])
	}
	// what it can carry still goes
	if r := message(t, simpleBody); r.status != 200 {
		t.Errorf("simple message: %d %s", r.status, r.body)
	}
}

// TestChatCompletionThroughAnOpenAIChannel: an OpenAI client served by an
// OpenAI-format upstream goes through both translations and gets its
// answer, stream and usage.
func TestChatCompletionThroughAnOpenAIChannel(t *testing.T) {
	up := fakeupstream.New(t, providertest.ChatAnswer(providertest.ChatReply))
	startRelay(t, openaiChannel("oai-both", up.URL)+keyAndGroup("oai-both", "oai-both"))
	r := send(t, http.MethodPost, "/v1/chat/completions", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}],"max_tokens":20}`)
	if r.status != 200 || gjson.GetBytes(r.body, "choices.0.message.content").Str != "Hello there" ||
		gjson.GetBytes(r.body, "usage.prompt_tokens").Int() != 12 || gjson.GetBytes(r.body, "usage.prompt_tokens_details.cached_tokens").Int() != 4 {
		t.Errorf("%d %s", r.status, r.body)
	}
	if got := string(up.Last(t).Body); got != `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":20}` {
		t.Errorf("upstream body %s", got)
	}
}

// An openai channel's lines in the Caddyfile: the provider's own go to its
// upstream, the channel's (models) to the channel; without api_key the
// adapter says so.
func TestAnOpenAIChannelInTheCaddyfile(t *testing.T) {
	cfg, err := parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel o {\n\t\tprovider openai\n\t\turl https://llm.example/v1/\n\t\tapi_key {env.RESELLER}\n\t\tmodels claude-sonnet-4-5=anthropic/claude-sonnet-4.5\n\t}\n\tgroup prod {\n\t\tchannels o\n\t}\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	if up := string(cfg.Channels[0].UpstreamRaw); up != `{"api_key":"{env.RESELLER}","provider":"openai","url":"https://llm.example/v1/"}` {
		t.Errorf("upstream = %s", up)
	}
	if m := cfg.Channels[0].Models; len(m) != 1 || m[0] != "claude-sonnet-4-5=anthropic/claude-sonnet-4.5" {
		t.Errorf("models = %q", m)
	}
	_, err = parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel o {\n\t\tprovider openai\n\t}\n\tgroup prod {\n\t\tchannels o\n\t}\n}\n")
	if err == nil || !strings.Contains(err.Error(), "no api_key") {
		t.Errorf("without api_key: %v", err)
	}
}
