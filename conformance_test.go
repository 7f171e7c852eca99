package relay

// The conformance suite of Claude Code's gateway protocol: the contract
// Anthropic publishes for a gateway in front of Claude Code ("Gateway
// protocol reference", renamed "Claude Code gateway compatibility guide",
// on code.claude.com). There is one test per section of the protocol,
// named after it; its comment names the section. Each sends what Claude
// Code sends (its betas, its headers, its body fields) through a real Caddy
// with the relay to the strict fake upstream, and compares byte for byte
// what arrived at each end.
//
// Run it alone with
//
//	go test -run GatewayProtocol .
//
// Like every end-to-end test of the package it binds ports 9080 and 2999
// (helpers_test.go).

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"math"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/provider"
	"github.com/tidwall/gjson"
)

// ccBetas is the anthropic-beta of a Claude Code request to a gateway
// (ANTHROPIC_BASE_URL): the values of today's release. One of a release
// to come is added where an upstream of that release answers
// (TestGatewayProtocolForwardAsOpenLists): today's API refuses a beta it
// does not know.
const ccBetas = "claude-code-20250219,interleaved-thinking-2025-05-14,context-management-2025-06-27," +
	"prompt-caching-scope-2026-01-05,extended-cache-ttl-2025-04-11,advanced-tool-use-2025-11-20," +
	"effort-2025-11-24"

// ccAttribution is the attribution block Claude Code puts first in
// `system`.
const ccAttribution = `{"type":"text","text":"x-anthropic-billing-header: cc_version=2.1.337.abc; cc_entrypoint=cli; cch=00000;"}`

// ccSessionID is the session of the requests, in its header and in
// metadata.user_id.
const ccSessionID = "6f1c2a9e-3b7d-4e21-9c55-0d8e7f4a1b23"

// ccHeaders are the headers of a Claude Code request, name and value
// pairs, with key as its bearer token (ANTHROPIC_AUTH_TOKEN). One request
// carries every gateway hint header, a subagent's ids, and an anthropic-*
// and an x-claude-code-* header of a release to come, so each is checked.
func ccHeaders(key string) []string {
	return []string{
		"Authorization", "Bearer " + key,
		"Anthropic-Version", "2023-06-01",
		"Anthropic-Beta", ccBetas,
		"Anthropic-Dangerous-Direct-Browser-Access", "true",
		"Anthropic-Some-Future-Header", "2027-01-01",
		"Content-Type", "application/json",
		"Accept", "application/json",
		"User-Agent", "claude-cli/2.1.337 (external, cli)",
		"X-App", "cli",
		"X-Claude-Code-Session-Id", ccSessionID,
		"X-Claude-Code-Agent-Id", "agent-a8c3e1f0",
		"X-Claude-Code-Parent-Agent-Id", "agent-root-51d2",
		"X-Claude-Code-Request-Class", "subagent",
		"X-Claude-Code-Agent-Type", "Explore",
		"X-Claude-Code-Compaction", "auto",
		"X-Claude-Code-Context-Compacted", "auto",
		"X-Claude-Code-Prev-Tool-Durations", "Bash=742;Read=9",
		"X-Claude-Code-Prompt-Id", "prompt-7d41",
		"X-Claude-Code-Some-Future-Hint", "on",
		"X-Client-Request-Id", "c7a1d2e3-0f4b-4c5d-8e9f-a0b1c2d3e4f5",
		"X-Stainless-Lang", "js",
		"X-Stainless-Package-Version", "0.70.0",
		"X-Stainless-Os", "Linux",
		"X-Stainless-Arch", "x64",
		"X-Stainless-Runtime", "node",
		"X-Stainless-Runtime-Version", "v22.12.0",
		"X-Stainless-Retry-Count", "0",
		"X-Stainless-Timeout", "600",
	}
}

// ccForwards is what the relay does with each header of ccHeaders that the
// protocol lets a gateway consume: forward it unchanged (true) or consume
// it, sending it no further (false). Either conforms; the table is the
// relay's choice, for its docs to state, so that a change to it shows here
// first. The credential, anthropic-* and content-type are checked apart.
var ccForwards = map[string]bool{
	"Accept":                            true,
	"User-Agent":                        true,
	"X-App":                             false,
	"X-Claude-Code-Session-Id":          false, // read for session affinity and limits
	"X-Claude-Code-Agent-Id":            false,
	"X-Claude-Code-Parent-Agent-Id":     false,
	"X-Claude-Code-Request-Class":       false,
	"X-Claude-Code-Agent-Type":          false,
	"X-Claude-Code-Compaction":          false,
	"X-Claude-Code-Context-Compacted":   false,
	"X-Claude-Code-Prev-Tool-Durations": false,
	"X-Claude-Code-Prompt-Id":           false,
	"X-Claude-Code-Some-Future-Hint":    false,
	"X-Client-Request-Id":               false,
	"X-Stainless-Lang":                  false,
	"X-Stainless-Package-Version":       false,
	"X-Stainless-Os":                    false,
	"X-Stainless-Arch":                  false,
	"X-Stainless-Runtime":               false,
	"X-Stainless-Runtime-Version":       false,
	"X-Stainless-Retry-Count":           false, // read to tell an SDK's retry
	"X-Stainless-Timeout":               false,
}

// ccBody is the body of a Claude Code turn for model: the attribution
// block first in `system`, one-hour and scoped cache breakpoints (four,
// the API's most), a tool call with its thinking, a mid-conversation
// system message, tools with beta fields, adaptive thinking, effort and
// context management. Compact, in Claude Code's field order: a relay that
// parses and writes it again changes its bytes.
func ccBody(model string, stream bool) string {
	s := ""
	if stream {
		s = `"stream":true,`
	}
	return `{"model":"` + model + `","max_tokens":32000,` + s +
		`"system":[` + ccAttribution + `,` +
		`{"type":"text","text":"You are Claude Code, Anthropic's official CLI for Claude.","cache_control":{"type":"ephemeral","ttl":"1h","scope":"global"}},` +
		`{"type":"text","text":"# Environment\nWorking directory: /repo","cache_control":{"type":"ephemeral","ttl":"1h"}}],` +
		`"messages":[` +
		`{"role":"user","content":[{"type":"text","text":"What does main.go do?"}]},` +
		`{"role":"assistant","content":[{"type":"thinking","thinking":"Read it first.","signature":"EqMBCkYIBxgCKkDcc"},{"type":"tool_use","id":"toolu_01A","name":"Read","input":{"file_path":"/repo/main.go"}}]},` +
		`{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_01A","content":"package main\n\nfunc main() {}"}]},` +
		`{"role":"system","content":[{"type":"text","text":"<system-reminder>Plan mode is active.</system-reminder>","cache_control":{"type":"ephemeral"}}]},` +
		`{"role":"user","content":[{"type":"text","text":"And then?","cache_control":{"type":"ephemeral"}}]}],` +
		`"tools":[` +
		`{"name":"Read","description":"Reads a file.","input_schema":{"type":"object","properties":{"file_path":{"type":"string"}},"required":["file_path"],"additionalProperties":false},"strict":true,"eager_input_streaming":true},` +
		`{"name":"mcp__github__search","description":"Searches GitHub.","input_schema":{"type":"object","properties":{"q":{"type":"string"}}},"defer_loading":true}],` +
		`"thinking":{"type":"adaptive"},` +
		`"output_config":{"effort":"high"},` +
		`"context_management":{"edits":[{"type":"clear_thinking_20251015","keep":"all"},{"type":"clear_tool_uses_20250919","trigger":{"type":"input_tokens","value":100000}}]},` +
		`"metadata":{"user_id":"user_9b1e4c_account_2d7f0a31-5c8e-4b6a-9f12-3e4d5c6b7a80_session_` + ccSessionID + `"}}`
}

