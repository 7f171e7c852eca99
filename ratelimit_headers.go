package relay

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/caddy-relay/relay/internal/limits"
)

// The anthropic-ratelimit-* headers. An upstream's tell a client what the
// upstream organisation has left: on a relay shared by tenants that is
// another tenant's business, and no limit the client can act on. So by
// default (upstream_ratelimit_headers replace) none of them reaches a
// client, and each client gets the same headers about its own key instead:
// its `rate` as requests, its `tokens` as tokens, each with its limit, what
// is left, and when it is full again. The relay still reads the upstream's
// for itself (classify.go, channel_classes.go's observeQuota) before they are
// dropped. With `pass`, the upstream's go through unchanged and the relay
// adds none.

// Values of upstream_ratelimit_headers.
const (
	ratelimitReplace = "replace"
	ratelimitPass    = "pass"
)

// ratelimitPrefix starts the name of every anthropic-ratelimit-* header,
// canonicalized.
const ratelimitPrefix = "Anthropic-Ratelimit-"

// isRatelimitHeader reports whether the header named k is one of
// anthropic-ratelimit-*, however an upstream (or a provider) spelled it.
func isRatelimitHeader(k string) bool {
	return len(k) >= len(ratelimitPrefix) && strings.EqualFold(k[:len(ratelimitPrefix)], ratelimitPrefix)
}

// setRatelimitHeaders sets, for a client of the key, the headers of each of
// its limits: requests for `rate`, tokens for `tokens`, none for a limit
// the key does not have.
func setRatelimitHeaders(h http.Header, spec limits.Spec, left limits.Headroom) {
	if spec.Rate.N > 0 {
		setRatelimit(h, "Requests", int64(math.Ceil(spec.Rate.N)), left.Requests, left.RequestsFull)
	}
	if spec.Tokens.N > 0 {
		setRatelimit(h, "Tokens", int64(spec.Tokens.N), left.Tokens, left.TokensFull)
	}
}

// setRatelimit sets one limit's three headers. The reset is RFC 3339 in
// UTC, as Anthropic's, rounded up to the second so that it is never early.
func setRatelimit(h http.Header, what string, limit, remaining int64, full time.Time) {
	h[ratelimitPrefix+what+"-Limit"] = []string{strconv.FormatInt(limit, 10)}
	h[ratelimitPrefix+what+"-Remaining"] = []string{strconv.FormatInt(min(max(remaining, 0), limit), 10)}
	reset := full.UTC().Add(time.Second - 1).Truncate(time.Second)
	h[ratelimitPrefix+what+"-Reset"] = []string{reset.Format(time.RFC3339)}
}

// ratelimitHeaders gives a client the headers of its own key's limits,
// unless upstream_ratelimit_headers is pass or the key's limits were never
// asked (the request did not get that far).
func (r *Relay) ratelimitHeaders(h http.Header, in *inbound) {
	if r.passRatelimit || !in.grant.keyAsked {
		return
	}
	spec, left := in.who.state.limits.Left(r.now(), in.grant.keyGrant) // the principal's: under user *, the identity's own
	setRatelimitHeaders(h, spec, left)
}
