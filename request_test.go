package relay

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/providers/anthropic"
	"github.com/caddyserver/caddy/v2"
)

func TestInboundInspect(t *testing.T) {
	tests := []struct {
		name       string
		body       string
		wantModel  string
		wantStream bool
		header     http.Header
		route      route
		wantNeeds  []string
	}{
		{
			name:      "model only",
			body:      `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[]}`,
			wantModel: "claude-sonnet-4-5",
		},
		{
			name:       "stream true",
			body:       `{"model":"m","stream":true}`,
			wantModel:  "m",
			wantStream: true,
		},
		{
			name:      "stream false",
			body:      `{"stream":false,"model":"m"}`,
			wantModel: "m",
		},
		{
			name:      "stream as a string is not a stream",
			body:      `{"model":"m","stream":"true"}`,
			wantModel: "m",
		},
		{
			name:      "service_tier is a capability",
			body:      `{"model":"m","service_tier":"auto"}`,
			wantModel: "m",
			wantNeeds: []string{"service_tier"},
		},
		{
			name:      "a null service_tier does not count",
			body:      `{"model":"m","service_tier":null}`,
			wantModel: "m",
		},
		{
			name:      "every capability field",
			body:      `{"speed":"fast","model":"m","inference_geo":"us","service_tier":"standard_only"}`,
			wantModel: "m",
			wantNeeds: []string{"service_tier", "inference_geo", "speed"},
		},
		{
			name:      "capability fields nested in other objects do not count",
			body:      `{"model":"m","metadata":{"service_tier":"auto","speed":"fast"},"messages":[{"inference_geo":"eu"}]}`,
			wantModel: "m",
		},
		{
			name:      "every feature field, server tools by their type, and betas",
			body:      `{"model":"m","mcp_servers":[{"type":"url","url":"https://x"}],"container":"c","context_management":{"edits":[]},"cache_control":{"type":"ephemeral"},"output_config":{},"tools":[{"name":"f","input_schema":{"type":"object"}},{"type":"web_search_20250305","name":"web_search"},{"name":"web_fetch","type":"web_fetch_20250910"},{"type":"code_execution_20250825","name":"code_execution"},{"type":"tool_search_tool_regex_20251119","name":"s"}]}`,
			header:    http.Header{"Anthropic-Beta": {"mcp-client-2025-11-20, files-api-2025-04-14", "mcp-client-2025-11-20,,compact-2026-01-12"}},
			wantModel: "m",
			wantNeeds: []string{"mcp_servers", "container", "context_management", "cache_control", "output_config", "web_search", "web_fetch", "code_execution", "tool_search", "mcp-client-2025-11-20", "files-api-2025-04-14", "compact-2026-01-12"},
		},
		{
			name:      "an escaped tool type is what it means",
			body:      `{"model":"m","tools":[{"t\u0079pe":"web\u005ffetch_20250910"},"not an object",{"type":7},{"type":"custom"},{"type":"bash_20250124"}]}`,
			wantModel: "m",
			wantNeeds: []string{"web_fetch"},
		},
		{
			name:      "tools that are not an array are skipped (the upstream says what is wrong)",
			body:      `{"model":"m","tools":{"type":"web_search_20250305"}}`,
			wantModel: "m",
		},
		{
			name:      "server tool types nested deeper do not count",
			body:      `{"model":"m","tools":[{"name":"f","input_schema":{"type":"web_search_20250305"}}],"messages":[{"role":"user","content":[{"type":"web_fetch_20250910"}]}]}`,
			wantModel: "m",
		},
		{
			name:      "a prompt estimated above 200k tokens needs a long context",
			body:      `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 4*features.LongContextTokens+8) + `"}]}`,
			route:     routeMessages,
			wantModel: "m",
			wantNeeds: []string{"long_context"},
		},
		{
			name:      "counting tokens needs no long context",
			body:      `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 4*features.LongContextTokens+8) + `"}]}`,
			route:     routeCountTokens,
			wantModel: "m",
		},
		{
			name:       "leading whitespace before the object",
			body:       " \n\t\r {\"model\":\"m\",\"stream\":true}",
			wantModel:  "m",
			wantStream: true,
		},
		{
			name:       "nested model keys are not the top-level one",
			body:       `{"messages":[{"role":"user","content":[{"type":"text","text":"hi","model":"inner"}],"model":"msg"}],"metadata":{"model":"meta","stream":false},"tools":[{"name":"model","input_schema":{"properties":{"model":{"type":"string"}}}}],"model":"outer","stream":true}`,
			wantModel:  "outer",
			wantStream: true,
		},
		{
			name:      `a "model" string value is not the key`,
			body:      `{"system":"\"model\":\"fake\"","model":"real"}`,
			wantModel: "real",
		},
		{
			name:      "escapes in the model string are decoded",
			body:      `{"model":"claude\u002dsonnet\/4"}`,
			wantModel: "claude-sonnet/4",
		},
		{
			name:      "escaped key is still model",
			body:      `{"mod\u0065l":"m"}`,
			wantModel: "m",
		},
		{
			name:       "unusual spacing",
			body:       "{ \"model\" :  \"m\" , \"stream\"\n:\ttrue }",
			wantModel:  "m",
			wantStream: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := &inbound{route: tt.route, ask: asked{body: []byte(tt.body), header: tt.header}}
			if rerr := in.inspect(); rerr != nil {
				t.Fatalf("inspect: %d %s", rerr.status, rerr.msg)
			}
			if in.ask.model != tt.wantModel {
				t.Errorf("model = %q, want %q", in.ask.model, tt.wantModel)
			}
			if in.ask.stream != tt.wantStream {
				t.Errorf("stream = %v, want %v", in.ask.stream, tt.wantStream)
			}
			if got := in.ask.needs.Names(); !slices.Equal(got, tt.wantNeeds) {
				t.Errorf("needs = %q, want %q", got, tt.wantNeeds)
			}
		})
	}
}

