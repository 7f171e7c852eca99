package relay

import (
	"bytes"
	"io"
	"net/http"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/internal/features"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddy-relay/relay/providers/anthropic"
	"github.com/caddy-relay/relay/providers/bedrock"
	"github.com/caddy-relay/relay/providers/mock"
	"github.com/caddy-relay/relay/providers/vertex"
	"github.com/tidwall/gjson"
)

func TestChannelFeaturesByProvider(t *testing.T) {
	tests := []struct {
		name                   string
		p                      provider.Provider
		supports, lacks, strip []string
		need                   []string
		wantOK, wantStrips     bool
	}{
		{name: "anthropic takes mcp_servers", p: &anthropic.Provider{}, need: []string{"mcp_servers", "web_fetch", "any-beta-2030"}, wantOK: true},
		{name: "service_tier is opt-in", p: &anthropic.Provider{}, need: []string{"service_tier"}},
		{name: "supports turns an opt-in on", p: &anthropic.Provider{}, supports: []string{"service_tier"}, need: []string{"service_tier"}, wantOK: true},
		{name: "lacks wins over the wire", p: &anthropic.Provider{}, lacks: []string{"long_context"}, need: []string{"long_context"}},
		{name: "bedrock lacks mcp_servers", p: &bedrock.Provider{}, need: []string{"mcp_servers"}},
		{name: "bedrock takes context_management with its beta", p: &bedrock.Provider{}, need: []string{"context_management", "compact-2026-01-12"}, wantOK: true},
		{name: "bedrock lacks betas it does not know", p: &bedrock.Provider{}, need: []string{"some-new-beta-2031-01-01"}},
		{name: "bedrock's betas list replaces its column", p: &bedrock.Provider{Betas: []string{"some-new-beta-2031-01-01"}}, need: []string{"some-new-beta-2031-01-01"}, wantOK: true},
		{name: "bedrock's betas list drops the column's", p: &bedrock.Provider{Betas: []string{"some-new-beta-2031-01-01"}}, need: []string{"compact-2026-01-12"}},
		{name: "bedrock's strip_fields strip", p: &bedrock.Provider{StripFields: []string{"mcp_servers"}}, need: []string{"mcp_servers"}, wantOK: true, wantStrips: true},
		{name: "the channel's strip", p: &bedrock.Provider{}, strip: []string{"container", "files-api-2025-04-14"}, need: []string{"container", "files-api-2025-04-14"}, wantOK: true, wantStrips: true},
		{name: "supports names a beta the table does not list", p: &bedrock.Provider{}, supports: []string{"some-new-beta-2031-01-01"}, need: []string{"some-new-beta-2031-01-01"}, wantOK: true},
		{name: "lacks names a beta of the table", p: &anthropic.Provider{}, lacks: []string{"files-api-2025-04-14"}, need: []string{"files-api-2025-04-14"}},
		{name: "lacks names a beta the table does not list", p: &vertex.Provider{}, lacks: []string{"some-new-beta-2031-01-01"}, need: []string{"some-new-beta-2031-01-01"}},
		{name: "strip names a beta the table does not list", p: &vertex.Provider{}, strip: []string{"some-new-beta-2031-01-01"}, need: []string{"some-new-beta-2031-01-01", "other-beta-2031-01-01"}, wantOK: true, wantStrips: true},
		{name: "vertex forwards betas it does not know", p: &vertex.Provider{}, need: []string{"some-new-beta-2031-01-01", "web_search"}, wantOK: true},
		{name: "vertex lacks web_fetch", p: &vertex.Provider{}, need: []string{"web_fetch"}},
		{name: "a provider module without a table takes everything", p: stubProvider{}, need: []string{"speed", "mcp_servers", "x-y"}, wantOK: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ch := testChannel("c")
			ch.features = features.NewChannel(tt.p, tt.supports, tt.lacks, tt.strip)
			n := needing(tt.need...)
			ok, strips := ch.takes(n, testNow)
			if ok != tt.wantOK || strips != tt.wantStrips {
				t.Errorf("takes = %v (strips %v), want %v (strips %v)", ok, strips, tt.wantOK, tt.wantStrips)
			}
		})
	}
}