// ccAnswer is an upstream's whole answer to a turn.
var ccAnswer = []byte(`{"id":"msg_01XFDUDYJgAACzvnptvVoYEL","type":"message","role":"assistant","model":"claude-sonnet-4-5-20250929",` +
	`"content":[{"type":"text","text":"It does nothing yet."}],"stop_reason":"end_turn","stop_sequence":null,` +
	`"usage":{"input_tokens":12,"cache_creation_input_tokens":0,"cache_read_input_tokens":2048,"output_tokens":9,"service_tier":"standard"}}`)

// ccEvents is an upstream's streamed answer to a turn.
var ccEvents = fakeupstream.StreamEvents("claude-sonnet-4-5-20250929", fakeupstream.Usage{InputTokens: 12, CacheReadInputTokens: 2048, OutputTokens: 9}, "It does", " nothing yet.")

// claudeCode sends a Claude Code request as clientKey's bearer token;
// more header pairs follow the body.
func claudeCode(t *testing.T, path, body string, header ...string) reply {
	t.Helper()
	return send(t, http.MethodPost, path, "", body, append(ccHeaders(clientKey), header...)...)
}

// startGateway is startRelay for the suite. When the test ends it resets
// the config's channels: their health outlives the config, and a run of
// the test again (-count) would find the channel its 529 cooled still
// cooling.
func startGateway(t *testing.T, block string) {
	t.Helper()
	startRelay(t, block)
	t.Cleanup(func() {
		for name := range channels(t) {
			adminPost(t, name, "reset")
		}
	})
}

// ccRelay starts a relay whose group name has one channel, name-a, at an
// upstream answering with h; relay holds lines of the relay block.
func ccRelay(t *testing.T, name string, h http.Handler, relay string) *fakeupstream.Upstream {
	t.Helper()
	up := fakeupstream.New(t, h)
	startGateway(t, relay+channelBlock(name+"-a", up.URL)+keyAndGroup(name, name+"-a"))
	return up
}

// wantForwarded checks what an upstream received of a request sent with
// the header pairs sent: the path and query as sent, the body byte for
// byte, every anthropic-* header unchanged and none added, and the
// channel's credential in place of the client's.
func wantForwarded(t *testing.T, got fakeupstream.Request, pathAndQuery, body string, sent []string) {
	t.Helper()
	if got.Method != http.MethodPost || got.Path+"?"+got.RawQuery != pathAndQuery {
		t.Errorf("upstream request %s %s?%s, want POST %s", got.Method, got.Path, got.RawQuery, pathAndQuery)
	}
	if string(got.Body) != body {
		t.Errorf("upstream body:\n%s\nwant the client's bytes:\n%s", got.Body, body)
	}
	want := headerOf(sent)
	for k, vs := range want {
		if strings.HasPrefix(k, "Anthropic-") && !slices.Equal(got.Header[k], vs) {
			t.Errorf("upstream %s = %q, want %q unchanged", k, got.Header[k], vs)
		}
	}
	for k, vs := range got.Header {
		if strings.HasPrefix(k, "Anthropic-") && want[k] == nil {
			t.Errorf("upstream got %s: %q, which the client did not send", k, vs)
		}
	}
	wantChannelCredential(t, got, want)
}

// wantChannelCredential checks that an upstream request carries the
// channel's key and nothing of the credentials in the client's header.
func wantChannelCredential(t *testing.T, got fakeupstream.Request, client http.Header) {
	t.Helper()
	if k := got.Header.Values("X-Api-Key"); !slices.Equal(k, []string{channelKey}) {
		t.Errorf("upstream x-api-key = %q, want the channel's key", k)
	}
	if a := got.Header.Values("Authorization"); a != nil {
		t.Errorf("upstream Authorization = %q, want none: the channel's key goes as x-api-key", a)
	}
	secrets := slices.Concat(client.Values("X-Api-Key"), []string{strings.TrimPrefix(client.Get("Authorization"), "Bearer ")})
	for k, vs := range got.Header {
		for _, v := range vs {
			for _, s := range secrets {
				if s != "" && strings.Contains(v, s) {
					t.Errorf("upstream %s carries the client's credential %q", k, s)
				}
			}
		}
	}
}

// headerOf is the header of name and value pairs.
func headerOf(pairs []string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(pairs); i += 2 {
		h.Add(pairs[i], pairs[i+1])
	}
	return h
}

// Section "API formats": the Anthropic Messages format, whose inference
// posts to /v1/messages?beta=true, so the gateway routes on the path; the
// request goes on with its path, query and body, and the answer comes back
// as the upstream sent it.
func TestGatewayProtocolAPIFormats(t *testing.T) {
	up := ccRelay(t, "gp-formats", fakeupstream.Raw(200, ccAnswer, "Request-Id", "req_011CcFormats"), "")
	body := ccBody("claude-sonnet-4-5", false)
	r := claudeCode(t, "/v1/messages?beta=true", body)
	if r.status != 200 || !bytes.Equal(r.body, ccAnswer) {
		t.Fatalf("client got %d:\n%s\nwant the upstream's answer byte for byte", r.status, r.body)
	}
	if ct := r.header.Get("Content-Type"); ct != "application/json" {
		t.Errorf("content-type = %q", ct)
	}
	if r.header.Get("Request-Id") != "req_011CcFormats" || r.header.Get("X-Relay-Request-Id") == "" {
		t.Errorf("request-id = %q, x-relay-request-id = %q; want the upstream's and the relay's own",
			r.header.Get("Request-Id"), r.header.Get("X-Relay-Request-Id"))
	}
	if up.Hits() != 1 {
		t.Fatalf("upstream hits = %d, want 1", up.Hits())
	}
	wantForwarded(t, up.Last(t), "/v1/messages?beta=true", body, ccHeaders(clientKey))
}

