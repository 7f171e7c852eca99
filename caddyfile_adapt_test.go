package relay

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/caddy-relay/relay/internal/health"
	"github.com/caddy-relay/relay/internal/providertest"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

// adaptCaddyfile adapts a whole Caddyfile to JSON the way `caddy adapt` does.
func adaptCaddyfile(src string) ([]byte, error) {
	adapter := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}
	out, _, err := adapter.Adapt([]byte(src), nil)
	return out, err
}

// findHandler returns the first object in v whose "handler" is name.
func findHandler(v any, name string) map[string]any {
	switch v := v.(type) {
	case map[string]any:
		if v["handler"] == name {
			return v
		}
		for _, c := range v {
			if h := findHandler(c, name); h != nil {
				return h
			}
		}
	case []any:
		for _, c := range v {
			if h := findHandler(c, name); h != nil {
				return h
			}
		}
	}
	return nil
}

func TestCaddyfileAdapts(t *testing.T) {
	src := `{
	admin localhost:2019
}

:8080 {
	` + strings.ReplaceAll(fullRelayCaddyfile, "\n", "\n\t") + `
}
`
	out, err := adaptCaddyfile(src)
	if err != nil {
		t.Fatalf("adapt: %v\n%s", err, src)
	}
	var cfg map[string]any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatalf("adapted config is not JSON: %v", err)
	}
	h := findHandler(cfg, "relay")
	if h == nil {
		t.Fatalf("no relay handler in the adapted config: %s", out)
	}
	for _, field := range []string{"keys", "channels", "groups", "max_body_size"} {
		if _, ok := h[field]; !ok {
			t.Errorf("relay handler has no %q: %v", field, h)
		}
	}
	if n := len(h["channels"].([]any)); n != 5 {
		t.Errorf("relay handler has %d channels, want 5", n)
	}
	// forward_traceparent is the channel's, in JSON as in the Caddyfile
	for _, c := range h["channels"].([]any) {
		c := c.(map[string]any)
		if got, want := c["forward_traceparent"] == true, c["name"] == "local-proxy"; got != want {
			t.Errorf("channel %v: forward_traceparent %v, want %v", c["name"], c["forward_traceparent"], want)
		}
	}
	if strings.Contains(string(out), "sk-relay-literal") {
		t.Errorf("the adapted config holds a literal key secret")
	}
	if !strings.Contains(string(out), sha256Secret("sk-relay-literal")) {
		t.Errorf("the adapted config lacks the literal key's sha256")
	}
	if !strings.Contains(string(out), `"{env.ANTHROPIC_API_KEY}"`) {
		t.Errorf("the adapted config does not keep the api_key placeholder")
	}
	// The full config round-trips through JSON into the same struct.
	b, _ := json.Marshal(h)
	var r Relay
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatalf("relay handler JSON does not decode: %v", err)
	}
	if err := r.validateConfig(); err != nil {
		t.Errorf("adapted config does not validate: %v", err)
	}
}

func TestCaddyfileAdaptFailsOnInvalidRelay(t *testing.T) {
	src := `:8080 {
	relay {
		key sk-test production
		channel a {
			provider mock
		}
		group production {
			channels a missing-channel
		}
	}
}
`
	_, err := adaptCaddyfile(src)
	if err == nil {
		t.Fatal("adapted a relay whose group names an unknown channel")
	}
	if !strings.Contains(err.Error(), `unknown channel "missing-channel"`) {
		t.Errorf("error %q does not name the unknown channel", err)
	}
}