func TestInboundInspectKeepsNoReferenceToTheBody(t *testing.T) {
	body := []byte(`{"model":"claude-sonnet-4-5"}`)
	in := &inbound{ask: asked{body: body}}
	if rerr := in.inspect(); rerr != nil {
		t.Fatal(rerr.msg)
	}
	// The body lives in a pooled buffer that the next request overwrites.
	copy(body, strings.Repeat("x", len(body)))
	if in.ask.model != "claude-sonnet-4-5" {
		t.Errorf("model changed with the buffer: %q", in.ask.model)
	}
}

func TestInboundInspectRejects(t *testing.T) {
	tests := []struct {
		name    string
		body    string
		wantMsg string
	}{
		{"empty body", ``, "not valid JSON"},
		{"not JSON", `model=claude`, "not valid JSON"},
		{"truncated JSON", `{"model":"m"`, "not valid JSON"},
		{"trailing garbage", `{"model":"m"} {}`, "not valid JSON"},
		{"JSON array", `[{"model":"m"}]`, "JSON object"},
		{"JSON string", `"model"`, "JSON object"},
		{"missing model", `{"max_tokens":16,"messages":[{"model":"m"}]}`, "model: field required"},
		{"model is a number", `{"model":4}`, "non-empty string"},
		{"model is null", `{"model":null}`, "non-empty string"},
		{"model is an object", `{"model":{"name":"m"}}`, "non-empty string"},
		{"empty model", `{"model":""}`, "non-empty string"},
		// a second object or a second key would let an upstream that reads
		// the first one serve another model than the relay routed and priced
		{"a second object after the first", `{"model":"claude-opus-4-1","max_tokens":1} {"model":"claude-sonnet-4-5"}`, "data after the top-level object"},
		{"trailing word", `{"model":"m"} x`, "data after the top-level object"},
		{"duplicate model", `{"model":"claude-opus-4-1","model":"claude-sonnet-4-5"}`, `duplicate key "model"`},
		{"duplicate model, one escaped", `{"model":"a","mod\u0065l":"b"}`, `duplicate key "model"`},
		{"duplicate stream", `{"model":"m","stream":false,"stream":true}`, `duplicate key "stream"`},
		{"duplicate capability field", `{"model":"m","speed":null,"speed":"fast"}`, `duplicate key "speed"`},
		{"duplicate key in a nested object", `{"model":"m","metadata":{"user_id":"a","user_id":"b"}}`, `duplicate key "user_id"`},
		{"malformed value the relay skips", `{"model":"a","x":[1,2 "model":"b"]}`, "not valid JSON"},
		{"bad literal the relay skips", `{"model":"a","x":tru}`, "not valid JSON"},
		{"invalid UTF-8 in a string", "{\"model\":\"m\",\"x\":\"\xff\"}", "not valid JSON"},
		{"dot-dot model", `{"model":".."}`, "path segment"},
		{"dot model", `{"model":"."}`, "path segment"},
		{"dot-dot segment inside", `{"model":"a/../invoke"}`, "path segment"},
		{"model with a space", `{"model":"claude sonnet"}`, "not a model id"},
		{"model with a slash-escaped quote", `{"model":"a\"b"}`, "not a model id"},
		{"model too long", `{"model":"` + strings.Repeat("m", 257) + `"}`, "longer than 256"},
		// the relay routes on the header's betas: a beta in the body would
		// reach Bedrock without being routed on
		{"betas in the body", `{"model":"m","anthropic_beta":["files-api-2025-04-14"]}`, "anthropic-beta header"},
		{"duplicate key in a tool", `{"model":"m","tools":[{"type":"custom","type":"web_search_20250305"}]}`, `duplicate key "type"`},
		{"malformed tools", `{"model":"m","tools":[{"type":"web_search_20250305",]}`, "not valid JSON"},
		{"truncated tools", `{"model":"m","tools":[{"type":"x"}`, "not valid JSON"},
		{"too many betas", `{"model":"m"}` + strings.Repeat(" ", 0), "more than 64"},
	}
	manyBetas := make([]string, 65)
	for i := range manyBetas {
		manyBetas[i] = fmt.Sprintf("b-%d", i)
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := &inbound{ask: asked{body: []byte(tt.body)}}
			if tt.name == "too many betas" {
				in.ask.header = http.Header{"Anthropic-Beta": {strings.Join(manyBetas, ",")}}
			}
			rerr := in.inspect()
			if rerr == nil {
				t.Fatalf("accepted; model %q", in.ask.model)
			}
			if rerr.status != http.StatusBadRequest || rerr.typ != "invalid_request_error" {
				t.Errorf("error = %d %s, want 400 invalid_request_error", rerr.status, rerr.typ)
			}
			if !strings.Contains(rerr.msg, tt.wantMsg) {
				t.Errorf("message %q does not say %q", rerr.msg, tt.wantMsg)
			}
		})
	}
}