// Section "Request headers" (with its "Gateway hint headers"):
// anthropic-version and anthropic-beta go on unchanged; the credential and
// the x-claude-code-* headers are the gateway's to consume.
func TestGatewayProtocolRequestHeaders(t *testing.T) {
	up := ccRelay(t, "gp-headers", fakeupstream.Raw(200, ccAnswer), "")
	// the workspace of Claude Platform on AWS, which its upstream needs
	workspace := []string{"Anthropic-Workspace-Id", "wrkspc_01JXAMPLE"}
	sent := append(ccHeaders(clientKey), workspace...)
	if r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", false), workspace...); r.status != 200 {
		t.Fatalf("client got %d: %s", r.status, r.body)
	}
	got := up.Last(t)
	if v := got.Header.Values("Anthropic-Version"); !slices.Equal(v, []string{"2023-06-01"}) {
		t.Errorf("upstream anthropic-version = %q", v)
	}
	if v := got.Header.Values("Anthropic-Beta"); !slices.Equal(v, []string{ccBetas}) {
		t.Errorf("upstream anthropic-beta = %q, want verbatim %q", v, ccBetas)
	}
	wantForwarded(t, got, "/v1/messages?beta=true", string(got.Body), sent)

	var forwarded, consumed []string
	for k, vs := range headerOf(sent) {
		forwards, listed := ccForwards[k]
		if strings.HasPrefix(k, "Anthropic-") || k == "Authorization" || k == "Content-Type" {
			continue
		}
		if !listed {
			t.Errorf("%s: sent but not in ccForwards", k)
			continue
		}
		arrived := got.Header[k]
		switch {
		case arrived == nil:
			consumed = append(consumed, k)
		case slices.Equal(arrived, vs):
			forwarded = append(forwarded, k)
		default:
			t.Errorf("upstream %s = %q: forwarded, but changed from %q", k, arrived, vs)
			continue
		}
		if (arrived != nil) != forwards {
			t.Errorf("%s: forwarded %v, the relay's documented choice is %v", k, arrived != nil, forwards)
		}
	}
	slices.Sort(forwarded)
	slices.Sort(consumed)
	t.Logf("forwarded unchanged: %s", strings.Join(forwarded, ", "))
	t.Logf("consumed: %s", strings.Join(consumed, ", "))
}

// Section "Forward as open lists": a beta, an anthropic-* header, an
// x-claude-code-* header and body fields of a release to come pass as the
// ones of today do.
func TestGatewayProtocolForwardAsOpenLists(t *testing.T) {
	// fields a later release adds inside today's objects
	nested := strings.NewReplacer(
		`"And then?","cache_control":{"type":"ephemeral"}`, `"And then?","cache_control":{"type":"ephemeral"},"some_future_block_field":{"on":true}`,
		`"defer_loading":true`, `"defer_loading":true,"some_future_tool_field":1`,
		`"output_config":{"effort":"high"}`, `"output_config":{"effort":"high","some_future_option":[1,2]}`,
	).Replace(ccBody("claude-sonnet-4-5", false))
	topLevel := strings.Replace(nested, `"thinking":{"type":"adaptive"},`, `"thinking":{"type":"adaptive"},"some_future_field":{"on":true},`, 1)
	if topLevel == nested || strings.Count(nested, "some_future") != 3 {
		t.Fatal("the future fields were not put in the body")
	}

	// Today's API refuses a beta it does not know, and most fields it does
	// not know; the strict fake checks betas and nested fields less than
	// that. The upstreams below stand for the API of the release that adds
	// them, so they take what a release to come sends.
	future := ccHeaders(clientKey)
	for i := 0; i+1 < len(future); i += 2 {
		if future[i] == "Anthropic-Beta" {
			future[i+1] += ",some-future-beta-2027-01-01"
		}
	}
	t.Run("nested fields, a beta and headers of a release to come", func(t *testing.T) {
		up := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer), fakeupstream.Lenient())
		startGateway(t, channelBlock("gp-open-nested-a", up.URL)+keyAndGroup("gp-open-nested", "gp-open-nested-a"))
		if r := send(t, http.MethodPost, "/v1/messages?beta=true", "", nested, future...); r.status != 200 || !bytes.Equal(r.body, ccAnswer) {
			t.Fatalf("client got %d: %s", r.status, r.body)
		}
		got := up.Last(t)
		wantForwarded(t, got, "/v1/messages?beta=true", nested, future)
		if !slices.Contains(provider.Betas(got.Header), "some-future-beta-2027-01-01") {
			t.Errorf("the future beta did not arrive: %q", got.Header.Values("Anthropic-Beta"))
		}
		if v := got.Header.Get("Anthropic-Some-Future-Header"); v != "2027-01-01" {
			t.Errorf("the future anthropic-* header arrived as %q", v)
		}
		if v, ok := got.Header["X-Claude-Code-Some-Future-Hint"]; ok && !slices.Equal(v, []string{"on"}) {
			t.Errorf("the future x-claude-code-* header was changed: %q", v)
		}
	})

	t.Run("a top-level field of a release to come", func(t *testing.T) {
		// today's API refuses it ("Extra inputs are not permitted"), and
		// so does the strict fake
		up := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer), fakeupstream.Lenient())
		startGateway(t, channelBlock("gp-open-top-a", up.URL)+keyAndGroup("gp-open-top", "gp-open-top-a"))
		if r := send(t, http.MethodPost, "/v1/messages?beta=true", "", topLevel, future...); r.status != 200 || !bytes.Equal(r.body, ccAnswer) {
			t.Fatalf("client got %d: %s", r.status, r.body)
		}
		wantForwarded(t, up.Last(t), "/v1/messages?beta=true", topLevel, future)
	})
}

// Section "System prompt attribution block": the block reaches the
// upstream unchanged as the first entry of `system`, in an entry of its
// own, on every attempt of a request.
func TestGatewayProtocolAttributionBlock(t *testing.T) {
	overloaded := fakeupstream.Error(529, "overloaded_error", "Overloaded")
	first, second := fakeupstream.New(t, overloaded), fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer))
	startGateway(t, channelBlock("gp-attr-a", first.URL, "priority 1")+channelBlock("gp-attr-b", second.URL, "priority 2")+
		keyAndGroup("gp-attr", "gp-attr-a gp-attr-b"))
	body := ccBody("claude-sonnet-4-5", false)
	if r := claudeCode(t, "/v1/messages?beta=true", body); r.status != 200 {
		t.Fatalf("client got %d: %s", r.status, r.body)
	}
	for _, up := range []*fakeupstream.Upstream{first, second} {
		got := up.Last(t)
		if string(got.Body) != body {
			t.Errorf("upstream body:\n%s\nwant the client's bytes", got.Body)
		}
		system := gjson.GetBytes(got.Body, "system")
		if !system.IsArray() || len(system.Array()) != 3 || system.Get("0").Raw != ccAttribution {
			t.Errorf("upstream system = %s, want the attribution block first in its own entry", system.Raw)
		}
	}
}

