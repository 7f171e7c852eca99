package relay

import (
	"bytes"
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/anthropics/anthropic-sdk-go/v2"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/memtest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/shared"
	"github.com/tidwall/gjson"
)

// openaiClient is the official OpenAI SDK pointed at the relay, without
// its own retries.
func openaiClient(opts ...option.RequestOption) openai.Client {
	return openai.NewClient(append([]option.RequestOption{
		option.WithBaseURL(relayURL + "/v1/"), option.WithAPIKey(clientKey), option.WithMaxRetries(0),
	}, opts...)...)
}

// wantOpenAIError checks that err is the SDK's API error with status,
// type, code and param.
func wantOpenAIError(t *testing.T, err error, status int, typ, code, param string) *openai.Error {
	t.Helper()
	var apiErr *openai.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("error = %v, want an *openai.Error", err)
	}
	if apiErr.StatusCode != status || apiErr.Type != typ || apiErr.Code != code || apiErr.Param != param {
		t.Fatalf("error = %d %q %q %q, want %d %q %q %q (%s)", apiErr.StatusCode, apiErr.Type, apiErr.Code, apiErr.Param, status, typ, code, param, apiErr.Message)
	}
	return apiErr
}

func TestChatCompletionWithTheOpenAISDK(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Raw(http.StatusOK, []byte(`{"id":"msg_1","type":"message","role":"assistant","model":"claude-sonnet-4-5",`+
		`"content":[{"type":"text","text":"Bonjour"}],"stop_reason":"end_turn","stop_sequence":null,`+
		`"usage":{"input_tokens":7,"cache_read_input_tokens":20,"cache_creation_input_tokens":3,"output_tokens":4}}`)))
	startRelay(t, channelBlock("oai-basic", up.URL)+keyAndGroup("oai-basic", "oai-basic"))

	c := openaiClient()
	resp, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model: "claude-sonnet-4-5",
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.SystemMessage("Be brief."),
			openai.DeveloperMessage("Answer in French."),
			openai.UserMessage("Hello"),
		},
		MaxCompletionTokens: openai.Int(100),
		Temperature:         openai.Float(0.5),
		Stop:                openai.ChatCompletionNewParamsStopUnion{OfStringArray: []string{"END"}},
		User:                openai.String("user-42"),
	})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Choices[0].Message.Content; got != "Bonjour" {
		t.Errorf("content = %q, want Bonjour", got)
	}
	if resp.Choices[0].FinishReason != "stop" || resp.Object != "chat.completion" || resp.Model != "claude-sonnet-4-5" {
		t.Errorf("finish_reason %q, object %q, model %q", resp.Choices[0].FinishReason, resp.Object, resp.Model)
	}
	if u := resp.Usage; u.PromptTokens != 30 || u.CompletionTokens != 4 || u.TotalTokens != 34 || u.PromptTokensDetails.CachedTokens != 20 {
		t.Errorf("usage = %+v, want 30 prompt (20 cached), 4 completion", u)
	}

	got := up.Last(t)
	if got.Path != "/v1/messages" {
		t.Fatalf("upstream path = %s", got.Path)
	}
	want := `{"model":"claude-sonnet-4-5","max_tokens":100,"system":[{"type":"text","text":"Be brief."},{"type":"text","text":"Answer in French."}],` +
		`"messages":[{"role":"user","content":[{"type":"text","text":"Hello"}]}],"stop_sequences":["END"],"temperature":0.5,"metadata":{"user_id":"user-42"}}`
	if string(got.Body) != want {
		t.Errorf("upstream body\n got %s\nwant %s", got.Body, want)
	}
	if got.Header.Get("Authorization") != "" || got.Header.Get("X-Api-Key") != channelKey {
		t.Errorf("upstream credentials: authorization %q, x-api-key %q", got.Header.Get("Authorization"), got.Header.Get("X-Api-Key"))
	}
	// the OpenAI SDK sends no anthropic-version; Anthropic's API requires one
	if v := got.Header.Get("Anthropic-Version"); v != "2023-06-01" {
		t.Errorf("upstream anthropic-version %q, want 2023-06-01", v)
	}
}