func TestCallBodyMapsTheModelOnly(t *testing.T) {
	mapped := &channel{name: "mapped", models: map[string]string{
		"claude-sonnet-4-5": "us.anthropic.claude-sonnet-4-5-20250929-v1:0",
		"claude-haiku-4-5":  "claude-haiku-4-5",
		"claude-opus-4-1":   "o",
	}}
	tests := []struct {
		name   string
		body   string
		ch     *channel
		want   string // "" means the same bytes as body
		oldRaw string // the raw model value replaced, quotes included
	}{
		{
			name: "channel serving every model sends the same bytes",
			body: `{"model":"claude-sonnet-4-5","max_tokens":16}`,
			ch:   &channel{name: "all"},
		},
		{
			name: "model mapped to itself sends the same bytes",
			body: `{"model":"claude-haiku-4-5","max_tokens":16}`,
			ch:   mapped,
		},
		{
			name:   "mapped model is replaced, nothing else changes",
			body:   `{"max_tokens":1024,"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}],"betas":["x"],"unknown_field":{"z":[1,2.50,3e2]}}`,
			ch:     mapped,
			want:   `{"max_tokens":1024,"model":"us.anthropic.claude-sonnet-4-5-20250929-v1:0","messages":[{"role":"user","content":[{"type":"text","text":"hi","cache_control":{"type":"ephemeral"}}]}],"betas":["x"],"unknown_field":{"z":[1,2.50,3e2]}}`,
			oldRaw: `"claude-sonnet-4-5"`,
		},
		{
			name:   "mapped to a shorter name",
			body:   `{"model":"claude-opus-4-1"}`,
			ch:     mapped,
			want:   `{"model":"o"}`,
			oldRaw: `"claude-opus-4-1"`,
		},
		{
			name:   "unusual spacing around the model is kept",
			body:   "{\n  \"model\" :  \"claude-sonnet-4-5\"  ,\n  \"stream\": true\n}\n",
			ch:     mapped,
			want:   "{\n  \"model\" :  \"us.anthropic.claude-sonnet-4-5-20250929-v1:0\"  ,\n  \"stream\": true\n}\n",
			oldRaw: `"claude-sonnet-4-5"`,
		},
		{
			name:   "nested model keys keep their values",
			body:   `{"messages":[{"role":"user","content":"x","model":"claude-sonnet-4-5"}],"model":"claude-sonnet-4-5","metadata":{"model":"claude-sonnet-4-5"}}`,
			ch:     mapped,
			want:   `{"messages":[{"role":"user","content":"x","model":"claude-sonnet-4-5"}],"model":"us.anthropic.claude-sonnet-4-5-20250929-v1:0","metadata":{"model":"claude-sonnet-4-5"}}`,
			oldRaw: `"claude-sonnet-4-5"`,
		},
		{
			name:   "an escaped model name is replaced whole",
			body:   `{"model":"claude\u002dopus-4-1","x":1}`,
			ch:     mapped,
			want:   `{"model":"o","x":1}`,
			oldRaw: `"claude\u002dopus-4-1"`,
		},
		{
			name:   "leading whitespace before the object",
			body:   "\n  {\"model\":\"claude-opus-4-1\",\"x\":1}",
			ch:     mapped,
			want:   "\n  {\"model\":\"o\",\"x\":1}",
			oldRaw: `"claude-opus-4-1"`,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			body := []byte(tt.body)
			in := &inbound{ask: asked{body: body}}
			if rerr := in.inspect(); rerr != nil {
				t.Fatalf("inspect: %s", rerr.msg)
			}
			got := in.callFor(tt.ch).Body()
			if tt.want == "" {
				if len(got) != len(body) || &got[0] != &body[0] {
					t.Errorf("got a different body %q, want the client's bytes unchanged and uncopied", got)
				}
				return
			}
			if string(got) != tt.want {
				t.Fatalf("body =\n%s\nwant\n%s", got, tt.want)
			}
			// Byte-faithful: the client's bytes with one occurrence of the
			// old value swapped for the new one, nothing else.
			up := `"` + tt.ch.models[in.ask.model] + `"`
			spliced := false
			for off := 0; ; {
				i := bytes.Index(body[off:], []byte(tt.oldRaw))
				if i < 0 {
					break
				}
				start, end := off+i, off+i+len(tt.oldRaw)
				if string(body[:start])+up+string(body[end:]) == string(got) {
					spliced = true
					break
				}
				off = end
			}
			if !spliced {
				t.Errorf("got %q is not the body with %s replaced by %s", got, tt.oldRaw, up)
			}
			if string(body) != tt.body {
				t.Errorf("bodyFor changed the client's buffer: %q", body)
			}
		})
	}
}

