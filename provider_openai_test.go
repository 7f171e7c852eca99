package relay

import (
	"context"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/anthropics/anthropic-sdk-go/v2"
	aoption "github.com/anthropics/anthropic-sdk-go/v2/option"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
	openaiprovider "github.com/caddy-relay/relay/providers/openai"
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

// answerChat answers as an OpenAI-format server: a chat.completion.
func answerChat(body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, body)
	}
}

// chatChunks answers as an OpenAI-format server streaming: each chunk a
// data line, then [DONE].
func chatChunks(chunks ...string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.WriteHeader(http.StatusOK)
		for _, c := range append(chunks, "[DONE]") {
			if !fakeupstream.WriteEvent(w, "data: "+c+"\n\n") {
				return
			}
		}
	}
}

const chatReply = `{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"claude-upstream","choices":[{"index":0,"message":{"role":"assistant","content":"Hello there"},"finish_reason":"stop"}],` +
	`"usage":{"prompt_tokens":12,"completion_tokens":3,"total_tokens":15,"prompt_tokens_details":{"cached_tokens":4}}}`

func TestOpenAIProviderWithTheAnthropicSDK(t *testing.T) {
	up := fakeupstream.New(t, answerChat(chatReply))
	startRelay(t, openaiChannel("oai-up", up.URL, "models claude-sonnet-4-5=claude-upstream")+keyAndGroup("oai-up", "oai-up"))

	sdk := anthropicSDK()
	msg, err := sdk.Messages.New(context.Background(), anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		System:        []anthropic.TextBlockParam{{Text: "Be brief."}},
		Messages:      []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))},
		StopSequences: []string{"END"},
		Metadata:      anthropic.MetadataParam{UserID: anthropic.String("u-1")},
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(msg.Content) != 1 || msg.Content[0].Text != "Hello there" || msg.StopReason != anthropic.StopReasonEndTurn {
		t.Errorf("message = %+v", msg)
	}
	if u := msg.Usage; u.InputTokens != 8 || u.CacheReadInputTokens != 4 || u.OutputTokens != 3 {
		t.Errorf("usage = %+v", u)
	}
	got := up.Last(t)
	if got.Path != "/v1/chat/completions" || got.Header.Get("Authorization") != "Bearer "+channelKey || got.Header.Get("X-Api-Key") != "" {
		t.Errorf("upstream request: %s, authorization %q, x-api-key %q", got.Path, got.Header.Get("Authorization"), got.Header.Get("X-Api-Key"))
	}
	want := `{"model":"claude-upstream","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":[{"type":"text","text":"Hi"}]}],"max_tokens":64,"stop":["END"],"user":"u-1"}`
	if string(got.Body) != want {
		t.Errorf("upstream body\n got %s\nwant %s", got.Body, want)
	}
	if gjson.GetBytes(got.Body, "anthropic_version").Exists() {
		t.Error("an Anthropic-only field reached the OpenAI upstream")
	}
}

