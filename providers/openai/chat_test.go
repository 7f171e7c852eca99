package openai

// Provider openai against an OpenAI-format upstream on 127.0.0.1: the
// Anthropic SDK's own requests, translated into chat completions, and the
// upstream's answers, translated back into what the SDK reads.

import (
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/internal/sse"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/tidwall/gjson"
)

// channel provisions an openai channel of url (its /v1 below it), whose
// key is the fake upstream's.
func channel(t *testing.T, name, url string) *Provider {
	t.Setenv("RELAY_TEST_CHANNEL_KEY", fakeupstream.Key)
	p := &Provider{URL: url + "/v1", APIKey: "{env.RELAY_TEST_CHANNEL_KEY}"}
	providertest.Provision(t, p, name)
	return p
}

// sdkRequest is the request the Anthropic SDK sends for params, on the
// channel, with the upstream's model for it.
func sdkRequest(t *testing.T, channel, model string, params anthropic.MessageNewParams, stream bool) *provider.Call {
	t.Helper()
	b, err := json.Marshal(params)
	if err != nil {
		t.Fatal(err)
	}
	body := string(b)
	if stream {
		body = `{"stream":true,` + body[1:]
	}
	return providertest.Request{Channel: channel, Model: model, Body: body}.Call()
}

// accumulate reads a Messages stream as the SDK does: each event into the
// message it builds.
func accumulate(t *testing.T, stream []byte) anthropic.Message {
	t.Helper()
	var msg anthropic.Message
	rd := sse.NewReader(strings.NewReader(string(stream)), 1<<20)
	for {
		ev, err := rd.Next()
		if err != nil {
			break
		}
		var e anthropic.MessageStreamEventUnion
		if err := json.Unmarshal(ev.Data, &e); err != nil {
			t.Fatalf("event %s: %v", ev.Name, err)
		}
		if err := msg.Accumulate(e); err != nil {
			t.Fatal(err)
		}
	}
	return msg
}

func TestOpenAIProviderWithTheAnthropicSDK(t *testing.T) {
	up := fakeupstream.New(t, providertest.ChatAnswer(providertest.ChatReply))
	p := channel(t, "oai-up", up.URL)
	c := sdkRequest(t, "oai-up", "claude-upstream", anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		System:        []anthropic.TextBlockParam{{Text: "Be brief."}},
		Messages:      []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))},
		StopSequences: []string{"END"},
		Metadata:      anthropic.MetadataParam{UserID: anthropic.String("u-1")},
	}, false)
	a := providertest.Send(t, p, c)
	var msg anthropic.Message
	if err := json.Unmarshal(a.Body, &msg); err != nil || a.Status != 200 {
		t.Fatalf("%d %s (%v)", a.Status, a.Body, err)
	}
	if len(msg.Content) != 1 || msg.Content[0].Text != "Hello there" || msg.StopReason != anthropic.StopReasonEndTurn {
		t.Errorf("message = %+v", msg)
	}
	if u := msg.Usage; u.InputTokens != 8 || u.CacheReadInputTokens != 4 || u.OutputTokens != 3 {
		t.Errorf("usage = %+v", u)
	}
	got := up.Last(t)
	if got.Path != "/v1/chat/completions" || got.Header.Get("Authorization") != "Bearer "+fakeupstream.Key || got.Header.Get("X-Api-Key") != "" {
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
	up := fakeupstream.New(t, providertest.ChatChunks(
		chunk(`{"role":"assistant","content":""}`, ""),
		chunk(`{"content":"Hel"}`, ""),
		chunk(`{"content":"lo"}`, ""),
		chunk(`{}`, "stop"),
		`{"id":"chatcmpl-2","object":"chat.completion.chunk","created":1,"model":"claude-upstream","choices":[],"usage":{"prompt_tokens":20,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}`,
	))
	p := channel(t, "oai-up-stream", up.URL)

	// the exact SSE events of a Messages stream
	a := providertest.Send(t, p, providertest.Request{Channel: "oai-up-stream", Body: providertest.StreamBody}.Call())
	if a.Status != 200 {
		t.Fatalf("status %d: %s", a.Status, a.Body)
	}
	rd := sse.NewReader(strings.NewReader(string(a.Body)), 1<<20)
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
	a = providertest.Send(t, p, sdkRequest(t, "oai-up-stream", "claude-sonnet-4-5", anthropic.MessageNewParams{
		Model: anthropic.ModelClaudeSonnet4_5, MaxTokens: 64,
		Messages: []anthropic.MessageParam{anthropic.NewUserMessage(anthropic.NewTextBlock("Hi"))},
	}, true))
	if msg := accumulate(t, a.Body); msg.Content[0].Text != "Hello" || msg.StopReason != anthropic.StopReasonEndTurn || msg.Usage.OutputTokens != 2 {
		t.Errorf("streamed message = %+v", msg)
	}
}