// Section "Feature pass-through": each capability's body field and its
// beta travel together, unchanged; the features without a beta (adaptive
// reasoning, cache_control wherever it stands) arrive as sent.
func TestGatewayProtocolFeaturePassThrough(t *testing.T) {
	up := ccRelay(t, "gp-features", fakeupstream.Raw(200, ccAnswer), "")
	body := ccBody("claude-sonnet-4-5", false)
	if r := claudeCode(t, "/v1/messages?beta=true", body); r.status != 200 {
		t.Fatalf("client got %d: %s", r.status, r.body)
	}
	got := up.Last(t)
	if string(got.Body) != body {
		t.Errorf("upstream body:\n%s\nwant the client's bytes", got.Body)
	}
	betas := provider.Betas(got.Header)
	for _, f := range []struct{ name, path, beta string }{
		{"context management", "context_management", "context-management-2025-06-27"},
		{"effort", "output_config", "effort-2025-11-24"},
		{"beta tool fields strict and defer_loading", "tools", "advanced-tool-use-2025-11-20"},
		{"one-hour cache TTL", "system.2.cache_control", "extended-cache-ttl-2025-04-11"},
		{"cache scope", "system.1.cache_control", "prompt-caching-scope-2026-01-05"},
		{"interleaved thinking", "", "interleaved-thinking-2025-05-14"},
		{"Claude Code's own beta", "", "claude-code-20250219"},
		{"adaptive reasoning", "thinking", ""},
		{"fine-grained tool streaming", "tools.0.eager_input_streaming", ""},
		{"cache_control on a mid-conversation system message", "messages.3", ""},
		{"metadata.user_id", "metadata.user_id", ""},
	} {
		t.Run(f.name, func(t *testing.T) {
			if f.path != "" {
				if sent, arrived := gjson.Get(body, f.path), gjson.GetBytes(got.Body, f.path); !sent.Exists() || arrived.Raw != sent.Raw {
					t.Errorf("%s arrived as %s, sent as %s", f.path, arrived.Raw, sent.Raw)
				}
			}
			if f.beta != "" && !slices.Contains(betas, f.beta) {
				t.Errorf("beta %s did not arrive: %q", f.beta, got.Header.Values("Anthropic-Beta"))
			}
		})
	}
}

// Section "How the connection method changes client behavior": through an
// Anthropic-format gateway Claude Code sends every current field for a
// model id it does not know (a gateway alias), and the one-hour cache TTL
// with its extended-cache-ttl beta. A channel that maps the alias changes
// `model` and nothing else.
func TestGatewayProtocolConnectionMethod(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Stream(ccEvents...))
	startGateway(t, channelBlock("gp-alias-a", up.URL, "models my-gateway-sonnet=claude-sonnet-4-5-20250929")+keyAndGroup("gp-alias", "gp-alias-a"))
	body := ccBody("my-gateway-sonnet", true)
	r := claudeCode(t, "/v1/messages?beta=true", body)
	if r.status != 200 || string(r.body) != strings.Join(ccEvents, "") {
		t.Fatalf("client got %d:\n%s", r.status, r.body)
	}
	want := strings.Replace(body, `"model":"my-gateway-sonnet"`, `"model":"claude-sonnet-4-5-20250929"`, 1)
	wantForwarded(t, up.Last(t), "/v1/messages?beta=true", want, ccHeaders(clientKey))
}

// Section "Streaming" (of "API formats"): the answer streams as the
// upstream sends it, every byte of it, keep-alive pings and comments
// included; the relay's hold before the first content ends by
// first_content_timeout for an upstream that keeps sending.
func TestGatewayProtocolStreaming(t *testing.T) {
	const timeouts = "\t\tfirst_content_timeout 500ms\n\t\tfirst_byte_timeout 2s\n\t\tstream_idle_timeout 2s\n"

	t.Run("a Claude Code stream byte for byte", func(t *testing.T) {
		up := ccRelay(t, "gp-stream", fakeupstream.Stream(ccEvents...), timeouts)
		body := ccBody("claude-sonnet-4-5", true)
		r := claudeCode(t, "/v1/messages?beta=true", body)
		if r.status != 200 || string(r.body) != strings.Join(ccEvents, "") {
			t.Fatalf("client got %d:\n%s\nwant the upstream's stream byte for byte", r.status, r.body)
		}
		if ct := r.header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
			t.Errorf("content-type = %q, want text/event-stream", ct)
		}
		if r.header.Get("Request-Id") != "req_fake_stream" || r.header.Get("X-Relay-Request-Id") == "" {
			t.Errorf("request-id = %q, x-relay-request-id = %q", r.header.Get("Request-Id"), r.header.Get("X-Relay-Request-Id"))
		}
		wantForwarded(t, up.Last(t), "/v1/messages?beta=true", body, ccHeaders(clientKey))
	})

	t.Run("pings and comments between content events", func(t *testing.T) {
		evs := slices.Concat(ccEvents[:4], []string{": keep-alive\n\n", fakeupstream.Event("ping", `{"type": "ping"}`)}, ccEvents[4:])
		ccRelay(t, "gp-stream-pings", fakeupstream.Stream(evs...), timeouts)
		if r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true)); r.status != 200 || string(r.body) != strings.Join(evs, "") {
			t.Errorf("client got %d:\n%q\nwant every byte, the keep-alives too:\n%q", r.status, r.body, strings.Join(evs, ""))
		}
	})

	t.Run("pings before the first content are not cut", func(t *testing.T) {
		release := make(chan struct{})
		var once sync.Once
		t.Cleanup(func() { once.Do(func() { close(release) }) })
		var mu sync.Mutex
		var sent strings.Builder // what the upstream sent, pings and all
		ping := fakeupstream.Event("ping", `{"type": "ping"}`)
		pinging := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = io.Copy(io.Discard, r.Body)
			write := func(ev string) bool {
				mu.Lock()
				sent.WriteString(ev)
				mu.Unlock()
				return fakeupstream.WriteEvent(w, ev)
			}
			fakeupstream.StartStream(w)
			write(ccEvents[0]) // message_start
			tick := time.NewTicker(100 * time.Millisecond)
			defer tick.Stop()
			for held := true; held; {
				select {
				case <-release:
					held = false
				case <-r.Context().Done():
					return
				case <-tick.C:
					if !write(ping) {
						return
					}
				}
			}
			for _, ev := range ccEvents[1:] {
				if !write(ev) {
					return
				}
			}
		})
		up := ccRelay(t, "gp-stream-keepalive", pinging, timeouts)

		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		start := time.Now()
		s := openStream(t, ctx, streamBody)
		if s.resp.StatusCode != 200 {
			b, _ := io.ReadAll(s.resp.Body)
			t.Fatalf("status %d, want the stream, not cut before its content: %s", s.resp.StatusCode, b)
		}
		// the held events reach the client while the content is still
		// held upstream: message_start first, then the pings
		var seen strings.Builder
		if ev := s.next(t); ev != ccEvents[0] {
			t.Fatalf("first event %q, want message_start", ev)
		}
		seen.WriteString(ccEvents[0])
		for ev := s.next(t); ; ev = s.next(t) {
			seen.WriteString(ev)
			if ev == ping {
				break
			}
			if ev == "" || strings.Contains(ev, "event: error") {
				t.Fatalf("stream ended before the content was released: %q", seen.String())
			}
		}
		held := time.Since(start)
		t.Logf("the client had message_start and a ping %v after its request (first_content_timeout 500ms)", held.Round(time.Millisecond))
		if held > 5*time.Second {
			t.Errorf("the held events reached the client %v after the request, long past first_content_timeout", held)
		}
		once.Do(func() { close(release) })
		seen.WriteString(s.rest(t))
		mu.Lock()
		want := sent.String()
		mu.Unlock()
		if seen.String() != want || strings.Contains(want, "event: error") {
			t.Errorf("client got:\n%q\nwant the upstream's bytes:\n%q", seen.String(), want)
		}
		if up.Hits() != 1 {
			t.Errorf("upstream hits = %d, want 1", up.Hits())
		}
	})

	t.Run("silence after message_start is a stall and fails over invisibly", func(t *testing.T) {
		stalls := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			fakeupstream.StartStream(w)
			fakeupstream.WriteEvent(w, ccEvents[0])
			<-r.Context().Done()
		}))
		good := fakeupstream.New(t, fakeupstream.Stream(ccEvents...))
		startGateway(t, timeouts+channelBlock("gp-stall-a", stalls.URL, "priority 1")+channelBlock("gp-stall-b", good.URL, "priority 2")+
			keyAndGroup("gp-stall", "gp-stall-a gp-stall-b"))
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
		if r.status != 200 || string(r.body) != strings.Join(ccEvents, "") {
			t.Fatalf("client got %d:\n%s\nwant the second channel's stream only", r.status, r.body)
		}
		if stalls.Hits() != 1 || good.Hits() != 1 || r.header.Get("X-Relay-Attempts") != "2" {
			t.Errorf("hits %d/%d, x-relay-attempts %q", stalls.Hits(), good.Hits(), r.header.Get("X-Relay-Attempts"))
		}
	})

	t.Run("a stream ending after message_delta's stop_reason is complete", func(t *testing.T) {
		evs := ccEvents[:len(ccEvents)-1] // all but message_stop
		if !strings.Contains(evs[len(evs)-1], `"stop_reason":"end_turn"`) {
			t.Fatalf("the last event is not message_delta with a stop_reason: %q", evs[len(evs)-1])
		}
		ccRelay(t, "gp-stream-nostop", fakeupstream.Stream(evs...), timeouts)
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
		if r.status != 200 || string(r.body) != strings.Join(evs, "") {
			t.Errorf("client got %d:\n%s\nwant the upstream's bytes, no event: error appended", r.status, r.body)
		}
		if st := channels(t)["gp-stream-nostop-a"]; st.State != stateHealthy || len(st.Classes) != 0 {
			t.Errorf("the channel was blamed for a complete stream: %+v", st)
		}
	})
}