func TestChatCompletionStreamWithUsage(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Stream(fakeupstream.StreamEvents("claude-sonnet-4-5",
		fakeupstream.Usage{InputTokens: 5, CacheReadInputTokens: 100, OutputTokens: 9}, "Hel", "lo \"world\"")...))
	startRelay(t, channelBlock("oai-stream", up.URL)+keyAndGroup("oai-stream", "oai-stream"))

	c := openaiClient()
	stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model:         "claude-sonnet-4-5",
		Messages:      []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hi")},
		StreamOptions: openai.ChatCompletionStreamOptionsParam{IncludeUsage: openai.Bool(true)},
	})
	var acc openai.ChatCompletionAccumulator
	chunks := 0
	for stream.Next() {
		acc.AddChunk(stream.Current())
		chunks++
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if got := acc.Choices[0].Message.Content; got != `Hello "world"` {
		t.Errorf("content = %q", got)
	}
	if acc.Choices[0].FinishReason != "stop" {
		t.Errorf("finish_reason = %q", acc.Choices[0].FinishReason)
	}
	if u := acc.Usage; u.PromptTokens != 105 || u.CompletionTokens != 9 || u.PromptTokensDetails.CachedTokens != 100 {
		t.Errorf("usage = %+v", u)
	}
	if chunks != 5 { // role, two deltas, finish, usage
		t.Errorf("%d chunks, want 5", chunks)
	}
	if !gjson.GetBytes(up.Last(t).Body, "stream").Bool() {
		t.Errorf("upstream body does not stream: %s", up.Last(t).Body)
	}
}

// toolReply is a Messages answer that calls a tool after a sentence.
const toolReply = `{"id":"msg_t","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[` +
	`{"type":"text","text":"Let me look."},{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{"city":"Paris"}}],` +
	`"stop_reason":"tool_use","stop_sequence":null,"usage":{"input_tokens":50,"output_tokens":20}}`

