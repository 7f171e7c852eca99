package relay

// Bedrock and Vertex channels through the whole relay: what needs a Caddy
// config, failover between channels, cooldowns, the admin API or the
// metrics. What the providers make of a request and of their upstream's
// answer is tested with them (providers/bedrock, providers/vertex),
// against the same fakes (internal/providertest).

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/tidwall/gjson"
)

// byModel answers 403 (as refuse does) for requests whose path names
// refused, and a message otherwise.
func byModel(refused string, refuse http.HandlerFunc) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.URL.Path, refused) {
			refuse(w, r)
			return
		}
		fakeupstream.Message("from "+r.URL.Path)(w, r)
	}
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

// bedrockChannel renders a bedrock channel block whose credentials (the
// fake Bedrock's) come from the environment.
func bedrockChannel(t *testing.T, name, url string, opts ...string) string {
	t.Setenv("RELAY_TEST_AWS_KEY_ID", providertest.AWSKeyID)
	t.Setenv("RELAY_TEST_AWS_SECRET", providertest.AWSSecret)
	t.Setenv("RELAY_TEST_AWS_SESSION", providertest.AWSSession)
	return fmt.Sprintf("\t\tchannel %s {\n\t\t\tprovider bedrock\n\t\t\tregion %s\n\t\t\turl %s\n"+
		"\t\t\taccess_key_id {env.RELAY_TEST_AWS_KEY_ID}\n\t\t\tsecret_access_key {env.RELAY_TEST_AWS_SECRET}\n\t\t\tsession_token {env.RELAY_TEST_AWS_SESSION}\n"+
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n\t\t\t%s\n\t\t}\n",
		name, providertest.AWSRegion, url, strings.Join(opts, "\n\t\t\t"))
}

// The channel's strip lines apply before Bedrock's translation: what it
// strips is in neither the body nor its anthropic_beta.
func TestBedrockGetsTheRequestTheChannelStrips(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5-20250929", "from bedrock", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2})))
	startRelay(t, bedrockChannel(t, "br-invoke", fb.URL, "strip mcp_servers prompt-caching-2024-07-31")+keyAndGroup("br-invoke", "br-invoke"))

	body := `{"model":"claude-sonnet-4-5","max_tokens":64,"mcp_servers":[{"type":"url","url":"https://mcp.example","name":"x"}],"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u-1"}}`
	r := message(t, body, "Anthropic-Beta", "interleaved-thinking-2025-05-14, prompt-caching-2024-07-31")
	if r.status != 200 || !bytes.Contains(r.body, []byte("from bedrock")) {
		t.Fatalf("%d %s (refused signatures: %v)", r.status, r.body, fb.Refused())
	}
	want := `{"max_tokens":64,"messages":[{"role":"user","content":[{"type":"text","text":"Hi","cache_control":{"type":"ephemeral"}}]}],"metadata":{"user_id":"u-1"},"anthropic_version":"bedrock-2023-05-31","anthropic_beta":["interleaved-thinking-2025-05-14"]}`
	if got := fb.Last(t); string(got.Body) != want {
		t.Errorf("Bedrock received\n %s\nwant\n %s\n(mcp_servers and a beta stripped as the channel says)", got.Body, want)
	}
}

// Bedrock's stream reaches the client as Anthropic's events, and its
// usage is counted.
func TestBedrockStreamIsCounted(t *testing.T) {
	u := fakeupstream.Usage{InputTokens: 10, OutputTokens: 3, CacheReadInputTokens: 40, CacheCreationInputTokens: 5}
	events := fakeupstream.StreamEvents("claude-sonnet-4-5-20250929", u, "Hello", " from", " Bedrock")
	fb := providertest.NewFakeBedrock(t, providertest.EventStream(events))
	startRelay(t, bedrockChannel(t, "br-stream", fb.URL)+keyAndGroup("br-stream", "br-stream"))

	r := message(t, streamBody)
	if r.status != 200 || r.header.Get("Content-Type") != "text/event-stream; charset=utf-8" || string(r.body) != strings.Join(events, "") {
		t.Fatalf("%d %v %s", r.status, r.header, r.body)
	}
	mf, _ := scrape(t)
	for kind, want := range map[string]float64{"input": 10, "output": 3, "cache_read": 40, "cache_write": 5} {
		if v := value(mf, "relay_tokens_total", "group=br-stream", "channel=br-stream", "kind="+kind); v != want {
			t.Errorf("relay_tokens_total{kind=%s} = %v, want %v", kind, v, want)
		}
	}
}