func TestOpenAIProviderToolUse(t *testing.T) {
	up := fakeupstream.New(t, providertest.ChatAnswer(`{"id":"chatcmpl-3","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":null,`+
		`"tool_calls":[{"id":"call_9","type":"function","function":{"name":"get_weather","arguments":"{\"city\":\"Oslo\"}"}}]},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":30,"completion_tokens":10}}`))
	p := channel(t, "oai-up-tools", up.URL)
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
	a := providertest.Send(t, p, sdkRequest(t, "oai-up-tools", "claude-sonnet-4-5", params, false))
	var msg anthropic.Message
	if err := json.Unmarshal(a.Body, &msg); err != nil || a.Status != 200 {
		t.Fatalf("%d %s (%v)", a.Status, a.Body, err)
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
	up.SetHandler(providertest.ChatChunks(
		tc(`{"role":"assistant","content":"Looking."}`, "null"),
		tc(`{"tool_calls":[{"index":0,"id":"call_9","type":"function","function":{"name":"get_weather","arguments":""}}]}`, "null"),
		tc(`{"tool_calls":[{"index":0,"function":{"arguments":"{\"city\":"}}]}`, "null"),
		tc(`{"tool_calls":[{"index":0,"function":{"arguments":"\"Oslo\"}"}}]}`, "null"),
		tc(`{}`, `"tool_calls"`),
	))
	a = providertest.Send(t, p, sdkRequest(t, "oai-up-tools", "claude-sonnet-4-5", params, true))
	acc := accumulate(t, a.Body)
	if len(acc.Content) != 2 || acc.Content[0].Text != "Looking." || acc.Content[1].Name != "get_weather" || string(acc.Content[1].Input) != `{"city":"Oslo"}` || acc.StopReason != anthropic.StopReasonToolUse {
		t.Errorf("streamed message = %+v", acc)
	}
}

func TestOpenAIProviderErrors(t *testing.T) {
	for _, c := range providertest.OpenAIErrors {
		t.Run(c.Name, func(t *testing.T) {
			out, err := (&Provider{}).Response(c.Response(), &provider.Call{})
			if err != nil {
				t.Fatal(err)
			}
			c.Check(t, out)
		})
	}
}

// TestOpenAIProviderRefusesWhatItCannotCarry: a request the format cannot
// carry is the client's 400, before anything is sent; a feature its wire
// lacks is not supported, so no such request is sent to it.
func TestOpenAIProviderRefusesWhatItCannotCarry(t *testing.T) {
	up := fakeupstream.New(t, providertest.ChatAnswer(providertest.ChatReply))
	p := channel(t, "oai-carry", up.URL)
	refused := func(path, body string) provider.UpstreamError {
		t.Helper()
		_, err := providertest.Do(t, p, providertest.Request{Channel: "oai-carry", Path: path, Body: body}.Call())
		var ue provider.UpstreamError
		if !errors.As(err, &ue) || ue.Status != 400 || provider.ErrorType(ue.Status) != "invalid_request_error" {
			t.Fatalf("%s: %v, want the client's 400", body, err)
		}
		return ue
	}
	if ue := refused(provider.PathMessages, `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":[{"type":"document","source":{"type":"text","media_type":"text/plain","data":"x"}}]}]}`); !strings.Contains(ue.Message, "provider openai") {
		t.Errorf("message: %s", ue.Message)
	}
	// a tool needs a name, as Messages wants: a nameless one would become
	// a function of no name, several times its size
	if ue := refused(provider.PathMessages, `{"model":"claude-sonnet-4-5","max_tokens":16,"tools":[{"name":"f","input_schema":{}},{"input_schema":{}}],"messages":[{"role":"user","content":"Hi"}]}`); !strings.HasSuffix(ue.Message, "(provider openai): tools.1.name: Field required") {
		t.Errorf("message: %s", ue.Message)
	}
	refused(provider.PathCountTokens, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`)
	for _, feature := range []string{"web_search", "container", "context_management", "interleaved-thinking-2025-05-14"} {
		if got := p.Supports(feature); got != provider.Unsupported {
			t.Errorf("Supports(%q) = %v, want no", feature, got)
		}
	}
	if up.Hits() != 0 {
		t.Errorf("hits %d", up.Hits())
	}
	// what it can carry still goes
	if a := providertest.Send(t, p, providertest.Request{Channel: "oai-carry", Body: providertest.SimpleBody}.Call()); a.Status != 200 {
		t.Errorf("simple message: %d %s", a.Status, a.Body)
	}
}

func TestOpenAIProviderCaddyfile(t *testing.T) {
	// the relay hands the provider the channel's lines it does not know
	var p Provider
	if err := p.UnmarshalCaddyfile(caddyfile.NewTestDispenser("openai {\n\turl https://llm.example/v1/\n\tapi_key {env.RESELLER}\n}")); err != nil {
		t.Fatal(err)
	}
	if b, _ := json.Marshal(&p); string(b) != `{"url":"https://llm.example/v1/","api_key":"{env.RESELLER}"}` {
		t.Errorf("upstream = %s", b)
	}
	if got := (&Provider{URL: "https://llm.example/v1/"}).BaseURL(); got != "https://llm.example/v1" {
		t.Errorf("base URL = %s", got)
	}
	if (&Provider{}).BaseURL() != "https://api.openai.com/v1" {
		t.Error("no default URL")
	}
	err := new(Provider).UnmarshalCaddyfile(caddyfile.NewTestDispenser("openai"))
	if err == nil || !strings.Contains(err.Error(), "no api_key") {
		t.Errorf("without api_key: %v", err)
	}
}
