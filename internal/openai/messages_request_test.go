package openai

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/memtest"
)

// TestEmptyMessagesForAnOpenAIUpstreamAreRefusedAtTheFirst: the Messages
// body of 8 MiB of empty messages, for an OpenAI-format upstream, is
// refused for its first message for a fraction of its size.
func TestEmptyMessagesForAnOpenAIUpstreamAreRefusedAtTheFirst(t *testing.T) {
	body := memtest.Repeated(`{"model":"claude-sonnet-5-5","max_tokens":16,"messages":[`, `{}`, `]}`, 8<<20)
	var err error
	n := memtest.Allocated(func() { _, err = MessagesToChat(body, "up") })
	if err == nil || !strings.HasPrefix(err.Error(), "messages.0: content: ") {
		t.Fatalf("err = %v", err)
	}
	if n > 64<<20 {
		t.Errorf("translating 8 MiB of empty messages allocated %d MB, want under 64", n>>20)
	}
}

// TestATranslationForAnOpenAIUpstreamCostsASmallMultipleOfItsBody:
// whatever a Messages body holds, its translation into a chat completion
// allocates at most 6 times its size (a conversation of tiny messages,
// about twice), and writes at most four times its size.
func TestATranslationForAnOpenAIUpstreamCostsASmallMultipleOfItsBody(t *testing.T) {
	size, factor := memtest.BoundedBodies()
	hi := `{"role":"user","content":"hi"}`
	body := func(prefix, elem, suffix string) []byte { return memtest.Repeated(prefix, elem, suffix, size) }
	for _, tc := range []struct {
		name  string
		body  []byte
		times float64 // the bound, times the body's size
		err   string  // the refusal's start; "" when it translates
	}{
		{"tiny user messages", memtest.Repeated(`{"model":"m","messages":[`, `{"role":"user","content":"a"}`, `]}`, 4*size), 3, ""},
		{"turns of one block each", body(`{"model":"m","messages":[`, `{"role":"user","content":[{"type":"text","text":"a"}]},{"role":"assistant","content":[{"type":"text","text":"b"}]}`, `]}`), 6, ""},
		{"a user turn of text blocks", body(`{"model":"m","messages":[{"role":"user","content":[`, `{"type":"text","text":"a"}`, `]}]}`), 6, ""},
		{"a user turn of images", body(`{"model":"m","messages":[{"role":"user","content":[`, `{"type":"image","source":{"type":"url","url":"https://x"}}`, `]}]}`), 6, ""},
		{"a user turn of tool results", body(`{"model":"m","messages":[{"role":"user","content":[`, `{"type":"tool_result","tool_use_id":"a","content":"x"}`, `]}]}`), 6, ""},
		{"a tool result of text blocks", body(`{"model":"m","messages":[{"role":"user","content":[{"type":"tool_result","tool_use_id":"a","content":[`, `{"type":"text","text":"a"}`, `]}]}]}`), 6, ""},
		{"an assistant turn of text blocks", body(`{"model":"m","messages":[{"role":"assistant","content":[`, `{"type":"text","text":"a"}`, `]}]}`), 6, ""},
		{"an assistant turn of tool calls", body(`{"model":"m","messages":[{"role":"assistant","content":[`, `{"type":"tool_use","id":"a","name":"f","input":{}}`, `]}]}`), 6, ""},
		{"system blocks", body(`{"model":"m","messages":[`+hi+`],"system":[`, `{"type":"text","text":"a"}`, `]}`), 6, ""},
		{"tools", body(`{"model":"m","messages":[`+hi+`],"tools":[`, `{"name":"f","input_schema":{}}`, `]}`), 6, ""},
		{"stop sequences", body(`{"model":"m","messages":[`+hi+`],"stop_sequences":[`, `""`, `]}`), 6, ""},
		{"empty blocks", body(`{"model":"m","messages":[{"role":"user","content":[`, `{}`, `]}]}`), 6, "messages.0:  blocks cannot be carried"},
		{"nameless tools", body(`{"model":"m","messages":[`+hi+`],"tools":[`, `{}`, `]}`), 6, "tools.0.name: Field required"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out []byte
			var err error
			n := memtest.Allocated(func() { out, err = MessagesToChat(tc.body, "up") })
			if err != nil && (tc.err == "" || !strings.HasPrefix(err.Error(), tc.err)) || err == nil && tc.err != "" {
				t.Fatalf("err = %v, want %q", err, tc.err)
			}
			if bound := factor*tc.times*float64(len(tc.body)) + 256<<10; float64(n) > bound {
				t.Errorf("allocated %.1f times the body (%d MB), want at most %v", memtest.PerByte(n, tc.body), n>>20, factor*tc.times)
			}
			if len(out) > 4*len(tc.body) {
				t.Errorf("wrote %d bytes for a body of %d", len(out), len(tc.body))
			}
			t.Logf("%.2f times the body", memtest.PerByte(n, tc.body))
		})
	}
}

// FuzzMessagesToChat feeds any bytes to the translation for an
// OpenAI-format upstream: it never panics, allocates at most a small
// multiple of the body, and writes a JSON object.
func FuzzMessagesToChat(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		var out []byte
		var err error
		n := memtest.Allocated(func() { out, err = MessagesToChat(body, "up") })
		if _, factor := memtest.BoundedBodies(); float64(n) > factor*float64(8*len(body)+64<<10) {
			t.Errorf("allocated %d bytes for a body of %d", n, len(body))
		}
		if err == nil && (!json.Valid(out) || out[0] != '{') {
			t.Errorf("translated to %s", out)
		}
	})
}

// TestAnUntranslatableBodySaysWhereNotHow: a value of the wrong type is
// named by where it is in the body, never by the decoder's Go types; of
// several fields the format cannot carry, the first by name is named,
// every time.
func TestAnUntranslatableBodySaysWhereNotHow(t *testing.T) {
	_, err := MessagesToChat([]byte(`{"model":"m","max_tokens":"ten","messages":[]}`), "m")
	if err == nil || strings.Contains(err.Error(), "Go") || strings.Contains(err.Error(), "msgRequest") || !strings.Contains(err.Error(), "max_tokens") {
		t.Errorf("a max_tokens of the wrong type: %v", err)
	}
	for range 20 {
		_, err := MessagesToChat([]byte(`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],"zeta":1,"alpha":2,"mid":3}`), "m")
		if err == nil || !strings.HasPrefix(err.Error(), "alpha cannot be carried") {
			t.Fatalf("three fields it cannot carry: %v", err)
		}
	}
}
