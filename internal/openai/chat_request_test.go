package openai

import (
	"bytes"
	"encoding/json"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/memtest"
	"github.com/tidwall/gjson"
)

// TestTranslateChat checks each translated parameter: the Messages body
// fields it becomes, or the 400 that names it.
func TestTranslateChat(t *testing.T) {
	const hi = `"messages":[{"role":"user","content":"Hi"}]`
	for _, tc := range []struct {
		name  string
		body  string // the members after model
		want  map[string]string
		param string // a refusal's parameter; "" when the body translates
	}{
		{"model and a default max_tokens", hi, map[string]string{"model": `"claude-x"`, "max_tokens": `8192`, "stream": ``}, ""},
		{"system message", `"messages":[{"role":"system","content":"S"},{"role":"user","content":"Hi"}]`, map[string]string{"system": `[{"type":"text","text":"S"}]`, "messages.#": `1`}, ""},
		{"developer message, text parts", `"messages":[{"role":"developer","content":[{"type":"text","text":"D"}]},{"role":"user","content":"Hi"}]`, map[string]string{"system": `[{"type":"text","text":"D"}]`}, ""},
		{"system message later on", `"messages":[{"role":"user","content":"Hi"},{"role":"system","content":"S"}]`, map[string]string{"system.0.text": `"S"`, "messages.#": `1`}, ""},
		{"system with an image", `"messages":[{"role":"system","content":[{"type":"image_url","image_url":{"url":"https://x/y.png"}}]},{"role":"user","content":"Hi"}]`, nil, "messages[0].content[0]"},
		{"text parts", `"messages":[{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]`, map[string]string{"messages.0.content": `[{"type":"text","text":"a"},{"type":"text","text":"b"}]`}, ""},
		{"data URL image", `"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/jpeg;base64,AAAA"}}]}]`, map[string]string{"messages.0.content.0.source": `{"type":"base64","media_type":"image/jpeg","data":"AAAA"}`}, ""},
		{"https image", `"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"https://x/y.png","detail":"low"}}]}]`, map[string]string{"messages.0.content.0.source": `{"type":"url","url":"https://x/y.png"}`}, ""},
		{"data URL that is not base64", `"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"data:image/png,abc"}}]}]`, nil, "messages[0].content[0].image_url.url"},
		{"audio part", `"messages":[{"role":"user","content":[{"type":"input_audio","input_audio":{"data":"x","format":"wav"}}]}]`, nil, "messages[0].content[0].input_audio"},
		{"file part", `"messages":[{"role":"user","content":[{"type":"file"}]}]`, nil, "messages[0].content[0].type"},
		{"assistant tool call and tool result", `"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"a\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}]`,
			map[string]string{"messages.1": `{"role":"assistant","content":[{"type":"tool_use","id":"c1","name":"f","input":{"a":1}}]}`, "messages.2": `{"role":"user","content":[{"type":"tool_result","tool_use_id":"c1","content":[{"type":"text","text":"42"}]}]}`}, ""},
		{"two tool results and a user message make one turn", `"messages":[{"role":"user","content":"Hi"},{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":""}},{"id":"c2","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c1","content":"1"},{"role":"tool","tool_call_id":"c2","content":"2"},{"role":"user","content":"and?"}]`,
			map[string]string{"messages.#": `3`, "messages.1.content.0.input": `{}`, "messages.2.content.#.type": `["tool_result","tool_result","text"]`}, ""},
		{"tool arguments that are not an object", `"messages":[{"role":"user","content":"Hi"},{"role":"assistant","tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"[1]"}}]}]`, nil, "messages[1].tool_calls[0].function.arguments"},
		{"tool message without its call", `"messages":[{"role":"tool","content":"x"}]`, nil, "messages[0].tool_call_id"},
		{"assistant refusal", `"messages":[{"role":"user","content":"Hi"},{"role":"assistant","content":null,"refusal":"no"}]`, map[string]string{"messages.1.content.0.text": `"no"`}, ""},
		{"function role", `"messages":[{"role":"function","name":"f","content":"x"}]`, nil, "messages[0].role"},
		{"only a system message", `"messages":[{"role":"system","content":"S"}]`, nil, "messages"},
		{"tools", hi + `,"tools":[{"type":"function","function":{"name":"f","description":"d","parameters":{"type":"object"},"strict":true}},{"type":"function","function":{"name":"g"}}]`,
			map[string]string{"tools": `[{"name":"f","description":"d","input_schema":{"type":"object"},"strict":true},{"name":"g","input_schema":{"type":"object","properties":{}}}]`}, ""},
		{"custom tool", hi + `,"tools":[{"type":"custom","custom":{"name":"x"}}]`, nil, "tools[0].type"},
		{"tool_choice none", hi + `,"tool_choice":"none"`, map[string]string{"tool_choice": `{"type":"none"}`}, ""},
		{"tool_choice auto", hi + `,"tool_choice":"auto"`, map[string]string{"tool_choice": `{"type":"auto"}`}, ""},
		{"tool_choice required", hi + `,"tool_choice":"required"`, map[string]string{"tool_choice": `{"type":"any"}`}, ""},
		{"tool_choice function", hi + `,"tool_choice":{"type":"function","function":{"name":"f"}}`, map[string]string{"tool_choice": `{"type":"tool","name":"f"}`}, ""},
		{"tool_choice allowed_tools", hi + `,"tool_choice":{"type":"allowed_tools","allowed_tools":{}}`, nil, "tool_choice"},
		{"parallel_tool_calls false", hi + `,"tools":[{"type":"function","function":{"name":"f"}}],"parallel_tool_calls":false`, map[string]string{"tool_choice": `{"type":"auto","disable_parallel_tool_use":true}`}, ""},
		{"parallel_tool_calls true", hi + `,"tools":[{"type":"function","function":{"name":"f"}}],"parallel_tool_calls":true`, map[string]string{"tool_choice": ``}, ""},
		{"max_tokens", hi + `,"max_tokens":50`, map[string]string{"max_tokens": `50`}, ""},
		{"max_completion_tokens wins", hi + `,"max_tokens":50,"max_completion_tokens":70`, map[string]string{"max_tokens": `70`}, ""},
		{"max_tokens zero", hi + `,"max_tokens":0`, nil, "max_tokens"},
		{"max_tokens not a number", hi + `,"max_tokens":"x"`, nil, "max_tokens"},
		{"stop string", hi + `,"stop":"END"`, map[string]string{"stop_sequences": `["END"]`}, ""},
		{"stop array", hi + `,"stop":["a","b"]`, map[string]string{"stop_sequences": `["a","b"]`}, ""},
		{"stop null", hi + `,"stop":null`, map[string]string{"stop_sequences": ``}, ""},
		{"stop number", hi + `,"stop":3`, nil, "stop"},
		{"temperature", hi + `,"temperature":0.2`, map[string]string{"temperature": `0.2`}, ""},
		{"temperature above Claude's", hi + `,"temperature":1.5`, nil, "temperature"},
		{"top_p", hi + `,"top_p":0.9`, map[string]string{"top_p": `0.9`}, ""},
		{"top_p out of range", hi + `,"top_p":2`, nil, "top_p"},
		{"json_schema", hi + `,"response_format":{"type":"json_schema","json_schema":{"name":"x","strict":true,"schema":{"type":"object","properties":{"a":{"type":"string"}}}}}`,
			map[string]string{"output_config": `{"format":{"type":"json_schema","schema":{"type":"object","properties":{"a":{"type":"string"}}}}}`}, ""},
		{"json_schema without a schema", hi + `,"response_format":{"type":"json_schema","json_schema":{"name":"x"}}`, nil, "response_format.json_schema.schema"},
		{"json_object", hi + `,"response_format":{"type":"json_object"}`, nil, "response_format"},
		{"text format", hi + `,"response_format":{"type":"text"}`, map[string]string{"output_config": ``}, ""},
		{"reasoning_effort", hi + `,"reasoning_effort":"medium"`, map[string]string{"thinking": `{"type":"enabled","budget_tokens":8192}`, "max_tokens": `16384`}, ""},
		{"reasoning_effort within max_completion_tokens", hi + `,"reasoning_effort":"high","max_completion_tokens":4000`, map[string]string{"thinking": `{"type":"enabled","budget_tokens":3999}`, "max_tokens": `4000`}, ""},
		{"reasoning_effort none", hi + `,"reasoning_effort":"none"`, map[string]string{"thinking": ``}, ""},
		{"reasoning_effort without room", hi + `,"reasoning_effort":"low","max_tokens":500`, nil, "reasoning_effort"},
		{"reasoning_effort unknown", hi + `,"reasoning_effort":"huge"`, nil, "reasoning_effort"},
		{"user", hi + `,"user":"u1"`, map[string]string{"metadata": `{"user_id":"u1"}`}, ""},
		{"safety_identifier", hi + `,"safety_identifier":"s1"`, map[string]string{"metadata": `{"user_id":"s1"}`}, ""},
		{"stream", hi + `,"stream":true,"stream_options":{"include_usage":true}`, map[string]string{"stream": `true`}, ""},
		{"n 1", hi + `,"n":1`, map[string]string{"model": `"claude-x"`}, ""},
		{"n 2", hi + `,"n":2`, nil, "n"},
		{"neutral penalties", hi + `,"frequency_penalty":0,"presence_penalty":0,"logprobs":false,"logit_bias":{}`, map[string]string{"model": `"claude-x"`}, ""},
		{"frequency_penalty", hi + `,"frequency_penalty":0.5`, nil, "frequency_penalty"},
		{"presence_penalty", hi + `,"presence_penalty":0.5`, nil, "presence_penalty"},
		{"logprobs", hi + `,"logprobs":true`, nil, "logprobs"},
		{"top_logprobs", hi + `,"top_logprobs":3`, nil, "top_logprobs"},
		{"logit_bias", hi + `,"logit_bias":{"1":5}`, nil, "logit_bias"},
		{"audio modality", hi + `,"modalities":["text","audio"]`, nil, "modalities"},
		{"ignored: store, metadata, seed, service_tier", hi + `,"store":true,"metadata":{"a":"b"},"seed":7,"service_tier":"auto","prompt_cache_key":"k"`, map[string]string{"metadata": ``, "seed": ``}, ""},
		{"unknown member", hi + `,"functions":[]`, nil, "functions"},
		{"unknown member of a message", `"messages":[{"role":"user","content":"Hi","audio":{}}]`, nil, "messages[0].audio"},
		{"no messages", `"messages":[]`, nil, "messages"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			_, err := TranslateChat(&buf, []byte(`{"model":"claude-x",`+tc.body+`}`), nil)
			if tc.param != "" {
				if err == nil || err.Param != tc.param {
					t.Fatalf("err = %+v, want a refusal of %s; body %s", err, tc.param, buf.Bytes())
				}
				if !strings.HasPrefix(err.Msg, tc.param+": ") {
					t.Errorf("message %q does not name %s", err.Msg, tc.param)
				}
				return
			}
			if err != nil {
				t.Fatalf("refused: %s", err.Msg)
			}
			if !json.Valid(buf.Bytes()) {
				t.Fatalf("not JSON: %s", buf.Bytes())
			}
			for path, want := range tc.want {
				if got := gjson.GetBytes(buf.Bytes(), path).Raw; got != want {
					t.Errorf("%s = %s, want %s\n(body %s)", path, got, want, buf.Bytes())
				}
			}
		})
	}
}