func TestRouteOf(t *testing.T) {
	tests := []struct {
		method, path string
		want         route
		wantStatus   int
		wantAllow    string
	}{
		{"POST", "/v1/messages", routeMessages, 0, ""},
		{"POST", "/v1/messages/count_tokens", routeCountTokens, 0, ""},
		{"GET", "/v1/models", routeModels, 0, ""},
		{"GET", "/v1/models/claude-sonnet-4-5", routeModel, 0, ""},
		{"GET", "/v1/models/claude-sonnet-4-5@20250929", routeModel, 0, ""},
		{"GET", "/v1/messages", 0, 405, "POST"},
		{"PUT", "/v1/messages", 0, 405, "POST"},
		{"GET", "/v1/messages/count_tokens", 0, 405, "POST"},
		{"POST", "/v1/models", 0, 405, "GET"},
		{"DELETE", "/v1/models/claude-sonnet-4-5", 0, 405, "GET"},
		{"POST", "/v1/complete", 0, 404, ""},
		{"POST", "/v1/messages/", 0, 404, ""},
		{"POST", "/v1/messages/batches", routeResource, 0, ""}, // its operation and method are checked by serveResource
		{"POST", "/v1/messages/batchesx", 0, 404, ""},
		{"GET", "/v1/models/", 0, 404, ""},
		{"GET", "/v1/models/a/b", 0, 404, ""},
		{"GET", "/", 0, 404, ""},
		{"POST", "/V1/MESSAGES", 0, 404, ""},
	}
	for _, tt := range tests {
		t.Run(tt.method+" "+tt.path, func(t *testing.T) {
			req := httptest.NewRequest(tt.method, "http://relay.test"+tt.path+"?beta=true", nil)
			rt, rerr := routeOf(req)
			switch {
			case tt.wantStatus == 0:
				if rerr != nil || rt != tt.want {
					t.Fatalf("route = %d, error %v; want route %d", rt, rerr, tt.want)
				}
			case rerr == nil:
				t.Fatalf("route = %d, want a %d error", rt, tt.wantStatus)
			case tt.wantStatus == 405:
				if rerr.status != 405 || rerr.allow != tt.wantAllow || rerr.typ != "invalid_request_error" {
					t.Errorf("error = %d %s allow %q, want 405 invalid_request_error allow %q", rerr.status, rerr.typ, rerr.allow, tt.wantAllow)
				}
			default:
				if rerr.status != 404 || rerr.typ != "not_found_error" || rerr.allow != "" {
					t.Errorf("error = %d %s allow %q, want 404 not_found_error", rerr.status, rerr.typ, rerr.allow)
				}
				if !strings.Contains(rerr.msg, tt.path) {
					t.Errorf("message %q does not name the path", rerr.msg)
				}
			}
		})
	}
}

