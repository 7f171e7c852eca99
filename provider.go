package relay

import (
	"context"
	"net/http"
	"strings"
)

// provider builds the upstream request for one attempt in its upstream's
// wire format. Everything else about an attempt is shared.
type provider interface {
	newRequest(ctx context.Context, ch *channel, in *inbound) (*http.Request, error)
}

// anthropicProvider speaks Anthropic's own API: same path and query, same
// body but for the model mapping, the channel's credential.
type anthropicProvider struct{}

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

// copyResponseHeaders copies upstream response headers to the client's,
// without hop-by-hop headers and those the Connection header names.
func copyResponseHeaders(dst, src http.Header) {
	for k, vs := range src {
		if hopHeaders[k] {
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