// TestTranslateChatIsStrict: a body another parser could read otherwise
// than the relay is refused.
func TestTranslateChatIsStrict(t *testing.T) {
	for _, body := range []string{
		`{"model":"a","model":"b","messages":[{"role":"user","content":"Hi"}]}`,
		`{"model":"a","messages":[{"role":"user","content":"Hi"}]} {}`,
		`{"model":"a","Messages":[{"role":"user","content":"Hi"}]}`,
		`[1]`,
		``,
	} {
		var buf bytes.Buffer
		if _, err := TranslateChat(&buf, []byte(body), nil); err == nil {
			t.Errorf("%s: translated to %s", body, buf.Bytes())
		}
	}
}

// BenchmarkTranslateChat measures the translation of a 10 KB chat
// completion (a system prompt, a conversation, a tool).
func BenchmarkTranslateChat(b *testing.B) {
	body := chatBody(10 << 10)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	var buf bytes.Buffer
	for b.Loop() {
		buf.Reset()
		if _, err := TranslateChat(&buf, body, nil); err != nil {
			b.Fatal(err.Msg)
		}
	}
}

// chatBody is a chat completion of about size bytes.
func chatBody(size int) []byte {
	var msgs []string
	msgs = append(msgs, `{"role":"system","content":"You are a helpful assistant. Answer briefly."}`)
	line := strings.Repeat("The quick brown fox jumps over the lazy dog. ", 10)
	for n := 0; n < size-1000; n += len(line) + 40 {
		role := "user"
		if len(msgs)%2 == 0 {
			role = "assistant"
		}
		msgs = append(msgs, `{"role":"`+role+`","content":"`+line+`"}`)
	}
	if len(msgs)%2 == 0 {
		msgs = append(msgs, `{"role":"user","content":"And the weather?"}`)
	}
	return []byte(`{"model":"claude-sonnet-4-5","max_completion_tokens":1024,"temperature":0.3,"stream":true,"stream_options":{"include_usage":true},` +
		`"tools":[{"type":"function","function":{"name":"get_weather","description":"Weather of a city","parameters":{"type":"object","properties":{"city":{"type":"string"}},"required":["city"]}}}],` +
		`"messages":[` + strings.Join(msgs, ",") + `]}`)
}

