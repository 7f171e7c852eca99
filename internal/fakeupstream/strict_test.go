package fakeupstream

import (
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"strings"
	"testing"
)

// anthropicHeaders are what an Anthropic SDK sends with the fake's key.
func anthropicHeaders(kv ...string) map[string]string {
	h := map[string]string{"X-Api-Key": Key, "Anthropic-Version": "2023-06-01", "Content-Type": "application/json"}
	for i := 0; i+1 < len(kv); i += 2 {
		if kv[i+1] == "" {
			delete(h, kv[i])
		} else {
			h[kv[i]] = kv[i+1]
		}
	}
	return h
}

const (
	okMessage  = `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	okCount    = `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`
	okBedrock  = `{"anthropic_version":"bedrock-2023-05-31","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	okVertex   = `{"anthropic_version":"vertex-2023-10-16","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`
	okChat     = `{"model":"gpt-5","messages":[{"role":"user","content":"Hi"}],"max_tokens":16}`
	bedrockURL = "/model/us.anthropic.claude-sonnet-4-5-20250929-v1:0/invoke"
	vertexURL  = "/v1/projects/p/locations/us-east5/publishers/anthropic/models/"
	sigV4      = "AWS4-HMAC-SHA256 Credential=AKIDTEST/20250101/us-east-1/bedrock/aws4_request, SignedHeaders=host;x-amz-date, Signature=abc"
)

func anthropicErr(status int, typ, msg string) want {
	return want{status: status, body: `{"type":"error","error":{"type":"` + typ + `","message":` + quote(msg) + `},"request_id":"req_fake_error"}`, header: [2]string{"Request-Id", "req_fake_error"}}
}

func bedrockErr(status int, name, msg string) want {
	return want{status: status, body: `{"message":` + quote(msg) + `}`, header: [2]string{"X-Amzn-Errortype", name + ":http://internal.amazon.com/coral/com.amazon.bedrock/"}}
}

func openAIErr(status int, msg, param, code string) want {
	null := func(s string) string {
		if s == "" {
			return "null"
		}
		return quote(s)
	}
	return want{status: status, body: `{"error":{"message":` + quote(msg) + `,"type":"invalid_request_error","param":` + null(param) + `,"code":` + null(code) + `}}`}
}

func quote(s string) string {
	b, _ := json.Marshal(s)
	return string(b)
}

// want is the fake's answer: a refusal's status, exact JSON body and one
// header, or (status 0) the handler's.
type want struct {
	status int
	body   string
	header [2]string
}

var passed = want{}

func countBody(invoke string) string {
	return `{"input":{"invokeModel":{"body":"` + base64.StdEncoding.EncodeToString([]byte(invoke)) + `"}}}`
}

func TestStrictUpstreamRefusesWhatTheRealAPIRefuses(t *testing.T) {
	cases := []struct {
		name         string
		method, path string
		header       map[string]string
		body         string
		opts         []Option
		want         want
	}{
		// Anthropic: credentials, then the version, on every endpoint
		{"a message passes", "POST", "/v1/messages", anthropicHeaders(), okMessage, nil, passed},
		{"a prefixed path is Anthropic's too", "POST", "/anthropic/v1/messages", anthropicHeaders("Anthropic-Version", ""), okMessage, nil,
			anthropicErr(400, "invalid_request_error", "anthropic-version: header is required")},
		{"no credential", "POST", "/v1/messages", anthropicHeaders("X-Api-Key", ""), okMessage, nil,
			anthropicErr(401, "authentication_error", "x-api-key header is required")},
		{"a wrong x-api-key", "POST", "/v1/messages", anthropicHeaders("X-Api-Key", "sk-ant-other"), okMessage, nil,
			anthropicErr(401, "authentication_error", "invalid x-api-key")},
		{"the key as a bearer token", "POST", "/v1/messages", anthropicHeaders("X-Api-Key", "", "Authorization", "Bearer "+Key), okMessage, nil, passed},
		{"a wrong bearer token", "POST", "/v1/messages", anthropicHeaders("X-Api-Key", "", "Authorization", "Bearer sk-other"), okMessage, nil,
			anthropicErr(401, "authentication_error", "Invalid bearer token")},
		{"another accepted key", "POST", "/v1/messages", anthropicHeaders("X-Api-Key", "sk-second-org"), okMessage, []Option{AcceptKeys("sk-second-org")}, passed},
		{"AcceptKeys replaces Key", "POST", "/v1/messages", anthropicHeaders(), okMessage, []Option{AcceptKeys("sk-second-org")},
			anthropicErr(401, "authentication_error", "invalid x-api-key")},
		{"no version", "POST", "/v1/messages", anthropicHeaders("Anthropic-Version", ""), okMessage, nil,
			anthropicErr(400, "invalid_request_error", "anthropic-version: header is required")},
		{"no version on count_tokens", "POST", "/v1/messages/count_tokens", anthropicHeaders("Anthropic-Version", ""), okCount, nil,
			anthropicErr(400, "invalid_request_error", "anthropic-version: header is required")},
		{"no version on a batch list", "GET", "/v1/messages/batches", anthropicHeaders("Anthropic-Version", ""), "", nil,
			anthropicErr(400, "invalid_request_error", "anthropic-version: header is required")},
		{"no version on a file upload", "POST", "/v1/files", anthropicHeaders("Anthropic-Version", ""), "--x--", nil,
			anthropicErr(400, "invalid_request_error", "anthropic-version: header is required")},
		{"no key on a file's content", "GET", "/v1/files/file_1/content", anthropicHeaders("X-Api-Key", ""), "", nil,
			anthropicErr(401, "authentication_error", "x-api-key header is required")},
		{"no version on the models", "GET", "/v1/models", anthropicHeaders("Anthropic-Version", ""), "", nil,
			anthropicErr(400, "invalid_request_error", "anthropic-version: header is required")},
		{"any version passes as sent", "POST", "/v1/messages", anthropicHeaders("Anthropic-Version", "2026-10-21"), okMessage, nil, passed},

		// Anthropic: the Messages body
		{"no max_tokens", "POST", "/v1/messages", anthropicHeaders(), `{"model":"m","messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "max_tokens: Field required")},
		{"no messages", "POST", "/v1/messages", anthropicHeaders(), `{"model":"m","max_tokens":1}`, nil,
			anthropicErr(400, "invalid_request_error", "messages: Field required")},
		{"no model", "POST", "/v1/messages", anthropicHeaders(), `{"max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "model: Field required")},
		{"empty messages", "POST", "/v1/messages", anthropicHeaders(), `{"model":"m","max_tokens":1,"messages":[ ]}`, nil,
			anthropicErr(400, "invalid_request_error", "messages: at least one message is required")},
		{"an unknown field", "POST", "/v1/messages", anthropicHeaders(), `{"model":"m","max_tokens":1,"x_unknown":1,"also":2,"messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "x_unknown: Extra inputs are not permitted")},
		{"a cloud's anthropic_version", "POST", "/v1/messages", anthropicHeaders(), `{"anthropic_version":"bedrock-2023-05-31","model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "anthropic_version: Extra inputs are not permitted")},
		{"every first-party field", "POST", "/v1/messages", anthropicHeaders(),
			`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}],"stream":true,"system":"s","metadata":{"user_id":"u"},"service_tier":"auto","inference_geo":"us","speed":"fast","container":"c","mcp_servers":[],"context_management":{},"cache_control":{"type":"ephemeral"},"output_config":{},"thinking":{"type":"enabled","budget_tokens":1024},"tools":[],"tool_choice":{"type":"auto"},"stop_sequences":["x"],"temperature":1,"top_p":1,"top_k":1}`, nil, passed},
		{"a body that is not JSON", "POST", "/v1/messages", anthropicHeaders(), `not json`, nil,
			anthropicErr(400, "invalid_request_error", "The request body is not valid JSON: unexpected character: line 1 column 2 (char 1)")},
		{"a body that is not an object", "POST", "/v1/messages", anthropicHeaders(), `[1]`, nil,
			anthropicErr(400, "invalid_request_error", "The request body is not a JSON object")},
		{"five cache breakpoints", "POST", "/v1/messages", anthropicHeaders(),
			`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":[` + strings.Repeat(`{"type":"text","text":"x","cache_control":{"type":"ephemeral"}},`, 4) +
				`{"type":"text","text":"x","cache_control":{"type":"ephemeral"}}]}]}`, nil,
			anthropicErr(400, "invalid_request_error", "A maximum of 4 blocks with cache_control may be provided. Found 5.")},
		{"a thinking block without its signature", "POST", "/v1/messages", anthropicHeaders(),
			`{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":[{"type":"thinking","thinking":"t"},{"type":"text","text":"ok"}]},{"role":"user","content":"Go"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "messages.1.content.0.thinking.signature: Field required")},

		// count_tokens: no max_tokens
		{"count_tokens passes", "POST", "/v1/messages/count_tokens", anthropicHeaders(), okCount, nil, passed},
		{"count_tokens with max_tokens", "POST", "/v1/messages/count_tokens", anthropicHeaders(), okMessage, nil,
			anthropicErr(400, "invalid_request_error", "max_tokens: Extra inputs are not permitted")},
		{"count_tokens without messages", "POST", "/v1/messages/count_tokens", anthropicHeaders(), `{"model":"m"}`, nil,
			anthropicErr(400, "invalid_request_error", "messages: Field required")},

		// batches: each request's params is a Messages body
		{"a batch passes", "POST", "/v1/messages/batches", anthropicHeaders(), `{"requests":[{"custom_id":"a","params":` + okMessage + `}]}`, nil, passed},
		{"a batch without requests", "POST", "/v1/messages/batches", anthropicHeaders(), `{}`, nil,
			anthropicErr(400, "invalid_request_error", "requests: Field required")},
		{"a batch request without max_tokens", "POST", "/v1/messages/batches", anthropicHeaders(),
			`{"requests":[{"custom_id":"a","params":` + okMessage + `},{"custom_id":"b","params":{"model":"m","messages":[{"role":"user","content":"Hi"}]}}]}`, nil,
			anthropicErr(400, "invalid_request_error", "requests.1.params.max_tokens: Field required")},
		{"a batch request without custom_id", "POST", "/v1/messages/batches", anthropicHeaders(), `{"requests":[{"params":` + okMessage + `}]}`, nil,
			anthropicErr(400, "invalid_request_error", "requests.0.custom_id: Field required")},
		{"a batch with an unknown field", "POST", "/v1/messages/batches", anthropicHeaders(), `{"requests":[{"custom_id":"a","params":` + okMessage + `}],"extra":1}`, nil,
			anthropicErr(400, "invalid_request_error", "extra: Extra inputs are not permitted")},

		// Bedrock
		{"a signed InvokeModel passes", "POST", bedrockURL, map[string]string{"Authorization": sigV4}, okBedrock, nil, passed},
		{"a Bedrock API key", "POST", bedrockURL, map[string]string{"Authorization": "Bearer " + Key}, okBedrock, nil, passed},
		{"a wrong Bedrock API key", "POST", bedrockURL, map[string]string{"Authorization": "Bearer nope"}, okBedrock, nil,
			bedrockErr(403, "UnrecognizedClientException", "The security token included in the request is invalid.")},
		{"no Authorization on Bedrock", "POST", bedrockURL, nil, okBedrock, nil,
			bedrockErr(403, "MissingAuthenticationTokenException", "Missing Authentication Token")},
		{"a signature for another service", "POST", bedrockURL, map[string]string{"Authorization": strings.Replace(sigV4, "/bedrock/", "/s3/", 1)}, okBedrock, nil,
			bedrockErr(403, "InvalidSignatureException", "Credential should be scoped to correct service: 'bedrock'.")},
		{"model in a Bedrock body", "POST", bedrockURL + "-with-response-stream", map[string]string{"Authorization": sigV4}, `{"anthropic_version":"bedrock-2023-05-31","model":"m","max_tokens":1,"messages":[]}`, nil,
			bedrockErr(400, "ValidationException", "Malformed input request: #: extraneous key [model] is not permitted, please reformat your input and try again.")},
		{"no anthropic_version in a Bedrock body", "POST", bedrockURL, map[string]string{"Authorization": sigV4}, okMessage, nil,
			bedrockErr(400, "ValidationException", "Malformed input request: #: required key [anthropic_version] not found, please reformat your input and try again.")},
		{"a Bedrock count with a valid inner body", "POST", "/model/anthropic.claude-sonnet-4-5-20250929-v1:0/count-tokens", map[string]string{"Authorization": sigV4}, countBody(okBedrock), nil, passed},
		{"a Bedrock count whose inner body has stream", "POST", "/model/anthropic.claude-sonnet-4-5-20250929-v1:0/count-tokens", map[string]string{"Authorization": sigV4},
			countBody(`{"anthropic_version":"bedrock-2023-05-31","max_tokens":1,"stream":true,"messages":[{"role":"user","content":"Hi"}]}`), nil,
			bedrockErr(400, "ValidationException", "Malformed input request: #: extraneous key [stream] is not permitted, please reformat your input and try again.")},

		// Vertex
		{"a Vertex message passes", "POST", vertexURL + "claude-sonnet-4-5@20250929:rawPredict", map[string]string{"Authorization": "Bearer ya29.x"}, okVertex, nil, passed},
		{"no token on Vertex", "POST", vertexURL + "claude-sonnet-4-5@20250929:streamRawPredict", nil, okVertex, nil,
			want{status: 401, body: `{"error":{"code":401,"message":"Request is missing required authentication credential. Expected OAuth 2 access token, login cookie or other valid authentication credential. See https://developers.google.com/identity/sign-in/web/devconsole-project.","status":"UNAUTHENTICATED"}}`}},
		{"no anthropic_version on Vertex", "POST", vertexURL + "claude-sonnet-4-5@20250929:rawPredict", map[string]string{"Authorization": "Bearer ya29.x"}, `{"max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "anthropic_version: Field required")},
		{"model in a Vertex message", "POST", vertexURL + "claude-sonnet-4-5@20250929:rawPredict", map[string]string{"Authorization": "Bearer ya29.x"}, `{"anthropic_version":"vertex-2023-10-16","model":"m","max_tokens":16,"messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "model: Extra inputs are not permitted")},
		{"a Vertex count needs its model", "POST", vertexURL + "count-tokens:rawPredict", map[string]string{"Authorization": "Bearer ya29.x"}, `{"anthropic_version":"vertex-2023-10-16","messages":[{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "model: Field required")},
		{"a Vertex count passes", "POST", vertexURL + "count-tokens:rawPredict", map[string]string{"Authorization": "Bearer ya29.x"}, `{"anthropic_version":"vertex-2023-10-16","model":"claude-sonnet-4-5@20250929","messages":[{"role":"user","content":"Hi"}]}`, nil, passed},

		// OpenAI
		{"a chat completion passes", "POST", "/v1/chat/completions", map[string]string{"Authorization": "Bearer " + Key}, okChat, nil, passed},
		{"no OpenAI key", "POST", "/v1/chat/completions", nil, okChat, nil,
			openAIErr(401, "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).", "", "")},
		{"a wrong OpenAI key", "POST", "/api/v1/chat/completions", map[string]string{"Authorization": "Bearer sk-wrong-key-1234"}, okChat, nil,
			openAIErr(401, "Incorrect API key provided: sk-*********1234. You can find your API key at https://platform.openai.com/account/api-keys.", "", "invalid_api_key")},
		{"no messages in a chat", "POST", "/v1/chat/completions", map[string]string{"Authorization": "Bearer " + Key}, `{"model":"gpt-5"}`, nil,
			openAIErr(400, "Missing required parameter: 'messages'.", "messages", "missing_required_parameter")},
		{"no model in a chat", "POST", "/v1/chat/completions", map[string]string{"Authorization": "Bearer " + Key}, `{"messages":[{"role":"user","content":"Hi"}]}`, nil,
			openAIErr(400, "you must provide a model parameter", "", "")},
		{"empty messages in a chat", "POST", "/v1/chat/completions", map[string]string{"Authorization": "Bearer " + Key}, `{"model":"gpt-5","messages":[]}`, nil,
			openAIErr(400, "Invalid 'messages': empty array. Expected an array with minimum length 1, but got an empty array instead.", "messages", "empty_array")},
		{"an unknown chat parameter", "POST", "/v1/chat/completions", map[string]string{"Authorization": "Bearer " + Key}, `{"model":"gpt-5","messages":[{"role":"user","content":"Hi"}],"max_tokens_to_sample":5}`, nil,
			openAIErr(400, "Unrecognized request argument supplied: max_tokens_to_sample", "", "")},

		// thinking blocks: an account's signatures, a tool loop's last turn
		{"an account takes its own signature", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(false, signedBlock("acct", "plan"), textBlock), []Option{Account("acct")}, passed},
		{"an account refuses another's signature", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(false, signedBlock("other", "plan"), textBlock), []Option{Account("acct")},
			anthropicErr(400, "invalid_request_error", "messages.1.content.0: Invalid `signature` in `thinking` block")},
		{"a signature of other text is refused", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(false, textBlock, `{"type":"thinking","thinking":"edited","signature":"`+Signature("acct", "plan")+`"}`), []Option{Account("acct")},
			anthropicErr(400, "invalid_request_error", "messages.1.content.1: Invalid `signature` in `thinking` block")},
		{"an account takes its own redacted block", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(false, `{"type":"redacted_thinking","data":"`+RedactedData("acct", "n1")+`"}`, textBlock), []Option{Account("acct")}, passed},
		{"an account refuses another's redacted block", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(false, `{"type":"redacted_thinking","data":"`+RedactedData("other", "n1")+`"}`, textBlock), []Option{Account("acct")},
			anthropicErr(400, "invalid_request_error", "messages.1.content.0: Invalid `data` in `redacted_thinking` block")},
		{"without an account no signature is checked", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(false, signedBlock("other", "plan"), textBlock), nil, passed},
		{"a tool loop's last turn starts with its thinking", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(true, textBlock, toolBlock), nil,
			anthropicErr(400, "invalid_request_error", "messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `text`. When `thinking` is enabled, a final `assistant` message must start with a thinking block (preceeding the lastmost set of `tool_use` and `tool_result` blocks). We recommend you include thinking blocks from previous turns. To avoid this requirement, disable `thinking`. Please consult our documentation at https://docs.claude.com/en/docs/build-with-claude/extended-thinking")},
		{"a tool loop with its thinking passes", "POST", "/v1/messages", anthropicHeaders(), thinkingMsgs(true, signedBlock("acct", "plan"), toolBlock), []Option{Account("acct")}, passed},
		{"an empty message", "POST", "/v1/messages", anthropicHeaders(), `{"model":"m","max_tokens":16,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":[]},{"role":"user","content":"Hi"}]}`, nil,
			anthropicErr(400, "invalid_request_error", "messages.1: all messages must have non-empty content except for the optional final assistant message")},

		// what no wire claims, and the opt-out
		{"another path is the handler's", "POST", "/token", nil, `grant_type=x`, nil, passed},
		{"Lenient lets anything through", "POST", "/v1/messages", nil, `{"x":1}`, []Option{Lenient()}, passed},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			handled := 0
			// Start, not New: these refusals are what the test wants
			u := Start(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				handled++
				if got := mustReadAll(r.Body); got != c.body {
					t.Errorf("the handler read %q, want %q", got, c.body)
				}
				_, _ = io.WriteString(w, "handled")
			}), true, c.opts...)
			defer u.Close()
			req, _ := http.NewRequest(c.method, u.URL+c.path, strings.NewReader(c.body))
			for k, v := range c.header {
				req.Header.Set(k, v)
			}
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			body := mustReadAll(resp.Body)
			if u.Hits() != 1 || string(u.Last(t).Body) != c.body {
				t.Errorf("recorded %d requests, last body %q: every request is recorded, refused or not", u.Hits(), u.Last(t).Body)
			}
			if c.want == passed {
				if handled != 1 || resp.StatusCode != 200 || body != "handled" {
					t.Fatalf("not passed to the handler: %d %s (refusals %q)", resp.StatusCode, body, u.Refusals())
				}
				return
			}
			if handled != 0 {
				t.Errorf("the handler saw a refused request")
			}
			if resp.StatusCode != c.want.status {
				t.Errorf("status %d, want %d", resp.StatusCode, c.want.status)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("content-type %q", ct)
			}
			var got, exp any
			if err := json.Unmarshal([]byte(body), &got); err != nil {
				t.Fatalf("body %s: %v", body, err)
			}
			if err := json.Unmarshal([]byte(c.want.body), &exp); err != nil {
				t.Fatalf("the test's body %s: %v", c.want.body, err)
			}
			if !reflect.DeepEqual(got, exp) {
				t.Errorf("body\n got %s\nwant %s", body, c.want.body)
			}
			if k := c.want.header[0]; k != "" && resp.Header.Get(k) != c.want.header[1] {
				t.Errorf("%s = %q, want %q", k, resp.Header.Get(k), c.want.header[1])
			}
			if len(u.Refusals()) != 1 {
				t.Errorf("refusals %q, want the one", u.Refusals())
			}
		})
	}
}

