package statuspage

import (
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"

	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

// Who the page answers: its data and actions go to its own origin only,
// and by a Host its site names (or a loopback name), which stops another
// site's page, DNS rebinding included, from reading or steering it.

// hostCheck says whether a route that leads to the page matches on the
// Host, found in the server's routes at the first request that asks.
type hostCheck struct {
	once  sync.Once
	named bool
}

// sameOrigin reports whether a browser sent r from a page of r's own
// origin: Origin names r's host, and Sec-Fetch-Site, when sent, says
// same-origin. A browser sends Origin with every POST, the page's fetch
// included.
func sameOrigin(r *http.Request) bool {
	if site := r.Header.Get("Sec-Fetch-Site"); site != "" && site != "same-origin" {
		return false
	}
	u, err := url.Parse(r.Header.Get("Origin"))
	return err == nil && u.Host != "" && strings.EqualFold(u.Host, r.Host)
}

// errUntrustedHost refuses a request for the page's data or actions by a
// Host that is neither one its site names nor a loopback name.
const errUntrustedHost = "this status page answers for the hosts its site names, or, in a site that names none, for localhost, 127.0.0.1 and [::1] only; name this host in the site's address"

// trustedHost reports whether r's Host is one the page may answer its
// data and actions for: any, when a route that leads to the page matches
// on the Host (Caddy served r because its Host is one the site names);
// else only a loopback name. A page that a DNS-rebinding site loads from
// a loopback-only relay comes with that site's Host, and so is refused.
func (s *StatusPage) trustedHost(r *http.Request) bool {
	hc := s.hosts
	hc.once.Do(func() {
		if srv, ok := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); ok {
			hc.named, _ = routesNameHost(srv.Routes, s)
			if !hc.named && srv.Errors != nil {
				hc.named, _ = routesNameHost(srv.Errors.Routes, s)
			}
		}
	})
	if hc.named {
		return true
	}
	host := r.Host
	if h, _, err := net.SplitHostPort(host); err == nil {
		host = h
	}
	host = strings.TrimSuffix(strings.TrimPrefix(host, "["), "]")
	return strings.EqualFold(host, "localhost") || host == "127.0.0.1" || host == "::1"
}

// routesNameHost reports whether, in routes (subroutes included), a route
// on the way to the handler h has a Host matcher in each of its matcher
// sets: a request then reaches h only by a Host the config names.
func routesNameHost(routes caddyhttp.RouteList, h caddyhttp.MiddlewareHandler) (named, found bool) {
	for _, rt := range routes {
		byHost := len(rt.MatcherSets) > 0
		for _, set := range rt.MatcherSets {
			byHost = byHost && slices.ContainsFunc(set, isHostMatcher)
		}
		for _, handler := range rt.Handlers {
			if handler == h {
				return byHost, true
			}
			if sub, ok := handler.(*caddyhttp.Subroute); ok {
				if named, found := routesNameHost(sub.Routes, h); found {
					return byHost || named, true
				}
			}
		}
	}
	return false, false
}

func isHostMatcher(m any) bool {
	switch m.(type) {
	case caddyhttp.MatchHost, *caddyhttp.MatchHost:
		return true
	}
	return false
}
