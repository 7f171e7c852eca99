package relay

import (
	"bytes"
	"embed"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddy-relay/relay/internal/fleet"
	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(StatusPage{})
	httpcaddyfile.RegisterHandlerDirective("relay_status", parseStatusCaddyfile)
	httpcaddyfile.RegisterDirectiveOrder("relay_status", httpcaddyfile.After, "metrics")
}

// statusFiles are the page, its script and its style: no CDN, no build.
//
//go:embed statuspage
var statusFiles embed.FS

// The page's files, by the last segment of the path they are served at.
var statusAssets = map[string]struct{ file, mime string }{
	"":           {"statuspage/index.html", "text/html; charset=utf-8"},
	"status.js":  {"statuspage/status.js", "text/javascript; charset=utf-8"},
	"status.css": {"statuspage/status.css", "text/css; charset=utf-8"},
}

// statusCSP is the page's Content-Security-Policy: its own script and
// style only, no inline code, no other origin, no frame.
const statusCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"

// How often an open page's event stream looks for changes, reads the
// fleet's nodes, and says it is alive.
const (
	statusTick      = 500 * time.Millisecond
	statusFleetTick = 5 * time.Second
	statusKeepalive = 15 * time.Second
)

// StatusPage is the `http.handlers.relay_status` module: a live page of
// every relay handler of the running config (channels, groups' queues,
// keys' spend, fleet nodes, this node's last 1,000 requests), served
// wherever it is mounted, with same-origin actions that disable, enable
// or reset a channel. It has no options: put it in a loopback site, or
// behind Caddy's basic_auth or forward_auth.
type StatusPage struct {
	ctx    caddy.Context
	nodes  *fleetCache
	hosts  *hostCheck
	spends *spendCache
}

// hostCheck says whether a route that leads to the page matches on the
// Host, found in the server's routes at the first request that asks.
type hostCheck struct {
	once  sync.Once
	named bool
}

// fleetCache is the fleet's nodes as last read.
type fleetCache struct {
	mu    sync.Mutex
	at    time.Time
	nodes []fleet.Node
	err   error
}

// CaddyModule returns the Caddy module information.
func (StatusPage) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.relay_status",
		New: func() caddy.Module { return new(StatusPage) },
	}
}

// Provision keeps the config's context: its end closes the page's event
// streams, which reconnect to the config that follows.
func (s *StatusPage) Provision(ctx caddy.Context) error {
	s.ctx, s.nodes, s.hosts, s.spends = ctx, new(fleetCache), new(hostCheck), new(spendCache)
	logStatusPage(ctx)
	watchExposure(ctx) // an open page is warned of once the config starts (status_exposure.go)
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
	asset, ok := statusAssets[last]
	if !ok {
		h.Set("Location", "./"+last+"/") // relative to the path as the browser sees it (a prefix stripped or not)
		w.WriteHeader(http.StatusFound)
		return nil
	}
	b, err := statusFiles.ReadFile(asset.file)
	if err != nil {
		return err
	}
	h.Set("Content-Type", asset.mime)
	h.Set("Content-Security-Policy", statusCSP)
	h.Set("X-Frame-Options", "DENY")
	h.Set("Cross-Origin-Resource-Policy", "same-origin")
	if r.Method == http.MethodHead {
		return nil
	}
	_, err = w.Write(b)
	return err
}

// act steers a channel as the admin API's POST does, for a POST from the
// page's own origin only.
func (s *StatusPage) act(w http.ResponseWriter, r *http.Request, name, action string) error {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		return statusError(w, http.StatusMethodNotAllowed, "use POST")
	}
	if !s.trustedHost(r) {
		return statusError(w, http.StatusForbidden, errUntrustedHost)
	}
	if !sameOrigin(r) {
		return statusError(w, http.StatusForbidden, "cross-origin request refused")
	}
	name, err := url.PathUnescape(name)
	if err != nil {
		return statusError(w, http.StatusBadRequest, "bad channel name")
	}
	st, err := steerChannel(name, action)
	if err != nil {
		return statusError(w, http.StatusNotFound, err.Error())
	}
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(st)
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

func statusError(w http.ResponseWriter, status int, msg string) error {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	return json.NewEncoder(w).Encode(map[string]string{"error": msg})
}

// events streams the page's picture: a `state` event when it changes
// (looked at every statusTick), `requests` events with the rows the ring
// gained. It ends with the client, or with the config that serves it.
func (s *StatusPage) events(w http.ResponseWriter, r *http.Request) error {
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("X-Accel-Buffering", "no")
	w.WriteHeader(http.StatusOK)
	if r.Method == http.MethodHead {
		return nil
	}
	rc := http.NewResponseController(w)
	if _, err := w.Write([]byte("retry: 1000\n\n")); err != nil {
		return nil
	}
	var (
		last    []byte
		seq     uint64
		rows    []recentRequest // this stream's copy of the ring, the oldest first
		buf     bytes.Buffer
		quiet   = time.Now()
		ticker  = time.NewTicker(statusTick)
		stopped = s.ctx.Done()
	)
	defer ticker.Stop()
	for {
		buf.Reset()
		var fresh []recentRequest
		fresh, seq = recentRequests.since(seq)
		rows = append(rows, fresh...)
		if len(rows) > recentSize {
			rows = append(rows[:0], rows[len(rows)-recentSize:]...)
		}
		now := time.Now()
		state, err := json.Marshal(snapshot(now, rows, s.fleet))
		if err != nil {
			return err
		}
		if !bytes.Equal(state, last) {
			last = state
			fmt.Fprintf(&buf, "event: state\ndata: {\"now\":%q,\"state\":%s}\n\n", now.UTC().Format(time.RFC3339Nano), state)
		}
		if len(fresh) > 0 {
			out := make([]requestRow, len(fresh))
			for i := range fresh {
				out[i] = fresh[i].row()
			}
			b, err := json.Marshal(out)
			if err != nil {
				return err
			}
			fmt.Fprintf(&buf, "event: requests\ndata: %s\n\n", b)
		}
		if buf.Len() == 0 && now.Sub(quiet) >= statusKeepalive {
			buf.WriteString(": alive\n\n")
		}
		if buf.Len() > 0 {
			quiet = now
			if _, err := w.Write(buf.Bytes()); err != nil {
				return nil
			}
			if err := rc.Flush(); err != nil {
				return nil
			}
		}
		select {
		case <-r.Context().Done():
			return nil
		case <-stopped:
			return nil
		case <-ticker.C:
		}
	}
}

// fleet lists the fleet's nodes, read at most every statusFleetTick; nil
// when no relay handler has storage.
func (s *StatusPage) fleet() ([]fleet.Node, error) {
	has := false
	fleets.Range(func(_, _ any) bool { has = true; return false })
	if !has {
		return nil, nil
	}
	c := s.nodes
	c.mu.Lock()
	defer c.mu.Unlock()
	if time.Since(c.at) >= statusFleetTick {
		c.nodes, c.err = fleetRows()
		c.at = time.Now()
	}
	return c.nodes, c.err
}

// Interface guards
var (
	_ caddy.Module                = (*StatusPage)(nil)
	_ caddy.Provisioner           = (*StatusPage)(nil)
	_ caddyhttp.MiddlewareHandler = (*StatusPage)(nil)
	_ caddyfile.Unmarshaler       = (*StatusPage)(nil)
)