// A beta that bears the name of a feature of the table that is not a beta
// is a beta the table does not list: its provider answers for it.
func TestBetaNamedAsAFeature(t *testing.T) {
	for _, tt := range []struct {
		p    provider.Provider
		want bool
	}{{&anthropic.Provider{}, true}, {&bedrock.Provider{}, false}} {
		ch := testChannel("c")
		ch.features = features.NewChannel(tt.p, nil, nil, nil)
		n := features.Needs{Betas: []string{"web_fetch"}}
		if ok, _ := ch.takes(n, testNow); ok != tt.want {
			t.Errorf("%T: takes the beta web_fetch = %v, want %v", tt.p, ok, tt.want)
		}
	}
}

// stubProvider is a provider module from elsewhere, which says nothing of
// features.
type stubProvider struct{ provider.Provider }

func TestLackedFeatures(t *testing.T) {
	carried := needing("mcp_servers", "context_management", "web_fetch", "files-api-2025-04-14", "b-2030")
	body := func(msg string) []byte {
		return []byte(`{"type":"error","error":{"type":"invalid_request_error","message":` + strconv.Quote(msg) + `}}`)
	}
	tests := []struct {
		name    string
		bedrock bool // in Bedrock's words
		msg     string
		want    []string
	}{
		{"an unknown field", false, "mcp_servers: Extra inputs are not permitted", []string{"mcp_servers"}},
		{"a nested unknown field is the request's", false, "mcp_servers.0.bogus: Extra inputs are not permitted", nil},
		{"a field the request did not carry", false, "container: Extra inputs are not permitted", nil},
		{"the wording elsewhere than the start", false, "messages.0.content: 'mcp_servers: Extra inputs are not permitted'", nil},
		{"betas", false, "Unexpected value(s) `files-api-2025-04-14`, `zzz` for the `anthropic-beta` header. Please consult our documentation at platform.claude.com/docs or try again without the header.", []string{"files-api-2025-04-14"}},
		{"a server tool", false, "tools.2: Input tag 'web_fetch_20250910' found using 'type' does not match any of the expected tags: 'custom', 'bash_20250124'", []string{"web_fetch"}},
		{"a tool tag the request's tool is not", false, "tools.2: Input tag 'custom_x' found using 'type' does not match", nil},
		{"another 400", false, "max_tokens: Field required", nil},
		{"the credit balance", false, "Your credit balance is too low to access the Anthropic API.", nil},
		{"bedrock's unknown key", true, "bedrock: ValidationException: Malformed input request: #: extraneous key [context_management] is not permitted, please reformat your input and try again.", []string{"context_management"}},
		{"bedrock's betas: one of every one carried", true, "bedrock: ValidationException: invalid beta flag", []string{"files-api-2025-04-14", "b-2030"}},
		{"anthropic's words from bedrock mean nothing", true, "mcp_servers: Extra inputs are not permitted", nil},
		{"bedrock's words from anthropic mean nothing", false, "bedrock: ValidationException: invalid beta flag", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var words provider.RefusalReader // Anthropic's
			if tt.bedrock {
				words = &bedrock.Provider{}
			}
			got, certain := features.Lacked(words, body(tt.msg), carried)
			if !slices.Equal(got, tt.want) || certain != (len(got) > 0 && !strings.Contains(tt.name, "every one carried")) {
				t.Errorf("Lacked = %q (certain %v), want %q", got, certain, tt.want)
			}
		})
	}
}

func TestBedrockBetaRefusalIsCertainOnlyForOneFlag(t *testing.T) {
	one := needing("effort-2025-11-24")
	msg := []byte(`{"type":"error","error":{"type":"invalid_request_error","message":"bedrock: ValidationException: invalid beta flag"}}`)
	if got, certain := features.Lacked(&bedrock.Provider{}, msg, one); !slices.Equal(got, []string{"effort-2025-11-24"}) || !certain {
		t.Errorf("one flag: %q certain %v", got, certain)
	}
}

