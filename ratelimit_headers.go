package relay

import (
	"math"
	"net/http"
	"strconv"
	"strings"
	"time"
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

// headroom is what a limiter's request rate and token limit have left, and
// when each is full again.
type headroom struct {
	known        bool // from the fleet's store; else unknown, read the limiter
	requests     int64
	requestsFull time.Time
	tokens       int64
	tokensFull   time.Time
}

// charge takes n more tokens off what a token limit of spec has left.
func (h *headroom) charge(spec rateSpec, n int64) {
	if !h.known || spec.n == 0 {
		return
	}
	h.tokens = max(0, h.tokens-n)
	h.tokensFull = h.tokensFull.Add(seconds(float64(n) / spec.perSecond()))
}

// seconds is a duration of s seconds, at most maxRetryHint (a limit of
// one token a year in debt would overflow a Duration).
func seconds(s float64) time.Duration {
	return time.Duration(min(s, maxRetryHint.Seconds()) * float64(time.Second))
}

// left is what the limiter has left at now, as far as a request that holds
// g knows (the fleet store's answer to it, or this relay's own limits),
// and the limits it has.
func (l *limiter) left(now time.Time, g grant) (limits, headroom) {
	l.mu.Lock()
	spec, requests, tokens := l.spec, l.requests, l.tokens
	l.mu.Unlock()
	if g.left.known {
		return spec, g.left
	}
	h := headroom{requestsFull: now, tokensFull: now}
	if requests != nil {
		left, burst := requests.TokensAt(now), float64(requests.Burst())
		h.requests = int64(max(0, math.Floor(left)))
		if left < burst {
			h.requestsFull = now.Add(seconds((burst - left) / float64(requests.Limit())))
		}
	}
	if tokens != nil {
		level, perSec, burst := tokens.state(now)
		h.tokens = int64(max(0, math.Floor(level)))
		if level < burst {
			h.tokensFull = now.Add(seconds((burst - level) / perSec))
		}
	}
	return spec, h
}

// setRatelimitHeaders sets, for a client of the key, the headers of each of
// its limits: requests for `rate`, tokens for `tokens`, none for a limit
// the key does not have.
func setRatelimitHeaders(h http.Header, spec limits, left headroom) {
	if spec.rate.n > 0 {
		setRatelimit(h, "Requests", int64(math.Ceil(spec.rate.n)), left.requests, left.requestsFull)
	}
	if spec.tokens.n > 0 {
		setRatelimit(h, "Tokens", int64(spec.tokens.n), left.tokens, left.tokensFull)
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
	spec, left := in.who.state.limits.left(r.now(), in.grant.keyGrant) // the principal's: under user *, the identity's own
	setRatelimitHeaders(h, spec, left)
}