// An upstream that records nothing, as the benchmarks start it, checks the
// same and still hands the handler the whole body.
func TestStrictUpstreamWithoutRecording(t *testing.T) {
	var seen string
	u := Start(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		seen = mustReadAll(r.Body)
	}), false)
	defer u.Close()
	post := func(key, body string) int {
		req, _ := http.NewRequest("POST", u.URL+"/v1/messages", strings.NewReader(body))
		for k, v := range anthropicHeaders("X-Api-Key", key) {
			req.Header.Set(k, v)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if st := post(Key, okMessage); st != 200 || seen != okMessage {
		t.Errorf("a valid message: %d, the handler read %q", st, seen)
	}
	seen = ""
	if st := post("sk-wrong", okMessage); st != 401 || seen != "" {
		t.Errorf("a wrong key: %d, the handler read %q", st, seen)
	}
	if u.Hits() != 0 {
		t.Errorf("recorded %d requests, want none", u.Hits())
	}
}

func mustReadAll(r io.Reader) string {
	b, _ := io.ReadAll(r)
	return string(b)
}

// BenchmarkUpstream measures a request of the benchmark harness's shape (a
// 10 KB message) through an upstream that records nothing, as the harness
// starts it, strict and lenient: what the checks add to each request.
func BenchmarkUpstream(b *testing.B) {
	body := `{"model":"claude-sonnet-4-5","max_tokens":64,"messages":[{"role":"user","content":"` +
		strings.Repeat("The quick brown fox jumps over the lazy dog. ", 227) + `"}]}`
	for _, mode := range []struct {
		name string
		opts []Option
	}{{"strict", nil}, {"lenient", []Option{Lenient()}}} {
		b.Run(mode.name, func(b *testing.B) {
			u := unstarted(Fast(), false, mode.opts)
			b.ReportAllocs()
			for b.Loop() {
				req, _ := http.NewRequest("POST", "/v1/messages", strings.NewReader(body))
				for k, v := range anthropicHeaders() {
					req.Header.Set(k, v)
				}
				w := discardWriter{h: http.Header{}}
				u.serve(&w, req)
				if w.status != 0 && w.status != 200 {
					b.Fatalf("status %d", w.status)
				}
			}
		})
	}
}

// discardWriter is an http.ResponseWriter that keeps only the status.
type discardWriter struct {
	h      http.Header
	status int
}

func (w *discardWriter) Header() http.Header         { return w.h }
func (w *discardWriter) Write(p []byte) (int, error) { return len(p), nil }
func (w *discardWriter) WriteHeader(s int)           { w.status = s }

// recordingT is a test whose errors are kept, not reported.
type recordingT struct {
	testing.TB
	errs []string
}

func (r *recordingT) Errorf(format string, args ...any) {
	r.errs = append(r.errs, fmt.Sprintf(format, args...))
}

// A request a test's upstream refuses fails that test: the relay sent what
// no real upstream takes, even when a failover hid it from the client.
func TestARefusalFailsTheTest(t *testing.T) {
	rt := &recordingT{TB: t}
	u := New(rt, Message("ok"))
	req, _ := http.NewRequest("POST", u.URL+"/v1/messages", strings.NewReader(okMessage))
	for k, v := range anthropicHeaders("Anthropic-Version", "") {
		req.Header.Set(k, v)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if want := "upstream " + u.URL + " refused POST /v1/messages: anthropic-version: header is required, as the real API would"; len(rt.errs) != 1 || rt.errs[0] != want {
		t.Errorf("errors %q, want %q", rt.errs, want)
	}
}

// Blocks and bodies of the thinking cases.
const (
	textBlock = `{"type":"text","text":"ok"}`
	toolBlock = `{"type":"tool_use","id":"toolu_1","name":"ls","input":{}}`
)

func signedBlock(secret, thinking string) string {
	return `{"type":"thinking","thinking":"` + thinking + `","signature":"` + Signature(secret, thinking) + `"}`
}

// thinkingMsgs is a Messages body with thinking on whose second message is
// an assistant turn of blocks; with loop, the last message answers its
// tool_use.
func thinkingMsgs(loop bool, blocks ...string) string {
	last := `{"role":"user","content":"Hi"}`
	if loop {
		last = `{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"a"}]}`
	}
	return `{"model":"m","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":[` +
		strings.Join(blocks, ",") + `]},` + last + `]}`
}
