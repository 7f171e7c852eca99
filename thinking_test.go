package relay

import (
	"encoding/json"
	"net/http"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/caddy-relay/relay/internal/signatures"
)

// learnSig makes the signature table know that domain signed sig.
func learnSig(sig, domain string) {
	signatures.Learned.Learn(signatures.Digest([]byte(`"`+sig+`"`)), domain, nil)
}

func TestStripThinkingRemovesWhatTheTargetDidNotSign(t *testing.T) {
	learnSig("sig-strip-A1", "strip-A")
	learnSig("sig-strip-A2", "strip-A")
	learnSig("sig-strip-B1", "strip-B")
	const (
		thA1 = `{"type":"thinking","thinking":"a1","signature":"sig-strip-A1"}`
		thA2 = `{"type":"thinking","thinking":"a2","signature":"sig-strip-A2"}`
		thB1 = `{"type":"thinking","thinking":"b1","signature":"sig-strip-B1"}`
		redA = `{"type":"redacted_thinking","data":"sig-strip-A2"}`
		text = `{"type":"text","text":"hello"}`
		tool = `{"type":"tool_use","id":"toolu_1","name":"ls","input":{}}`
		res  = `{"role":"user","content":[{"type":"tool_result","tool_use_id":"toolu_1","content":"ok"}]}`
		user = `{"role":"user","content":"Hi"}`
	)
	asst := func(blocks ...string) string {
		return `{"role":"assistant","content":[` + strings.Join(blocks, ",") + `]}`
	}
	body := func(thinking bool, msgs ...string) string {
		b := `{"model":"claude-sonnet-4-5","max_tokens":2048,`
		if thinking {
			b += `"thinking":{"type":"enabled","budget_tokens":1024},`
		}
		return b + `"messages":[` + strings.Join(msgs, ",") + `]}`
	}
	for _, tc := range []struct {
		name, in, want string
	}{
		{"an earlier turn's thinking block goes, its text stays",
			body(true, user, asst(thA1, text), user),
			body(true, user, asst(text), user)},
		{"the block in the middle of a message goes with one comma",
			body(true, user, asst(text, thA1, text), user),
			body(true, user, asst(text, text), user)},
		{"the last block goes with the comma before it",
			body(true, user, asst(text, thA1), user),
			body(true, user, asst(text), user)},
		{"the target's own blocks stay, the other domain's go",
			body(true, user, asst(thA1, text), user, asst(thB1, text), user),
			body(true, user, asst(text), user, asst(thB1, text), user)},
		{"a redacted block goes like a signed one",
			body(true, user, asst(redA, thA2, text), user),
			body(true, user, asst(text), user)},
		{"a message of nothing but thinking goes whole",
			body(true, user, asst(thA1), user, asst(text), user),
			body(true, user, user, asst(text), user)},
		{"a tool loop's last assistant turn loses its block, and the request its thinking",
			body(true, user, asst(thA1, text, tool), res),
			`{"model":"claude-sonnet-4-5","max_tokens":2048,"messages":[` + user + `,` + asst(text, tool) + `,` + res + `]}`},
		{"an earlier tool loop's turn keeps the request's thinking",
			body(true, user, asst(thA1, tool), res, asst(thB1, text), user),
			body(true, user, asst(tool), res, asst(thB1, text), user)},
		{"whitespace of a pretty body stays where nothing went",
			"{\n  \"model\": \"m\",\n  \"max_tokens\": 1,\n  \"messages\": [\n    " + user + ",\n    {\"role\": \"assistant\", \"content\": [\n      " + thA1 + ",\n      " + text + "\n    ]},\n    " + user + "\n  ]\n}",
			"{\n  \"model\": \"m\",\n  \"max_tokens\": 1,\n  \"messages\": [\n    " + user + ",\n    {\"role\": \"assistant\", \"content\": [\n      " + text + "\n    ]},\n    " + user + "\n  ]\n}"},
		{"the thinking member last in the body goes with the comma before it",
			`{"model":"m","max_tokens":1,"messages":[` + user + `,` + asst(thA1, tool) + `,` + res + `],"thinking":{"type":"enabled","budget_tokens":1024}}`,
			`{"model":"m","max_tokens":1,"messages":[` + user + `,` + asst(tool) + `,` + res + `]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := stripThinking([]byte(tc.in), "strip-B")
			if !ok || string(got) != tc.want {
				t.Errorf("stripThinking:\n got %s (%v)\nwant %s", got, ok, tc.want)
			}
			if !json.Valid(got) {
				t.Errorf("not valid JSON: %s", got)
			}
		})
	}

	// nothing of another domain: the body as it was
	in := body(true, user, asst(thB1, text), user)
	if got, ok := stripThinking([]byte(in), "strip-B"); ok || string(got) != in {
		t.Errorf("nothing to strip: got %s (%v)", got, ok)
	}
}

// TestInspectNotesTheSigner reads the signer of a body's thinking blocks
// in inspect's pass: the last known block's domain, and whether another
// domain signed an earlier one.
func TestInspectNotesTheSigner(t *testing.T) {
	learnSig("sig-inspect-A", "inspect-A")
	learnSig("sig-inspect-B", "inspect-B")
	for _, tc := range []struct {
		name, messages string
		signed         int32
		signer         string
		mixed          bool
	}{
		{"no thinking", `[{"role":"user","content":"Hi"}]`, 0, "", false},
		{"a known signer", `[{"role":"user","content":"Hi"},{"role":"assistant","content":[{"type":"thinking","thinking":"x","signature":"sig-inspect-A"},{"type":"text","text":"y"}]},{"role":"user","content":"Hi"}]`, 1, "inspect-A", false},
		{"an escaped signature is the same", `[{"role":"assistant","content":[{"signature":"sig-inspect\u002dA","type":"thinking","thinking":"x"}]}]`, 1, "inspect-A", false},
		{"garbage is unknown", `[{"role":"assistant","content":[{"type":"thinking","thinking":"x","signature":"garbage"}]}]`, 1, "", false},
		{"the last known wins", `[{"role":"assistant","content":[{"type":"redacted_thinking","data":"sig-inspect-A"}]},{"role":"assistant","content":[{"type":"thinking","thinking":"x","signature":"sig-inspect-B"}]}]`, 2, "inspect-B", true},
	} {
		// with a cache breakpoint the messages are walked by the prompt
		// cache's scan (affinity.go), which must note the same
		for _, system := range []string{"", `"system":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}],`} {
			t.Run(tc.name+map[bool]string{true: ", cached", false: ""}[system != ""], func(t *testing.T) {
				in := &inbound{route: routeMessages}
				in.who.key = &key{group: &group{affinity: system != ""}}
				in.ask.body = []byte(`{"model":"claude-sonnet-4-5","max_tokens":1,` + system + `"thinking":{"type":"enabled","budget_tokens":1024},"messages":` + tc.messages + `}`)
				in.ask.header = http.Header{}
				if err := in.inspect(); err != nil {
					t.Fatal(err.msg)
				}
				if (in.ask.prefix != nil) != (system != "") {
					t.Fatalf("prefix = %v with system %q", in.ask.prefix, system)
				}
				got := in.ask.thinking
				if !got.on || got.signed != tc.signed || got.signer != tc.signer || got.mixed != tc.mixed {
					t.Errorf("thinking = %+v, want signed %d signer %q mixed %v", got, tc.signed, tc.signer, tc.mixed)
				}
			})
		}
	}
}

func TestDropSpans(t *testing.T) {
	// "[E0, E1, E2]": elements at 1-3, 5-7, 9-11
	els := func(drops ...bool) []element {
		out := []element{{span: span{1, 3}}, {span: span{5, 7}}, {span: span{9, 11}}}
		for i, d := range drops {
			out[i].drop = d
		}
		return out
	}
	const raw = "[E0, E1, E2]"
	apply := func(spans []span) string {
		slices.SortFunc(spans, func(a, b span) int { return a.start - b.start })
		out, at := "", 0
		for _, s := range spans {
			if s.start < at {
				continue
			}
			out += raw[at:s.start]
			at = s.end
		}
		return out + raw[at:]
	}
	for _, tc := range []struct {
		drops []bool
		want  string
	}{
		{[]bool{true, false, false}, "[E1, E2]"},
		{[]bool{false, true, false}, "[E0, E2]"},
		{[]bool{false, false, true}, "[E0, E1]"},
		{[]bool{true, true, false}, "[E2]"},
		{[]bool{false, true, true}, "[E0]"},
		{[]bool{true, false, true}, "[E1]"},
		{[]bool{true, true, true}, "[]"},
	} {
		if got := apply(dropSpans(nil, els(tc.drops...))); got != tc.want {
			t.Errorf("drop %v: %q, want %q", tc.drops, got, tc.want)
		}
	}
}

// TestThinkingOptionsAdapt reads signature_domain and thinking_failover
// from a Caddyfile into the JSON config, which decodes and validates.
func TestThinkingOptionsAdapt(t *testing.T) {
	out, err := adaptCaddyfile(`:8080 {
	relay {
		key sk-client-secret-0123456789 g
		channel a {
			api_key {env.A}
			signature_domain org-acme
		}
		channel b {
			api_key {env.B}
		}
		group g {
			channels a b
			thinking_failover strip
		}
	}
}
`)
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	h := findHandler(cfg, "relay")
	b, _ := json.Marshal(h)
	var r Relay
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("the adapted relay does not decode: %v", err)
	}
	if r.Channels[0].SignatureDomain != "org-acme" || r.Channels[1].SignatureDomain != "" || r.Groups[0].ThinkingFailover != "strip" {
		t.Errorf("channels %+v, group %+v", r.Channels, r.Groups[0])
	}
	if err := r.validateConfig(); err != nil {
		t.Errorf("validate: %v", err)
	}
	if !strings.Contains(string(out), `"signature_domain":"org-acme"`) || !strings.Contains(string(out), `"thinking_failover":"strip"`) {
		t.Errorf("adapted: %s", out)
	}
}

// TestSignatureDomainDefaults: a channel's default domain is its
// provider's and its credential's account, which names no secret.
func TestSignatureDomainDefaults(t *testing.T) {
	const secret = "sk-ant-api03-secret-of-domain-test"
	t.Setenv("DOMAIN_TEST_KEY", secret)
	r := &Relay{
		Keys: []*Key{{Secret: "sk-client-secret-0123456789", Group: "dom-g"}},
		Channels: []*Channel{
			{Name: "dom-a", UpstreamRaw: upstream("anthropic", "api_key", "{env.DOMAIN_TEST_KEY}")},
			{Name: "dom-b", UpstreamRaw: upstream("anthropic", "api_key", "{env.DOMAIN_TEST_KEY}")},
			{Name: "dom-c", UpstreamRaw: upstream("anthropic", "api_key", "{env.DOMAIN_TEST_KEY}", "url", "https://reseller.example")},
			{Name: "dom-d", UpstreamRaw: upstream("anthropic", "api_key", "{env.DOMAIN_TEST_KEY}"), SignatureDomain: "org-x"},
			{Name: "dom-br", UpstreamRaw: upstream("bedrock", "region", "us-east-1", "access_key_id", "{env.DOMAIN_TEST_KEY}", "secret_access_key", "{env.DOMAIN_TEST_KEY}")},
			{Name: "dom-m", UpstreamRaw: upstream("mock")},
		},
		Groups: []*Group{{Name: "dom-g", Channels: []string{"dom-a", "dom-b", "dom-c", "dom-d", "dom-br", "dom-m"}}},
	}
	provisionHandler(t, r)
	d := func(name string) string {
		for _, ch := range r.groups["dom-g"].channels {
			if ch.name == name {
				return ch.domain
			}
		}
		t.Fatalf("no channel %s", name)
		return ""
	}
	if d("dom-a") != d("dom-b") || !strings.HasPrefix(d("dom-a"), "anthropic:key-") {
		t.Errorf("one key, one domain: %q %q", d("dom-a"), d("dom-b"))
	}
	if d("dom-c") == d("dom-a") {
		t.Errorf("the key at another upstream shares its domain: %q", d("dom-c"))
	}
	if d("dom-d") != "org-x" || !strings.HasPrefix(d("dom-br"), "bedrock:us-east-1/key-") || d("dom-m") != "mock:channel:dom-m" {
		t.Errorf("domains %q %q %q", d("dom-d"), d("dom-br"), d("dom-m"))
	}
	for _, name := range []string{"dom-a", "dom-c", "dom-br"} {
		if strings.Contains(d(name), secret) || strings.Contains(d(name), secret[len(secret)-8:]) {
			t.Errorf("domain %q shows the key", d(name))
		}
	}
}

// BenchmarkInspectMessages is BenchmarkInspect on the Messages route,
// whose messages the scan walks for thinking blocks; with route 0 it
// skips them as a whole value, as before thinking signatures.
func BenchmarkInspectMessages(b *testing.B) {
	for _, bc := range []struct {
		name  string
		route route
	}{{"walked", routeMessages}, {"skipped", 0}} {
		b.Run(bc.name, func(b *testing.B) {
			body := []byte(benchBody)
			b.ReportAllocs()
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				in := inbound{route: bc.route, ask: asked{body: body}}
				if err := in.inspect(); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkInspectThinking is the scan of a conversation of 20 turns,
// each with a signed thinking block the table knows.
func BenchmarkInspectThinking(b *testing.B) {
	var turns []string
	for i := range 20 {
		sig := strings.Repeat("EqQBCkgIARABGAIiQL", 20) + strconv.Itoa(i)
		learnSig(sig, "bench-domain")
		turns = append(turns, `{"role":"user","content":"question `+strconv.Itoa(i)+`"}`,
			`{"role":"assistant","content":[{"type":"thinking","thinking":"`+strings.Repeat("reasoning ", 50)+`","signature":"`+sig+`"},{"type":"text","text":"`+strings.Repeat("answer ", 40)+`"}]}`)
	}
	body := []byte(`{"model":"claude-sonnet-4-5","max_tokens":2048,"thinking":{"type":"enabled","budget_tokens":1024},"messages":[` + strings.Join(append(turns, `{"role":"user","content":"go on"}`), ",") + `]}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		in := inbound{route: routeMessages, ask: asked{body: body}}
		if err := in.inspect(); err != nil || in.ask.thinking.signer != "bench-domain" {
			b.Fatal(err)
		}
	}
}

// BenchmarkStripThinking is the body of that conversation for another
// domain: every block found and removed.
func BenchmarkStripThinking(b *testing.B) {
	sig := strings.Repeat("EqQBCkgIARABGAIiQL", 20)
	learnSig(sig, "bench-domain")
	var turns []string
	for i := range 20 {
		turns = append(turns, `{"role":"user","content":"question `+strconv.Itoa(i)+`"}`,
			`{"role":"assistant","content":[{"type":"thinking","thinking":"`+strings.Repeat("reasoning ", 50)+`","signature":"`+sig+`"},{"type":"text","text":"`+strings.Repeat("answer ", 40)+`"}]}`)
	}
	body := []byte(`{"model":"claude-sonnet-4-5","max_tokens":2048,"messages":[` + strings.Join(append(turns, `{"role":"user","content":"go on"}`), ",") + `]}`)
	b.ReportAllocs()
	b.SetBytes(int64(len(body)))
	for b.Loop() {
		if _, ok := stripThinking(body, "other-domain"); !ok {
			b.Fatal("nothing stripped")
		}
	}
}
