// Package provider is the seam between caddy-relay and the upstreams it
// speaks to. A provider is a Caddy module in the
// http.handlers.relay.providers namespace that turns one attempt of a
// Messages request (a Call) into its upstream's wire, and the upstream's
// answer back into Anthropic's. The built-in providers (under providers/)
// use only this package, exactly as one from another repository does.
//
// Everything else about an attempt (the transport, the commit point,
// failover, classification, accounting) is the relay's.
package provider

import (
	"context"
	"net/http"

	"github.com/caddyserver/caddy/v2"
)

// Namespace is the Caddy module namespace of providers: the module
// http.handlers.relay.providers.<name> is the provider `provider <name>`
// names.
const Namespace = "http.handlers.relay.providers"

// Provider speaks one upstream's wire. Caddy provisions and validates it as
// any module, and its Caddyfile options are the lines of its channel the
// relay does not know, handed over as a block of its own (see
// caddyfile.Unmarshaler and UnmarshalOptions).
type Provider interface {
	// BaseURL is the upstream's scheme and host (and a path prefix): a
	// channel's default transport uses TLS for https, and after a 529 the
	// next attempt prefers another host. It must not depend on Provision,
	// since the Caddyfile adapter asks it too.
	BaseURL() string

	// NewRequest builds the upstream request of one attempt: its URL,
	// headers, credential and body. An UpstreamError it returns ends the
	// attempt as if the upstream had answered it.
	NewRequest(ctx context.Context, c *Call) (*http.Request, error)

	// Response turns the upstream's answer into Anthropic's wire format
	// (the status, an Anthropic error body, an SSE event stream) before the
	// relay classifies it. It returns resp itself when there is nothing to
	// change; an error fails the attempt as a broken upstream.
	Response(resp *http.Response, c *Call) (*http.Response, error)
}

// Transporter is a Provider that answers in-process, as mock does: its
// round tripper stands where the channel's HTTP transport would, and the
// channel takes no `transport`.
type Transporter interface {
	Transport() http.RoundTripper
}

// Names lists the providers compiled in, by the name `provider` takes.
func Names() []string {
	var names []string
	for _, m := range caddy.GetModules(Namespace) {
		names = append(names, m.ID.Name())
	}
	return names
}
