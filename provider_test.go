package relay_test

// A provider defined outside the relay package, as another repository would
// write one: only the provider package, registered as a Caddy module,
// configured from a Caddyfile's channel lines and from JSON.

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	_ "github.com/caddy-relay/relay"
	"github.com/caddy-relay/relay/internal/fakeupstream"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddytest"
	"github.com/tidwall/gjson"
)

func init() {
	caddy.RegisterModule(tokenProvider{})
}

// tokenProvider speaks an Anthropic-like upstream that wants its
// credential in an X-Token header and answers refusals in a shape of its
// own: {"refused": "why", "code": 403}.
type tokenProvider struct {
	// URL is the upstream's base URL.
	URL string `json:"url,omitempty"`
	// Token is the upstream's credential.
	Token string `json:"token,omitempty"`
}

func (tokenProvider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.token",
		New: func() caddy.Module { return new(tokenProvider) },
	}
}

func (p *tokenProvider) BaseURL() string { return p.URL }

// Supports says the token upstream's wire has no MCP connector.
func (*tokenProvider) Supports(name string) provider.Support {
	if name == "mcp_servers" {
		return provider.Unsupported
	}
	return provider.Supported
}

func (p *tokenProvider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	req, err := c.NewRequest(ctx, http.MethodPost, p.URL+c.Path, c.Body())
	if err != nil {
		return nil, err
	}
	c.ForwardHeaders(req.Header)
	req.Header.Set("X-Token", p.Token)
	return req, nil
}

func (p *tokenProvider) Response(resp *http.Response, c *provider.Call) (*http.Response, error) {
	if resp.StatusCode < 400 {
		return resp, nil
	}
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	why := gjson.GetBytes(b, "refused").String()
	return provider.UpstreamError{Status: int(gjson.GetBytes(b, "code").Int()), Message: "token upstream: " + why,
		RefusesModel: strings.Contains(why, "model")}.Response(resp), nil
}

func (p *tokenProvider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the provider's name
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "url":
			d.Args(&p.URL)
		case "token":
			d.Args(&p.Token)
		default:
			return d.Errf("unknown token provider option %q", d.Val())
		}
	}
	return nil
}

var _ provider.Provider = (*tokenProvider)(nil)

const (
	extGlobal = "{\n\tadmin localhost:2999\n\thttp_port 9080\n\thttps_port 9443\n\tskip_install_trust\n\tgrace_period 1ns\n}\n"
	extKey    = "sk-external-provider-0123456789"
)

func post(t *testing.T, body string) (*http.Response, string) {
	t.Helper()
	req, _ := http.NewRequest(http.MethodPost, "http://localhost:9080/v1/messages", strings.NewReader(body))
	req.Header.Set("X-Api-Key", extKey)
	req.Header.Set("Anthropic-Version", "2023-06-01")
	// a connection of its own: a kept-alive one may be the previous
	// config's, which its server closes as it stops (an EOF, no answer)
	req.Close = true
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp, string(b)
}

func TestAProviderFromAnotherPackage(t *testing.T) {
	// the token upstream speaks a wire of its own on Anthropic's paths (its
	// credential in X-Token): Anthropic's rules are not its rules
	ok := fakeupstream.New(t, fakeupstream.Message("from the token upstream"), fakeupstream.Lenient())
	refusing := fakeupstream.New(t, fakeupstream.Raw(418, []byte(`{"refused":"this model is not in your plan","code":403}`)), fakeupstream.Lenient())
	tester := caddytest.NewTester(t)
	// the provider's lines stand on the channel's own lines, or in a
	// `provider <name> { }` block
	tester.InitServer(extGlobal+`http://localhost:9080 {
	relay {
		key `+extKey+` ext
		channel ext-refusing {
			provider token
			url `+refusing.URL+`
			token t-one
			priority 1
		}
		channel ext-ok {
			provider token {
				url `+ok.URL+`
				token t-two
			}
			priority 2
		}
		group ext {
			channels ext-refusing ext-ok
		}
	}
}
`, "caddyfile")
	resp, body := post(t, `{"model":"claude-opus-4-1","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`)
	if resp.StatusCode != 200 || !strings.Contains(body, "from the token upstream") {
		t.Fatalf("%d %s", resp.StatusCode, body)
	}
	if got := refusing.Last(t).Header.Get("X-Token"); got != "t-one" {
		t.Errorf("the first channel sent X-Token %q", got)
	}
	if got := ok.Last(t).Header.Get("X-Token"); got != "t-two" || ok.Last(t).Header.Get("Anthropic-Version") != "2023-06-01" {
		t.Errorf("the second channel sent %v", ok.Last(t).Header)
	}
	// what its wire lacks, no channel of its kind is sent
	resp, body = post(t, `{"model":"claude-sonnet-4-5","max_tokens":8,"mcp_servers":[],"messages":[{"role":"user","content":"Hi"}]}`)
	if resp.StatusCode != 503 || !strings.Contains(body, "capability_not_available") || !strings.Contains(body, "mcp_servers") {
		t.Errorf("a feature the provider lacks: %d %s", resp.StatusCode, body)
	}
	// the translated refusal set the model aside on that channel alone
	resp, err := http.Get("http://localhost:2999/relay/channels")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var rows []struct {
		Name          string
		Provider      string
		State         string
		RefusedModels map[string]any `json:"refused_models"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&rows); err != nil {
		t.Fatal(err)
	}
	for _, r := range rows {
		if r.Name == "ext-refusing" && (r.Provider != "token" || r.State != "healthy" || r.RefusedModels["claude-opus-4-1"] == nil) {
			t.Errorf("ext-refusing: %+v", r)
		}
	}

	// the same provider from JSON, as POST /load takes it
	tester.InitServer(`{
	"admin": {"listen": "localhost:2999"},
	"apps": {"http": {"http_port": 9080, "servers": {"s": {"listen": [":9080"], "routes": [{"handle": [{
		"handler": "relay",
		"keys": [{"secret": "`+extKey+`", "group": "ext"}],
		"channels": [{"name": "ext-json", "upstream": {"provider": "token", "url": "`+ok.URL+`", "token": "t-json"}}],
		"groups": [{"name": "ext", "channels": ["ext-json"]}]
	}]}]}}}}
}`, "json")
	if resp, body := post(t, `{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"Hi"}]}`); resp.StatusCode != 200 || ok.Last(t).Header.Get("X-Token") != "t-json" {
		t.Errorf("from JSON: %d %s", resp.StatusCode, body)
	}
}
