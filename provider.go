package relay

import (
	"net/http"
	"strings"
)

// The provider seam is the package provider: the Provider interface, the
// Call a provider sees, and what it uses to speak Anthropic's wire back.
// The built-in providers are packages of their own under providers/,
// compiled in by relay.go's imports. What stays here is the relay's side
// of the seam: the response headers a client may see, and the Call's
// source (inbound.Body and inbound.NewRequest, in request.go).

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
// them, and an upstream's cookies belong to the relay's session with it. An
// upstream that is itself a relay tells what is left of the budget of the
// channel's key there, which is the operator's, not the client's (the
// client's own is set where the answer leaves, degrade.go).
var upstreamOnlyHeaders = map[string]bool{
	"Anthropic-Organization-Id": true,
	"Set-Cookie":                true,
	headerBudgetRemaining:       true,
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