// An exception in Bedrock's stream before any content fails over,
// invisibly to the client, and cools the channel as its status would.
func TestBedrockExceptionBeforeContentFailsOver(t *testing.T) {
	events := fakeupstream.StreamEvents("m", fakeupstream.Usage{InputTokens: 1, OutputTokens: 1}, "partial")
	fb := providertest.NewFakeBedrock(t, providertest.EventStream(events[:1], providertest.ExceptionFrame("throttlingException", "Too many requests")))
	ok := fakeupstream.New(t, fakeupstream.Stream(events...))
	startRelay(t, bedrockChannel(t, "br-exc-a", fb.URL, "priority 1")+channelBlock("br-exc-b", ok.URL, "priority 2")+
		keyAndGroup("br-exc", "br-exc-a br-exc-b"))
	r := message(t, streamBody)
	if string(r.body) != strings.Join(events, "") || ok.Hits() != 1 {
		t.Fatalf("client got\n%s\n(second channel hits %d)", r.body, ok.Hits())
	}
	if st := channels(t)["br-exc-a"]; st.State != stateCooldown || st.LastError != "rate_limited" {
		t.Errorf("a throttled Bedrock channel should cool as a 429: %+v", st)
	}
}

func TestBedrockErrorsFailOverAndPassThrough(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, providertest.BedrockFailure(429, "ThrottlingException", "Too many tokens"))
	ok := fakeupstream.New(t, fakeupstream.Message("anthropic"))
	startRelay(t, bedrockChannel(t, "br-err-a", fb.URL, "priority 1")+channelBlock("br-err-b", ok.URL, "priority 2")+
		keyAndGroup("br-err", "br-err-a br-err-b"))
	if r := message(t, simpleBody); r.status != 200 || ok.Hits() != 1 {
		t.Fatalf("throttled Bedrock should fail over: %d %s", r.status, r.body)
	}
	if st := channels(t)["br-err-a"]; st.State != stateCooldown || st.LastError != "rate_limited" {
		t.Errorf("throttled channel: %+v", st)
	}

	fb2 := providertest.NewFakeBedrock(t, providertest.BedrockFailure(400, "ValidationException", "messages: field required"))
	startRelay(t, bedrockChannel(t, "br-err-v", fb2.URL)+keyAndGroup("br-err-v", "br-err-v"))
	r := message(t, simpleBody)
	if r.status != 400 || gjson.GetBytes(r.body, "error.type").String() != "invalid_request_error" ||
		!strings.Contains(string(r.body), "ValidationException: messages: field required") {
		t.Errorf("a validation error reaches the client in the Anthropic shape: %d %s", r.status, r.body)
	}
	if st := channels(t)["br-err-v"]; st.State != stateHealthy {
		t.Errorf("a client error must not cool the channel: %+v", st)
	}

	fb3 := providertest.NewFakeBedrock(t, providertest.BedrockFailure(403, "AccessDeniedException", "not authorized for this model"))
	startRelay(t, bedrockChannel(t, "br-err-d", fb3.URL, "priority 1")+channelBlock("br-err-e", ok.URL, "priority 2")+
		keyAndGroup("br-err-d", "br-err-d br-err-e"))
	if r := message(t, simpleBody); r.status != 200 {
		t.Fatalf("access denied should fail over: %d %s", r.status, r.body)
	}
	// a client picks the model: the refusal sets that model aside on the
	// channel for capability_ttl, and never cools the channel
	st := channels(t)["br-err-d"]
	if until, ok := st.RefusedModels["claude-sonnet-4-5"]; st.State != stateHealthy || st.LastError != "model_refused" || !ok ||
		time.Until(until) < 59*time.Minute || st.CooldownUntil != nil {
		t.Errorf("access denied should set the model aside for capability_ttl, not cool the channel: %+v", st)
	}
}

