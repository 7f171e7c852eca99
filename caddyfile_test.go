package relay

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// parseRelay runs the relay's Caddyfile parser over input, which starts
// with the `relay` directive.
func parseRelay(t *testing.T, input string) (*Relay, error) {
	t.Helper()
	r := new(Relay)
	err := r.UnmarshalCaddyfile(caddyfile.NewTestDispenser(input))
	return r, err
}

func sha256Secret(s string) string {
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

const fullRelayCaddyfile = `relay {
	max_body_size 32MiB
	max_response_size 8MiB
	decode_memory 512MiB
	read_body_timeout 10s
	capability_ttl 20m
	first_byte_timeout 30s
	first_content_timeout 1m
	response_timeout 10m
	stream_idle_timeout 45s
	cooldown 5s
	max_cooldown 5m
	auth_cooldown 30m

	key {env.KEY_SUPPORT} production {
		name support
	}
	key sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08 free
	key sk-relay-literal production

	channel anthropic-main {
		provider anthropic
		url https://api.anthropic.com
		api_key {env.ANTHROPIC_API_KEY}
		auth bearer
		models claude-opus-4-1 claude-sonnet-4-5=claude-sonnet-4-5-20250929
		models claude-haiku-4-5
		priority 1
		weight 10
		allow service_tier inference_geo
		allow speed
		supports web-search-2025-03-05
		lacks long_context
		strip mcp_servers unsupported_betas
		transport http {
			dial_timeout 5s
		}
		first_byte_timeout 10s
		first_content_timeout 20s
		response_timeout 2m
		stream_idle_timeout 15s
		cooldown 2s
		max_cooldown 1m
		auth_cooldown 1h
	}
	channel local-proxy {
		url http://127.0.0.1:9000/anthropic
		api_key {file./run/secrets/proxy}
		priority 2
		forward_traceparent
		transport http {
			dial_timeout 5s
		}
	}
	channel default-url {
		api_key {env.SECOND_KEY}
		transport http {
			dial_timeout 5s
		}
	}
	channel mock-a {
		provider mock
		latency 50ms
		tokens 32
		fail_rate 10%
		weight 3
	}
	channel mock-b {
		provider mock
		fail_rate 0.25
		price_factor 0.8
	}

	group production {
		channels anthropic-main local-proxy
		channels default-url mock-a
		retries 3
		expose_channel
	}
	group free {
		channels mock-a mock-b
		retries 0
	}
}
`

func groupRetries(n int) *int { return &n }

func priceFactor(f float64) *float64 { return &f }

func TestCaddyfileFullConfig(t *testing.T) {
	r, err := parseRelay(t, fullRelayCaddyfile)
	if err != nil {
		t.Fatalf("parse: %v", err)
	}

	transports := map[string]json.RawMessage{}
	for _, ch := range r.Channels {
		if ch.TransportRaw != nil {
			transports[ch.Name] = ch.TransportRaw
			ch.TransportRaw = nil // compared below
		}
	}

	want := &Relay{
		MaxBodySize:     32 << 20,
		MaxResponseSize: 8 << 20,
		DecodeMemory:    512 << 20,
		ReadBodyTimeout: caddy.Duration(10 * time.Second),
		Tuning: Tuning{
			CapabilityTTL:       caddy.Duration(20 * time.Minute),
			FirstByteTimeout:    caddy.Duration(30 * time.Second),
			FirstContentTimeout: caddy.Duration(time.Minute),
			ResponseTimeout:     caddy.Duration(10 * time.Minute),
			StreamIdleTimeout:   caddy.Duration(45 * time.Second),
			Cooldown:            caddy.Duration(5 * time.Second),
			MaxCooldown:         caddy.Duration(5 * time.Minute),
			AuthCooldown:        caddy.Duration(30 * time.Minute),
		},
		Keys: []*Key{
			{Secret: "{env.KEY_SUPPORT}", Group: "production", KeyOptions: KeyOptions{Name: "support"}},
			{Secret: "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", Group: "free"},
			{Secret: sha256Secret("sk-relay-literal"), Group: "production"},
		},
		Channels: []*Channel{
			{
				Name:        "anthropic-main",
				UpstreamRaw: json.RawMessage(`{"api_key":"{env.ANTHROPIC_API_KEY}","auth":"bearer","provider":"anthropic","url":"https://api.anthropic.com"}`),
				Models:      []string{"claude-opus-4-1", "claude-sonnet-4-5=claude-sonnet-4-5-20250929", "claude-haiku-4-5"},
				Priority:    1,
				Weight:      10,
				Allow:       []string{"service_tier", "inference_geo", "speed"},
				Supports:    []string{"web-search-2025-03-05"},
				Lacks:       []string{"long_context"},
				Strip:       []string{"mcp_servers", "unsupported_betas"},
				Tuning: Tuning{
					FirstByteTimeout:    caddy.Duration(10 * time.Second),
					FirstContentTimeout: caddy.Duration(20 * time.Second),
					ResponseTimeout:     caddy.Duration(2 * time.Minute),
					StreamIdleTimeout:   caddy.Duration(15 * time.Second),
					Cooldown:            caddy.Duration(2 * time.Second),
					MaxCooldown:         caddy.Duration(time.Minute),
					AuthCooldown:        caddy.Duration(time.Hour),
				},
			},
			{Name: "local-proxy", UpstreamRaw: json.RawMessage(`{"api_key":"{file./run/secrets/proxy}","provider":"anthropic","url":"http://127.0.0.1:9000/anthropic"}`), Priority: 2, ForwardTraceparent: true},
			{Name: "default-url", UpstreamRaw: json.RawMessage(`{"api_key":"{env.SECOND_KEY}","provider":"anthropic"}`)},
			{Name: "mock-a", UpstreamRaw: json.RawMessage(`{"fail_rate":0.1,"latency":50000000,"provider":"mock","reply_tokens":32}`), Weight: 3},
			{Name: "mock-b", UpstreamRaw: json.RawMessage(`{"fail_rate":0.25,"provider":"mock"}`), PriceFactor: priceFactor(0.8)},
		},
		Groups: []*Group{
			{Name: "production", Channels: []string{"anthropic-main", "local-proxy", "default-url", "mock-a"}, Retries: groupRetries(3), ExposeChannel: true},
			{Name: "free", Channels: []string{"mock-a", "mock-b"}, Retries: groupRetries(0)},
		},
	}
	if !reflect.DeepEqual(r, want) {
		got, _ := json.MarshalIndent(r, "", "  ")
		exp, _ := json.MarshalIndent(want, "", "  ")
		t.Errorf("parsed config:\n%s\nwant:\n%s", got, exp)
	}

	tests := []struct {
		channel string
		wantTLS bool
	}{
		{"anthropic-main", true}, // https url
		{"default-url", true},    // no url: https://api.anthropic.com
		{"local-proxy", false},   // http url
	}
	for _, tt := range tests {
		t.Run("transport of "+tt.channel, func(t *testing.T) {
			raw, ok := transports[tt.channel]
			if !ok {
				t.Fatalf("no transport JSON")
			}
			var tr map[string]any
			if err := json.Unmarshal(raw, &tr); err != nil {
				t.Fatalf("transport is not JSON: %v: %s", err, raw)
			}
			if tr["protocol"] != "http" {
				t.Errorf("protocol = %v, want http: %s", tr["protocol"], raw)
			}
			if tr["dial_timeout"] != float64(5*time.Second) {
				t.Errorf("dial_timeout = %v, want 5s in ns: %s", tr["dial_timeout"], raw)
			}
			tls, hasTLS := tr["tls"]
			if hasTLS != tt.wantTLS {
				t.Fatalf("tls present = %v, want %v: %s", hasTLS, tt.wantTLS, raw)
			}
			if tt.wantTLS && !reflect.DeepEqual(tls, map[string]any{}) {
				t.Errorf("tls = %v, want {}", tls)
			}
		})
	}
	for _, name := range []string{"mock-a", "mock-b"} {
		if _, ok := transports[name]; ok {
			t.Errorf("mock channel %s has a transport", name)
		}
	}
}

func TestCaddyfileKeySecret(t *testing.T) {
	const hex64 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
	tests := []struct {
		name   string
		secret string
		want   string
	}{
		{"literal secret is stored as its sha256", "sk-relay-abc123", sha256Secret("sk-relay-abc123")},
		{"env placeholder stays as written", "{env.RELAY_KEY}", "{env.RELAY_KEY}"},
		{"file placeholder stays as written", "{file./run/secrets/relay}", "{file./run/secrets/relay}"},
		{"sha256 value stays as written", "sha256:" + hex64, "sha256:" + hex64},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r, err := parseRelay(t, `relay {
	key `+tt.secret+` g
	channel a {
		provider mock
	}
	group g {
		channels a
	}
}`)
			if err != nil {
				t.Fatalf("parse: %v", err)
			}
			if len(r.Keys) != 1 || r.Keys[0].Secret != tt.want || r.Keys[0].Group != "g" {
				t.Fatalf("keys = %+v, want secret %q in group g", r.Keys[0], tt.want)
			}
			b, _ := json.Marshal(r)
			if tt.want != tt.secret && strings.Contains(string(b), tt.secret) {
				t.Errorf("the JSON config holds the literal secret: %s", b)
			}
		})
	}
}