func TestFeatureBedrockBetaRefusal(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		if strings.Contains(gjson.GetBytes(body, "anthropic_beta").Raw, "effort-2025-11-24") {
			providertest.BedrockFailure(400, "ValidationException", "invalid beta flag")(w, r)
			return
		}
		fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5", "from bedrock", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2}))(w, r)
	})
	direct := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, bedrockChannel(t, "brbeta-bedrock", fb.URL, "priority 1")+channelBlock("brbeta-direct", direct.URL, "priority 2")+
		keyAndGroup("brbeta", "brbeta-bedrock brbeta-direct"))
	body := `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`

	// two flags: Bedrock does not say which it refuses; fail over, learn nothing
	r := message(t, body, "Anthropic-Beta", "effort-2025-11-24,interleaved-thinking-2025-05-14")
	if r.status != 200 || !bytes.Contains(r.body, []byte("from anthropic")) || fb.Hits() != 1 {
		t.Fatalf("%d %s (bedrock hits %d)", r.status, r.body, fb.Hits())
	}
	if l := channels(t)["brbeta-bedrock"].Lacks; len(l) != 0 {
		t.Errorf("an ambiguous refusal set features aside: %v", l)
	}
	if r := message(t, body, "Anthropic-Beta", "interleaved-thinking-2025-05-14"); r.status != 200 || fb.Hits() != 2 || !bytes.Contains(r.body, []byte("from bedrock")) {
		t.Errorf("the other flag alone should still reach Bedrock: %d %s", r.status, r.body)
	}
	// one flag: that one
	if r := message(t, body, "Anthropic-Beta", "effort-2025-11-24"); r.status != 200 || fb.Hits() != 3 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if _, ok := channels(t)["brbeta-bedrock"].Lacks["effort-2025-11-24"]; !ok {
		t.Errorf("the one flag Bedrock refused is not set aside: %v", channels(t)["brbeta-bedrock"].Lacks)
	}
	if r := message(t, body, "Anthropic-Beta", "effort-2025-11-24"); r.status != 200 || fb.Hits() != 3 {
		t.Errorf("the flag set aside reached Bedrock again")
	}
}

// lacking answers as an Anthropic-shaped upstream whose wire does not know
// the body field field or the beta beta: the 400 Anthropic's API sends for
// each, and a message otherwise.
func lacking(text, field, beta string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		switch {
		case field != "" && gjson.GetBytes(body, field).Exists():
			fakeupstream.Error(400, "invalid_request_error", field+": Extra inputs are not permitted")(w, r)
		case beta != "" && strings.Contains(r.Header.Get("Anthropic-Beta"), beta):
			fakeupstream.Error(400, "invalid_request_error", "Unexpected value(s) `"+beta+"` for the `anthropic-beta` header. Please consult our documentation at platform.claude.com/docs or try again without the header.")(w, r)
		default:
			fakeupstream.Message(text)(w, r)
		}
	}
}

func TestFeatureRoutesPastBedrockByteIdentical(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5", "from bedrock", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2})))
	direct := fakeupstream.New(t, fakeupstream.Message("from anthropic"))
	startRelay(t, bedrockChannel(t, "fid-bedrock", fb.URL, "priority 1")+
		channelBlock("fid-direct", direct.URL, "priority 2")+
		keyAndGroup("fid", "fid-bedrock fid-direct"))

	body := `{"model":"claude-sonnet-4-5","max_tokens":64,"mcp_servers":[{"type":"url","url":"https://mcp.example/sse","name":"x"}],"messages":[{"role":"user","content":"Hi"}]}`
	r := message(t, body, "Anthropic-Beta", "mcp-client-2025-11-20")
	if r.status != 200 || !bytes.Contains(r.body, []byte("from anthropic")) {
		t.Fatalf("%d %s", r.status, r.body)
	}
	if fb.Hits() != 0 {
		t.Errorf("Bedrock, which lacks mcp_servers, got the request (%d hits)", fb.Hits())
	}
	got := direct.Last(t)
	if string(got.Body) != body || got.Header.Get("Anthropic-Beta") != "mcp-client-2025-11-20" {
		t.Errorf("Anthropic got\n %s (beta %q)\nwant the client's bytes\n %s", got.Body, got.Header.Get("Anthropic-Beta"), body)
	}
	// a request without the feature takes the preferred channel as before
	if r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 || fb.Hits() != 1 {
		t.Errorf("a plain request: %d, Bedrock hits %d; want it on Bedrock", r.status, fb.Hits())
	}
}