// TestAnthropicOverloadFailsOverToBedrockForTheSDK: a group whose
// Anthropic channel is overloaded fails over to Bedrock, and the official
// Go SDK sees a normal stream.
func TestAnthropicOverloadFailsOverToBedrockForTheSDK(t *testing.T) {
	overloaded := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded"))
	events := fakeupstream.StreamEvents("claude-sonnet-4-5-20250929", fakeupstream.Usage{InputTokens: 9, OutputTokens: 4}, "Hello", " from", " Bedrock", "!")
	fb := providertest.NewFakeBedrock(t, providertest.EventStream(events))
	startRelay(t, channelBlock("sdk-anthropic", overloaded.URL, "priority 1")+bedrockChannel(t, "sdk-bedrock", fb.URL, "priority 2")+
		keyAndGroup("sdk-mixed", "sdk-anthropic sdk-bedrock", "expose_channel"))

	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sdk := anthropicSDK()
	stream := sdk.Messages.NewStreaming(ctx, anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))},
	})
	var msg anthropic.Message
	for stream.Next() {
		if err := msg.Accumulate(stream.Current()); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("the SDK saw an error: %v (refused signatures: %v)", err, fb.Refused())
	}
	if len(msg.Content) != 1 || msg.Content[0].Text != "Hello from Bedrock!" || msg.Usage.OutputTokens != 4 || msg.StopReason != anthropic.StopReasonEndTurn {
		t.Errorf("the SDK assembled %+v", msg)
	}
	if overloaded.Hits() != 1 || fb.Hits() != 1 {
		t.Errorf("hits: anthropic %d, bedrock %d", overloaded.Hits(), fb.Hits())
	}
}

