package relay

import (
	"encoding/json"
	"strings"
	"testing"
)

func TestMockChannelServesWithoutCredentials(t *testing.T) {
	startRelay(t, "\t\tchannel mock-only {\n\t\t\tprovider mock\n\t\t\ttokens 5\n\t\t}\n"+keyAndGroup("mockg", "mock-only", "expose_channel"))
	r := message(t, simpleBody)
	var msg struct {
		Model   string `json:"model"`
		Content []struct {
			Text string `json:"text"`
		} `json:"content"`
		Usage struct {
			InputTokens  int `json:"input_tokens"`
			OutputTokens int `json:"output_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(r.body, &msg); err != nil || r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if msg.Model != "claude-sonnet-4-5" || !strings.Contains(msg.Content[0].Text, "mock-only") || msg.Usage.OutputTokens != 5 || msg.Usage.InputTokens < 1 {
		t.Errorf("mock reply: %+v", msg)
	}
	if r.header.Get("X-Relay-Channel") != "mock-only" {
		t.Errorf("x-relay-channel = %q", r.header.Get("X-Relay-Channel"))
	}
	r = message(t, streamBody)
	if !strings.HasPrefix(string(r.body), "event: message_start\n") || !strings.HasSuffix(string(r.body), "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n") {
		t.Errorf("mock stream:\n%s", r.body)
	}
}

// The mock refuses what Anthropic's API refuses, with the API's 400 and
// message (the rules of the tests' strict upstream), passes the refusal to
// the client as a real upstream's, and cools nothing for it. A client that
// names no anthropic-version is served, as provider anthropic serves it
// (it sends the SDKs' version).
func TestMockRefusesWhatTheAPIRefuses(t *testing.T) {
	startRelay(t, "\t\tchannel mock-only {\n\t\t\tprovider mock\n\t\t\tfail_rate 0\n\t\t}\n"+keyAndGroup("mockg", "mock-only", "expose_channel"))
	cases := []struct {
		name, path, body, msg string
	}{
		{"no max_tokens", "/v1/messages", `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`, "max_tokens: Field required"},
		{"no messages", "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":16}`, "messages: Field required"},
		{"empty messages", "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[]}`, "messages: at least one message is required"},
		{"an unknown field", "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":16,"max_output":5,"messages":[{"role":"user","content":"Hi"}]}`, "max_output: Extra inputs are not permitted"},
		{"a streamed one", "/v1/messages", `{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"}]}`, "max_tokens: Field required"},
		{"max_tokens on count_tokens", "/v1/messages/count_tokens", simpleBody, "max_tokens: Extra inputs are not permitted"},
		{"a tool loop without its thinking", "/v1/messages", `{"model":"claude-sonnet-4-5","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[` +
			`{"role":"user","content":"Hi"},{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"f","input":{}}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"ok"}]}]}`,
			"messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`."},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			r := send(t, "POST", c.path, clientKey, c.body)
			if r.status != 400 {
				t.Fatalf("status %d, want 400: %s", r.status, r.body)
			}
			var e struct {
				Type  string `json:"type"`
				Error struct {
					Type    string `json:"type"`
					Message string `json:"message"`
				} `json:"error"`
				RequestID string `json:"request_id"`
			}
			if err := json.Unmarshal(r.body, &e); err != nil {
				t.Fatalf("%v: %s", err, r.body)
			}
			if e.Type != "error" || e.Error.Type != "invalid_request_error" || !strings.HasPrefix(e.Error.Message, c.msg) {
				t.Errorf("body %s, want an invalid_request_error %q", r.body, c.msg)
			}
			if !strings.HasPrefix(e.RequestID, "req_mock_") || r.header.Get("Request-Id") != e.RequestID {
				t.Errorf("request_id %q, Request-Id %q: want the mock's, the same", e.RequestID, r.header.Get("Request-Id"))
			}
			if ch := r.header.Get("X-Relay-Channel"); ch != "mock-only" {
				t.Errorf("x-relay-channel = %q: the refusal is the channel's answer", ch)
			}
		})
	}
	// the client's mistakes cooled nothing: the only channel still serves,
	// and a client without anthropic-version is served as provider
	// anthropic serves it
	for _, h := range [][]string{nil, {"Anthropic-Version", ""}} {
		if r := message(t, simpleBody, h...); r.status != 200 {
			t.Errorf("a valid request after the refusals (header %q): %d %s", h, r.status, r.body)
		}
	}
	if r := send(t, "POST", "/v1/messages/count_tokens", clientKey, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 {
		t.Errorf("count_tokens: %d %s", r.status, r.body)
	}
}