func TestOpenAIProviderStreams(t *testing.T) {
	chunk := func(delta, finish string) string {
		f := "null"
		if finish != "" {
			f = `"` + finish + `"`
		}
		return `{"id":"chatcmpl-2","object":"chat.completion.chunk","created":1,"model":"claude-upstream","choices":[{"index":0,"delta":` + delta + `,"finish_reason":` + f + `}]}`
	}
	up := fakeupstream.New(t, chatChunks(
		chunk(`{"role":"assistant","content":""}`, ""),
		chunk(`{"content":"Hel"}`, ""),
		chunk(`{"content":"lo"}`, ""),
		chunk(`{}`, "stop"),
		`{"id":"chatcmpl-2","object":"chat.completion.chunk","created":1,"model":"claude-upstream","choices":[],"usage":{"prompt_tokens":20,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`,
	))
	startRelay(t, openaiChannel("oai-up-stream", up.URL)+keyAndGroup("oai-up-stream", "oai-up-stream"))

	// the exact SSE events of a Messages stream
	r := send(t, http.MethodPost, "/v1/messages", clientKey, streamBody)
	if r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	rd := sse.NewReader(strings.NewReader(string(r.body)), 1<<20)
	var names []string
	for {
		ev, err := rd.Next()
		if err != nil {
			break
		}
		names = append(names, string(ev.Name))
		if gjson.GetBytes(ev.Data, "type").Str != string(ev.Name) {
			t.Errorf("event %s has data %s", ev.Name, ev.Data)
		}
		if string(ev.Name) == "message_delta" && (gjson.GetBytes(ev.Data, "delta.stop_reason").Str != "end_turn" || gjson.GetBytes(ev.Data, "usage.input_tokens").Int() != 20) {
			t.Errorf("message_delta = %s", ev.Data)
		}
	}
	if got := strings.Join(names, " "); got != "message_start content_block_start content_block_delta content_block_delta content_block_stop message_delta message_stop" {
		t.Errorf("events: %s", got)
	}
	if !gjson.GetBytes(up.Last(t).Body, "stream_options.include_usage").Bool() {
		t.Errorf("upstream body asks no usage: %s", up.Last(t).Body)
	}

	// and the SDK accumulates them
	sdk := anthropicSDK()
	stream := sdk.Messages.NewStreaming(context.Background(), anthropic.MessageNewParams{
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
		t.Fatal(err)
	}
	if msg.Content[0].Text != "Hello" || msg.StopReason != anthropic.StopReasonEndTurn || msg.Usage.OutputTokens != 2 {
		t.Errorf("streamed message = %+v", msg)
	}
}

func TestOpenAIProviderToolUse(t *testing.T) {
	up := fakeupstream.New(t, answerChat(`{"id":"chatcmpl-3","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,`+
		`"tool_calls":[{"id":"call_9","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":30,"completion_tokens":10}}`))
	startRelay(t, openaiChannel("oai-up-tools", up.URL)+keyAndGroup("oai-up-tools", "oai-up-tools"))
	sdk := anthropicSDK()
	params := anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		Messages: []anthropic.MessageParam{
			anthropic.NewUserMessage(anthropic.NewTextBlock("Weather?")),
			anthropic.NewAssistantMessage(anthropic.NewToolUseBlock("call_1", map[string]any{"city": "Rome"}, "get_weather")),
			anthropic.NewUserMessage(anthropic.NewToolResultBlock("call_1", "Sunny", false), anthropic.NewTextBlock("And Oslo?")),
		},
		Tools: []anthropic.ToolUnionParam{{OfTool: &anthropic.ToolParam{Name: "get_weather", Description: anthropic.String("Weather"),
			InputSchema: anthropic.ToolInputSchemaParam{Properties: map[string]any{"city": map[string]any{"type": "string"}}}}}},
		ToolChoice: anthropic.ToolChoiceUnionParam{OfAny: &anthropic.ToolChoiceAnyParam{DisableParallelToolUse: anthropic.Bool(true)}},
	}
	msg, err := sdk.Messages.New(context.Background(), params)
	if err != nil {
		t.Fatal(err)
	}
	if msg.StopReason != anthropic.StopReasonToolUse || len(msg.Content) != 1 {
		t.Fatalf("message = %+v", msg)
	}
	if tu := msg.Content[0]; tu.Type != "tool_use" || tu.ID != "call_9" || tu.Name != "get_weather" || string(tu.Input) != `{"city":"Oslo"}` {
		t.Errorf("tool_use = %+v (input %s)", tu, tu.Input)
	}
	body := up.Last(t).Body
	for path, want := range map[string]string{
		"messages.1":            `{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Rome\"}"}}]}`,
		"messages.2":            `{"role":"tool","content":"Sunny","tool_call_id":"call_1"}`,
		"messages.3":            `{"role":"user","content":[{"type":"text","text":"And Oslo?"}]}`,
		"tools.0.function.name": `"get_weather"`,
		"tool_choice":           `"required"`,
		"parallel_tool_calls":   `false`,
	} {
		if got := gjson.GetBytes(body, path).Raw; got != want {
			t.Errorf("upstream %s = %s, want %s", path, got, want)
		}
	}

	// streamed: a tool call in pieces becomes tool_use with input_json_delta
	tc := func(delta, finish string) string {
		return `{"id":"c","object":"chat.completion.chunk","created":1,"model":"m","choices":[{"index":0,"delta":` + delta + `,"finish_reason":` + finish + `}]}`
	}
	up.SetHandler(chatChunks(
		tc(`{"role":"assistant","content":"Looking."}`, "null"),
		tc(`{"tool_calls":[{"index":0,"id":"call_9","type":"function","function":{"name":"get_weather","arguments":""}}]}`, "null"),
		tc(`{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}`, "null"),
		tc(`{"tool_calls":[{"index":0,"function":{"arguments":"\"Oslo\"}"}}]}`, "null"),
		tc(`{}`, `"tool_calls"`),
	))
	stream := sdk.Messages.NewStreaming(context.Background(), params)
	var acc anthropic.Message
	for stream.Next() {
		if err := acc.Accumulate(stream.Current()); err != nil {
			t.Fatal(err)
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(acc.Content) != 2 || acc.Content[0].Text != "Looking." || acc.Content[1].Name != "get_weather" || string(acc.Content[1].Input) != `{"city":"Oslo"}` || acc.StopReason != anthropic.StopReasonToolUse {
		t.Errorf("streamed message = %+v", acc)
	}
}

func TestOpenAIProvider429FailsOver(t *testing.T) {
	limited := fakeupstream.New(t, fakeupstream.Raw(http.StatusTooManyRequests,
		[]byte(`{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}`), "Retry-After", "20"))
	good := fakeupstream.New(t, answerChat(chatReply))
	startRelay(t, openaiChannel("oai-429-a", limited.URL, "priority 1")+openaiChannel("oai-429-b", good.URL, "priority 2")+
		keyAndGroup("oai-429", "oai-429-a oai-429-b"))
	sdk := anthropicSDK()
	var raw *http.Response
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

func TestOpenAIProviderErrors(t *testing.T) {
	for _, tc := range []struct {
		name    string
		status  int
		body    string
		want    int
		outcome outcome
		refuses bool
	}{
		{"bad request", 400, `{"error":{"message":"bad","type":"invalid_request_error","code":null}}`, 400, outcomeClientError, false},
		{"bad key", 401, `{"error":{"message":"Incorrect API key","type":"invalid_request_error","code":"invalid_api_key"}}`, 401, outcomeAuth, false},
		{"rate limited", 429, `{"error":{"message":"slow","type":"requests","code":"rate_limit_exceeded"}}`, 429, outcomeRateLimited, false},
		{"quota spent", 429, `{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}`, 402, outcomeAuth, false},
		{"no such model", 404, `{"error":{"message":"The model x does not exist","type":"invalid_request_error","code":"model_not_found"}}`, 403, outcomeAuth, true},
		{"server error", 500, `{"error":{"message":"oops","type":"server_error"}}`, 500, outcomeTransient, false},
		{"overloaded", 503, `{"error":{"message":"overloaded","type":"server_error"}}`, 529, outcomeOverloaded, false},
		{"error as a string", 502, `{"error":"bad gateway"}`, 502, outcomeTransient, false},
		{"not JSON", 502, `<html>bad gateway</html>`, 502, outcomeTransient, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			resp := &http.Response{StatusCode: tc.status, Header: http.Header{"X-Request-Id": {"req-9"}}, Body: io.NopCloser(strings.NewReader(tc.body))}
			out, err := (&openaiprovider.Provider{}).Response(resp, &provider.Call{})
			if err != nil {
				t.Fatal(err)
			}
			body, _ := io.ReadAll(out.Body)
			if out.StatusCode != tc.want || gjson.GetBytes(body, "error.type").Str != provider.ErrorType(tc.want) || !strings.HasPrefix(gjson.GetBytes(body, "error.message").Str, "openai upstream: ") {
				t.Errorf("%d %s", out.StatusCode, body)
			}
			if v := classifyStatus(out.StatusCode, out.Header, body, time.Now()); v.outcome != tc.outcome {
				t.Errorf("outcome %s, want %s", v.outcome, tc.outcome)
			}
			if provider.RefusesModel(out) != tc.refuses {
				t.Errorf("refuses model: %v", !tc.refuses)
			}
		})
	}
}

// TestOpenAIProviderRefusesWhatItCannotCarry: a request the format cannot
// carry is the client's 400, and the channel stays healthy; one carrying a
// feature its wire lacks finds no channel.
func TestOpenAIProviderRefusesWhatItCannotCarry(t *testing.T) {
	up := fakeupstream.New(t, answerChat(chatReply))
	startRelay(t, openaiChannel("oai-carry", up.URL)+keyAndGroup("oai-carry", "oai-carry"))
	r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"text","media_type":"text/plain","data":"x"}}]}]}`)
	wantRelayError(t, r, 400, "invalid_request_error", "")
	if !strings.Contains(gjson.GetBytes(r.body, "error.message").Str, "provider openai") {
		t.Errorf("message: %s", r.body)
	}
	// a tool needs a name, as Messages wants: a nameless one would become
	// a function of no name, several times its size
	r = message(t, `{"model":"claude-sonnet-4-5","max_tokens":16,"tools":[{"name":"f","input_schema":{}},{"input_schema":{}}],"messages":[{"role":"user","content":"Hi"}]}`)
	wantRelayError(t, r, 400, "invalid_request_error", "")
	if !strings.HasSuffix(gjson.GetBytes(r.body, "error.message").Str, "(provider openai): tools.1.name: Field required") {
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

func TestOpenAIProviderCaddyfile(t *testing.T) {
	cfg, err := parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel o {\n\t\tprovider openai\n\t\turl https://llm.example/v1/\n\t\tapi_key {env.RESELLER}\n\t\tmodels claude-sonnet-4-5=anthropic/claude-sonnet-4.5\n\t}\n\tgroup prod {\n\t\tchannels o\n\t}\n}\n")
	if err != nil {
		t.Fatal(err)
	}
	up := string(cfg.Channels[0].UpstreamRaw)
	if up != `{"api_key":"{env.RESELLER}","provider":"openai","url":"https://llm.example/v1/"}` {
		t.Errorf("upstream = %s", up)
	}
	if got := (&openaiprovider.Provider{URL: "https://llm.example/v1/"}).BaseURL(); got != "https://llm.example/v1" {
		t.Errorf("base URL = %s", got)
	}
	if (&openaiprovider.Provider{}).BaseURL() != "https://api.openai.com/v1" {
		t.Error("no default URL")
	}
	_, err = parseRelay(t, "relay {\n\tkey sk-client-secret-0123456789 prod\n\tchannel o {\n\t\tprovider openai\n\t}\n\tgroup prod {\n\t\tchannels o\n\t}\n}\n")
	if err == nil || !strings.Contains(err.Error(), "no api_key") {
		t.Errorf("without api_key: %v", err)
	}
}

// TestChatCompletionThroughAnOpenAIChannel: an OpenAI client served by an
// OpenAI-format upstream goes through both translations and gets its
// answer, stream and usage.
func TestChatCompletionThroughAnOpenAIChannel(t *testing.T) {
	up := fakeupstream.New(t, answerChat(chatReply))
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