func TestFeatureNoChannelSupportsIt(t *testing.T) {
	fb := providertest.NewFakeBedrock(t, fakeupstream.Raw(200, fakeupstream.MessageBody("claude-sonnet-4-5", "from bedrock", fakeupstream.Usage{InputTokens: 7, OutputTokens: 2})))
	startRelay(t, bedrockChannel(t, "fid-only-bedrock", fb.URL)+keyAndGroup("fid-only", "fid-only-bedrock"))

	r := message(t, `{"model":"claude-sonnet-4-5","max_tokens":64,"mcp_servers":[{"type":"url","url":"https://mcp.example/sse","name":"x"}],"messages":[{"role":"user","content":"Hi"}]}`)
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	msg := gjson.GetBytes(r.body, "error.message").String()
	if !strings.Contains(msg, "mcp_servers") || !strings.Contains(msg, `"fid-only"`) || r.header.Get("X-Should-Retry") != "false" {
		t.Errorf("the error should name the feature and the group, and say not to retry: %s %v", r.body, r.header)
	}
	r = message(t, `{"model":"claude-sonnet-4-5","max_tokens":64,"tools":[{"type":"web_fetch_20250910","name":"web_fetch"}],"messages":[{"role":"user","content":"Hi"}]}`, "Anthropic-Beta", "context-1m-2025-08-07,files-api-2025-04-14")
	wantRelayError(t, r, 503, "relay_error", "capability_not_available")
	if msg := gjson.GetBytes(r.body, "error.message").String(); !strings.Contains(msg, "web_fetch, files-api-2025-04-14") || strings.Contains(msg, "context-1m") {
		t.Errorf("the error should name exactly the missing features: %s", msg)
	}
	if fb.Hits() != 0 {
		t.Errorf("Bedrock got %d requests it cannot serve", fb.Hits())
	}
}

func TestFeatureLearnedFromTheUpstreamsRefusal(t *testing.T) {
	first := fakeupstream.New(t, lacking("first", "context_management", "files-api-2025-04-14"))
	second := fakeupstream.New(t, fakeupstream.Message("second"))
	startRelay(t, channelBlock("learn-first", first.URL, "priority 1")+channelBlock("learn-second", second.URL, "priority 2")+
		keyAndGroup("learn", "learn-first learn-second"))
	misses := func(feature string) float64 {
		mf, _ := scrape(t)
		return max(value(mf, "relay_capability_misses_total", "channel=learn-first", "feature="+feature), 0)
	}
	before := misses("context_management")

	withFeature := `{"model":"m","max_tokens":8,"context_management":{"edits":[{"type":"clear_tool_uses_20250919"}]},"messages":[{"role":"user","content":"Hi"}]}`
	r := message(t, withFeature)
	if r.status != 200 || !bytes.Contains(r.body, []byte("second")) || first.Hits() != 1 || second.Hits() != 1 {
		t.Fatalf("first request: %d %s, hits %d/%d; want a failover to the second channel", r.status, r.body, first.Hits(), second.Hits())
	}
	if got := misses("context_management") - before; got != 1 {
		t.Errorf("relay_capability_misses_total grew by %v, want 1", got)
	}
	st := channels(t)["learn-first"]
	if _, ok := st.Lacks["context_management"]; !ok || st.State != "healthy" {
		t.Errorf("GET /relay/channels: lacks %v, state %s; want context_management set aside on a healthy channel", st.Lacks, st.State)
	}
	// set aside for that feature only
	if r := message(t, withFeature); r.status != 200 || first.Hits() != 1 || second.Hits() != 2 {
		t.Errorf("second request with the feature: %d, hits %d/%d; want it straight on the second channel", r.status, first.Hits(), second.Hits())
	}
	if r := message(t, `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`); r.status != 200 || first.Hits() != 2 {
		t.Errorf("a request without the feature: %d, first hits %d; want the preferred channel", r.status, first.Hits())
	}

	// a beta is a feature as well
	r = message(t, `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`, "Anthropic-Beta", "files-api-2025-04-14")
	if r.status != 200 || !bytes.Contains(r.body, []byte("second")) || first.Hits() != 3 {
		t.Fatalf("beta request: %d %s; want a failover", r.status, r.body)
	}
	if _, ok := channels(t)["learn-first"].Lacks["files-api-2025-04-14"]; !ok {
		t.Errorf("the beta is not set aside on the channel: %v", channels(t)["learn-first"].Lacks)
	}
	if r := message(t, `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`, "Anthropic-Beta", "files-api-2025-04-14"); r.status != 200 || first.Hits() != 3 {
		t.Errorf("the beta's second request reached the channel that lacks it")
	}

	// an operator's reset forgets what was learned
	if code, _ := adminPost(t, "learn-first", "reset"); code != 200 {
		t.Fatalf("reset: %d", code)
	}
	if l := channels(t)["learn-first"].Lacks; len(l) != 0 {
		t.Errorf("lacks after a reset: %v", l)
	}
}

