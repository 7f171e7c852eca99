package mock

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/provider"
)

func TestMockServesWithoutCredentials(t *testing.T) {
	p := &Provider{ReplyTokens: 5}
	providertest.Provision(t, p, "mock-only")
	a := providertest.Send(t, p, providertest.Request{Channel: "mock-only", Body: providertest.SimpleBody}.Call())
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
	if err := json.Unmarshal(a.Body, &msg); err != nil || a.Status != 200 {
		t.Fatalf("%d %s", a.Status, a.Body)
	}
	if msg.Model != "claude-sonnet-4-5" || !strings.Contains(msg.Content[0].Text, "mock-only") || msg.Usage.OutputTokens != 5 || msg.Usage.InputTokens < 1 {
		t.Errorf("mock reply: %+v", msg)
	}
	a = providertest.Send(t, p, providertest.Request{Channel: "mock-only", Body: providertest.StreamBody}.Call())
	if !strings.HasPrefix(string(a.Body), "event: message_start\n") || !strings.HasSuffix(string(a.Body), "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n") {
		t.Errorf("mock stream:\n%s", a.Body)
	}
}

// The mock refuses what Anthropic's API refuses, with the API's 400 and
// message (the rules of the tests' strict upstream) and a request id of
// its own. A client that names no anthropic-version is served, as provider
// anthropic serves it (it sends the SDKs' version).
func TestMockRefusesWhatTheAPIRefuses(t *testing.T) {
	p := &Provider{}
	providertest.Provision(t, p, "mock-only")
	cases := []struct {
		name, path, body, msg string
	}{
		{"no max_tokens", provider.PathMessages, `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`, "max_tokens: Field required"},
		{"no messages", provider.PathMessages, `{"model":"claude-sonnet-4-5","max_tokens":16}`, "messages: Field required"},
		{"empty messages", provider.PathMessages, `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[]}`, "messages: at least one message is required"},
		{"an unknown field", provider.PathMessages, `{"model":"claude-sonnet-4-5","max_tokens":16,"max_output":5,"messages":[{"role":"user","content":"Hi"}]}`, "max_output: Extra inputs are not permitted"},
		{"a streamed one", provider.PathMessages, `{"model":"claude-sonnet-4-5","stream":true,"messages":[{"role":"user","content":"Hi"}]}`, "max_tokens: Field required"},
		{"max_tokens on count_tokens", provider.PathCountTokens, providertest.SimpleBody, "max_tokens: Extra inputs are not permitted"},
		{"a tool loop without its thinking", provider.PathMessages, `{"model":"claude-sonnet-4-5","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[` +
			`{"role":"user","content":"Hi"},{"role":"assistant","content":[{"type":"tool_use","id":"toolu_1","name":"f","input":{}}]},` +
			`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"ok"}]}]}`,
			"messages.1.content.0.type: Expected `thinking` or `redacted_thinking`, but found `tool_use`."},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			a := providertest.Send(t, p, providertest.Request{Channel: "mock-only", Path: c.path, Body: c.body}.Call())
			if a.Status != 400 {
				t.Fatalf("status %d, want 400: %s", a.Status, a.Body)
			}
			var e struct {
				Type  string `json:"type"`
				Error struct {
					Type    string `json:"type"`
					Message string `json:"message"`
				} `json:"error"`
				RequestID string `json:"request_id"`
			}
			if err := json.Unmarshal(a.Body, &e); err != nil {
				t.Fatalf("%v: %s", err, a.Body)
			}
			if e.Type != "error" || e.Error.Type != "invalid_request_error" || !strings.HasPrefix(e.Error.Message, c.msg) {
				t.Errorf("body %s, want an invalid_request_error %q", a.Body, c.msg)
			}
			if !strings.HasPrefix(e.RequestID, "req_mock_") || a.Header.Get("Request-Id") != e.RequestID {
				t.Errorf("request_id %q, Request-Id %q: want the mock's, the same", e.RequestID, a.Header.Get("Request-Id"))
			}
		})
	}
	// a client without anthropic-version is served as provider anthropic
	// serves it
	for _, h := range []http.Header{{}, {"Anthropic-Version": {""}}} {
		if a := providertest.Send(t, p, providertest.Request{Channel: "mock-only", Header: h, Body: providertest.SimpleBody}.Call()); a.Status != 200 {
			t.Errorf("a valid request (header %q): %d %s", h, a.Status, a.Body)
		}
	}
	if a := providertest.Send(t, p, providertest.Request{Channel: "mock-only", Path: provider.PathCountTokens,
		Body: `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":"Hi"}]}`}.Call()); a.Status != 200 {
		t.Errorf("count_tokens: %d %s", a.Status, a.Body)
	}
}