// TestABodyOfEmptyMessagesIsRefusedAtTheFirst: the translation decodes
// one message at a time, so the first it cannot translate is the 400, for
// a fraction of the body's size.
func TestABodyOfEmptyMessagesIsRefusedAtTheFirst(t *testing.T) {
	body := memtest.EmptyMessages()
	var err *ParamError
	n := memtest.Allocated(func() { _, err = TranslateChat(new(bytes.Buffer), body, nil) })
	if err == nil || err.Param != "messages[0].role" || err.Msg != "messages[0].role: must be system, developer, user, assistant or tool" {
		t.Fatalf("err = %+v", err)
	}
	if n > 64<<20 {
		t.Errorf("translating 8 MiB of empty messages allocated %d MB, want under 64", n>>20)
	}
}

// TestATranslationCostsASmallMultipleOfItsBody: whatever a Chat
// Completions body holds, its translation allocates at most 5 times its
// size (a conversation of tiny messages, about twice), and writes at most
// twice its size.
func TestATranslationCostsASmallMultipleOfItsBody(t *testing.T) {
	size, factor := memtest.BoundedBodies()
	hi := `{"role":"user","content":"hi"}`
	body := func(prefix, elem, suffix string) []byte { return memtest.Repeated(prefix, elem, suffix, size) }
	for _, tc := range []struct {
		name  string
		body  []byte
		times float64 // the bound, times the body's size
		param string  // the refusal's; "" when it translates
	}{
		{"tiny user messages", memtest.Repeated(`{"model":"m","messages":[`, `{"role":"user","content":"a"}`, `]}`, 4*size), 3, ""},
		{"a conversation", chatBody(size), 5, ""},
		{"turns of one message each", body(`{"model":"m","messages":[`, `{"role":"user","content":"a"},{"role":"assistant","content":"b"}`, `]}`), 5, ""},
		{"tool results between assistant turns", body(`{"model":"m","messages":[`, `{"role":"assistant","content":"b"},{"role":"tool","tool_call_id":"c","content":"a"}`, `]}`), 5, ""},
		{"tool results after user text", body(`{"model":"m","messages":[`, `{"role":"user","content":"a"},{"role":"tool","tool_call_id":"c","content":"a"},{"role":"assistant","content":"b"}`, `]}`), 5, ""},
		{"system messages", body(`{"model":"m","messages":[`+hi+`,`, `{"role":"system","content":"a"}`, `]}`), 5, ""},
		{"text parts", body(`{"model":"m","messages":[{"role":"user","content":[`, `{"type":"text","text":"a"}`, `]}]}`), 5, ""},
		{"image parts", body(`{"model":"m","messages":[{"role":"user","content":[`, `{"type":"image_url","image_url":{"url":"data:image/png;base64,A"}}`, `]}]}`), 5, ""},
		{"tool result parts", body(`{"model":"m","messages":[{"role":"tool","tool_call_id":"c","content":[`, `{"type":"text","text":"a"}`, `]}]}`), 5, ""},
		{"tool calls", body(`{"model":"m","messages":[`+hi+`,{"role":"assistant","tool_calls":[`, `{"id":"a","type":"function","function":{"name":"f","arguments":"{\"a\":[1,2]}"}}`, `]}]}`), 5, ""},
		{"refusals", body(`{"model":"m","messages":[`, `{"role":"assistant","refusal":"r"}`, `]}`), 5, ""},
		{"tools", body(`{"model":"m","messages":[`+hi+`],"tools":[`, `{"type":"function","function":{"name":"f"}}`, `]}`), 5, ""},
		{"stop sequences", body(`{"model":"m","messages":[`+hi+`],"stop":[`, `""`, `]}`), 5, ""},
		{"modalities", body(`{"model":"m","messages":[`+hi+`],"modalities":[`, `"text"`, `]}`), 5, ""},
		{"empty parts", body(`{"model":"m","messages":[{"role":"user","content":[`, `{}`, `]}]}`), 5, "messages[0].content[0].type"},
		{"empty tool calls", body(`{"model":"m","messages":[`+hi+`,{"role":"assistant","tool_calls":[`, `{}`, `]}]}`), 5, "messages[1].tool_calls[0].type"},
		{"empty tools", body(`{"model":"m","messages":[`+hi+`],"tools":[`, `{}`, `]}`), 5, "tools[0].type"},
		{"members a message does not know", body(`{"model":"m","messages":[`, `{"role":"user","content":"a","x":1}`, `]}`), 5, "messages[0].x"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			var err *ParamError
			n := memtest.Allocated(func() {
				out = bytes.Buffer{}
				_, err = TranslateChat(&out, tc.body, nil)
			})
			got := ""
			if err != nil {
				got = err.Param
			}
			if got != tc.param {
				t.Fatalf("refusal %q (%v), want %q", got, err, tc.param)
			}
			if bound := factor*tc.times*float64(len(tc.body)) + 256<<10; float64(n) > bound {
				t.Errorf("allocated %.1f times the body (%d MB), want at most %v", memtest.PerByte(n, tc.body), n>>20, factor*tc.times)
			}
			if out.Len() > 2*len(tc.body) {
				t.Errorf("wrote %d bytes for a body of %d", out.Len(), len(tc.body))
			}
			t.Logf("%.2f times the body", memtest.PerByte(n, tc.body))
		})
	}
}