// Section "Response headers": request-id and x-should-retry as the
// upstream sent them, retry-after in whole seconds, and what the relay
// does with anthropic-ratelimit-unified-*.
func TestGatewayProtocolResponseHeaders(t *testing.T) {
	t.Run("request-id beside the relay's own id", func(t *testing.T) {
		ccRelay(t, "gp-rh-id", fakeupstream.Raw(200, ccAnswer, "Request-Id", "req_011CcHeaders"), "")
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", false))
		if r.header.Get("Request-Id") != "req_011CcHeaders" {
			t.Errorf("request-id = %q, want the upstream's", r.header.Get("Request-Id"))
		}
		if id := r.header.Get("X-Relay-Request-Id"); id == "" || id == "req_011CcHeaders" {
			t.Errorf("x-relay-request-id = %q, want the relay's own", id)
		}
	})

	t.Run("x-should-retry true after a failover", func(t *testing.T) {
		a := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded (a)", "X-Should-Retry", "true"))
		b := fakeupstream.New(t, fakeupstream.Error(529, "overloaded_error", "Overloaded (b)", "X-Should-Retry", "true"))
		startGateway(t, channelBlock("gp-rh-retry-a", a.URL, "priority 1")+channelBlock("gp-rh-retry-b", b.URL, "priority 2")+
			keyAndGroup("gp-rh-retry", "gp-rh-retry-a gp-rh-retry-b", "retries 1"))
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
		if r.status != 529 || !bytes.Equal(r.body, fakeupstream.ErrorBody("overloaded_error", "Overloaded (b)")) {
			t.Fatalf("client got %d %s, want the second channel's 529", r.status, r.body)
		}
		if v := r.header.Values("X-Should-Retry"); !slices.Equal(v, []string{"true"}) || r.header.Get("X-Relay-Attempts") != "2" {
			t.Errorf("x-should-retry = %q, x-relay-attempts = %q; want the upstream's true and 2", v, r.header.Get("X-Relay-Attempts"))
		}
	})

	t.Run("x-should-retry false from the upstream", func(t *testing.T) {
		ccRelay(t, "gp-rh-noretry", fakeupstream.Error(400, "invalid_request_error", "max_tokens: Field required", "X-Should-Retry", "false"), "")
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
		if r.status != 400 || !slices.Equal(r.header.Values("X-Should-Retry"), []string{"false"}) {
			t.Errorf("client got %d with x-should-retry %q, want 400 and false", r.status, r.header.Values("X-Should-Retry"))
		}
	})

	t.Run("x-should-retry false on the relay's refusals no retry cures", func(t *testing.T) {
		up := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer))
		startGateway(t, channelBlock("gp-rh-refuse-a", up.URL, "models claude-sonnet-4-5")+keyAndGroup("gp-rh-refuse", "gp-rh-refuse-a"))
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-opus-4-1", true))
		wantRelayError(t, r, 503, "relay_error", "model_not_found")
		if v := r.header.Values("X-Should-Retry"); !slices.Equal(v, []string{"false"}) {
			t.Errorf("model_not_found: x-should-retry = %q, want false", v)
		}
		tier := strings.Replace(ccBody("claude-sonnet-4-5", true), `"thinking":{"type":"adaptive"}`, `"service_tier":"priority","thinking":{"type":"adaptive"}`, 1)
		if gjson.Get(tier, "service_tier").Str != "priority" {
			t.Fatalf("no service_tier in %s", tier)
		}
		r = claudeCode(t, "/v1/messages?beta=true", tier)
		wantRelayError(t, r, 503, "relay_error", "capability_not_available")
		if v := r.header.Values("X-Should-Retry"); !slices.Equal(v, []string{"false"}) {
			t.Errorf("capability_not_available: x-should-retry = %q, want false", v)
		}
		if up.Hits() != 0 {
			t.Errorf("upstream hits = %d, want none", up.Hits())
		}
	})

	t.Run("retry-after as the upstream sent it", func(t *testing.T) {
		ccRelay(t, "gp-rh-after", fakeupstream.Error(429, "rate_limit_error", "Number of request tokens has exceeded your per-minute rate limit", "Retry-After", "37"), "")
		r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
		if r.status != 429 || r.header.Get("Retry-After") != "37" {
			t.Errorf("client got %d with retry-after %q, want 429 and 37", r.status, r.header.Get("Retry-After"))
		}
	})

	// The relay replaces anthropic-ratelimit-* by default (a tenant of a
	// shared relay has no business with the upstream organisation's
	// limits): the protocol asks for the unified ones unchanged on every
	// response, which upstream_ratelimit_headers pass gives.
	unified := []string{
		"Anthropic-Ratelimit-Unified-Status", "allowed",
		"Anthropic-Ratelimit-Unified-5h-Status", "allowed",
		"Anthropic-Ratelimit-Unified-5h-Utilization", "0.42",
		"Anthropic-Ratelimit-Unified-5h-Reset", "1767225600",
		"Anthropic-Ratelimit-Unified-7d-Utilization", "0.13",
		"Anthropic-Ratelimit-Unified-Representative-Claim", "five_hour",
		"Anthropic-Ratelimit-Unified-Fallback-Percentage", "0.5",
		"Anthropic-Ratelimit-Unified-Overage-Status", "rejected",
	}
	spent := slices.Concat([]string{"Retry-After", "3"}, unified)
	spent[3] = "rejected" // Unified-Status
	for _, c := range []struct {
		name, relay, key string
		pass             bool
	}{
		{"anthropic-ratelimit-unified-* replaced by the key's own by default", "", "\t\tkey " + clientKey + " gp-rh-replace {\n\t\t\trate 1000/m\n\t\t}\n", false},
		{"anthropic-ratelimit-unified-* unchanged with upstream_ratelimit_headers pass", "\t\tupstream_ratelimit_headers pass\n", "\t\tkey " + clientKey + " gp-rh-pass\n", true},
	} {
		t.Run(c.name, func(t *testing.T) {
			group := strings.Fields(c.key)[2]
			up := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer, unified...))
			startGateway(t, c.relay+channelBlock(group+"-a", up.URL, "cooldown 1s")+c.key+"\t\tgroup "+group+" {\n\t\t\tchannels "+group+"-a\n\t\t}\n")
			ok := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", false))
			limited := fakeupstream.ErrorBody("rate_limit_error", "You have reached your usage limit")
			up.SetHandler(fakeupstream.Raw(429, limited, spent...))
			refused := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", false))
			if ok.status != 200 || refused.status != 429 || !bytes.Equal(refused.body, limited) {
				t.Fatalf("client got %d then %d %s", ok.status, refused.status, refused.body)
			}
			for _, r := range []struct {
				reply
				sent []string
			}{{ok, unified}, {refused, spent[2:]}} {
				for i := 0; i+1 < len(r.sent); i += 2 {
					got := r.header.Values(r.sent[i])
					if c.pass && !slices.Equal(got, []string{r.sent[i+1]}) {
						t.Errorf("%d: %s = %q, want the upstream's %q", r.status, r.sent[i], got, r.sent[i+1])
					}
					if !c.pass && got != nil {
						t.Errorf("%d: %s = %q reached the client, want it replaced", r.status, r.sent[i], got)
					}
				}
				if own := r.header.Get("Anthropic-Ratelimit-Requests-Limit"); !c.pass && own != "1000" {
					t.Errorf("%d: anthropic-ratelimit-requests-limit = %q, want the key's own 1000", r.status, own)
				}
			}
		})
	}
}