func TestARefusedModelIsSetAsideAloneOnBedrock(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, byModel("claude-opus", providertest.BedrockFailure(403, "AccessDeniedException", "You don't have access to the model with the specified model ID.")))
	fallback := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	// the bedrock channel lists no models: the client picks the model id
	brChannel := strings.Replace(bedrockChannel(t, "hostile-br", fb.URL, "priority 1"),
		"\t\t\tmodels claude-sonnet-4-5=us.anthropic.claude-sonnet-4-5-20250929-v1:0\n", "", 1)
	startRelay(t, brChannel+channelBlock("hostile-br-fallback", fallback.URL, "priority 2")+
		keyAndGroup("hostile-br", "hostile-br hostile-br-fallback", "expose_channel")+
		"\t\tkey sk-bedrock-only-0123456789 hostile-br-only\n\t\tgroup hostile-br-only {\n\t\t\tchannels hostile-br\n\t\t}\n")
	opus := `{"model":"claude-opus-4-1","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	sonnet := `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`

	r := message(t, opus)
	if r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br-fallback" || fb.Hits() != 1 {
		t.Fatalf("a refused model should fail over: %d %s via %q, bedrock hits %d", r.status, r.body, r.header.Get("X-Relay-Channel"), fb.Hits())
	}
	st := channels(t)["hostile-br"]
	if st.State != stateHealthy || st.CooldownUntil != nil || st.LastError != "model_refused" {
		t.Errorf("a model refusal must not cool the channel: %+v", st)
	}
	if until, ok := st.RefusedModels["claude-opus-4-1"]; !ok || time.Until(until) < 59*time.Minute || len(st.RefusedModels) != 1 {
		t.Errorf("only claude-opus-4-1 should be set aside, for capability_ttl: %v", st.RefusedModels)
	}
	// the refusal is remembered: the model goes elsewhere without asking
	if r := message(t, opus); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br-fallback" || fb.Hits() != 1 {
		t.Errorf("the refused model was asked again: %d via %q, bedrock hits %d", r.status, r.header.Get("X-Relay-Channel"), fb.Hits())
	}
	// and other models are served by the channel as before
	if r := message(t, sonnet); r.status != 200 || r.header.Get("X-Relay-Channel") != "hostile-br" {
		t.Errorf("another model should still be served by the channel: %d %s via %q", r.status, r.body, r.header.Get("X-Relay-Channel"))
	}
	// a group that has no other channel: the upstream's answer, then the
	// relay's own model_not_found without asking the upstream again
	hits := fb.Hits()
	if r := send(t, http.MethodPost, "/v1/messages", "sk-bedrock-only-0123456789", opus); r.status != 503 || fb.Hits() != hits {
		t.Errorf("a model every channel refused: %d %s, bedrock hits %d, want %d", r.status, r.body, fb.Hits(), hits)
	} else {
		wantRelayError(t, r, 503, "relay_error", "model_not_found")
	}
	// the admin reset forgets the refusal
	if code, body := adminPost(t, "hostile-br", "reset"); code != 200 || strings.Contains(string(body), "refused_models") {
		t.Fatalf("reset: %d %s", code, body)
	}
	if message(t, opus); fb.Hits() != hits+1 {
		t.Errorf("after a reset the channel should be asked again: bedrock hits %d, want %d", fb.Hits(), hits+1)
	}
}

// A vertex channel through the relay: the config loads without fetching a
// token (caddy validate runs offline), the channel's strip lines apply
// before the provider's rewriting, and its answers, Anthropic's wire, are
// counted.
func TestVertexThroughTheRelay(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	u := fakeupstream.Usage{InputTokens: 11, OutputTokens: 7, CacheReadInputTokens: 3}
	events := fakeupstream.StreamEvents("claude-sonnet-4-5@20250929", u, "Hel", "lo")
	vertex := providertest.NewFakeVertex(t, g, func(w http.ResponseWriter, r *http.Request) {
		if strings.HasSuffix(r.URL.Path, ":streamRawPredict") {
			fakeupstream.Stream(events...)(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(fakeupstream.MessageBody("claude-sonnet-4-5@20250929", "hi", fakeupstream.Usage{InputTokens: 10, OutputTokens: 5}))
	})
	startRelay(t, vertexBlock("vx-main", vertex.URL, g.ServiceAccountFile(t),
		"models claude-sonnet-4-5=claude-sonnet-4-5@20250929", "strip service_tier")+keyAndGroup("vx", "vx-main"))
	if n := g.Hits.Load(); n != 0 {
		t.Fatalf("provisioning fetched %d tokens; it must fetch none (caddy validate runs offline)", n)
	}
	tokens := func(kind string) float64 {
		mf, _ := scrape(t)
		return max(value(mf, "relay_tokens_total", "group=vx", "channel=vx-main", "model=claude-sonnet-4-5", "kind="+kind), 0)
	}
	before := map[string]float64{"input": tokens("input"), "output": tokens("output"), "cache_read": tokens("cache_read")}

	r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":16,"service_tier":"auto","messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 || !strings.Contains(string(r.body), `"text":"hi"`) {
		t.Fatalf("non-streaming: %d %s", r.status, r.body)
	}
	if want := `{"max_tokens":16,"messages":[{"role":"user","content":"Hi"}],"anthropic_version":"vertex-2023-10-16"}`; string(vertex.Last(t).Body) != want {
		t.Errorf("upstream body\n got %s\nwant %s (service_tier stripped as the channel says)", vertex.Last(t).Body, want)
	}
	r = message(t, `{"model":"claude-sonnet-4-5","max_tokens":16,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`)
	if want := strings.Join(events, ""); r.status != 200 || string(r.body) != want {
		t.Fatalf("stream: %d\n got %q\nwant %q", r.status, r.body, want)
	}
	for kind, want := range map[string]float64{"input": 10 + 11, "output": 5 + 7, "cache_read": 3} {
		if v := tokens(kind) - before[kind]; v != want {
			t.Errorf("relay_tokens_total{kind=%s} grew by %v, want %v", kind, v, want)
		}
	}
}

// A beta flag a vertex channel's betas do not list is not dropped: the
// request cannot be served as sent, and nothing reaches Vertex.
func TestVertexBetaTheChannelDoesNotListFindsNoChannel(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	vertex := providertest.NewFakeVertex(t, g, fakeupstream.Message("ok"))
	startRelay(t, vertexBlock("vx-beta", vertex.URL, g.ServiceAccountFile(t),
		"betas context-1m-2025-08-07 interleaved-thinking-2025-05-14")+keyAndGroup("vx-beta", "vx-beta"))
	r := message(t, simpleBody, "Anthropic-Beta", "interleaved-thinking-2025-05-14,unknown-2030-01-01,context-1m-2025-08-07")
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	if !strings.Contains(gjson.GetBytes(r.body, "error.message").String(), "unknown-2030-01-01") || vertex.Hits() != 0 {
		t.Fatalf("the error should name the flag, and nothing reach Vertex: %s (%d hits)", r.body, vertex.Hits())
	}
	if r := message(t, simpleBody, "Anthropic-Beta", "interleaved-thinking-2025-05-14,context-1m-2025-08-07"); r.status != 200 || vertex.Hits() != 1 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
}

func TestVertexErrorsFailOverAndCool(t *testing.T) {
	g := providertest.NewFakeGoogle(t, 3600)
	creds := g.ServiceAccountFile(t)
	quota := providertest.NewFakeVertex(t, g, providertest.GoogleError(429, "RESOURCE_EXHAUSTED", "Quota exceeded for aiplatform.googleapis.com/online_prediction_requests_per_base_model", true))
	denied := providertest.NewFakeVertex(t, g, providertest.GoogleError(403, "PERMISSION_DENIED", "Permission 'aiplatform.endpoints.predict' denied on resource", false))
	invalid := providertest.NewFakeVertex(t, g, providertest.GoogleError(400, "INVALID_ARGUMENT", "messages.0.content: required", false))
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
	g := providertest.NewFakeGoogle(t, 3600)
	vx := providertest.NewFakeVertex(t, g, byModel("claude-opus", providertest.GoogleError(400, "FAILED_PRECONDITION",
		"Publisher Model `projects/p/locations/us-east5/publishers/anthropic/models/claude-opus-4-1` is not enabled for this project.", false)))
	fallback := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, vertexBlock("hostile-vx", vx.URL, g.ServiceAccountFile(t), "priority 1")+channelBlock("hostile-vx-fallback", fallback.URL, "priority 2")+
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

func TestVertexWithoutCredentialsFailsOver(t *testing.T) {
	// no credentials_file, and no application default credentials either
	t.Setenv("GOOGLE_APPLICATION_CREDENTIALS", filepath.Join(t.TempDir(), "missing.json"))
	t.Setenv("HOME", t.TempDir())
	vertex := fakeupstream.New(t, fakeupstream.Message("vertex must not be reached"))
	good := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, vertexBlock("vx-adc-a", vertex.URL, "", "priority 1")+channelBlock("vx-adc-b", good.URL, "priority 2")+
		vertexBlock("vx-adc-c", vertex.URL, "")+
		keyAndGroup("vx-adc", "vx-adc-a vx-adc-b")+
		"\t\tkey sk-vx-adc-solo vx-adc-solo\n\t\tgroup vx-adc-solo {\n\t\t\tchannels vx-adc-c\n\t\t}\n")

	r := message(t, simpleBody)
	if r.status != 200 || !strings.Contains(string(r.body), "from anthropic") {
		t.Fatalf("failover: %d %s", r.status, r.body)
	}
	if st := channels(t)["vx-adc-a"]; st.State != stateCooldown || st.LastError != "transient" || !strings.Contains(st.LastErrorReason, "credentials") {
		t.Errorf("vx-adc-a: %+v", st)
	}

	r = send(t, http.MethodPost, "/v1/messages", "sk-vx-adc-solo", simpleBody)
	wantRelayError(t, r, http.StatusBadGateway, "api_error", "")
	if !strings.Contains(string(r.body), "application default credentials were not found") {
		t.Errorf("the reason does not say what is missing: %s", r.body)
	}
	if vertex.Hits() != 0 {
		t.Errorf("a request without a token reached Vertex")
	}
}