func TestCaddyfileKeyExpiresAndDisabled(t *testing.T) {
	r, err := parseRelay(t, `relay {
	key sk-relay-expiring-0123456789 g {
		name contractor
		expires 2027-01-31T00:00:00Z
	}
	key sk-relay-switched-off-0123456789 g {
		name intern
		disabled
	}
	channel a {
		provider mock
	}
	group g {
		channels a
	}
}`)
	if err != nil {
		t.Fatal(err)
	}
	if k := r.Keys[0]; k.Expires != "2027-01-31T00:00:00Z" || k.Disabled {
		t.Errorf("contractor = %+v", k)
	}
	if k := r.Keys[1]; k.Expires != "" || !k.Disabled {
		t.Errorf("intern = %+v", k)
	}
	b, _ := json.Marshal(r.Keys)
	if !strings.Contains(string(b), `"expires":"2027-01-31T00:00:00Z"`) || !strings.Contains(string(b), `"disabled":true`) ||
		strings.Count(string(b), `"disabled"`) != 1 {
		t.Errorf("JSON: %s", b)
	}

	_, err = parseRelay(t, caddyfileWith("key sk-test g {\n\texpires tomorrow\n}\n", "", ""))
	if err == nil || !strings.Contains(err.Error(), `expires: "tomorrow" is not an RFC 3339 time`) {
		t.Errorf("a bad expires: %v", err)
	}
}