func TestRouteUpstreamPath(t *testing.T) {
	for rt, want := range map[route]string{
		routeMessages:    "/v1/messages",
		routeCountTokens: "/v1/messages/count_tokens",
		routeModels:      "",
		routeModel:       "",
	} {
		if got := rt.upstreamPath(); got != want {
			t.Errorf("route %d: upstreamPath = %q, want %q", rt, got, want)
		}
	}
}

func TestAuthenticate(t *testing.T) {
	support := &key{name: "support"}
	free := &key{name: "free"}
	off := &key{name: "off", disabled: true}
	support.active.Store(true) // made here, with no state to take
	free.active.Store(true)
	r := &Relay{keys: map[[sha256.Size]byte]*key{
		sha256.Sum256([]byte("sk-relay-support")): support,
		sha256.Sum256([]byte("sk-relay-free")):    free,
		sha256.Sum256([]byte("sk-relay-off")):     off,
	}, now: time.Now}
	tests := []struct {
		name    string
		header  []string
		want    *key
		wantMsg string // for a 401
	}{
		{name: "x-api-key", header: []string{"X-Api-Key", "sk-relay-support"}, want: support},
		{name: "x-api-key picks the right key", header: []string{"x-api-key", "sk-relay-free"}, want: free},
		{name: "Authorization: Bearer", header: []string{"Authorization", "Bearer sk-relay-support"}, want: support},
		{name: "bearer is case-insensitive", header: []string{"Authorization", "bearer sk-relay-free"}, want: free},
		{name: "BEARER in capitals", header: []string{"Authorization", "BEARER sk-relay-free"}, want: free},
		{name: "spaces around the bearer token are trimmed", header: []string{"Authorization", "Bearer   sk-relay-free  "}, want: free},
		{name: "the same key in both headers", header: []string{"X-Api-Key", "sk-relay-free", "Authorization", "Bearer sk-relay-free"}, want: free},
		{name: "two different keys are refused", header: []string{"X-Api-Key", "sk-relay-support", "Authorization", "Bearer sk-relay-free"}, wantMsg: "two different relay keys"},
		{name: "missing", wantMsg: "x-api-key"},
		{name: "basic auth is not a relay key", header: []string{"Authorization", "Basic c2stcmVsYXktZnJlZQ=="}, wantMsg: "x-api-key"},
		{name: "bearer without a token", header: []string{"Authorization", "Bearer "}, wantMsg: "x-api-key"},
		{name: "unknown x-api-key", header: []string{"X-Api-Key", "sk-relay-guess"}, wantMsg: "invalid relay key"},
		{name: "unknown bearer", header: []string{"Authorization", "Bearer sk-relay-guess"}, wantMsg: "invalid relay key"},
		{name: "a key is not matched by prefix", header: []string{"X-Api-Key", "sk-relay-support2"}, wantMsg: "invalid relay key"},
		// Claude Code sends both when a developer has ANTHROPIC_API_KEY and
		// ANTHROPIC_AUTH_TOKEN set: the stale one must not refuse the other
		{name: "a stale x-api-key beside a relay key as bearer", header: []string{"X-Api-Key", "sk-ant-api03-stale", "Authorization", "Bearer sk-relay-free"}, want: free},
		{name: "a relay key as x-api-key beside a stale bearer", header: []string{"X-Api-Key", "sk-relay-free", "Authorization", "Bearer sk-ant-stale"}, want: free},
		{name: "a disabled x-api-key beside a usable bearer", header: []string{"X-Api-Key", "sk-relay-off", "Authorization", "Bearer sk-relay-free"}, want: free},
		{name: "a usable x-api-key beside a disabled bearer", header: []string{"X-Api-Key", "sk-relay-free", "Authorization", "Bearer sk-relay-off"}, want: free},
		{name: "a disabled key alone", header: []string{"X-Api-Key", "sk-relay-off"}, wantMsg: "disabled"},
		{name: "both invalid", header: []string{"X-Api-Key", "sk-relay-guess", "Authorization", "Bearer sk-relay-guess2"}, wantMsg: "invalid relay key"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req := httptest.NewRequest("POST", "/v1/messages", nil)
			for i := 0; i < len(tt.header); i += 2 {
				req.Header.Set(tt.header[i], tt.header[i+1])
			}
			k, rerr := r.authenticate(req)
			if tt.want != nil {
				if rerr != nil || k != tt.want {
					t.Fatalf("got key %v, error %v; want %s", k, rerr, tt.want.name)
				}
				return
			}
			if k != nil || rerr == nil {
				t.Fatalf("got key %v, want a 401", k)
			}
			if rerr.status != http.StatusUnauthorized || rerr.typ != "authentication_error" {
				t.Errorf("error = %d %s, want 401 authentication_error", rerr.status, rerr.typ)
			}
			if !strings.Contains(rerr.msg, tt.wantMsg) {
				t.Errorf("message %q does not say %q", rerr.msg, tt.wantMsg)
			}
			if strings.Contains(rerr.msg, "sk-relay") {
				t.Errorf("message %q repeats the secret", rerr.msg)
			}
		})
	}
}

