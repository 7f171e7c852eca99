// Package echo is a provider written as one from another repository would
// be: a Caddy module that imports only the relay's provider package
// (github.com/caddy-relay/relay/provider), never the relay itself. It
// answers in-process, with no upstream and no credential: its reply is the
// text of the client's last message, after a prefix.
//
// Build it into Caddy beside the relay:
//
//	xcaddy build --with github.com/caddy-relay/relay --with github.com/caddy-relay/relay/examples/provider/echo
//
// and name it on a channel:
//
//	channel parrot {
//		provider echo
//		prefix "you said: "
//	}
package echo

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"

	"github.com/caddy-relay/relay/provider"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func init() {
	caddy.RegisterModule(Provider{})
}

// Provider echoes the client's last message. Its wire is plain text: the
// in-process transport answers with the echoed text alone, and Response
// turns that into an Anthropic message, as a real provider turns its
// upstream's wire into Anthropic's.
type Provider struct {
	// Prefix is put before the echoed text. Default: "echo: ".
	Prefix string `json:"prefix,omitempty"`
}

// CaddyModule returns the Caddy module information: the name after
// http.handlers.relay.providers is what `provider` takes.
func (Provider) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  provider.Namespace + ".echo",
		New: func() caddy.Module { return new(Provider) },
	}
}

// BaseURL implements provider.Provider. Nothing is dialed.
func (*Provider) BaseURL() string { return "http://echo.invalid" }

// Transport implements provider.Transporter: the echo is made in-process,
// where a channel's HTTP transport would send the request.
func (p *Provider) Transport() http.RoundTripper {
	return transport{prefix: cmp.Or(p.Prefix, "echo: ")}
}

// column is the echo's column of the feature table: it understands none
// of the features, so a request that carries one goes to another channel
// of its group, and one carrying a beta too.
var column = provider.Column{Default: provider.Unsupported}

// Supports implements provider.FeatureSupport.
func (*Provider) Supports(name string) provider.Support { return column.Supports(name) }

// NewRequest implements provider.Provider. The body goes out through
// Call.NewRequest, which lets the relay reuse the client's buffer safely.
// What the echo cannot do is the client's error, never the channel's: an
// UpstreamError answers for it.
func (p *Provider) NewRequest(ctx context.Context, c *provider.Call) (*http.Request, error) {
	if c.CountTokens() || c.Stream {
		return nil, provider.UpstreamError{Status: http.StatusBadRequest,
			Message: "channel " + strconv.Quote(c.Channel) + " (provider echo) answers whole messages only: no stream, no token count"}
	}
	req, err := c.NewRequest(ctx, http.MethodPost, p.BaseURL()+c.Path, c.Body())
	if err != nil {
		return nil, err
	}
	c.ForwardHeaders(req.Header)
	return req, nil
}

// Response implements provider.Provider: the echoed text becomes an
// Anthropic message, with usage the relay accounts (four bytes a token).
func (*Provider) Response(resp *http.Response, c *provider.Call) (*http.Response, error) {
	if resp.StatusCode != http.StatusOK {
		return resp, nil
	}
	text, err := io.ReadAll(io.LimitReader(resp.Body, provider.MaxErrorBody))
	if err != nil {
		return nil, err
	}
	msg := message{ID: "msg_echo", Type: "message", Role: "assistant", Model: c.Model,
		Content: []block{{Type: "text", Text: string(text)}}, StopReason: "end_turn"}
	msg.Usage.InputTokens = max(1, len(c.Body())/4)
	msg.Usage.OutputTokens = max(1, len(text)/4)
	body, err := json.Marshal(msg)
	if err != nil {
		return nil, err
	}
	return provider.ReplaceBody(resp, "application/json", body), nil
}

// UnmarshalCaddyfile reads the provider's lines of a channel block:
//
//	prefix <text>
func (p *Provider) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return provider.UnmarshalOptions(d, p.CaddyfileOptions(), nil)
}

// CaddyfileOptions implements provider.OptionsProvider.
func (p *Provider) CaddyfileOptions() provider.Options {
	return provider.Options{Strings: map[string]*string{"prefix": &p.Prefix}}
}

// transport makes the echo: the text of the request's last message.
type transport struct{ prefix string }

// RoundTrip implements http.RoundTripper.
func (t transport) RoundTrip(req *http.Request) (*http.Response, error) {
	var in struct {
		Messages []struct {
			Content json.RawMessage `json:"content"`
		} `json:"messages"`
	}
	err := json.NewDecoder(req.Body).Decode(&in)
	_ = req.Body.Close()
	if err != nil {
		return nil, err
	}
	var text string
	if n := len(in.Messages); n > 0 {
		text = textOf(in.Messages[n-1].Content)
	}
	out := t.prefix + text
	return &http.Response{
		Status: "200 OK", StatusCode: http.StatusOK, Proto: "HTTP/1.1", ProtoMajor: 1, ProtoMinor: 1,
		Header:        http.Header{"Content-Type": {"text/plain; charset=utf-8"}},
		Body:          io.NopCloser(strings.NewReader(out)),
		ContentLength: int64(len(out)),
		Request:       req,
	}, nil
}

// textOf is the text of a message's content: a string, or its text blocks.
func textOf(content json.RawMessage) string {
	var s string
	if json.Unmarshal(content, &s) == nil {
		return s
	}
	var blocks []block
	_ = json.Unmarshal(content, &blocks)
	var b bytes.Buffer
	for _, bl := range blocks {
		if bl.Type == "text" {
			b.WriteString(bl.Text)
		}
	}
	return b.String()
}

// message is the part of an Anthropic message the echo answers with.
type message struct {
	ID         string  `json:"id"`
	Type       string  `json:"type"`
	Role       string  `json:"role"`
	Model      string  `json:"model"`
	Content    []block `json:"content"`
	StopReason string  `json:"stop_reason"`
	Usage      struct {
		InputTokens  int `json:"input_tokens"`
		OutputTokens int `json:"output_tokens"`
	} `json:"usage"`
}

type block struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

// Interface guards
var (
	_ provider.Provider        = (*Provider)(nil)
	_ provider.Transporter     = (*Provider)(nil)
	_ provider.FeatureSupport  = (*Provider)(nil)
	_ provider.OptionsProvider = (*Provider)(nil)
	_ caddyfile.Unmarshaler    = (*Provider)(nil)
)