func toolStreamEvents() []string {
	return []string{
		fakeupstream.Event("message_start", `{"type":"message_start","message":{"id":"msg_t","type":"message","role":"assistant","model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":50,"output_tokens":1}}}`),
		fakeupstream.Event("content_block_start", `{"type":"content_block_start","index":0,"content_block":{"type":"tool_use","id":"toolu_1","name":"get_weather","input":{}}}`),
		fakeupstream.Event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"{\"city\":"}}`),
		fakeupstream.Event("content_block_delta", `{"type":"content_block_delta","index":0,"delta":{"type":"input_json_delta","partial_json":"\"Paris\"}"}}`),
		fakeupstream.Event("content_block_stop", `{"type":"content_block_stop","index":0}`),
		fakeupstream.Event("message_delta", `{"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":20}}`),
		fakeupstream.Event("message_stop", `{"type":"message_stop"}`),
	}
}

func TestChatCompletionTools(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Raw(http.StatusOK, []byte(toolReply)))
	startRelay(t, channelBlock("oai-tools", up.URL)+keyAndGroup("oai-tools", "oai-tools"))
	c := openaiClient()
	params := openai.ChatCompletionNewParams{
		Model: "claude-sonnet-4-5",
		Messages: []openai.ChatCompletionMessageParamUnion{
			openai.UserMessage("Weather in Paris and Rome?"),
			{OfAssistant: &openai.ChatCompletionAssistantMessageParam{ToolCalls: []openai.ChatCompletionMessageToolCallUnionParam{
				{OfFunction: &openai.ChatCompletionMessageFunctionToolCallParam{ID: "call_a", Function: openai.ChatCompletionMessageFunctionToolCallFunctionParam{Name: "get_weather", Arguments: `{"city":"Rome"}`}}},
			}}},
			openai.ToolMessage("Sunny", "call_a"),
		},
		Tools: []openai.ChatCompletionToolUnionParam{openai.ChatCompletionFunctionTool(shared.FunctionDefinitionParam{
			Name: "get_weather", Description: openai.String("Weather of a city"),
			Parameters: shared.FunctionParameters{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}},
		})},
		ToolChoice:        openai.ChatCompletionToolChoiceOptionUnionParam{OfAuto: openai.String("required")},
		ParallelToolCalls: openai.Bool(false),
	}
	resp, err := c.Chat.Completions.New(context.Background(), params)
	if err != nil {
		t.Fatal(err)
	}
	m := resp.Choices[0].Message
	if resp.Choices[0].FinishReason != "tool_calls" || m.Content != "Let me look." || len(m.ToolCalls) != 1 {
		t.Fatalf("answer = %+v, finish %q", m, resp.Choices[0].FinishReason)
	}
	if tc := m.ToolCalls[0]; tc.ID != "toolu_1" || tc.Function.Name != "get_weather" || tc.Function.Arguments != `{"city":"Paris"}` {
		t.Errorf("tool call = %+v", tc)
	}
	body := up.Last(t).Body
	for path, want := range map[string]string{
		"messages.1.content.0":      `{"type":"tool_use","id":"call_a","name":"get_weather","input":{"city":"Rome"}}`,
		"messages.2.content.0":      `{"type":"tool_result","tool_use_id":"call_a","content":[{"type":"text","text":"Sunny"}]}`,
		"tools.0":                   `{"name":"get_weather","description":"Weather of a city","input_schema":{"properties":{"city":{"type":"string"}},"type":"object"}}`,
		"tool_choice":               `{"type":"any","disable_parallel_tool_use":true}`,
		"messages.2.role":           `"user"`,
		"messages.#":                `3`,
		"messages.0.content.0.text": `"Weather in Paris and Rome?"`,
	} {
		if got := gjson.GetBytes(body, path).Raw; got != want {
			t.Errorf("upstream %s = %s, want %s", path, got, want)
		}
	}

	// streamed, the call arrives in pieces and the accumulator joins them
	up.SetHandler(fakeupstream.Stream(toolStreamEvents()...))
	stream := c.Chat.Completions.NewStreaming(context.Background(), params)
	var acc openai.ChatCompletionAccumulator
	var finished *openai.FinishedChatCompletionToolCall
	for stream.Next() {
		acc.AddChunk(stream.Current())
		if tc, ok := acc.JustFinishedToolCall(); ok {
			finished = &tc
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if acc.Choices[0].FinishReason != "tool_calls" || len(acc.Choices[0].Message.ToolCalls) != 1 {
		t.Fatalf("streamed answer = %+v", acc.Choices[0])
	}
	if tc := acc.Choices[0].Message.ToolCalls[0]; tc.ID != "toolu_1" || tc.Function.Name != "get_weather" || tc.Function.Arguments != `{"city":"Paris"}` {
		t.Errorf("streamed tool call = %+v", tc)
	}
	if finished == nil || finished.Arguments != `{"city":"Paris"}` {
		t.Errorf("JustFinishedToolCall = %+v", finished)
	}
}

func TestChatCompletionImages(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("a cat"))
	startRelay(t, channelBlock("oai-img", up.URL)+keyAndGroup("oai-img", "oai-img"))
	c := openaiClient()
	_, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model: "claude-sonnet-4-5",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
			openai.TextContentPart("What is this?"),
			openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: "data:image/png;base64,iVBORw0KGgo=", Detail: "high"}),
			openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: "https://example.com/cat.jpg"}),
		})},
	})
	if err != nil {
		t.Fatal(err)
	}
	content := gjson.GetBytes(up.Last(t).Body, "messages.0.content").Raw
	want := `[{"type":"text","text":"What is this?"},{"type":"image","source":{"type":"base64","media_type":"image/png","data":"iVBORw0KGgo="}},{"type":"image","source":{"type":"url","url":"https://example.com/cat.jpg"}}]`
	if content != want {
		t.Errorf("upstream content\n got %s\nwant %s", content, want)
	}

	// a URL Claude cannot fetch is the client's error, before any upstream
	hits := up.Hits()
	_, err = c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{
		Model: "claude-sonnet-4-5",
		Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage([]openai.ChatCompletionContentPartUnionParam{
			openai.ImageContentPart(openai.ChatCompletionContentPartImageImageURLParam{URL: "ftp://example.com/cat.jpg"}),
		})},
	})
	wantOpenAIError(t, err, 400, "invalid_request_error", "", "messages[0].content[0].image_url.url")
	if up.Hits() != hits {
		t.Error("a refused request reached the upstream")
	}
}

func TestChatCompletionErrors(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Error(http.StatusTooManyRequests, "rate_limit_error", "slow down", "Retry-After", "7"))
	startRelay(t, channelBlock("oai-err", up.URL)+keyAndGroup("oai-err", "oai-err"))
	c := openaiClient()
	hi := []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hi")}

	// refused by the translation: the parameter is named
	_, err := c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "claude-sonnet-4-5", Messages: hi, N: openai.Int(2)})
	wantOpenAIError(t, err, 400, "invalid_request_error", "", "n")
	_, err = c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "claude-sonnet-4-5", Messages: hi},
		option.WithJSONSet("best_of", 3))
	wantOpenAIError(t, err, 400, "invalid_request_error", "", "best_of")
	if up.Hits() != 0 {
		t.Fatalf("refused requests reached the upstream %d times", up.Hits())
	}

	// a wrong key
	bad := openaiClient(option.WithAPIKey("sk-wrong"))
	_, err = bad.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "claude-sonnet-4-5", Messages: hi})
	wantOpenAIError(t, err, 401, "invalid_request_error", "invalid_api_key", "")

	// the upstream's 429, passed through with its wait, in OpenAI's shape
	var raw *http.Response
	_, err = c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "claude-sonnet-4-5", Messages: hi}, option.WithResponseInto(&raw))
	e := wantOpenAIError(t, err, 429, "rate_limit_error", "rate_limit_exceeded", "")
	if e.Message != "slow down" || raw.Header.Get("Retry-After") != "7" {
		t.Errorf("message %q, retry-after %q", e.Message, raw.Header.Get("Retry-After"))
	}

	// the relay's own refusal keeps its code
	if code, b := adminPost(t, "oai-err", "disable"); code != http.StatusOK {
		t.Fatalf("disable: %d %s", code, b)
	}
	_, err = c.Chat.Completions.New(context.Background(), openai.ChatCompletionNewParams{Model: "claude-sonnet-4-5", Messages: hi})
	wantOpenAIError(t, err, 503, "server_error", "no_healthy_channel", "")

	// a wrong method on the route
	r := send(t, http.MethodGet, "/v1/chat/completions", clientKey, "")
	if r.status != 405 || gjson.GetBytes(r.body, "error.type").Str != "invalid_request_error" || gjson.GetBytes(r.body, "type").Exists() {
		t.Errorf("GET: %d %s", r.status, r.body)
	}
}

func TestChatCompletionFailsOverBeforeTheCommitPoint(t *testing.T) {
	// the first channel answers 200 and then overloaded before any content
	broken := fakeupstream.New(t, fakeupstream.Stream(
		fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 5, OutputTokens: 1})[0],
		fakeupstream.Event("error", string(fakeupstream.ErrorBody("overloaded_error", "Overloaded")))))
	good := fakeupstream.New(t, fakeupstream.Stream(fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 5, OutputTokens: 2}, "fine")...))
	startRelay(t, channelBlock("oai-fo-a", broken.URL, "priority 1")+channelBlock("oai-fo-b", good.URL, "priority 2")+
		keyAndGroup("oai-fo", "oai-fo-a oai-fo-b"))

	c := openaiClient()
	var raw *http.Response
	stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model: "claude-sonnet-4-5", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hi")},
	}, option.WithResponseInto(&raw))
	var acc openai.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if acc.Choices[0].Message.Content != "fine" || broken.Hits() != 1 || good.Hits() != 1 {
		t.Errorf("content %q, hits %d and %d", acc.Choices[0].Message.Content, broken.Hits(), good.Hits())
	}
	if raw.Header.Get("X-Relay-Attempts") != "2" {
		t.Errorf("x-relay-attempts = %q", raw.Header.Get("X-Relay-Attempts"))
	}
}

func TestChatCompletionStreamBrokenAfterTheCommitPoint(t *testing.T) {
	evs := fakeupstream.StreamEvents("claude-sonnet-4-5", fakeupstream.Usage{InputTokens: 5, OutputTokens: 2}, "partial")
	up := fakeupstream.New(t, fakeupstream.StreamThenCut(evs[:4]...)) // cut after the first delta
	startRelay(t, channelBlock("oai-cut", up.URL)+keyAndGroup("oai-cut", "oai-cut"))

	r := send(t, http.MethodPost, "/v1/chat/completions", clientKey, `{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 200 {
		t.Fatalf("status %d: %s", r.status, r.body)
	}
	body := string(r.body)
	if strings.Contains(body, "[DONE]") || !strings.Contains(body, `"content":"partial"`) {
		t.Fatalf("stream:\n%s", body)
	}
	last := body[strings.LastIndex(strings.TrimSpace(body), "\n\n")+2:]
	if e := gjson.Get(strings.TrimPrefix(strings.TrimSpace(last), "data: "), "error"); e.Get("type").Str != "server_error" || !strings.Contains(e.Get("message").Str, "after the response started") {
		t.Errorf("last event = %q", last)
	}

	// the SDK raises it (the channel cools after the break: bring it back)
	if code, b := adminPost(t, "oai-cut", "reset"); code != http.StatusOK {
		t.Fatalf("reset: %d %s", code, b)
	}
	c := openaiClient()
	stream := c.Chat.Completions.NewStreaming(context.Background(), openai.ChatCompletionNewParams{
		Model: "claude-sonnet-4-5", Messages: []openai.ChatCompletionMessageParamUnion{openai.UserMessage("Hi")},
	})
	for stream.Next() {
	}
	if err := stream.Err(); err == nil || !strings.Contains(err.Error(), "after the response started") {
		t.Errorf("stream error = %v", err)
	}
}