// Section "Automatic retry and error forwarding": an upstream's error
// reaches the client with its status and its body byte for byte, since
// Claude Code's recovery reads the upstream's wording; the relay's own
// errors are in Anthropic's shape.
func TestGatewayProtocolErrorForwarding(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer))
	startGateway(t, channelBlock("gp-errors-a", up.URL, "models claude-sonnet-4-5")+keyAndGroup("gp-errors", "gp-errors-a"))
	for _, c := range []struct {
		name, typ, msg string
		status         int
	}{
		{"prompt too long", "invalid_request_error", "prompt is too long: 250000 tokens > 200000 maximum", 400},
		{"adaptive thinking unknown upstream", "invalid_request_error", "thinking: Input tag 'adaptive' found using 'type' does not match any of the expected tags: 'disabled', 'enabled'", 400},
		{"context management unknown upstream", "invalid_request_error", "context_management: Extra inputs are not permitted", 400},
		{"a mid-conversation system message refused", "invalid_request_error", "messages.3.role: Input should be 'user' or 'assistant'", 400},
		{"overloaded", "overloaded_error", "Overloaded", 529}, // last: it cools the channel
	} {
		t.Run(c.name, func(t *testing.T) {
			body := fakeupstream.ErrorBody(c.typ, c.msg)
			up.SetHandler(fakeupstream.Raw(c.status, body, "Request-Id", "req_011CcErr"))
			r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
			if r.status != c.status || !bytes.Equal(r.body, body) {
				t.Errorf("client got %d:\n%s\nwant the upstream's %d byte for byte:\n%s", r.status, r.body, c.status, body)
			}
			if r.header.Get("Request-Id") != "req_011CcErr" {
				t.Errorf("request-id = %q", r.header.Get("Request-Id"))
			}
		})
	}
	t.Run("the relay's own errors", func(t *testing.T) {
		wantRelayError(t, claudeCode(t, "/v1/messages?beta=true", ccBody("claude-opus-4-1", true)), 503, "relay_error", "model_not_found")
		wantRelayError(t, send(t, http.MethodPost, "/v1/complete", "", simpleBody, ccHeaders(clientKey)...), 404, "not_found_error", "")
		wantRelayError(t, send(t, http.MethodPost, "/v1/messages?beta=true", "", simpleBody, ccHeaders("sk-ant-api03-not-a-relay-key")...), 401, "authentication_error", "")
	})
}

// Section "Request headers", its rows on Authorization and x-api-key, with
// the credential table of Claude Code's gateway connection page: the
// gateway credential comes as x-api-key, as a bearer token, or in both,
// one of them possibly stale; neither reaches the upstream.
func TestGatewayProtocolCredentials(t *testing.T) {
	up := ccRelay(t, "gp-creds", fakeupstream.Raw(200, ccAnswer), "")
	body := ccBody("claude-sonnet-4-5", false)
	const stale = "sk-ant-api03-stale-personal-key-0123456789"
	for _, c := range []struct{ name, apiKey, bearer string }{
		{"a bearer token (ANTHROPIC_AUTH_TOKEN)", "", clientKey},
		{"x-api-key (ANTHROPIC_API_KEY)", clientKey, ""},
		{"the same key in both (apiKeyHelper)", clientKey, clientKey},
		{"a relay key as bearer beside a stale x-api-key", stale, clientKey},
		{"a relay key as x-api-key beside a stale bearer", clientKey, stale},
	} {
		t.Run(c.name, func(t *testing.T) {
			header := []string{"Anthropic-Version", "2023-06-01", "Anthropic-Beta", ccBetas, "User-Agent", "claude-cli/2.1.337 (external, cli)"}
			if c.bearer != "" {
				header = append(header, "Authorization", "Bearer "+c.bearer)
			}
			hits := up.Hits()
			r := send(t, http.MethodPost, "/v1/messages?beta=true", c.apiKey, body, header...)
			if r.status != 200 || up.Hits() != hits+1 {
				t.Fatalf("client got %d: %s", r.status, r.body)
			}
			sent := headerOf(header)
			if c.apiKey != "" {
				sent.Set("X-Api-Key", c.apiKey)
			}
			wantChannelCredential(t, up.Last(t), sent)
		})
	}
	t.Run("both invalid", func(t *testing.T) {
		hits := up.Hits()
		r := send(t, http.MethodPost, "/v1/messages?beta=true", stale, body, "Authorization", "Bearer sk-ant-oat01-stale")
		wantRelayError(t, r, 401, "authentication_error", "")
		if up.Hits() != hits {
			t.Error("a request without a valid relay key reached the upstream")
		}
	})
}

