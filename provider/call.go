package provider

import (
	"bytes"
	"context"
	"io"
	"net/http"
)

// Paths of the relayed Messages routes, as Call.Path gives them.
const (
	PathMessages    = "/v1/messages"
	PathCountTokens = "/v1/messages/count_tokens"
)

// Call is one attempt's request, as a provider sees it. It is valid until
// the attempt ends, and read-only.
type Call struct {
	// Channel is the name of the channel the attempt is on.
	Channel string
	// Path is the client's route: PathMessages or PathCountTokens.
	Path string
	// RawQuery is the client's query string, without '?'.
	RawQuery string
	// Header holds the client's request headers (ForwardHeaders copies
	// the ones an upstream may see), without the anthropic-beta values
	// the channel strips.
	Header http.Header
	// Model is the model id the upstream knows: the client's model, or a
	// fallback of it, after the channel's mapping.
	Model string
	// Stream is the body's "stream": the client wants an event stream.
	Stream bool

	src  Source // nil: no body
	body []byte // Body, once made
}

// Source is the relay's side of a Call: the client's body, which the relay
// keeps in a pooled buffer, and the upstream requests that share that
// buffer. The relay implements it; NewCall ties a Call to it.
type Source interface {
	// Body is the client's body with its model replaced by model, and
	// without the features the channel strips. When nothing changes it is
	// the client's buffer itself, not a copy.
	Body(model string) []byte

	// NewRequest makes an upstream request with body. When body shares
	// the client's buffer, the request tells the relay when the transport
	// is done with it, which returns it to its pool only after that.
	NewRequest(ctx context.Context, method, url string, body []byte) (*http.Request, error)
}

// NewCall returns c with its body coming from src. A Call made without it
// has no body, and its NewRequest shares nothing.
func NewCall(c Call, src Source) Call {
	c.src, c.body = src, nil
	return c
}

// Body is the client's body with its model replaced by Model, and without
// the features the channel's config says to strip; every other byte is as
// the client sent it. It may share the client's pooled buffer: it must not
// be changed, and it is only sent safely through NewRequest.
func (c *Call) Body() []byte {
	if c.body == nil && c.src != nil {
		c.body = c.src.Body(c.Model)
	}
	return c.body
}

// NewRequest makes an upstream request with body, which may be Body()
// itself: then the request tells the relay when the transport is done
// with the client's buffer, which goes back to its pool only after that.
func (c *Call) NewRequest(ctx context.Context, method, url string, body []byte) (*http.Request, error) {
	if c.src != nil {
		return c.src.NewRequest(ctx, method, url, body)
	}
	req, err := http.NewRequestWithContext(ctx, method, url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.GetBody = func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(body)), nil }
	return req, nil
}

// ForwardHeaders copies the client headers an upstream may see into dst:
// every anthropic-* header, content-type, accept and user-agent.
// Credentials, hop-by-hop headers and Host never pass.
func (c *Call) ForwardHeaders(dst http.Header) { ForwardHeaders(dst, c.Header) }

// CountTokens reports whether the call counts tokens rather than asking
// for a message.
func (c *Call) CountTokens() bool { return c.Path == PathCountTokens }
