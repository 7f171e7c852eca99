package relay

import (
	"bytes"
	"context"
	"net/http"
	"slices"
	"strconv"
	"strings"

	"github.com/tidwall/gjson"
	"github.com/tidwall/sjson"
)

// provider speaks one upstream's wire: it builds the upstream request of an
// attempt, and turns the upstream's answer into Anthropic's wire format
// (statuses, error bodies, the event stream) before the relay classifies
// it. Everything else about an attempt is shared.
type provider interface {
	newRequest(ctx context.Context, ch *channel, in *inbound) (*http.Request, error)
	response(resp *http.Response, in *inbound) (*http.Response, error)
}

// anthropicProvider speaks Anthropic's own API: same path and query, same
// body but for the model mapping, the channel's credential.
type anthropicProvider struct{}

// response implements provider: Anthropic's answers are Anthropic's.
func (anthropicProvider) response(resp *http.Response, _ *inbound) (*http.Response, error) {
	return resp, nil
}

func (anthropicProvider) newRequest(ctx context.Context, ch *channel, in *inbound) (*http.Request, error) {
	u := ch.urls[in.route]
	if in.rawQuery != "" {
		u += "?" + in.rawQuery
	}
	ctx, body, getBody := in.upstreamBody(ctx, in.bodyFor(ch))
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, u, body)
	if err != nil {
		return nil, err
	}
	req.GetBody = getBody
	forwardHeaders(req.Header, in.header)
	if ch.bearer {
		req.Header.Set("Authorization", "Bearer "+ch.apiKey)
	} else {
		req.Header.Set("X-Api-Key", ch.apiKey)
	}
	return req, nil
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
// without hop-by-hop headers, those the Connection header names, and those
// that say who the upstream account is.
func copyResponseHeaders(dst, src http.Header) {
	for k, vs := range src {
		if hopHeaders[k] || upstreamOnlyHeaders[k] {
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

// betasFor splits the client's anthropic-beta headers (comma-separated,
// possibly repeated) and keeps the flags allowed: all of them when allowed
// holds "*".
func betasFor(h http.Header, allowed []string) []string {
	var out []string
	for _, v := range h.Values("Anthropic-Beta") {
		for _, flag := range strings.Split(v, ",") {
			flag = strings.TrimSpace(flag)
			if flag != "" && !slices.Contains(out, flag) && (slices.Contains(allowed, "*") || slices.Contains(allowed, flag)) {
				out = append(out, flag)
			}
		}
	}
	return out
}

// asAnthropicError replaces an upstream answer in another shape (a cloud's
// error) with an Anthropic error of status and type, keeping its headers,
// so the classification table and the client see what Anthropic would send.
// modelRefusal says that the cloud refused the model, not the credential.
func asAnthropicError(resp *http.Response, status int, typ, msg, requestID string, modelRefusal bool) *http.Response {
	out := withBody(resp, "application/json", (&relayError{typ: typ, msg: msg}).body(requestID))
	out.Body.(*translatedBody).modelRefusal = modelRefusal
	out.StatusCode, out.Status = status, strconv.Itoa(status)+" "+http.StatusText(status)
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