func TestFeatureRefusalWithNoOtherChannelReachesTheClient(t *testing.T) {
	only := fakeupstream.New(t, lacking("only", "context_management", ""))
	other := fakeupstream.New(t, fakeupstream.Message("other"))
	startRelay(t, channelBlock("refuse-only", only.URL)+channelBlock("refuse-other", other.URL, "lacks context_management")+
		keyAndGroup("refuse", "refuse-only refuse-other"))

	r := message(t, `{"model":"m","max_tokens":8,"context_management":{},"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 400 || gjson.GetBytes(r.body, "error.message").String() != "context_management: Extra inputs are not permitted" {
		t.Errorf("want the upstream's 400 unchanged, got %d %s", r.status, r.body)
	}
	if only.Hits() != 1 || other.Hits() != 0 {
		t.Errorf("hits %d/%d: the channel configured to lack the feature is no candidate", only.Hits(), other.Hits())
	}
	if l := channels(t)["refuse-only"].Lacks; len(l) != 0 {
		t.Errorf("with no other candidate, nothing is learned: %v", l)
	}
	// a refusal of a feature the request did not carry is the request's
	only.SetHandler(fakeupstream.Error(400, "invalid_request_error", "container: Extra inputs are not permitted"))
	r = message(t, `{"model":"m","max_tokens":8,"context_management":{},"messages":[{"role":"user","content":"Hi"}]}`)
	if r.status != 400 || only.Hits() != 2 || other.Hits() != 0 || len(channels(t)["refuse-only"].Lacks) != 0 {
		t.Errorf("a 400 about a feature the request did not carry: %d, hits %d/%d, lacks %v", r.status, only.Hits(), other.Hits(), channels(t)["refuse-only"].Lacks)
	}
}

// TestFeatureTableMatchesDocs reads the feature table of
// docs/providers.md: the same rows, in the same order, saying the same as
// the code's table and the built-in providers' columns.
func TestFeatureTableMatchesDocs(t *testing.T) {
	doc, err := os.ReadFile("docs/providers.md")
	if err != nil {
		t.Fatal(err)
	}
	_, table, ok := strings.Cut(string(doc), "<!-- feature table start -->\n")
	table, _, ok2 := strings.Cut(table, "<!-- feature table end -->")
	if !ok || !ok2 {
		t.Fatal("docs/providers.md has no feature table between its markers")
	}
	var rows [][]string
	for _, line := range strings.Split(strings.TrimSpace(table), "\n")[2:] {
		cells := strings.Split(strings.Trim(line, "| "), " | ")
		if len(cells) != 6 || strings.TrimSpace(cells[5]) == "" {
			t.Fatalf("row %q: want 6 cells and a source", line)
		}
		rows = append(rows, cells)
	}
	columns := []provider.FeatureSupport{&anthropic.Provider{}, &bedrock.Provider{}, &vertex.Provider{}}
	want := func(name, label string, kind features.Kind) []string {
		row := []string{label, kind.String()}
		for _, c := range columns {
			row = append(row, c.Supports(name).String())
		}
		return row
	}
	var code [][]string
	for _, name := range features.Names() {
		code = append(code, want(name, "`"+name+"`", features.KindOf(name)))
	}
	code = append(code, want("no-such-beta-2099-01-01", "(other betas)", features.KindBeta))
	if len(rows) != len(code) {
		t.Errorf("the docs list %d features, the code %d", len(rows), len(code))
	}
	for i := range min(len(rows), len(code)) {
		if got := rows[i][:5]; !slices.Equal(got, code[i]) {
			t.Errorf("row %d: the docs say %q, the code %q", i+1, got, code[i])
		}
	}
}

func TestFeatureStripOnAnAnthropicChannel(t *testing.T) {
	up := fakeupstream.New(t, fakeupstream.Message("stripped"))
	startRelay(t, channelBlock("strip-a", up.URL, "lacks old-beta-2024-01-01", "strip web_fetch unsupported_betas")+
		keyAndGroup("strip", "strip-a"))

	body := `{"model":"m","max_tokens":8,"tools":[{"type":"web_fetch_20250910","name":"web_fetch"},{"name":"f","input_schema":{}}],"messages":[{"role":"user","content":"Hi"}]}`
	r := message(t, body, "Anthropic-Beta", "old-beta-2024-01-01,new-beta-2031-01-01")
	if r.status != 200 {
		t.Fatalf("%d %s", r.status, r.body)
	}
	got := up.Last(t)
	if want := `{"model":"m","max_tokens":8,"tools":[{"name":"f","input_schema":{}}],"messages":[{"role":"user","content":"Hi"}]}`; string(got.Body) != want {
		t.Errorf("upstream body\n %s\nwant\n %s", got.Body, want)
	}
	if got.Header.Get("Anthropic-Beta") != "new-beta-2031-01-01" {
		t.Errorf("anthropic-beta upstream = %q, want the flag the channel does not lack", got.Header.Get("Anthropic-Beta"))
	}
	// a request without them is sent byte for byte
	plain := `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`
	if r := message(t, plain, "Anthropic-Beta", "new-beta-2031-01-01"); r.status != 200 || string(up.Last(t).Body) != plain {
		t.Errorf("plain request: %d, upstream got %s", r.status, up.Last(t).Body)
	}
}

// BenchmarkTakesBetas is what selection asks of each candidate channel for
// a request that carries betas: a Bedrock channel (whose wire refuses the
// betas it does not list) asked about a field, two betas of the table and
// one the table does not list, which its config names.
func BenchmarkTakesBetas(b *testing.B) {
	ch := testChannel("bedrock")
	ch.features = features.NewChannel(&bedrock.Provider{}, []string{"dev-tools-2026-01-01"}, nil, nil)
	n := needing("context_management", "interleaved-thinking-2025-05-14", "context-1m-2025-08-07", "dev-tools-2026-01-01")
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if ok, _ := ch.takes(n, testNow); !ok {
			b.Fatal("refused")
		}
	}
}

// TestTheMockAnswersFeaturesAsAnthropic: the mock imitates Anthropic's API,
// and its column of the feature table is Anthropic's.
func TestTheMockAnswersFeaturesAsAnthropic(t *testing.T) {
	names := append([]string{"no-such-beta-2099-01-01"}, features.Names()...)
	for _, name := range names {
		if a, m := (&anthropic.Provider{}).Supports(name), (&mock.Provider{}).Supports(name); a != m {
			t.Errorf("%s: anthropic %v, mock %v", name, a, m)
		}
	}
}

// An upstream that says its account lacks long context (a 429 though
// nothing is busy) has it set aside, as a feature its wire lacks: the
// request fails over to a channel that has it, the channel keeps serving
// the rest, and nothing cools.
func TestLongContextRefusalIsAMissingFeatureNotACooldown(t *testing.T) {
	const refusal = "Extra usage is required for long context requests."
	const beta = "context-1m-2025-08-07"
	long := func(h http.Handler) http.HandlerFunc {
		return func(w http.ResponseWriter, r *http.Request) {
			if strings.Contains(r.Header.Get("Anthropic-Beta"), beta) {
				fakeupstream.Error(429, "rate_limit_error", refusal)(w, r)
				return
			}
			h.ServeHTTP(w, r)
		}
	}
	body := `{"model":"claude-sonnet-4-5","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`

	t.Run("another channel has it", func(t *testing.T) {
		noLong := fakeupstream.New(t, long(fakeupstream.Message("no-long")))
		hasLong := fakeupstream.New(t, fakeupstream.Message("has-long"))
		startRelay(t, channelBlock("entitled-no", noLong.URL, "priority 1")+channelBlock("entitled-yes", hasLong.URL, "priority 2")+
			keyAndGroup("entitled", "entitled-no entitled-yes"))
		r := message(t, body, "Anthropic-Beta", "claude-code-20250219,"+beta)
		if r.status != 200 || !bytes.Contains(r.body, []byte("has-long")) || r.header.Get("X-Relay-Attempts") != "2" {
			t.Fatalf("a long context request: %d %s, attempts %q; want it failed over to the channel that has long context", r.status, r.body, r.header.Get("X-Relay-Attempts"))
		}
		st := channels(t)["entitled-no"]
		if _, ok := st.Lacks["long_context"]; !ok || st.State != stateHealthy || st.CooldownUntil != nil {
			t.Errorf("GET /relay/channels: %+v; want long_context and the beta set aside on a healthy channel", st)
		}
		if _, ok := st.Lacks[beta]; !ok {
			t.Errorf("the beta the request used is not set aside: %v", st.Lacks)
		}
		// the next long context request goes straight to the other channel
		if r := message(t, body, "Anthropic-Beta", beta); r.status != 200 || noLong.Hits() != 1 || hasLong.Hits() != 2 {
			t.Errorf("a second long context request: %d, hits %d/%d; want it on the channel that has long context only", r.status, noLong.Hits(), hasLong.Hits())
		}
		// and the channel serves everything else
		if r := message(t, body); r.status != 200 || !bytes.Contains(r.body, []byte("no-long")) {
			t.Errorf("a request without long context: %d %s; want the preferred channel", r.status, r.body)
		}
	})
	t.Run("no other channel has it", func(t *testing.T) {
		only := fakeupstream.New(t, long(fakeupstream.Message("only")))
		startRelay(t, channelBlock("entitled-only", only.URL)+keyAndGroup("entitled1", "entitled-only"))
		r := message(t, body, "Anthropic-Beta", beta)
		if r.status != 429 || !bytes.Equal(r.body, fakeupstream.ErrorBody("rate_limit_error", refusal)) {
			t.Fatalf("got %d %s; want the upstream's 429 unchanged", r.status, r.body)
		}
		if st := channels(t)["entitled-only"]; st.State != stateHealthy || len(st.Classes) != 0 {
			t.Errorf("the refusal cooled the channel: %+v", st)
		}
		if r := message(t, body); r.status != 200 {
			t.Errorf("a request without long context after the refusal: %d %s; want it served", r.status, r.body)
		}
	})
	t.Run("the words must start the message", func(t *testing.T) {
		// an upstream message that quotes a client's words is no refusal of
		// long context: it must not take long context from a shared channel
		quoting := fakeupstream.New(t, fakeupstream.Error(400, "invalid_request_error", "tools.0: Input tag '"+refusal+"' found using 'type' does not match any of the expected tags"))
		other := fakeupstream.New(t, fakeupstream.Message("other"))
		startRelay(t, channelBlock("entitled-quote", quoting.URL, "priority 1")+channelBlock("entitled-quote-b", other.URL, "priority 2")+
			keyAndGroup("entitled2", "entitled-quote entitled-quote-b"))
		r := message(t, body, "Anthropic-Beta", beta)
		if r.status != 400 || other.Hits() != 0 || len(channels(t)["entitled-quote"].Lacks) != 0 {
			t.Errorf("a 400 quoting the words: %d, other hits %d, lacks %v; want the 400 unchanged and nothing learned", r.status, other.Hits(), channels(t)["entitled-quote"].Lacks)
		}
	})
}

// A 403 that refuses a beta the request carried, in Anthropic's words, is
// the channel's lack of that beta, not a refused credential: a client's
// beta must not cool a shared channel for auth_cooldown.
func TestABetaRefusedWithA403DoesNotCoolTheChannel(t *testing.T) {
	const beta = "files-api-2025-04-14"
	refusing := fakeupstream.New(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if strings.Contains(r.Header.Get("Anthropic-Beta"), beta) {
			fakeupstream.Error(403, "permission_error", "Unexpected value(s) `"+beta+"` for the `anthropic-beta` header.")(w, r)
			return
		}
		fakeupstream.Message("refusing")(w, r)
	}))
	other := fakeupstream.New(t, fakeupstream.Message("other"))
	startRelay(t, channelBlock("beta403-a", refusing.URL, "priority 1")+channelBlock("beta403-b", other.URL, "priority 2")+
		keyAndGroup("beta403", "beta403-a beta403-b"))
	body := `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`
	if r := message(t, body, "Anthropic-Beta", beta); r.status != 200 || !bytes.Contains(r.body, []byte("other")) {
		t.Fatalf("with the beta: %d %s; want a failover", r.status, r.body)
	}
	st := channels(t)["beta403-a"]
	if _, ok := st.Lacks[beta]; !ok || st.State != stateHealthy {
		t.Errorf("GET /relay/channels: %+v; want the beta set aside on a healthy channel", st)
	}
	if r := message(t, body); r.status != 200 || !bytes.Contains(r.body, []byte("refusing")) {
		t.Errorf("without the beta: %d %s; want the preferred channel, not cooling", r.status, r.body)
	}
}