func TestModelsListServesBothSDKs(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("x"))
	startRelay(t, channelBlock("oai-models", up.URL, "models claude-sonnet-4-5 claude-haiku-4-5")+keyAndGroup("oai-models", "oai-models"))
	c := openaiClient()
	page, err := c.Models.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Data) != 2 || page.Data[0].ID != "claude-sonnet-4-5" || page.Data[0].Object != "model" || page.Data[0].OwnedBy != "anthropic" {
		t.Errorf("models = %+v", page.Data)
	}
	m, err := c.Models.Get(context.Background(), "claude-haiku-4-5")
	if err != nil || m.ID != "claude-haiku-4-5" {
		t.Errorf("model = %+v, %v", m, err)
	}

	// the Anthropic SDK reads the same list, and pages through it
	sdk := anthropicSDK()
	pager := sdk.Models.ListAutoPaging(context.Background(), anthropic.ModelListParams{Limit: anthropic.Int(1)})
	var ids []string
	for pager.Next() {
		ids = append(ids, pager.Current().ID)
	}
	if err := pager.Err(); err != nil || strings.Join(ids, " ") != "claude-sonnet-4-5 claude-haiku-4-5" {
		t.Errorf("anthropic SDK: %v, %v", ids, err)
	}
}

// TestChatCompletionOfEmptyMessagesIsA400: through Caddy, the 8 MiB of
// empty messages get the 400 of their first, in OpenAI's shape, and no
// upstream hears of them.
func TestChatCompletionOfEmptyMessagesIsA400(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("x"))
	startRelay(t, channelBlock("oai-empty", up.URL)+keyAndGroup("oai-empty", "oai-empty"))
	r := send(t, http.MethodPost, "/v1/chat/completions", clientKey, string(memtest.EmptyMessages()))
	want := `{"error":{"message":"messages[0].role: must be system, developer, user, assistant or tool","type":"invalid_request_error","param":"messages[0].role","code":null}}`
	if r.status != http.StatusBadRequest || string(r.body) != want {
		t.Errorf("%d %s\nwant 400 %s", r.status, r.body, want)
	}
	if up.Hits() != 0 {
		t.Errorf("the upstream was asked %d times", up.Hits())
	}
}

