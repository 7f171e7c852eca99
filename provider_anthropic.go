package relay

import (
	"cmp"
	"context"
	"fmt"
	"net/http"
	"net/url"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(AnthropicProvider{})
}

// AnthropicProvider speaks Anthropic's own API, or any endpoint that speaks
// it (a reseller, a local proxy): the client's path, query and body (but for
// the model mapping), the channel's credential.
type AnthropicProvider struct {
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
func (AnthropicProvider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.anthropic",
		New: func() caddy.Module { return new(AnthropicProvider) },
	}
}

// Provision resolves the credential.
func (p *AnthropicProvider) Provision(ctx caddy.Context) error {
	if err := p.check(); err != nil {
		return err
	}
	p.base = p.BaseURL()
	key, err := providerSecret(ctx, "api_key", p.APIKey)
	p.apiKey = key
	return err
}

// check validates what needs no secret; the Caddyfile adapter runs it too.
func (p *AnthropicProvider) check() error {
	if p.APIKey == "" {
		return fmt.Errorf("no api_key: an anthropic channel needs a credential")
	}
	switch p.Auth {
	case "", "x-api-key", "bearer":
	default:
		return fmt.Errorf("auth must be x-api-key or bearer, not %q", p.Auth)
	}
	return checkURL(p.URL)
}

// Supports implements FeatureSupport: the feature table's Anthropic
// column.
func (*AnthropicProvider) Supports(name string) Support {
	return anthropicColumn.lookup(name, otherBetas.anthropic)
}

// BaseURL implements Provider.
func (p *AnthropicProvider) BaseURL() string {
	return strings.TrimSuffix(cmp.Or(p.URL, defaultAnthropicURL), "/")
}

// NewRequest implements Provider.
func (p *AnthropicProvider) NewRequest(ctx context.Context, c *Call) (*http.Request, error) {
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

// anthropicVersion is the API version of a request the relay sends to an
// Anthropic-wire upstream when its client named none (an OpenAI client
// knows of no such header): the version the official SDKs send. The API
// refuses a request without one.
const anthropicVersion = "2023-06-01"

// setHeaders sets what the relay adds to the client's forwarded headers on
// an upstream request: the channel's credential, and the API version when
// the client sent none (one it sent passes as sent).
func (p *AnthropicProvider) setHeaders(req *http.Request) {
	if p.Auth == "bearer" {
		req.Header.Set("Authorization", "Bearer "+p.apiKey)
	} else {
		req.Header.Set("X-Api-Key", p.apiKey)
	}
	if req.Header.Get("Anthropic-Version") == "" {
		req.Header.Set("Anthropic-Version", anthropicVersion)
	}
}

// Response implements Provider: Anthropic's answers are Anthropic's.
func (*AnthropicProvider) Response(resp *http.Response, _ *Call) (*http.Response, error) {
	return resp, nil
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	url     <base url>
//	api_key <secret|{env.NAME}|{file./path}>
//	auth    x-api-key|bearer
func (p *AnthropicProvider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return unmarshalProvider(d, p)
}

func (p *AnthropicProvider) caddyfileOptions() options {
	return options{strings: map[string]*string{"url": &p.URL, "api_key": &p.APIKey, "auth": &p.Auth}}
}

// providerSecret resolves one of the secrets of the provider ctx
// provisions (field names it in errors) and warns when it is written in the
// config itself.
func providerSecret(ctx caddy.Context, field, value string) (string, error) {
	v, err := resolveSecret(value)
	if err != nil {
		return "", fmt.Errorf("%s: %w", field, err)
	}
	if !isPlaceholder(value) {
		ctx.Logger().Warn("a channel secret is written in the config; use a placeholder such as {env.NAME} to keep it out of GET /config/ and autosave.json",
			zap.String("channel", channelOf(ctx)), zap.String("field", field))
	}
	return v, nil
}

// checkURL checks a provider's optional base URL.
func checkURL(raw string) error {
	if raw == "" {
		return nil
	}
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("url: %v", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" || u.Host == "" {
		return fmt.Errorf("url %q must be an absolute http:// or https:// URL", raw)
	}
	if u.RawQuery != "" || u.Fragment != "" {
		return fmt.Errorf("url %q must not have a query or fragment", raw)
	}
	return nil
}

// caddyfileProvider is a built-in provider: the options its Caddyfile
// lines take, and the check they must pass.
type caddyfileProvider interface {
	caddyfileOptions() options
	check() error
}

// unmarshalProvider reads a built-in provider's Caddyfile block (the lines
// of a channel the relay handed over) into its fields, then checks them.
func unmarshalProvider(d *caddyfile.Dispenser, p caddyfileProvider) error {
	d.Next() // the provider's name
	name := d.Val()
	if d.NextArg() {
		return d.ArgErr()
	}
	o := p.caddyfileOptions()
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		ok, err := o.parse(d)
		if err != nil {
			return err
		}
		if !ok {
			return d.Errf("unrecognized channel option %q (provider %s has no such option either%s)", d.Val(), name, optionOwners(d.Val()))
		}
	}
	if err := p.check(); err != nil {
		return d.Err(err.Error())
	}
	return nil
}

// optionOwners names the other built-in providers that take an option, for
// an error about a line on the wrong channel.
func optionOwners(opt string) string {
	var owners []string
	for _, m := range caddy.GetModules(providerNamespace) {
		if p, ok := m.New().(caddyfileProvider); ok && p.caddyfileOptions().has(opt) {
			owners = append(owners, m.ID.Name())
		}
	}
	if len(owners) == 0 {
		return ""
	}
	return "; it is an option of provider " + strings.Join(owners, " and ")
}

// Interface guards
var (
	_ Provider              = (*AnthropicProvider)(nil)
	_ ResourceProvider      = (*AnthropicProvider)(nil)
	_ caddy.Provisioner     = (*AnthropicProvider)(nil)
	_ caddyfile.Unmarshaler = (*AnthropicProvider)(nil)
)

// ServesResource implements ResourceProvider: Anthropic serves Message
// Batches and Files.
func (*AnthropicProvider) ServesResource(resource string) bool {
	return resource == ResourceBatches || resource == ResourceFiles
}

// NewResourceRequest implements ResourceProvider.
func (p *AnthropicProvider) NewResourceRequest(ctx context.Context, c *ResourceCall) (*http.Request, error) {
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
