package relay

import (
	"bytes"
	"context"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// Provider speaks one upstream's wire. Each kind of upstream is a Caddy
// module in the http.handlers.relay.providers namespace, named by the
// `provider` a channel gives (http.handlers.relay.providers.bedrock for
// `provider bedrock`); Caddy provisions and validates it as any module, and
// its Caddyfile options are the channel's lines the relay does not know
// (see caddyfile.Unmarshaler). A module compiled in from another repository
// adds a provider the same way. Everything else about an attempt (the
// transport, the commit point, failover, accounting) is the relay's.
type Provider interface {
	// BaseURL is the upstream's scheme and host (and a path prefix): a
	// channel's default transport uses TLS for https, and after a 529 the
	// next attempt prefers another host. It must not depend on Provision,
	// since the Caddyfile adapter asks it too.
	BaseURL() string

	// NewRequest builds the upstream request of one attempt: its URL,
	// headers, credential and body.
	NewRequest(ctx context.Context, c *Call) (*http.Request, error)

	// Response turns the upstream's answer into Anthropic's wire format
	// (the status, an Anthropic error body, an SSE event stream) before the
	// relay classifies it. It returns resp itself when there is nothing to
	// change; an error fails the attempt as a broken upstream.
	Response(resp *http.Response, c *Call) (*http.Response, error)
}

// providerNamespace is the Caddy module namespace of providers.
const providerNamespace = "http.handlers.relay.providers"

// providerNames lists the providers compiled in, by the name `provider`
// takes.
func providerNames() []string {
	var names []string
	for _, m := range caddy.GetModules(providerNamespace) {
		names = append(names, m.ID.Name())
	}
	return names
}

// Transporter is a Provider that answers in-process, as mock does: its
// round tripper stands where the channel's HTTP transport would.
type Transporter interface {
	Transport() http.RoundTripper
}

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

	in     *inbound
	strip  featureSet // the features the channel removes from this request
	mapped []byte     // Body, once made
}

// Body is the client's body with its model replaced by Model, and without
// the features the channel's config says to strip; every other byte is as
// the client sent it. It may share the client's pooled buffer: it must not
// be changed, and it is only sent safely through NewRequest.
func (c *Call) Body() []byte {
	in := c.in
	if c.Model == in.model && c.strip == 0 {
		return in.body
	}
	if c.mapped == nil {
		out := in.body
		if c.Model != in.model {
			out = make([]byte, 0, len(in.body)+len(c.Model)-len(in.model))
			out = append(out, in.body[:in.modelStart]...)
			out = append(out, '"')
			out = append(out, c.Model...)
			out = append(out, '"')
			out = append(out, in.body[in.modelEnd:]...)
		}
		if c.strip != 0 {
			// the body is valid JSON (inspect checked): this cannot fail
			if stripped, err := stripBody(out, c.strip); err == nil {
				out = stripped
			}
		}
		c.mapped = out
	}
	return c.mapped
}

// NewRequest makes an upstream request with body, which may be Body()
// itself: then the request tells the relay when the transport is done
// with the client's buffer, which goes back to its pool only after that.
func (c *Call) NewRequest(ctx context.Context, method, url string, body []byte) (*http.Request, error) {
	ctx, rd, getBody := c.in.upstreamBody(ctx, body)
	req, err := http.NewRequestWithContext(ctx, method, url, rd)
	if err != nil {
		return nil, err
	}
	req.GetBody = getBody
	return req, nil
}

// ForwardHeaders copies the client headers an upstream may see into dst:
// every anthropic-* header, content-type, accept and user-agent.
// Credentials, hop-by-hop headers and Host never pass.
func (c *Call) ForwardHeaders(dst http.Header) { forwardHeaders(dst, c.Header) }

// CountTokens reports whether the call counts tokens rather than asking
// for a message.
func (c *Call) CountTokens() bool { return c.Path == PathCountTokens }

// UpstreamError is an upstream's error in Anthropic's terms, for a
// provider whose upstream speaks another error shape: the status Anthropic
// answers the same condition with (the classification table gives the
// error type and what the relay does), and a message for the client.
type UpstreamError struct {
	Status    int
	Message   string
	RequestID string
	// RefusesModel says that the upstream refused the model, not the
	// credential: the relay sets the model aside on the channel instead of
	// cooling it.
	RefusesModel bool
}

// Error makes an UpstreamError an error a provider's NewRequest may
// return: the attempt then ends as if the upstream had answered it, so a
// request the provider cannot carry is the client's 400, not a failure of
// the channel.
func (e UpstreamError) Error() string { return e.Message }

