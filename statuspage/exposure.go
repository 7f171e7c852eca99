package statuspage

import (
	"net"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/caddyauth"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
)

// An open status page. The page shows key names, spend and recent
// requests, and its buttons disable channels; it has no login of its own.
// A page that a client of the network can reach with no authentication
// on the way is warned of when the config loads. A handler cannot see the
// routes around it while it is provisioned (they are being loaded), so
// each page asks for a small app, relay_status_exposure, which looks
// through the http app's servers once every app is provisioned, as the
// config starts.

func init() {
	caddy.RegisterModule(statusExposure{})
}

// statusExposure is the `relay_status_exposure` app: it has no config
// and is never written in one. A status page's Provision loads it; when
// the config starts, it warns of every status page that a request from
// beyond loopback may reach without an authentication handler before it.
type statusExposure struct {
	ctx caddy.Context
}

// CaddyModule returns the Caddy module information.
func (statusExposure) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "relay_status_exposure",
		New: func() caddy.Module { return new(statusExposure) },
	}
}

// Provision keeps the config's context, to find the http app at Start.
func (a *statusExposure) Provision(ctx caddy.Context) error {
	a.ctx = ctx
	return nil
}

// Start warns of the open status pages of the config's http app, which is
// provisioned by now, with every handler of its routes.
func (a *statusExposure) Start() error {
	app, err := a.ctx.AppIfConfigured("http")
	if err != nil {
		return nil
	}
	httpApp, ok := app.(*caddyhttp.App)
	if !ok {
		return nil
	}
	for name, srv := range httpApp.Servers {
		if loopbackOnly(srv.Listen) {
			continue
		}
		pages := openStatusPages(srv.Routes, false, nil, nil)
		if srv.Errors != nil {
			pages = openStatusPages(srv.Errors.Routes, false, nil, pages)
		}
		for _, p := range pages {
			site := siteOf(srv, p.hosts)
			p.page.ctx.Logger().Warn("relay_status at "+site+" has no authentication before it and its server listens beyond loopback: "+
				"anyone who reaches it reads key names, spend and recent requests, and may disable channels; "+
				"put basic_auth or forward_auth before it, or bind its site to 127.0.0.1",
				zap.String("site", site), zap.String("server", name), zap.Strings("listen", srv.Listen))
		}
	}
	return nil
}

// Stop does nothing: the app holds nothing.
func (*statusExposure) Stop() error { return nil }

// watchExposure loads the app for the config ctx belongs to, when the
// page is provisioned by an http server (not alone, as some tests do).
func watchExposure(ctx caddy.Context) {
	if _, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server); !ok {
		return
	}
	if _, err := ctx.App("relay_status_exposure"); err != nil {
		ctx.Logger().Debug("the check of open status pages did not load", zap.Error(err))
	}
}

// openPage is a status page a request may reach unauthenticated, with the
// hosts that the routes on the way to it match.
type openPage struct {
	page  *StatusPage
	hosts []string
}

// openStatusPages appends to out the status pages in routes (subroutes
// included) that a request may reach with no authentication handler run
// before them. guarded says whether one ran on the way to routes. An
// authentication handler guards the handlers after it in its route and
// the later routes of its list that match the same requests: those with
// the same matchers, or every later route when its own has none. One
// behind a narrower matcher (another path, a header a client may leave
// out) guards nothing else.
func openStatusPages(routes caddyhttp.RouteList, guarded bool, hosts []string, out []openPage) []openPage {
	var authMatchers []caddyhttp.MatcherSets // of the routes in the list that authenticate
	for _, rt := range routes {
		g := guarded || slices.ContainsFunc(authMatchers, func(m caddyhttp.MatcherSets) bool {
			return len(m) == 0 || reflect.DeepEqual(m, rt.MatcherSets)
		})
		h := append(slices.Clip(hosts), routeHosts(rt.MatcherSets)...)
		for _, handler := range rt.Handlers {
			switch handler := handler.(type) {
			case *StatusPage:
				if !g {
					out = append(out, openPage{handler, h})
				}
			case *caddyhttp.Subroute:
				out = openStatusPages(handler.Routes, g, h, out)
			}
			if !g && authenticates(handler) {
				g = true
				authMatchers = append(authMatchers, rt.MatcherSets)
			}
		}
	}
	return out
}

// authenticates reports whether a handler lets only authenticated
// requests on: Caddy's authentication handler (basic_auth and its other
// providers), forward_auth (a reverse_proxy that asks another service,
// rewriting the request, and acts on its answer), or a third party's
// handler whose module name says it authenticates.
func authenticates(h caddyhttp.MiddlewareHandler) bool {
	switch h := h.(type) {
	case *caddyauth.Authentication:
		return true
	case *reverseproxy.Handler:
		return h.Rewrite != nil && len(h.HandleResponse) > 0
	}
	return strings.Contains(caddy.GetModuleName(h), "auth")
}

// routeHosts lists the hosts a route's host matchers name.
func routeHosts(sets caddyhttp.MatcherSets) []string {
	var hosts []string
	for _, set := range sets {
		for _, m := range set {
			switch m := m.(type) {
			case caddyhttp.MatchHost:
				hosts = append(hosts, m...)
			case *caddyhttp.MatchHost:
				hosts = append(hosts, *m...)
			}
		}
	}
	return hosts
}

// loopbackOnly reports whether every address a server listens on is a
// loopback one (or a Unix socket): nothing beyond this machine reaches it.
func loopbackOnly(listen []string) bool {
	for _, l := range listen {
		na, err := caddy.ParseNetworkAddress(l)
		if err != nil {
			return false
		}
		if na.IsUnixNetwork() {
			continue
		}
		if strings.EqualFold(na.Host, "localhost") {
			continue
		}
		if ip := net.ParseIP(na.Host); ip == nil || !ip.IsLoopback() {
			return false
		}
	}
	return len(listen) > 0
}

// siteOf names a page's site as its Caddyfile address would: each host
// the routes to it match, with the server's scheme and ports, or, when
// they match none, the addresses the server listens on.
func siteOf(srv *caddyhttp.Server, hosts []string) string {
	if len(hosts) == 0 {
		return strings.Join(srv.Listen, " ")
	}
	scheme, defaultPort := "http", "80"
	if len(srv.TLSConnPolicies) > 0 {
		scheme, defaultPort = "https", "443"
	}
	var ports []string
	for _, l := range srv.Listen {
		if na, err := caddy.ParseNetworkAddress(l); err == nil && !na.IsUnixNetwork() {
			if p := strconv.FormatUint(uint64(na.StartPort), 10); !slices.Contains(ports, p) {
				ports = append(ports, p)
			}
		}
	}
	var sites []string
	for _, host := range hosts {
		if len(ports) == 0 {
			sites = append(sites, scheme+"://"+host)
		}
		for _, p := range ports {
			if p == defaultPort {
				sites = append(sites, scheme+"://"+host)
			} else {
				sites = append(sites, scheme+"://"+net.JoinHostPort(host, p))
			}
		}
	}
	return strings.Join(sites, " ")
}

// Interface guards
var (
	_ caddy.App         = (*statusExposure)(nil)
	_ caddy.Provisioner = (*statusExposure)(nil)
)