func TestSharedBodyIsFreedOnceTheTransportWroteIt(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("ok"))
	body := []byte(`{"model":"claude-sonnet-4-5","max_tokens":1,"messages":[{"role":"user","content":"Hi"}]}`)
	in := &inbound{route: routeMessages, ask: asked{body: body, header: http.Header{}}}
	if err := in.inspect(); err != nil {
		t.Fatal(err)
	}
	ch := &channel{name: "shared"}
	p := &anthropic.Provider{URL: up.URL, APIKey: channelKey}
	ctx, cancel := caddy.NewContext(caddy.Context{Context: context.Background()})
	defer cancel()
	if err := p.Provision(ctx); err != nil {
		t.Fatal(err)
	}
	req, err := p.NewRequest(context.Background(), in.callFor(ch))
	if err != nil {
		t.Fatal(err)
	}
	if in.try.writing.Load() != 1 {
		t.Fatalf("bodies being written before sending: %d", in.try.writing.Load())
	}
	resp, err := http.DefaultTransport.RoundTrip(req)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if string(up.Last(t).Body) != string(body) {
		t.Errorf("upstream got %s", up.Last(t).Body)
	}
	if n := in.try.writing.Load(); n != 0 {
		t.Errorf("bodies being written after the round trip: %d; the buffer would never return to its pool", n)
	}

	// a mapped model is a copy: it shares nothing with the pooled buffer
	ch.models = map[string]string{"claude-sonnet-4-5": "upstream-name"}
	if _, err := p.NewRequest(context.Background(), in.callFor(ch)); err != nil || in.try.writing.Load() != 0 {
		t.Errorf("a copied body must not count as sharing the buffer: %d", in.try.writing.Load())
	}
}

func TestWeakKeys(t *testing.T) {
	for key, weak := range map[string]bool{
		"sk-test":                                  true,  // short
		"sk-relay-quickstart":                      true,  // 19 characters
		"aaaaaaaaaaaaaaaaaaaaaaaaaaaaaa":           true,  // long, one character
		"abababababcdcdcdcdcdefefefefef":           true,  // long, 6 different
		clientKey:                                  false, // 27 characters, 20 different
		"3f9a1c0e7b2d48a6c5e1f0d9b8a7c6e5d4c3b2a1": false,
	} {
		if got := weakKey(key); got != weak {
			t.Errorf("weakKey(%q) = %v, want %v", key, got, weak)
		}
	}
}

// Two upstream requests made from one attempt's context that share the
// body each count one write, and each write's end is counted once: a
// second request must not fire the attempt trace's hook twice.
func TestSharedBodyWritesAreCountedOncePerRequest(t *testing.T) {
	in := &inbound{ask: asked{body: []byte(`{"model":"m"}`)}}
	trace := &httptrace.ClientTrace{}
	in.try.trace = trace
	ctx := httptrace.WithClientTrace(context.Background(), trace)
	var reqs []*http.Request
	for range 2 {
		req, err := in.NewRequest(ctx, http.MethodPost, "http://upstream.invalid/v1/messages", in.ask.body)
		if err != nil {
			t.Fatal(err)
		}
		reqs = append(reqs, req)
	}
	if n := in.try.writing.Load(); n != 2 {
		t.Fatalf("%d writes counted, want 2", n)
	}
	for _, req := range reqs { // what the transport does when each is written
		httptrace.ContextClientTrace(req.Context()).WroteRequest(httptrace.WroteRequestInfo{})
	}
	if n := in.try.writing.Load(); n != 0 {
		t.Fatalf("%d writes left after both ended, want 0", n)
	}
}