// Section "Model discovery": GET /v1/models?limit=1000, with both
// credential headers, answered at the base URL without a redirect; ids
// that start with claude, display names in Anthropic's style.
func TestGatewayProtocolModelDiscovery(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer))
	const anyKey = "sk-gp-models-any-0123456789"
	startGateway(t, channelBlock("gp-models-listed", up.URL, "models claude-sonnet-4-5 claude-sonnet-4-5-20250929 claude-3-5-haiku claude-opus-4")+
		channelBlock("gp-models-any", up.URL)+
		keyAndGroup("gp-models", "gp-models-listed")+
		"\t\tkey "+anyKey+" gp-models-any\n\t\tgroup gp-models-any {\n\t\t\tchannels gp-models-any\n\t\t}\n")
	noRedirect := &http.Client{Timeout: 10 * time.Second, CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(t *testing.T, path, key string, into any) {
		t.Helper()
		req, _ := http.NewRequest(http.MethodGet, relayURL+path, nil)
		req.Header.Set("X-Api-Key", key)
		req.Header.Set("Authorization", "Bearer "+key)
		req.Header.Set("Anthropic-Version", "2023-06-01")
		req.Header.Set("User-Agent", "claude-cli/2.1.337 (external, cli)")
		resp, err := noRedirect.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 {
			t.Fatalf("GET %s: %d (location %q) %s, want 200 at once", path, resp.StatusCode, resp.Header.Get("Location"), b)
		}
		if err := json.Unmarshal(b, into); err != nil {
			t.Fatalf("GET %s: %v: %s", path, err, b)
		}
	}
	type model struct {
		ID          string `json:"id"`
		Type        string `json:"type"`
		DisplayName string `json:"display_name"`
	}
	type page struct {
		Data    []model `json:"data"`
		HasMore bool    `json:"has_more"`
	}

	t.Run("the listed models", func(t *testing.T) {
		var list page
		get(t, "/v1/models?limit=1000", clientKey, &list)
		names := map[string]string{}
		for _, m := range list.Data {
			names[m.ID] = m.DisplayName
			if !strings.HasPrefix(m.ID, "claude") || m.Type != "model" {
				t.Errorf("entry %+v: want a model whose id starts with claude", m)
			}
		}
		for id, want := range map[string]string{
			"claude-sonnet-4-5":          "Claude Sonnet 4.5",
			"claude-sonnet-4-5-20250929": "Claude Sonnet 4.5",
			"claude-3-5-haiku":           "Claude Haiku 3.5",
			"claude-opus-4":              "Claude Opus 4",
		} {
			if got, ok := names[id]; !ok || got != want {
				t.Errorf("%s: listed %v, display_name %q; want %q", id, ok, got, want)
			}
		}
		if list.HasMore {
			t.Error("has_more with limit=1000")
		}
		var one model
		get(t, "/v1/models/claude-sonnet-4-5-20250929", clientKey, &one)
		if one.ID != "claude-sonnet-4-5-20250929" || one.DisplayName != "Claude Sonnet 4.5" {
			t.Errorf("GET /v1/models/{id}: %+v", one)
		}
	})

	t.Run("a channel that serves every model", func(t *testing.T) {
		var list page
		get(t, "/v1/models?limit=1000", anyKey, &list)
		if len(list.Data) == 0 {
			t.Fatal("the list is empty: Claude Code would show no model of the gateway")
		}
		for _, m := range list.Data {
			if !strings.HasPrefix(m.ID, "claude") {
				t.Errorf("entry %+v: want an id that starts with claude", m)
			}
		}
	})
	if up.Hits() != 0 {
		t.Errorf("discovery reached the upstream %d times; the relay answers it", up.Hits())
	}
}

// Section "Response headers" (retry-after in whole seconds), with Claude
// Code's errors reference on 529, 429 and fallbackModel: while the only
// channel cools after an upstream's 529 or 429, the relay refuses in the
// upstream's language, so Claude Code's model fallback and retries work as
// against the API, and the upstream is not asked again.
func TestGatewayProtocolOverloadAndRateLimitRefusals(t *testing.T) {
	for _, c := range []struct {
		name   string
		first  int      // the upstream's status
		header []string // and headers
		status int      // the refusal's
		typ    string
		wait   int  // the longest retry-after the refusal may give, in seconds
		exact  bool // the wait is the upstream's: retry-after is what is left of it
	}{
		{"after a 529", 529, nil, 529, "overloaded_error", 20, false},
		{"after a 429", 429, []string{"Retry-After", "37"}, 429, "rate_limit_error", 37, true},
		{"after a 500", 500, nil, 503, "relay_error", 20, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			name := "gp-cool-" + strings.Fields(c.name)[2]
			answer := fakeupstream.ErrorBody(map[int]string{529: "overloaded_error", 429: "rate_limit_error", 500: "api_error"}[c.first], "refused")
			up := fakeupstream.New(t, fakeupstream.Raw(c.first, answer, c.header...))
			startGateway(t, channelBlock(name+"-a", up.URL, "cooldown 20s")+keyAndGroup(name, name+"-a"))
			start := time.Now()
			first := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
			if first.status != c.first || !bytes.Equal(first.body, answer) {
				t.Fatalf("the first request: %d %s, want the upstream's answer unchanged", first.status, first.body)
			}
			r := claudeCode(t, "/v1/messages?beta=true", ccBody("claude-sonnet-4-5", true))
			if up.Hits() != 1 {
				t.Errorf("upstream hits = %d: a cooling channel was asked again", up.Hits())
			}
			wantRelayError(t, r, c.status, c.typ, "no_healthy_channel")
			lo := 1
			if c.exact { // whole seconds to the recovery, rounded up
				lo = c.wait - int(math.Ceil(time.Since(start).Seconds()))
			}
			wantRetryAfter(t, r, lo, c.wait)
			if v := r.header.Values("X-Should-Retry"); v != nil {
				t.Errorf("x-should-retry = %q, want none", v)
			}
		})
	}
}

// wantRetryAfter checks a refusal's wait: retry-after in whole seconds,
// between lo and hi, and retry-after-ms, which it is rounded up from.
func wantRetryAfter(t *testing.T, r reply, lo, hi int) {
	t.Helper()
	secs, err := strconv.Atoi(r.header.Get("Retry-After"))
	if err != nil || secs < lo || secs > hi {
		t.Errorf("retry-after = %q, want whole seconds from %d to %d", r.header.Get("Retry-After"), lo, hi)
	}
	ms, err := strconv.ParseInt(r.header.Get("Retry-After-Ms"), 10, 64)
	if err != nil || ms <= 0 || max(1, int(math.Ceil(float64(ms)/1000))) != secs {
		t.Errorf("retry-after-ms = %q, want the wait retry-after %d is rounded up from", r.header.Get("Retry-After-Ms"), secs)
	}
}