// caddyfileWith builds a relay block from a valid one-key, one-channel,
// one-group config, with parts replaced or added.
func caddyfileWith(keys, channels, groups string) string {
	if keys == "" {
		keys = "key sk-test g\n"
	}
	if channels == "" {
		channels = "channel a {\n\tapi_key {env.A}\n}\n"
	}
	if groups == "" {
		groups = "group g {\n\tchannels a\n}\n"
	}
	return "relay {\n" + keys + channels + groups + "}\n"
}

func TestCaddyfileErrors(t *testing.T) {
	mockChannel := func(opts string) string { return "channel a {\n\tprovider mock\n\t" + opts + "\n}\n" }
	modelsChannel := func(models string) string {
		return "channel a {\n\tapi_key {env.A}\n\tmodels " + models + "\n}\n"
	}
	tests := []struct {
		name  string
		input string
		want  []string // every one must appear in the error
	}{
		{
			name:  "group naming an unknown channel",
			input: caddyfileWith("", "", "group g {\n\tchannels a nope\n}\n"),
			want:  []string{`group "g"`, `unknown channel "nope"`},
		},
		{
			name:  "key naming an unknown group",
			input: caddyfileWith("key sk-test other\n", "", ""),
			want:  []string{`unknown group "other"`},
		},
		{
			name:  "duplicate channel name",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n}\nchannel a {\n\tprovider mock\n}\n", ""),
			want:  []string{`channel "a" is defined twice`},
		},
		{
			name:  "duplicate group",
			input: caddyfileWith("", "", "group g {\n\tchannels a\n}\ngroup g {\n\tchannels a\n}\n"),
			want:  []string{`group "g" is defined twice`},
		},
		{
			name:  "anthropic channel without api_key",
			input: caddyfileWith("", "channel a {\n\turl https://api.anthropic.com\n}\n", ""),
			want:  []string{`channel "a"`, "api_key"},
		},
		{
			name:  "channel with no provider and no api_key",
			input: caddyfileWith("", "channel a {\n\tweight 2\n}\n", ""),
			want:  []string{`channel "a"`, "api_key"},
		},
		{
			name:  "models entry with an empty upstream name",
			input: caddyfileWith("", modelsChannel("a="), ""),
			want:  []string{`channel "a"`, `malformed entry "a="`},
		},
		{
			name:  "models entry with an empty client name",
			input: caddyfileWith("", modelsChannel("=b"), ""),
			want:  []string{`malformed entry "=b"`},
		},
		{
			name:  "models entry with two equals signs",
			input: caddyfileWith("", modelsChannel("a=b=c"), ""),
			want:  []string{`malformed entry "a=b=c"`},
		},
		{
			name:  "models: each space-separated entry is checked",
			input: caddyfileWith("", modelsChannel("a=b c="), ""),
			want:  []string{`malformed entry "c="`},
		},
		{
			name:  "models listing a name twice",
			input: caddyfileWith("", modelsChannel("m m=x"), ""),
			want:  []string{`"m" is listed twice`},
		},
		{
			name:  "unknown provider",
			input: caddyfileWith("", "channel a {\n\tprovider azure\n\tapi_key {env.A}\n}\n", ""),
			want:  []string{`channel "a"`, `unknown provider "azure"`},
		},
		{
			name:  "unknown allow value",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tallow service_tier temperature\n}\n", ""),
			want:  []string{`channel "a"`, `unknown feature "temperature"`},
		},
		{
			name:  "unknown feature on its own line",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tlacks mcp_servers\n\tsupports web_search mcp-servers\n}\n", ""),
			want:  []string{`channel "a"`, `supports: unknown feature "mcp-servers"`, "Testfile:6"},
		},
		{
			name:  "a feature on two lines",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tsupports mcp_servers\n\tstrip mcp_servers\n}\n", ""),
			want:  []string{`channel "a"`, `strip: "mcp_servers" is on the supports line too`},
		},
		{
			name:  "a long context cannot be stripped",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tstrip long_context\n}\n", ""),
			want:  []string{`channel "a"`, "long_context cannot be stripped"},
		},
		{
			name:  "unknown relay option",
			input: "relay {\n\tmax_bodysize 1MB\n}\n",
			want:  []string{`unrecognized relay option "max_bodysize"`, "Testfile:2"},
		},
		{
			name:  "unknown channel option",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tcolour blue\n}\n", ""),
			want:  []string{`unrecognized channel option "colour"`},
		},
		{
			name:  "unknown group option",
			input: caddyfileWith("", "", "group g {\n\tchannels a\n\tcolour blue\n}\n"),
			want:  []string{`unrecognized group option "colour"`},
		},
		{
			name:  "unknown policy",
			input: caddyfileWith("", "", "group g {\n\tchannels a\n\tpolicy fastest\n}\n"),
			want:  []string{`group "g"`, `unknown policy "fastest"`},
		},
		{
			name:  "unknown key option",
			input: caddyfileWith("key sk-test g {\n\tlabel x\n}\n", "", ""),
			want:  []string{`unrecognized key option "label"`},
		},
		{
			name:  "forward_traceparent with a value",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tforward_traceparent yes\n}\n", ""),
			want:  []string{"forward_traceparent takes no value"},
		},
		{
			name:  "a price factor of 0",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tprice_factor 0\n}\n", ""),
			want:  []string{"price_factor", `"0" is not a number above 0`},
		},
		{
			name:  "a negative price factor",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tprice_factor -0.5\n}\n", ""),
			want:  []string{"price_factor", "not a number above 0"},
		},
		{
			name:  "a price factor that is not a number",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tprice_factor 80%\n}\n", ""),
			want:  []string{"price_factor", `"80%" is not a number above 0`},
		},
		{
			name:  "a price factor without a value",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tprice_factor\n}\n", ""),
			want:  []string{"wrong argument count"},
		},
		{
			name:  "negative weight",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tweight -1\n}\n", ""),
			want:  []string{`channel "a"`, "weight must be between 0 and 1000000"},
		},
		{
			// weights that add up past an int make every pick panic
			name:  "weight that would overflow a group's sum",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tweight 4611686018427387904\n}\n", ""),
			want:  []string{`channel "a"`, "weight must be between 0 and 1000000"},
		},
		{
			name:  "weight that is not a number",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tweight heavy\n}\n", ""),
			want:  []string{`weight: "heavy" is not an integer`},
		},
		{
			name:  "fail_rate 150%",
			input: caddyfileWith("", mockChannel("fail_rate 150%"), ""),
			want:  []string{`channel "a"`, "fail_rate: \"150%\" is not between 0 and 1"},
		},
		{
			name:  "fail_rate that is not a number",
			input: caddyfileWith("", mockChannel("fail_rate often"), ""),
			want:  []string{`fail_rate: "often" is not a number`},
		},
		{
			name:  "mock settings on an anthropic channel",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tfail_rate 10%\n}\n", ""),
			want:  []string{`channel "a"`, `unrecognized channel option "fail_rate"`, "it is an option of provider mock"},
		},
		{
			name:  "transport on a mock channel",
			input: caddyfileWith("", mockChannel("transport http {\n\t\tdial_timeout 5s\n\t}"), ""),
			want:  []string{`channel "a"`, "takes no transport"},
		},
		{
			name:  "http url with a TLS transport",
			input: caddyfileWith("", "channel a {\n\turl http://127.0.0.1:9000\n\tapi_key {env.A}\n\ttransport http {\n\t\ttls\n\t}\n}\n", ""),
			want:  []string{`channel "a"`, "http://", "TLS"},
		},
		{
			name:  "unknown auth",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tauth basic\n}\n", ""),
			want:  []string{`auth must be x-api-key or bearer, not "basic"`},
		},
		{
			name:  "url that is not absolute",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\turl api.anthropic.com\n}\n", ""),
			want:  []string{`url "api.anthropic.com"`},
		},
		{
			name:  "bad duration",
			input: caddyfileWith("", "channel a {\n\tapi_key {env.A}\n\tcooldown soon\n}\n", ""),
			want:  []string{"cooldown:"},
		},
		{
			name:  "bad max_body_size",
			input: "relay {\n\tmax_body_size lots\n}\n",
			want:  []string{"max_body_size:"},
		},
		{
			name:  "sha256 key that is not 64 hex digits",
			input: caddyfileWith("key sha256:abcd g\n", "", ""),
			want:  []string{"64 hex digits"},
		},
		{
			name:  "key without a group",
			input: caddyfileWith("key sk-test\n", "", ""),
			want:  []string{"key takes a secret and a group"},
		},
		{
			name:  "a transport on a channel that answers in-process",
			input: caddyfileWith("", "channel a {\n\tprovider mock\n\ttransport http {\n\t\tdial_timeout 1s\n\t}\n}\n", ""),
			want:  []string{`channel "a"`, "provider mock answers in-process and takes no transport"},
		},
		{
			name:  "a provider's option on another provider's channel",
			input: caddyfileWith("", "channel a {\n\tprovider bedrock\n\tregion us-east-1\n\tproject p\n}\n", ""),
			want:  []string{`channel "a"`, `unrecognized channel option "project"`, "it is an option of provider vertex", "Testfile:6"},
		},
		{
			name:  "no key at all",
			input: "relay {\n\tchannel a {\n\t\tapi_key {env.A}\n\t}\n\tgroup g {\n\t\tchannels a\n\t}\n}\n",
			want:  []string{"no key is configured"},
		},
		{
			name:  "group without channels",
			input: caddyfileWith("", "", "group g {\n\tretries 1\n}\n"),
			want:  []string{`group "g" lists no channels`},
		},
		{
			name:  "negative retries",
			input: caddyfileWith("", "", "group g {\n\tchannels a\n\tretries -1\n}\n"),
			want:  []string{"retries must not be negative"},
		},
		{
			name:  "argument after relay",
			input: "relay extra {\n\tkey sk-test g\n}\n",
			want:  []string{"wrong argument count", "extra"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseRelay(t, tt.input)
			if err == nil {
				t.Fatalf("parsed without error:\n%s", tt.input)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
			if strings.Contains(err.Error(), "sk-test") {
				t.Errorf("error %q repeats a key secret", err)
			}
		})
	}
}

func TestCaddyfileValidBaseParses(t *testing.T) {
	// The error cases above differ from this one only by what they break.
	if _, err := parseRelay(t, caddyfileWith("", "", "")); err != nil {
		t.Fatalf("base config: %v", err)
	}
}