// BenchmarkTranslateTinyMessages translates 8 MiB of tiny valid messages.
func BenchmarkTranslateTinyMessages(b *testing.B) {
	body := memtest.Repeated(`{"model":"claude-sonnet-5-5","messages":[`, `{"role":"user","content":"a"}`, `]}`, 8<<20)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	var out bytes.Buffer
	for b.Loop() {
		out.Reset()
		if _, err := TranslateChat(&out, body, nil); err != nil {
			b.Fatal(err.Msg)
		}
	}
}

// FuzzTranslateChat feeds any bytes to the Chat Completions translation:
// it never panics, allocates at most a small multiple of the body, refuses
// with a message that names what it refuses, and writes a JSON object.
func FuzzTranslateChat(f *testing.F) {
	f.Fuzz(func(t *testing.T, body []byte) {
		var out bytes.Buffer
		var err *ParamError
		n := memtest.Allocated(func() {
			out = bytes.Buffer{}
			_, err = TranslateChat(&out, body, nil)
		})
		if _, factor := memtest.BoundedBodies(); float64(n) > factor*float64(8*len(body)+64<<10) {
			t.Errorf("allocated %d bytes for a body of %d", n, len(body))
		}
		switch {
		case err != nil && err.Param != "" && !strings.HasPrefix(err.Msg, err.Param+": "):
			t.Errorf("refusal %q does not name %q", err.Msg, err.Param)
		case err == nil && (!json.Valid(out.Bytes()) || out.Bytes()[0] != '{'):
			t.Errorf("translated to %s", out.Bytes())
		}
	})
}
