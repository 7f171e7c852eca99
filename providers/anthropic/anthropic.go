// Package anthropic is the relay's provider for Anthropic's own API, and
// for any endpoint that speaks it (a reseller, a local proxy): module
// http.handlers.relay.providers.anthropic, the provider of a channel that
// names none.
package anthropic

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(Provider{})
}

// DefaultURL is Anthropic's API.
const DefaultURL = "https://api.anthropic.com"

// Provider speaks Anthropic's own API, or any endpoint that speaks it: the
// client's path, query and body (but for the model mapping), the channel's
// credential.
type Provider struct {
	// URL is the upstream's base URL; the request path (/v1/messages...)
	// is appended to its path. Default: https://api.anthropic.com.
	URL string `json:"url,omitempty"`

	// APIKey is the channel's credential, usually a placeholder such as
	// `{env.ANTHROPIC_API_KEY}` resolved when the config loads, so that
	// the secret stays out of the config. Required.
	APIKey string `json:"api_key,omitempty"`

	// Auth is how the credential is sent: `x-api-key` (default) or
	// `bearer` (Authorization: Bearer), for resellers that want a bearer
	// token.
	Auth string `json:"auth,omitempty"`

	base   string
	apiKey string
}

// CaddyModule returns the Caddy module information.
func (Provider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.anthropic",
		New: func() caddy.Module { return new(Provider) },
	}
}

// Provision resolves the credential.
func (p *Provider) Provision(ctx caddy.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	p.base = p.BaseURL()
	key, err := provider.Secret(ctx, "api_key", p.APIKey)
	p.apiKey = key
	return err
}

// check validates what needs no secret; the Caddyfile adapter runs it too.
func (p *Provider) check() error {
	if p.APIKey == "" {
		return fmt.Errorf("no api_key: an anthropic channel needs a credential")
	}
	switch p.Auth {
	case "", "x-api-key", "bearer":
	default:
		return fmt.Errorf("auth must be x-api-key or bearer, not %q", p.Auth)
	}
	return provider.CheckURL(p.URL)
}

// Supports implements provider.FeatureSupport: the feature table's
// Anthropic column.
func (*Provider) Supports(name string) provider.Support { return provider.AnthropicWire.Supports(name) }

// BaseURL implements provider.Provider.
func (p *Provider) BaseURL() string {
	return strings.TrimSuffix(cmp.Or(p.URL, DefaultURL), "/")
}

// Account implements provider.AccountNamer. A key does not say which
// organisation it belongs to, so the account is the key's digest, with
// the upstream it is sent to: channels sharing one key share a signature
// domain, and channels of one organisation with different keys share one
// only when their config says so (signature_domain).
func (p *Provider) Account() string { return "key-" + provider.Digest(p.base, p.apiKey) }

// GenAIProviderName implements provider.GenAINamer: the conventions' name of
// Anthropic's API.
func (*Provider) GenAIProviderName() string { return "anthropic" }

// NewRequest implements provider.Provider.
func (p *Provider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	u := p.base + c.Path
	if c.RawQuery != "" {
		u += "?" + c.RawQuery
	}
	req, err := c.NewRequest(ctx, http.MethodPost, u, c.Body())
	if err != nil {
		return nil, err
	}
	c.ForwardHeaders(req.Header)
	p.setHeaders(req)
	return req, nil
}

// setHeaders sets what the relay adds to the client's forwarded headers on
// an upstream request: the channel's credential, and the API version when
// the client sent none (one it sent passes as sent).
func (p *Provider) setHeaders(req *http.Request) {
	if p.Auth == "bearer" {
		req.Header.Set("Authorization", "Bearer "+p.apiKey)
	} else {
		req.Header.Set("X-Api-Key", p.apiKey)
	}
	if req.Header.Get("Anthropic-Version") == "" {
		req.Header.Set("Anthropic-Version", provider.AnthropicVersion)
	}
}

// Response implements provider.Provider: Anthropic's answers are
// Anthropic's.
func (*Provider) Response(resp *http.Response, _ *provider.Call) (*http.Response, error) {
	return resp, nil
}

// ServesResource implements provider.ResourceProvider: Anthropic serves
// Message Batches and Files.
func (*Provider) ServesResource(resource string) bool {
	return resource == provider.ResourceBatches || resource == provider.ResourceFiles
}

// NewResourceRequest implements provider.ResourceProvider.
func (p *Provider) NewResourceRequest(ctx context.Context, c *provider.ResourceCall) (*http.Request, error) {
	u := p.base + c.Path
	if c.RawQuery != "" {
		u += "?" + c.RawQuery
	}
	req, err := http.NewRequestWithContext(ctx, c.Method, u, c.Body)
	if err != nil {
		return nil, err
	}
	req.ContentLength = c.ContentLength
	if c.Body == nil {
		req.ContentLength = 0
	}
	c.ForwardHeaders(req.Header)
	p.setHeaders(req)
	return req, nil
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	url     <base url>
//	api_key <secret|{env.NAME}|{file./path}>
//	auth    x-api-key|bearer
func (p *Provider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), p.check)
}

// CaddyfileOptions implements provider.OptionsProvider.
func (p *Provider) CaddyfileOptions() provider.Options {
	return provider.Options{Strings: map[string]*string{"url": &p.URL, "api_key": &p.APIKey, "auth": &p.Auth}}
}

// Interface guards
var (
	_ provider.GenAINamer       = (*Provider)(nil)
	_ provider.Provider         = (*Provider)(nil)
	_ provider.ResourceProvider = (*Provider)(nil)
	_ provider.FeatureSupport   = (*Provider)(nil)
	_ provider.OptionsProvider  = (*Provider)(nil)
	_ provider.AccountNamer     = (*Provider)(nil)
	_ caddy.Provisioner         = (*Provider)(nil)
	_ caddyfile.Unmarshaler     = (*Provider)(nil)
)
