// Package statuspage is the relay's status page: the `relay_status`
// handler (the page, its embedded script and style, its event stream, its
// Spend view and its same-origin actions), the ring of the last requests
// it shows, and the `relay_status_exposure` app that warns of a page open
// to the network. It reads the relay through a Source, which the relay
// registers; it never imports the relay.
package statuspage

import (
	"embed"
	"encoding/json"
	"net/http"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

func init() {
	caddy.RegisterModule(StatusPage{})
	httpcaddyfile.RegisterHandlerDirective("relay_status", parseStatusCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("relay_status", httpcaddyfile.After, "metrics")
}

// files are the page, its script and its style: no CDN, no build.
//
//go:embed index.html status.js status.css
var files embed.FS

// The page's files, by the last segment of the path they are served at.
var assets = map[string]struct{ file, mime string }{
	"":           {"index.html", "text/html; charset=utf-8"},
	"status.js":  {"status.js", "text/javascript; charset=utf-8"},
	"status.css": {"status.css", "text/css; charset=utf-8"},
}

// CSP is the page's Content-Security-Policy: its own script and style
// only, no inline code, no other origin, no frame.
const CSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// StatusPage is the `http.handlers.relay_status` module: a live page of
// every relay handler of the running config (channels, groups' queues,
// keys' spend, fleet nodes, this node's last 1,000 requests), served
// wherever it is mounted, with same-origin actions that disable, enable
// or reset a channel. It has no options: put it in a loopback site, or
// behind Caddy's basic_auth or forward_auth.
type StatusPage struct {
	ctx    caddy.Context
	src    Source
	nodes  *fleetCache
	hosts  *hostCheck
	spends *spendCache
}

// CaddyModule returns the Caddy module information.
func (StatusPage) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay_status",
		New: func() caddy.Module { return new(StatusPage) },
	}
}

// Provision keeps the config's context (its end closes the page's event
// streams, which reconnect to the config that follows) and the relay's
// Source.
func (s *StatusPage) Provision(ctx caddy.Context) error {
	src, err := theSource()
	if err != nil {
		return err
	}
	s.ctx, s.src, s.nodes, s.hosts, s.spends = ctx, src, new(fleetCache), new(hostCheck), new(spendCache)
	logListening(ctx)
	watchExposure(ctx) // an open page is warned of once the config starts (exposure.go)
	return nil
}

// UnmarshalCaddyfile reads `relay_status`, which takes no argument.
func (s *StatusPage) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // the directive's name
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(0) {
		return d.Errf("relay_status takes no options, found %q", d.Val())
	}
	return nil
}

func parseStatusCaddyfile(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	s := new(StatusPage)
	err := s.UnmarshalCaddyfile(h.Dispenser)
	return s, err
}

// ServeHTTP serves the page at the path it is mounted on (a path that does
// not end in / is sent to the same with /, so the page's relative links
// hold), its files, its data (`events`, `spend`, `spend.csv`) beside it,
// and POST channels/<name>/<action>.
func (s *StatusPage) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	h := w.Header()
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("Cache-Control", "no-store")
	segs := strings.Split(r.URL.EscapedPath(), "/")
	n := len(segs)
	if n >= 4 && segs[n-3] == "channels" {
		return s.act(w, r, segs[n-2], segs[n-1])
	}
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		h.Set("Allow", "GET, HEAD")
		return statusError(w, http.StatusMethodNotAllowed, "method "+r.Method+" is not allowed here")
	}
	last := segs[n-1]
	switch last {
	case "events", "spend", "spend.csv": // the page's data: for its own hosts only
		if !s.trustedHost(r) {
			return statusError(w, http.StatusForbidden, errUntrustedHost)
		}
		switch last {
		case "spend":
			return s.spend(w, r)
		case "spend.csv":
			return s.spendCSV(w, r)
		}
		return s.events(w, r)
	}
	asset, ok := assets[last]
	if !ok {
		h.Set("Location", "./"+last+"/") // relative to the path as the browser sees it (a prefix stripped or not)
		w.WriteHeader(http.StatusFound)
		return nil
	}
	b, err := files.ReadFile(asset.file)
	if err != nil {
		return err
	}
	h.Set("Content-Type", asset.mime)
	h.Set("Content-Security-Policy", CSP)
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cross-Origin-Resource-Policy", "same-origin")
	if r.Method == http.MethodHead {
		return nil
	}
	_, err = w.Write(b)
	return err
}

// statusError answers with status and {"error": msg}.
func statusError(w http.ResponseWriter, status int, msg string) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	return json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// logListening logs where the status page that ctx provisions listens:
// its server's addresses as URLs (localhost for a wildcard host), so that
// a first start is not silent.
func logListening(ctx caddy.Context) {
	srv, ok := ctx.Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if !ok {
		return
	}
	scheme := "http://"
	if len(srv.TLSConnPolicies) > 0 {
		scheme = "https://"
	}
	var urls []string
	for _, l := range srv.Listen {
		na, err := caddy.ParseNetworkAddress(l)
		if err != nil || na.IsUnixNetwork() || na.IsFdNetwork() {
			continue
		}
		if na.Host == "" || na.Host == "0.0.0.0" || na.Host == "::" {
			na.Host = "localhost"
		}
		urls = append(urls, scheme+na.JoinHostPort(0)+"/")
	}
	if len(urls) > 0 {
		ctx.Logger().Info("relay status page at "+strings.Join(urls, " and "), zap.Strings("listen", srv.Listen))
	}
}

// Interface guards
var (
	_ caddy.Module                = (*StatusPage)(nil)
	_ caddy.Provisioner           = (*StatusPage)(nil)
	_ caddyhttp.MiddlewareHandler = (*StatusPage)(nil)
	_ caddyfile.Unmarshaler       = (*StatusPage)(nil)
)
