// Package openai is the relay's provider for upstreams that serve Claude
// in OpenAI's Chat Completions format (a reseller, a gateway): module
// http.handlers.relay.providers.openai. The translation both ways is
// internal/openai's, which the relay's Chat Completions route uses too.
package openai

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"

	wire "github.com/caddy-relay/relay/internal/openai"
	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// init registers provider openai with Caddy.
func init() {
	caddy.RegisterModule(Provider{})
}

// The bounds of an answer, as the relay's own: a stream's event, and a
// whole answer read at once.
const (
	maxEvent  = 16 << 20
	maxAnswer = 64 << 20
)

// isEventStream reports whether an answer's headers say it is an SSE
// stream.
func isEventStream(h http.Header) bool {
	return strings.HasPrefix(strings.ToLower(strings.TrimSpace(h.Get("Content-Type"))), "text/event-stream")
}

// defaultOpenAIURL is the base URL of OpenAI's API; a reseller's is its own.
const defaultOpenAIURL = "https://api.openai.com/v1"

// Provider speaks OpenAI's Chat Completions to an upstream that
// serves Claude in that format (a reseller, a gateway): each Messages
// request is translated into a chat completion, and the answer back into
// Anthropic's wire: a message, the exact SSE events of a stream, or an
// error the relay classifies as Anthropic's.
type Provider struct {
	// URL is the upstream's base URL, as OpenAI's SDKs take it: the path
	// /chat/completions is appended. Default: https://api.openai.com/v1.
	URL string `json:"url,omitempty"`

	// APIKey is the channel's credential, sent as a bearer token; usually a
	// placeholder such as `{env.RESELLER_KEY}`, resolved when the config
	// loads. Required.
	APIKey string `json:"api_key,omitempty"`

	base   string
	apiKey string
}

// CaddyModule returns the Caddy module information.
func (Provider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay.providers.openai",
		New: func() caddy.Module { return new(Provider) },
	}
}

// check validates what needs no secret; the Caddyfile adapter runs it too.
func (p *Provider) check() error {
	if p.APIKey == "" {
		return fmt.Errorf("no api_key: an openai channel needs a credential")
	}
	return provider.CheckURL(p.URL)
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

// BaseURL implements provider.Provider.
func (p *Provider) BaseURL() string {
	return strings.TrimSuffix(cmp.Or(p.URL, defaultOpenAIURL), "/")
}

// GenAIProviderName implements provider.GenAINamer: its upstream speaks
// OpenAI's API, which the conventions name openai whoever serves it.
func (*Provider) GenAIProviderName() string { return "openai" }

// NewRequest implements provider.Provider: the message becomes a chat completion.
// A request the format cannot carry is the client's error (a 400), never
// the channel's.
func (p *Provider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	if c.CountTokens() {
		return nil, provider.UpstreamError{Status: http.StatusBadRequest, Message: "channel " + strconv.Quote(c.Channel) + " (provider openai) cannot count tokens: Chat Completions has no such endpoint"}
	}
	body, err := wire.MessagesToChat(c.Body(), c.Model)
	if err != nil {
		return nil, provider.UpstreamError{Status: http.StatusBadRequest, Message: "channel " + strconv.Quote(c.Channel) + " (provider openai): " + err.Error()}
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.base+"/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Authorization", "Bearer "+p.apiKey)
	if c.Stream {
		req.Header.Set("Accept", "text/event-stream")
	} else {
		req.Header.Set("Accept", "application/json")
	}
	req.Header["User-Agent"] = []string{c.Header.Get("User-Agent")}
	return req, nil
}

// Response implements provider.Provider.
func (p *Provider) Response(resp *http.Response, c *provider.Call) (*http.Response, error) {
	if resp.StatusCode < 200 || resp.StatusCode > 299 {
		body, err := io.ReadAll(io.LimitReader(resp.Body, provider.MaxErrorBody))
		if err != nil {
			return nil, err
		}
		return openAIUpstreamError(resp.StatusCode, body, resp.Header.Get("X-Request-Id")).Response(resp), nil
	}
	if isEventStream(resp.Header) {
		out := *resp
		out.Header = resp.Header.Clone()
		out.Header.Del("Content-Length")
		out.ContentLength = -1
		out.Body = wire.NewMessageStream(resp.Body, maxEvent, openAIErrorEvent)
		return &out, nil
	}
	body, err := io.ReadAll(io.LimitReader(resp.Body, maxAnswer))
	if err != nil {
		return nil, err
	}
	msg, err := wire.ChatToMessage(body)
	if err != nil {
		return nil, err
	}
	return provider.ReplaceBody(resp, "application/json", msg), nil
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	url     <base url, with /v1>
//	api_key <secret|{env.NAME}|{file./path}>
func (p *Provider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), p.check)
}

// CaddyfileOptions implements provider.OptionsProvider: the lines
// UnmarshalCaddyfile reads.
func (p *Provider) CaddyfileOptions() provider.Options {
	return provider.Options{Strings: map[string]*string{"url": &p.URL, "api_key": &p.APIKey}}
}

// openAIUpstreamError is an OpenAI error answer in Anthropic's terms
// (internal/openai says which status each condition takes).
func openAIUpstreamError(status int, body []byte, requestID string) provider.UpstreamError {
	e := wire.ErrorOf(status, body)
	return provider.UpstreamError{Status: e.Status, Message: e.Message, RequestID: requestID, RefusesModel: e.RefusesModel}
}

// openAIErrorEvent is the Anthropic error event that ends a stream whose
// upstream sent an error chunk.
func openAIErrorEvent(status int, msg string) []byte {
	return provider.ErrorEvent(provider.ErrorType(status), msg, "")
}

// Supports implements provider.FeatureSupport: Chat Completions carries
// output_config (as reasoning_effort and response_format) and a long
// prompt; no other feature field, no server tool and no anthropic-beta
// value.
func (*Provider) Supports(name string) provider.Support {
	switch name {
	case "output_config", "long_context":
		return provider.Supported
	}
	return provider.Unsupported
}

// Interface guards
var (
	_ provider.GenAINamer   = (*Provider)(nil)
	_ provider.Provider     = (*Provider)(nil)
	_ caddy.Provisioner     = (*Provider)(nil)
	_ caddyfile.Unmarshaler = (*Provider)(nil)
)