// BenchmarkChatCompletionOfEmptyMessages is the request of
// TestChatCompletionOfEmptyMessagesIsA400 through the handler, from its
// key to its 400: what refusing 8 MiB of empty messages takes.
func BenchmarkChatCompletionOfEmptyMessages(b *testing.B) {
	body := memtest.EmptyMessages()
	r := &Relay{
		Keys:     []*Key{{Secret: "sk-bench-empty-messages", Group: "bench-empty"}},
		Channels: []*Channel{{Name: "bench-empty", UpstreamRaw: upstream("anthropic", "url", "http://127.0.0.1:9", "api_key", "{env.HOME}")}},
		Groups:   []*Group{{Name: "bench-empty", Channels: []string{"bench-empty"}}},
	}
	provisionHandler(b, r)
	srv := &caddyhttp.Server{}
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		req := httptest.NewRequest(http.MethodPost, PathChatCompletions, bytes.NewReader(body))
		req.Header.Set("Authorization", "Bearer sk-bench-empty-messages")
		w := httptest.NewRecorder()
		req = caddyhttp.PrepareRequest(req, caddy.NewReplacer(), w, srv)
		if err := r.ServeHTTP(w, req, nil); err != nil || w.Code != http.StatusBadRequest {
			b.Fatalf("%v %d %s", err, w.Code, w.Body)
		}
	}
}