func TestCaddyfileBreakerProbeAndBudget(t *testing.T) {
	r, err := parseRelay(t, `relay {
	breaker {
		window 20s
		failure_ratio 50%
	}
	key sk-x g
	channel a {
		api_key {env.A}
		models claude-haiku-4-5
		breaker {
			min_requests 8
			open_for 1m
			half_open_probes 2
		}
		probe {
			interval 15s
			path /v1/messages
			body {"model":"claude-haiku-4-5","max_tokens":1,"messages":[]}
		}
	}
	group g {
		channels a
		retry_budget 25% 5/s
		wait_for_recovery 3s
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	if b := r.Breaker; b == nil || b.Window != caddy.Duration(20*time.Second) || b.FailureRatio != 0.5 {
		t.Errorf("relay breaker = %+v", b)
	}
	ch := r.Channels[0]
	if b := ch.Breaker; b == nil || b.MinRequests != 8 || b.OpenFor != caddy.Duration(time.Minute) || b.HalfOpenProbes != 2 || b.Window != 0 {
		t.Errorf("channel breaker = %+v", b)
	}
	if got := resolveBreaker(ch.Breaker, r.Breaker); got != (health.BreakerSettings{Window: 20 * time.Second, Ratio: 0.5, MinRequests: 8, OpenFor: time.Minute, Probes: 2}) {
		t.Errorf("merged breaker = %+v", got)
	}
	if p := ch.Probe; p == nil || p.Interval != caddy.Duration(15*time.Second) || p.Path != "/v1/messages" || p.Body != `{"model":"claude-haiku-4-5","max_tokens":1,"messages":[]}` {
		t.Errorf("probe = %+v", p)
	}
	g := r.Groups[0]
	if g.RetryBudget == nil || *g.RetryBudget != 0.25 || g.RetryBudgetFloor == nil || *g.RetryBudgetFloor != 5 || g.WaitForRecovery != caddy.Duration(3*time.Second) {
		t.Errorf("group = %+v", g)
	}

	for _, bad := range []struct{ input, want string }{
		{"relay {\n\tbreaker {\n\t\tfailure_ratio 150%\n\t}\n\tkey k g\n\tchannel a {\n\t\tapi_key x\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n}", "failure_ratio"},
		{"relay {\n\tbreaker {\n\t\tjitter 1s\n\t}\n}", "jitter"},
		{"relay {\n\tkey k g\n\tchannel a {\n\t\tapi_key x\n\t\tprobe {\n\t\t\tpath /v1/models\n\t\t}\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n}", "probe: path"},
		{"relay {\n\tkey k g\n\tchannel a {\n\t\tapi_key x\n\t\tprobe {\n\t\t\tbody {nope\n\t\t}\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n}", "probe: body"},
		{"relay {\n\tkey k g\n\tchannel a {\n\t\tapi_key x\n\t}\n\tgroup g {\n\t\tchannels a\n\t\tretry_budget 120%\n\t}\n}", "retry_budget"},
		{"relay {\n\tkey k g\n\tchannel a {\n\t\tapi_key x\n\t}\n\tgroup g {\n\t\tchannels a\n\t\tretry_budget 20% fast\n\t}\n}", "floor"},
	} {
		if _, err := parseRelay(t, bad.input); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("want an error naming %q, got %v", bad.want, err)
		}
	}
}

// TestExamplesAdaptAndValidate adapts every Caddyfile in examples/ and then
// provisions it as `caddy validate` does, with made-up values for the
// placeholders it uses.
func TestExamplesAdaptAndValidate(t *testing.T) {
	files, err := filepath.Glob("examples/*.Caddyfile")
	if err != nil || len(files) < 2 {
		t.Fatalf("examples: %v %v", files, err)
	}
	placeholder := regexp.MustCompile(`\{(env|file)\.([^}]+)\}`)
	for _, file := range files {
		t.Run(filepath.Base(file), func(t *testing.T) {
			src, err := os.ReadFile(file)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range placeholder.FindAllStringSubmatch(string(src), -1) {
				switch {
				case m[1] == "env" && strings.HasSuffix(m[2], "_FILE"):
					// a credentials file must exist and be well formed
					t.Setenv(m[2], providertest.NewFakeGoogle(t, 3600).ServiceAccountFile(t))
				case m[1] == "env":
					t.Setenv(m[2], "test-secret-"+m[2])
				default:
					if _, err := os.Stat(m[2]); err == nil {
						continue
					}
					// point the {file.*} placeholder at a file that exists
					tmp := filepath.Join(t.TempDir(), "secret")
					if err := os.WriteFile(tmp, []byte("test-secret-file\n"), 0o600); err != nil {
						t.Fatal(err)
					}
					src = []byte(strings.ReplaceAll(string(src), m[0], "{file."+tmp+"}"))
				}
			}
			adapter := caddyconfig.GetAdapter("caddyfile")
			cfgJSON, warnings, err := adapter.Adapt(src, map[string]any{"filename": file})
			if err != nil {
				t.Fatalf("adapt: %v", err)
			}
			for _, w := range warnings {
				t.Logf("warning: %s", w.String())
			}
			if !strings.Contains(string(cfgJSON), `"handler":"relay"`) {
				t.Errorf("no relay handler in the adapted config")
			}
			var cfg caddy.Config
			if err := json.Unmarshal(cfgJSON, &cfg); err != nil {
				t.Fatal(err)
			}
			// validation must not bind the example's ports or admin address
			cfg.Admin = &caddy.AdminConfig{Disabled: true}
			if err := caddy.Validate(&cfg); err != nil {
				t.Fatalf("validate: %v", err)
			}
		})
	}
}

func TestCaddyfileErrorsPointAtTheirLine(t *testing.T) {
	// each config has one mistake, on the line marked "# here"; errors
	// found once the whole block is read still point at it, not at the
	// block's closing brace
	base := func(key, channel, group string) string {
		credential := "\t\tapi_key {env.A}\n"
		if strings.Contains(channel, "provider mock") {
			credential = "\t\tlatency 1ms\n"
		}
		return "relay {\n\tkey sk-client-secret-0123456789 prod\n" + key +
			"\tchannel a {\n" + credential + channel + "\t}\n" +
			"\tgroup prod {\n\t\tchannels a\n" + group + "\t}\n}\n"
	}
	for name, src := range map[string]string{
		"a budget in euros":                        base("\tkey sk-other-secret-0123456789 prod {\n\t\tbudget 5eur/month # here\n\t}\n", "", ""),
		"two daily budgets":                        base("\tkey sk-other-secret-0123456789 prod {\n\t\tbudget 1usd/day\n\t\tbudget 2usd/day # here\n\t}\n", "", ""),
		"a budget_warn over 100%":                  base("\tkey sk-other-secret-0123456789 prod {\n\t\tbudget_warn 120% # here\n\t}\n", "", ""),
		"a key naming an unknown group":            base("\tkey sk-other-secret-0123456789 nowhere # here\n", "", ""),
		"a channel's bad weight":                   base("", "\t\tweight 2000000 # here\n", ""),
		"an unknown provider, before its options":  base("", "\t\tprovider mok # here\n\t\tlatency 5s\n", ""),
		"a mock's fail_rate":                       base("", "\t\tprovider mock\n\t\tfail_rate 150% # here\n", ""),
		"a group naming an unknown channel":        base("", "", "\t\tchannels ghost # here\n"),
		"a bad policy":                             base("", "", "\t\tpolicy roundrobin # here\n"),
		"a key's expires that is no RFC 3339 time": base("\tkey sk-other-secret-0123456789 prod {\n\t\tname other\n\t\texpires 2027-01-31 # here\n\t}\n", "", ""),
		"disabled given an argument":               base("\tkey sk-other-secret-0123456789 prod {\n\t\tdisabled yes # here\n\t}\n", "", ""),
		"a split of no share":                      base("", "", "\t\tsplit a 0 # here\n"),
		"a channel's bad price factor":             base("", "\t\tprice_factor -1 # here\n", ""),
		"an openai channel's bedrock option":       base("", "\t\tprovider openai\n\t\tregion us-east-1 # here\n", ""),
		"a signature_domain with a space":          base("", "\t\tsignature_domain \"org a\" # here\n", ""),
		"a thinking_failover of no known value":    base("", "", "\t\tthinking_failover drop # here\n"),
	} {
		wantErrorAtMarkedLine(t, name, src)
	}
}

// wantErrorAtMarkedLine parses a relay block with one mistake, on the line
// marked "# here", and wants the error to point at that line.
func wantErrorAtMarkedLine(t *testing.T, name, src string) {
	t.Helper()
	line := 0
	for i, l := range strings.Split(src, "\n") {
		if strings.HasSuffix(l, "# here") {
			line = i + 1
		}
	}
	src = strings.ReplaceAll(src, " # here", "")
	_, err := parseRelay(t, src)
	if want := fmt.Sprintf("Testfile:%d", line); err == nil || !strings.HasSuffix(err.Error(), want) {
		t.Errorf("%s: error %v, want it at %s", name, err, want)
	}
}

// TestCaddyfileSessionLimits: session_budget, session_rate and loop_guard
// on a key, a user entry and a group adapt to their JSON fields, and
// values that cannot work fail the adapt naming the line's option.
func TestCaddyfileSessionLimits(t *testing.T) {
	site := func(key, group string) string {
		return ":8080 {\n\trelay {\n\t\tidentity {http.auth.user.id}\n\t\tkey sk-session-limits-0123456789 team {\n" + key +
			"\t\t}\n\t\tuser * team {\n\t\t\tloop_guard 4\n\t\t}\n\t\tchannel a {\n\t\t\tprovider mock\n\t\t}\n\t\tgroup team {\n\t\t\tchannels a\n" + group + "\t\t}\n\t}\n}\n"
	}
	out, err := adaptCaddyfile(site("\t\t\tsession_budget 5usd/5h\n\t\t\tsession_rate 60/m\n",
		"\t\t\tsession_budget 20usd/24h\n\t\t\tloop_guard 5\n"))
	if err != nil {
		t.Fatal(err)
	}
	var cfg any
	if err := json.Unmarshal(out, &cfg); err != nil {
		t.Fatal(err)
	}
	h := findHandler(cfg, "relay")
	key := h["keys"].([]any)[0].(map[string]any)
	user := h["users"].([]any)[0].(map[string]any)
	group := h["groups"].([]any)[0].(map[string]any)
	if key["session_budget"] != "5usd/5h" || key["session_rate"] != "60/m" || key["loop_guard"] != nil {
		t.Errorf("key: %v", key)
	}
	if user["loop_guard"] != 4.0 {
		t.Errorf("user: %v", user)
	}
	if group["session_budget"] != "20usd/24h" || group["loop_guard"] != 5.0 {
		t.Errorf("group: %v", group)
	}
	for _, bad := range []struct{ key, group, want string }{
		{"\t\t\tsession_budget 5usd\n", "", "session_budget"},
		{"\t\t\tsession_budget 5/5h\n", "", "session_budget"},
		{"\t\t\tsession_budget 5usd/month\n", "", "window must be a duration"},
		{"\t\t\tsession_budget 5usd/10s\n", "", "window must be a duration"},
		{"\t\t\tsession_rate fast\n", "", "session_rate"},
		{"", "\t\t\tloop_guard 1\n", "loop_guard must be 2 or more"},
		{"\t\t\tloop_guard -3\n", "", "loop_guard"},
		{"\t\t\tloop_guard\n", "", "loop_guard"},
	} {
		if _, err := adaptCaddyfile(site(bad.key, bad.group)); err == nil || !strings.Contains(err.Error(), bad.want) {
			t.Errorf("key %q group %q: want an error naming %q, got %v", bad.key, bad.group, bad.want, err)
		}
	}
}