// Response replaces resp with the Anthropic error, keeping resp's headers,
// so the classification table and the client see what Anthropic would
// send.
func (e UpstreamError) Response(resp *http.Response) *http.Response {
	out := withBody(resp, "application/json", (&relayError{typ: anthropicType(e.Status), msg: e.Message}).body(e.RequestID))
	out.Body.(*translatedBody).modelRefusal = e.RefusesModel
	out.StatusCode, out.Status = e.Status, strconv.Itoa(e.Status)+" "+http.StatusText(e.Status)
	return out
}

// forwardHeaders copies the client headers an upstream may see: every
// anthropic-* header, content-type, accept and user-agent. Credentials,
// hop-by-hop headers and Host never pass.
func forwardHeaders(dst, src http.Header) {
	for k, vs := range src {
		switch {
		case strings.HasPrefix(k, "Anthropic-"), k == "Content-Type", k == "Accept", k == "User-Agent":
			dst[k] = vs
		}
	}
	if dst.Get("Content-Type") == "" {
		dst.Set("Content-Type", "application/json")
	}
	if _, ok := dst["User-Agent"]; !ok {
		dst["User-Agent"] = []string{""} // as reverse_proxy: no Go default user agent
	}
}

// hopHeaders are removed from upstream responses before they reach the
// client, as reverse_proxy does (RFC 9110, section 7.6.1).
var hopHeaders = map[string]bool{
	"Alt-Svc":             true,
	"Connection":          true,
	"Proxy-Connection":    true,
	"Keep-Alive":          true,
	"Proxy-Authenticate":  true,
	"Proxy-Authorization": true,
	"Te":                  true,
	"Trailer":             true,
	"Transfer-Encoding":   true,
	"Upgrade":             true,
}

// upstreamOnlyHeaders never reach a client: the relay is shared by
// tenants who have no business learning which upstream organisation serves
// them, and an upstream's cookies belong to the relay's session with it.
var upstreamOnlyHeaders = map[string]bool{
	"Anthropic-Organization-Id": true,
	"Set-Cookie":                true,
}

// copyResponseHeaders copies upstream response headers to the client's,
// without hop-by-hop headers, those the Connection header names, those
// that say who the upstream account is, and its anthropic-ratelimit-*
// headers unless keepRatelimit.
func copyResponseHeaders(dst, src http.Header, keepRatelimit bool) {
	for k, vs := range src {
		if hopHeaders[k] || upstreamOnlyHeaders[k] || !keepRatelimit && isRatelimitHeader(k) {
			continue
		}
		dst[k] = vs
	}
	for _, c := range src.Values("Connection") {
		for _, name := range strings.Split(c, ",") {
			dst.Del(strings.TrimSpace(name))
		}
	}
}

// cloudBody rewrites a Messages body for a cloud endpoint (Bedrock,
// Vertex): the top-level fields in drop leave it (the model goes in the
// URL; fields the cloud rejects), and anthropic_version is set when the
// client sent none. Every other byte stays as the client sent it.
func cloudBody(body []byte, version string, drop []string) ([]byte, error) {
	out := body
	for _, f := range drop {
		if !gjson.GetBytes(out, gjson.Escape(f)).Exists() {
			continue
		}
		var err error
		if out, err = sjson.DeleteBytes(out, gjson.Escape(f)); err != nil {
			return nil, err
		}
	}
	if gjson.GetBytes(out, "anthropic_version").Exists() {
		return out, nil
	}
	return sjson.SetBytes(out, "anthropic_version", version)
}

// betasFor splits the anthropic-beta headers (comma-separated, possibly
// repeated) into their distinct flags.
func betasFor(h http.Header) []string {
	var out []string
	for _, v := range h.Values("Anthropic-Beta") {
		for flag := range strings.SplitSeq(v, ",") {
			if flag = strings.TrimSpace(flag); flag != "" && !slices.Contains(out, flag) {
				out = append(out, flag)
			}
		}
	}
	return out
}

// translatedBody is the body of an upstream answer a provider rewrote. It
// carries what only the provider could tell from the original.
type translatedBody struct {
	*bytes.Reader
	modelRefusal bool
}

func (*translatedBody) Close() error { return nil }

// providerRefusedModel reports whether the provider translated this answer
// from a refusal of the model (see refusesModel).
func providerRefusedModel(resp *http.Response) bool {
	t, ok := resp.Body.(*translatedBody)
	return ok && t.modelRefusal
}

// withBody returns resp with body (of contentType) in place of its own,
// which it closes.
func withBody(resp *http.Response, contentType string, body []byte) *http.Response {
	_ = resp.Body.Close()
	out := *resp
	out.Header = resp.Header.Clone()
	out.Header.Set("Content-Type", contentType)
	out.Header.Set("Content-Length", strconv.Itoa(len(body)))
	out.ContentLength = int64(len(body))
	out.Body = &translatedBody{Reader: bytes.NewReader(body)}
	return &out
}
