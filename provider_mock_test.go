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