// Claude Code's errors reference, "Extra usage is required for long
// context requests", with the section "Automatic retry and error
// forwarding": that 429 says the account lacks long context, not that it
// is busy. The request fails over to a channel that has it; the channel
// that refused keeps serving everything else, and with no other channel
// the refusal reaches the client as sent.
func TestGatewayProtocolLongContextEntitlement(t *testing.T) {
	const extraUsage = "Extra usage is required for long context requests."
	long := `{"model":"claude-sonnet-4-5","max_tokens":16,"messages":[{"role":"user","content":"` +
		strings.Repeat("All work and no play. ", 41_000) + `"}]}` // over 800 KB: over 200k tokens estimated
	short := ccBody("claude-sonnet-4-5", false)
	for _, c := range []struct {
		name   string
		body   string
		header []string
		isLong func(r *http.Request, body []byte) bool
	}{
		{"the context-1m beta", short, []string{"Anthropic-Beta", ccBetas + ",context-1m-2025-08-07"},
			func(r *http.Request, _ []byte) bool {
				return strings.Contains(r.Header.Get("Anthropic-Beta"), "context-1m-2025-08-07")
			}},
		{"a prompt over 200k tokens", long, nil,
			func(_ *http.Request, body []byte) bool { return len(body) > 800_000 }},
	} {
		// an account without extra usage: it refuses long context only
		entitled := func(w http.ResponseWriter, r *http.Request) {
			body, _ := io.ReadAll(r.Body)
			if c.isLong(r, body) {
				fakeupstream.Error(429, "rate_limit_error", extraUsage)(w, r)
				return
			}
			fakeupstream.Raw(200, ccAnswer, "Request-Id", "req_from_a")(w, r)
		}
		name := "gp-1m-" + strings.Fields(c.name)[1]

		t.Run(c.name+" fails over, and the channel keeps serving", func(t *testing.T) {
			a := fakeupstream.New(t, http.HandlerFunc(entitled))
			b := fakeupstream.New(t, fakeupstream.Raw(200, ccAnswer, "Request-Id", "req_from_b"))
			startGateway(t, channelBlock(name+"-a", a.URL, "priority 1")+channelBlock(name+"-b", b.URL, "priority 2")+
				keyAndGroup(name, name+"-a "+name+"-b"))
			r := claudeCode(t, "/v1/messages?beta=true", c.body, c.header...)
			if r.status != 200 || r.header.Get("Request-Id") != "req_from_b" || a.Hits() != 1 || b.Hits() != 1 {
				t.Fatalf("client got %d from %q (hits a %d b %d), want the second channel's 200", r.status, r.header.Get("Request-Id"), a.Hits(), b.Hits())
			}
			if st := channels(t)[name+"-a"]; st.State != stateHealthy || st.CooldownUntil != nil || len(st.Classes) != 0 {
				t.Errorf("the refusing channel is cooling: state %s, until %v, classes %v", st.State, st.CooldownUntil, st.Classes)
			}
			if r := claudeCode(t, "/v1/messages?beta=true", short); r.status != 200 || r.header.Get("Request-Id") != "req_from_a" {
				t.Errorf("a short request got %d from %q, want the preferred channel", r.status, r.header.Get("Request-Id"))
			}
			hits := a.Hits()
			if r := claudeCode(t, "/v1/messages?beta=true", c.body, c.header...); r.status != 200 || r.header.Get("Request-Id") != "req_from_b" || a.Hits() != hits {
				t.Errorf("the next long request got %d from %q, the refusing channel asked %d more times; want it straight on the second channel",
					r.status, r.header.Get("Request-Id"), a.Hits()-hits)
			}
		})

		t.Run(c.name+" with no other channel reaches the client, and nothing cools", func(t *testing.T) {
			a := fakeupstream.New(t, http.HandlerFunc(entitled))
			startGateway(t, channelBlock(name+"-only", a.URL)+keyAndGroup(name+"-only", name+"-only"))
			r := claudeCode(t, "/v1/messages?beta=true", c.body, c.header...)
			if want := fakeupstream.ErrorBody("rate_limit_error", extraUsage); r.status != 429 || !bytes.Equal(r.body, want) {
				t.Fatalf("client got %d %s, want the upstream's 429 unchanged", r.status, r.body)
			}
			if st := channels(t)[name+"-only"]; st.State != stateHealthy || st.CooldownUntil != nil || len(st.Classes) != 0 {
				t.Errorf("the channel is cooling: state %s, until %v, classes %v", st.State, st.CooldownUntil, st.Classes)
			}
			if r := claudeCode(t, "/v1/messages?beta=true", short); r.status != 200 || a.Hits() != 2 {
				t.Errorf("a short request got %d (upstream hits %d), want it served", r.status, a.Hits())
			}
		})
	}
}

// Section "Optional endpoints and startup traffic" (of "API formats"):
// count_tokens is relayed as Claude Code sends it; the startup probes get
// a quick answer and reach no upstream.
func TestGatewayProtocolOptionalEndpoints(t *testing.T) {
	const counted = `{"input_tokens":4242}`
	up := ccRelay(t, "gp-optional", fakeupstream.Raw(200, []byte(counted), "Request-Id", "req_011CcCount"), "")

	t.Run("count_tokens byte for byte", func(t *testing.T) {
		body := `{"model":"claude-sonnet-4-5","messages":[{"role":"user","content":[{"type":"text","text":"What does main.go do?","cache_control":{"type":"ephemeral","ttl":"1h"}}]}],` +
			`"system":[` + ccAttribution + `,{"type":"text","text":"You are Claude Code, Anthropic's official CLI for Claude."}],` +
			`"tools":[{"name":"Read","description":"Reads a file.","input_schema":{"type":"object","properties":{"file_path":{"type":"string"}}},"strict":true,"defer_loading":true}],` +
			`"thinking":{"type":"adaptive"},"context_management":{"edits":[{"type":"clear_thinking_20251015","keep":"all"}]}}`
		r := claudeCode(t, "/v1/messages/count_tokens?beta=true", body)
		if r.status != 200 || string(r.body) != counted || r.header.Get("Request-Id") != "req_011CcCount" {
			t.Fatalf("client got %d %s (request-id %q)", r.status, r.body, r.header.Get("Request-Id"))
		}
		wantForwarded(t, up.Last(t), "/v1/messages/count_tokens?beta=true", body, ccHeaders(clientKey))
	})

	t.Run("startup probes", func(t *testing.T) {
		hits := up.Hits()
		quick := &http.Client{Timeout: 5 * time.Second}
		for _, path := range []string{"/api/hello", "/"} {
			req, _ := http.NewRequest(http.MethodHead, relayURL+path, nil)
			for h, vs := range headerOf(ccHeaders(clientKey)) {
				req.Header[h] = vs
			}
			start := time.Now()
			resp, err := quick.Do(req)
			if err != nil {
				t.Fatalf("HEAD %s: %v", path, err)
			}
			resp.Body.Close()
			t.Logf("HEAD %s: %d in %v", path, resp.StatusCode, time.Since(start).Round(time.Millisecond))
			if resp.StatusCode >= 500 {
				t.Errorf("HEAD %s: %d, want the relay's own quick answer", path, resp.StatusCode)
			}
		}
		if up.Hits() != hits {
			t.Errorf("the probes reached the upstream %d times", up.Hits()-hits)
		}
	})
}
