package relay

import (
	"strconv"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// What the relay says when a config loads: one line per relay handler with
// what it loaded, and one per status page with where it listens, so that a
// first start is not silent.

// logReady logs what r loaded.
func (r *Relay) logReady() {
	r.logger.Info("relay ready: "+count(len(r.Channels), "channel")+", "+count(len(r.groups), "group")+", "+count(len(r.keys), "key"),
		zap.Int("channels", len(r.Channels)), zap.Int("groups", len(r.groups)), zap.Int("keys", len(r.keys)))
}

// count is "1 key", "3 keys".
func count(n int, noun string) string {
	if n != 1 {
		noun += "s"
	}
	return strconv.Itoa(n) + " " + noun
}

// logStatusPage logs where the status page that ctx provisions listens:
// its server's addresses as URLs (localhost for a wildcard host).
func logStatusPage(ctx caddy.Context) {
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
