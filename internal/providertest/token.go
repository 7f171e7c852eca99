package providertest

import (
	"context"
	"io"
	"net/http"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/tidwall/gjson"
)

// init registers the token provider, as importing a provider's package
// does.
func init() {
	caddy.RegisterModule(TokenProvider{})
}

// TokenProvider is a provider written outside the relay, as another
// repository would write one: with the provider package alone, its
// Caddyfile lines read by hand. Its upstream is Anthropic-like but wants
// its credential in an X-Token header and answers refusals in a shape of
// its own: {"refused": "why", "code": 403}. It is `provider token`.
type TokenProvider struct {
	// URL is the upstream's base URL.
	URL string `json:"url,omitempty"`
	// Token is the upstream's credential.
	Token string `json:"token,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (TokenProvider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.token",
		New: func() caddy.Module { return new(TokenProvider) },
	}
}

// BaseURL implements provider.Provider.
func (p *TokenProvider) BaseURL() string { return p.URL }

// Supports says the token upstream's wire has no MCP connector.
func (*TokenProvider) Supports(name string) provider.Support {
	if name == "mcp_servers" {
		return provider.Unsupported
	}
	return provider.Supported
}

// NewRequest implements provider.Provider: the client's request, with the
// token.
func (p *TokenProvider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	req, err := c.NewRequest(ctx, http.MethodPost, p.URL+c.Path, c.Body())
	if err != nil {
		return nil, err
	}
	c.ForwardHeaders(req.Header)
	req.Header.Set("X-Token", p.Token)
	return req, nil
}

// Response implements provider.Provider: a refusal becomes Anthropic's
// error of its code, which refuses the model when its reason names one.
func (p *TokenProvider) Response(resp *http.Response, c *provider.Call) (*http.Response, error) {
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

// UnmarshalCaddyfile reads its lines, url and token.
func (p *TokenProvider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
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

// Interface guards
var (
	_ provider.Provider       = (*TokenProvider)(nil)
	_ provider.FeatureSupport = (*TokenProvider)(nil)
	_ caddyfile.Unmarshaler   = (*TokenProvider)(nil)
)
