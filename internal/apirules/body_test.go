package apirules

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/tidwall/gjson"
)

// A body every wire reads must be a JSON object, and at most four blocks
// may carry cache_control: what a byte-wise splice of the relay gets wrong
// must be refused as the real API refuses it.
func TestBodyMustBeJSONObject(t *testing.T) {
	versioned := http.Header{"Anthropic-Version": {"2023-06-01"}}
	cc := `"cache_control":{"type":"ephemeral"}`
	block := `{"type":"text","text":"x",` + cc + `}`
	five := `{"model":"m","max_tokens":1,"tools":[{"name":"t","input_schema":{"type":"object"},` + cc + `}],` +
		`"system":[` + block + `,` + block + `],"messages":[{"role":"user","content":[` + block + `,` + block + `]}]}`
	four := strings.Replace(five, `"system":[`+block+`,`+block+`]`, `"system":[`+block+`]`, 1)
	r := Rules{RequestID: "req_1"}
	cases := []struct {
		name string
		w    Wire
		body string
		msg  string // "" when taken
	}{
		{"a cut body", AnthropicMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]`, "The request body is not valid JSON: unexpected end of data: line 1 column 72 (char 71)"},
		{"a spliced comma", AnthropicMessages, "{\"model\":\"m\",,\n\"max_tokens\":1}", "The request body is not valid JSON: unexpected character: line 1 column 14 (char 13)"},
		{"a second line", AnthropicMessages, "{\"model\":\"m\",\n\"max_tokens\":1 x}", "The request body is not valid JSON: unexpected character: line 2 column 16 (char 29)"},
		{"trailing bytes", AnthropicMessages, `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}}`, "The request body is not valid JSON: unexpected character: line 1 column 73 (char 72)"},
		{"an array", AnthropicMessages, `[]`, "The request body is not a JSON object"},
		{"a string", AnthropicCountTokens, `"hi"`, "The request body is not a JSON object"},
		{"nothing", AnthropicMessages, ``, "The request body is not valid JSON: unexpected end of data: line 1 column 1 (char 0)"},
		{"a batch", AnthropicBatchCreate, `{"requests":[}`, "The request body is not valid JSON: unexpected character: line 1 column 14 (char 13)"},
		{"on Vertex", VertexPredict, `{"anthropic_version":"vertex-2023-10-16",}`, "The request body is not valid JSON: unexpected character: line 1 column 42 (char 41)"},
		{"five breakpoints", AnthropicMessages, five, "A maximum of 4 blocks with cache_control may be provided. Found 5."},
		{"four breakpoints", AnthropicMessages, four, ""},
		{"count_tokens counts too", AnthropicCountTokens, strings.Replace(five, `"max_tokens":1,`, "", 1), "A maximum of 4 blocks with cache_control may be provided. Found 5."},
		{"a null cache_control is none", AnthropicMessages, strings.Replace(five, `"tools":[{"name":"t","input_schema":{"type":"object"},`+cc, `"tools":[{"name":"t","input_schema":{"type":"object"},"cache_control":null`, 1), ""},
		{"Vertex counts too", VertexPredict, strings.Replace(five, `"model":"m"`, `"anthropic_version":"vertex-2023-10-16"`, 1), "A maximum of 4 blocks with cache_control may be provided. Found 5."},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := r.Check(c.w, versioned, []byte(c.body))
			if c.msg == "" {
				if f != nil {
					t.Fatalf("refused: %s", f.Body)
				}
				return
			}
			if f == nil || f.Status != 400 || gjson.GetBytes(f.Body, "error.type").Str != "invalid_request_error" ||
				gjson.GetBytes(f.Body, "error.message").Str != c.msg || gjson.GetBytes(f.Body, "request_id").Str != "req_1" {
				t.Fatalf("got %v, want 400 invalid_request_error %q", f, c.msg)
			}
		})
	}
}

// Bedrock refuses the same bodies with its ValidationException, the inner
// body of a CountTokens included.
func TestBedrockBodyMustBeJSONObject(t *testing.T) {
	r := Rules{RequestID: "req_b"}
	cc := `{"type":"text","text":"x","cache_control":{"type":"ephemeral"}}`
	five := `{"anthropic_version":"bedrock-2023-05-31","max_tokens":1,"messages":[{"role":"user","content":[` +
		strings.Repeat(cc+",", 4) + cc + `]}]}`
	cases := []struct {
		name string
		w    Wire
		body string
		msg  string
	}{
		{"invalid JSON", BedrockInvoke, `{"anthropic_version":"bedrock-2023-05-31",`, "Malformed input request, please reformat your input and try again."},
		{"an array", BedrockInvoke, `[1]`, "Malformed input request, please reformat your input and try again."},
		{"an invalid CountTokens", BedrockCountTokens, `{"input":{"invokeModel":{"body":"e30="}}`, "Malformed input request, please reformat your input and try again."},
		{"an invalid inner body", BedrockCountTokens, `{"input":{"invokeModel":{"body":"eyJh"}}}`, "Malformed input request, please reformat your input and try again."},
		{"five breakpoints", BedrockInvoke, five, "A maximum of 4 blocks with cache_control may be provided. Found 5."},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			f := r.Check(c.w, http.Header{}, []byte(c.body))
			if f == nil || f.Status != 400 || gjson.GetBytes(f.Body, "message").Str != c.msg ||
				!strings.HasPrefix(f.Header.Get("X-Amzn-Errortype"), "ValidationException:") {
				t.Fatalf("got %v, want 400 ValidationException %q", f, c.msg)
			}
		})
	}
}

// A thinking block without its signature, or a redacted one without its
// data, is refused even where no account verifies signatures.
func TestThinkingBlockNeedsSignature(t *testing.T) {
	h := http.Header{"Anthropic-Version": {"2023-06-01"}}
	for _, c := range []struct{ block, msg string }{
		{`{"type":"thinking","thinking":"plan"}`, "messages.1.content.0.thinking.signature: Field required"},
		{`{"type":"redacted_thinking"}`, "messages.1.content.0.redacted_thinking.data: Field required"},
		{`{"type":"thinking","thinking":"plan","signature":"sig"}`, ""},
		{`{"type":"redacted_thinking","data":"enc"}`, ""},
	} {
		body := fmt.Sprintf(`{"model":"m","max_tokens":2048,"messages":[{"role":"user","content":"Hi"},`+
			`{"role":"assistant","content":[%s,{"type":"text","text":"ok"}]},{"role":"user","content":"Go on"}]}`, c.block)
		f := (&Rules{}).Check(AnthropicMessages, h, []byte(body))
		switch {
		case c.msg == "" && f != nil:
			t.Errorf("%s refused: %s", c.block, f.Body)
		case c.msg != "" && (f == nil || f.Status != 400 || gjson.GetBytes(f.Body, "error.message").Str != c.msg):
			t.Errorf("%s: got %v, want %q", c.block, f, c.msg)
		}
	}
}
