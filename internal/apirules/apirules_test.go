package apirules

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/tidwall/gjson"
)

// The zero Rules, provider mock's, checks no credential but everything
// else, and its refusals carry its request id; the fake upstreams' tests
// (internal/fakeupstream) pin every rule's answer over HTTP.
func TestZeroRulesCheckAllButCredentials(t *testing.T) {
	versioned := http.Header{"Anthropic-Version": {"2023-06-01"}}
	ok := `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`
	r := Rules{RequestID: "req_mock_1"}
	cases := []struct {
		name   string
		w      Wire
		h      http.Header
		body   string
		status int
		msg    string
	}{
		{"no credential is needed", AnthropicMessages, versioned, ok, 0, ""},
		{"the version is", AnthropicMessages, http.Header{}, ok, 400, "anthropic-version: header is required"},
		{"max_tokens", AnthropicMessages, versioned, `{"model":"m","messages":[{"role":"user","content":"Hi"}]}`, 400, "max_tokens: Field required"},
		{"count_tokens takes no max_tokens", AnthropicCountTokens, versioned, ok, 400, "max_tokens: Extra inputs are not permitted"},
		{"a batch's params", AnthropicBatchCreate, versioned, `{"requests":[{"custom_id":"a","params":{"model":"m","messages":[{"role":"user","content":"Hi"}]}}]}`, 400, "requests.0.params.max_tokens: Field required"},
		{"no Bedrock credential either", BedrockInvoke, http.Header{}, `{"anthropic_version":"bedrock-2023-05-31","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`, 0, ""},
		{"no OpenAI key either", OpenAIChat, http.Header{}, `{"model":"gpt","messages":[{"role":"user","content":"Hi"}]}`, 0, ""},
		{"another path", Other, http.Header{}, `{}`, 0, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := r.Check(c.w, c.h, []byte(c.body))
			if c.status == 0 {
				if f != nil {
					t.Fatalf("refused: %d %s", f.Status, f.Body)
				}
				return
			}
			if f == nil {
				t.Fatalf("taken, want %d %q", c.status, c.msg)
			}
			var e struct {
				Type  string `json:"type"`
				Error struct{ Type, Message string }
				ID    string `json:"request_id"`
			}
			if err := json.Unmarshal(f.Body, &e); err != nil || f.Status != c.status || e.Type != "error" ||
				e.Error.Type != "invalid_request_error" || e.Error.Message != c.msg || e.ID != "req_mock_1" || f.Header.Get("Request-Id") != "req_mock_1" {
				t.Errorf("%d %s %v, want %d %q with the rules' request id", f.Status, f.Body, f.Header, c.status, c.msg)
			}
		})
	}
}

// Rules.Thinking is asked about each thinking block of an assistant
// message; without it none is verified.
func TestThinkingVerifier(t *testing.T) {
	body := []byte(`{"model":"m","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[{"role":"user","content":"Hi"},` +
		`{"role":"assistant","content":[{"type":"thinking","thinking":"plan","signature":"sig"},{"type":"text","text":"ok"}]},{"role":"user","content":"Go on"}]}`)
	h := http.Header{"Anthropic-Version": {"2023-06-01"}}
	if f := (&Rules{}).Check(AnthropicMessages, h, body); f != nil {
		t.Errorf("without a verifier: %s", f.Body)
	}
	var seen []string
	r := Rules{Thinking: func(b gjson.Result) bool { seen = append(seen, b.Get("signature").Str); return false }}
	f := r.Check(AnthropicMessages, h, body)
	if f == nil || gjson.GetBytes(f.Body, "error.message").Str != "messages.1.content.0: Invalid `signature` in `thinking` block" || len(seen) != 1 || seen[0] != "sig" {
		t.Errorf("a refused signature: %v, asked about %q", f, seen)
	}
}
